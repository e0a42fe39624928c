"""A request's structured output: which grammar constrains it, which tools it may call, its prompt.

OpenAI's `response_format` (json_object, json_schema), vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` and their newer spelling `structured_outputs: {json, regex, choice,
grammar, json_object, structural_tag}`, and `tools` + `tool_choice` all become one grammar spec (or
none) and a tool mode that says how the output is parsed:

- `tool_choice` "required" or a named function: the output is constrained to calls of those tools, in
  the served model's tool-call format (Hermes-style by default: motet/grammar/tool_formats/), whose
  arguments follow each tool's schema (an xgrammar structural tag); a named function is one call, then the
  output ends, unless `parallel_tool_calls` is true (grammar.tool_calls.parallel_calls).
- "auto": free text, and where the model opens a call (`<tool_call>` in Hermes's format), the call is
  constrained likewise (unless the request sends `guided_tool_calls: false`: then calls are only parsed).
  A format without a grammar (`pythonic`) is only parsed.
- otherwise `response_format` / `guided_*`, at most one of them.

Everything that is wrong with them raises one `StructureError` here, naming the field (the API answers it 400:
motet/api/errors.py `from_structure_error`), before any work is queued: grammars over the size limits
(grammar.limits) before anything reads them further. Whether a spec
compiles is found out by the ingress (the compile cache, with its time limit). A schema sent without
`strict` whose grammar leaves parts of it unenforced is served, with `Structure.warnings` saying which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from motet.grammar.enforceable import best_effort_warning, strict_refusal
from motet.grammar.limits import GrammarLimitError, GrammarLimits
from motet.grammar.reasoning import ReasoningFormat
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import (
    BACKEND_NAMES,
    DEFAULT_MAX_WHITESPACE,
    ChoiceSpec,
    EbnfSpec,
    GrammarError,
    GrammarSpec,
    JsonObjectSpec,
    JsonSchemaSpec,
    RegexSpec,
    StructuralTagSpec,
)
from motet.grammar.tool_calls import Tool, ToolError, parallel_calls, resolve_tool_choice, validate_tools
from motet.grammar.tool_formats import HERMES, ToolFormat
from motet.grammar.tool_prompt import template_messages


class StructureError(ValueError):
    """A request's structured-output or tool field that is wrong: `param` names it (OpenAI's error `param`), `code`
    where OpenAI has one."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass
class Structure:
    spec: GrammarSpec | None = None
    param: str | None = None  # the request field that errors about the grammar name
    backend: str | None = None  # per-request backend override
    tool_mode: str = "none"  # "none" | "auto" | "required": whether the output is parsed for calls
    tools: list[Tool] = field(default_factory=list)  # all the request's tools (shown in the prompt)
    tool_format: ToolFormat = (
        HERMES  # how the model writes calls (--tool-call-parser, or its chat template's)
    )
    warnings: list[str] = field(default_factory=list)  # "param: what the grammar does not enforce"
    # how the model writes its reasoning (--reasoning-parser, or its family's): split from the content, and
    # the grammar holds after it; None: no reasoning parser
    reasoning: ReasoningFormat | None = None

    @property
    def engine_reasoning(self) -> str | None:
        """The reasoning format the engine's grammar gate reads: none for a format whose calls' grammar holds
        from the output's first token (GPT-OSS's: its calls are a channel of their own)."""
        if self.reasoning is None or (self.param == "tools" and not self.tool_format.grammar_after_reasoning):
            return None
        return self.reasoning.name

    @property
    def bounds_reasoning(self) -> bool:
        """Whether the reasoning must end in time for the grammar (SamplingParams.bound_reasoning): the calls of
        `tool_choice` required or a named function are what the request asked for, which a model that never
        ends its reasoning would never write."""
        return self.tool_mode == "required" and self.param == "tools" and self.engine_reasoning is not None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output's text must keep the special tokens (the formats' markers are such tokens)."""
        calls = self.tool_mode != "none" and self.tool_format.keeps_special_tokens
        return calls or (self.reasoning is not None and self.reasoning.keeps_special_tokens)


def _bad(param: str, message: str) -> StructureError:
    return StructureError(f"{param}: {message}", param)


def _too_large(param: str, e: GrammarLimitError) -> StructureError:
    return StructureError(f"{param}: {e}", param, code="grammar_limit_exceeded")


def _choice(choices, param: str, limits: GrammarLimits) -> GrammarSpec:
    """A choice list (guided_choice, structured_outputs.choice) as a spec, its errors naming `param`."""
    try:
        spec = ChoiceSpec(tuple(choices))
    except GrammarError as e:
        raise _bad(param, str(e)) from None
    return _limited(limits, spec, param)


def _limited(limits: GrammarLimits, spec: GrammarSpec, param: str, what: str | None = None) -> GrammarSpec:
    try:
        limits.check_spec(spec, what)
    except GrammarLimitError as e:
        raise _too_large(param, e) from None
    return spec


def _schema(value, param: str, limits: GrammarLimits) -> dict:
    """A JSON schema from a request (a dict, or its JSON text), within the limits, checked against its
    meta-schema."""
    try:
        if isinstance(value, str):
            value = limits.loads(value)
        limits.check_schema(value)
    except GrammarLimitError as e:
        raise _too_large(param, e) from None
    except ValueError as e:  # from json.loads
        raise _bad(param, f"the schema is not valid JSON ({e})") from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise _bad(param, "the schema must be a JSON object")
    try:
        schema = normalize_schema(value)  # also checks it against its meta-schema
    except GrammarError as e:
        raise _bad(param, str(e)) from None
    return schema


def _warn(schema: dict, param: str, warnings: list[str]) -> None:
    """Without `strict` a schema is constrained best effort: say what its grammar leaves out."""
    warning = best_effort_warning(schema)
    if warning:
        warnings.append(f"{param}: {warning}")


def _check_enforceable(schema: dict, param: str) -> None:
    """`strict: true` promises every output validates: refuse what the grammar would not enforce."""
    refusal = strict_refusal(schema)
    if refusal:
        raise StructureError(
            f"{param}: {refusal}. Rewrite those parts, or set strict to false for best-effort constraining.",
            param,
            code="unsupported_schema",
        )


_RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",), "json_schema": ("type", "json_schema")}


def _known_keys(obj: dict, known: tuple[str, ...], where: str) -> None:
    """An unknown key is refused, never ignored (as every request field is)."""
    for key in obj:
        if key not in known:
            raise StructureError(f"Unrecognized request argument supplied: {where}.{key}", f"{where}.{key}")


def _response_format(rf: dict, limits: GrammarLimits, warnings: list[str]) -> GrammarSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format", 'must be an object with a "type"')
    kind = rf["type"]
    if kind in _RESPONSE_FORMAT_KEYS:
        _known_keys(rf, _RESPONSE_FORMAT_KEYS[kind], "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonObjectSpec()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _bad("response_format.json_schema", 'must be an object with a "schema"')
        _known_keys(js, ("name", "schema", "strict", "description"), "response_format.json_schema")
        param = "response_format.json_schema.schema"
        schema = _schema(js["schema"], param, limits)
        if js.get("strict") is True:
            _check_enforceable(schema, param)
        else:
            _warn(schema, param, warnings)
        return JsonSchemaSpec(schema)
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"} | {"type": "structural_tag"}
        return _limited(limits, StructuralTagSpec(tag), "response_format")
    raise _bad("response_format", f"unknown type {kind!r} (text, json_object, json_schema, structural_tag)")


def _guided(req, limits: GrammarLimits, warnings: list[str]) -> list[tuple[str, GrammarSpec | None]]:
    """The grammar fields the request sets, as (field, spec)."""
    found = []
    if req.response_format is not None:
        found.append(("response_format", _response_format(req.response_format, limits, warnings)))
    if req.guided_json is not None:
        schema = _schema(req.guided_json, "guided_json", limits)
        _warn(schema, "guided_json", warnings)
        found.append(("guided_json", JsonSchemaSpec(schema)))
    if req.guided_regex is not None:
        found.append(("guided_regex", _limited(limits, RegexSpec(req.guided_regex), "guided_regex")))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice(req.guided_choice, "guided_choice", limits)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", _limited(limits, EbnfSpec(req.guided_grammar), "guided_grammar")))
    if req.structured_outputs is not None:
        found += _structured_outputs(req.structured_outputs, limits, warnings)
    return [(name, spec) for name, spec in found if spec is not None]


def _structured_outputs(so, limits: GrammarLimits, warnings: list[str]) -> list[tuple[str, GrammarSpec]]:
    """vLLM's `structured_outputs` (api.completions.protocol.StructuredOutputs): its constraints, with its JSON
    options (`disable_any_whitespace`: compact JSON; `disable_additional_properties`: objects closed or,
    when false, open where the schema does not say)."""
    space = 0 if so.disable_any_whitespace else DEFAULT_MAX_WHITESPACE
    closed = so.disable_additional_properties is not False
    found = []
    if so.json_ is not None:
        param = "structured_outputs.json"
        schema = _schema(so.json_, param, limits)
        _warn(schema, param, warnings)
        found.append((param, JsonSchemaSpec(schema, strict=closed, max_whitespace=space)))
    if so.json_object:
        found.append(("structured_outputs.json_object", JsonObjectSpec(max_whitespace=space)))
    if so.regex is not None:
        found.append(
            ("structured_outputs.regex", _limited(limits, RegexSpec(so.regex), "structured_outputs.regex"))
        )
    if so.choice is not None:
        param = "structured_outputs.choice"
        found.append((param, _choice(so.choice, param, limits)))
    if so.grammar is not None:
        param = "structured_outputs.grammar"
        found.append((param, _limited(limits, EbnfSpec(so.grammar), param)))
    if so.structural_tag is not None:
        param = "structured_outputs.structural_tag"
        found.append((param, _limited(limits, StructuralTagSpec(so.structural_tag), param)))
    return found


def _check_tool_schemas(tools, limits: GrammarLimits) -> None:
    """Each tool's parameters within the limits, before anything reads them further."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if params is not None:
            try:
                limits.check_schema(params)
            except GrammarLimitError as e:
                raise _too_large(f"tools[{i}].function.parameters", e) from None


def structured_output(
    req,
    allow_tools: bool = True,
    limits: GrammarLimits | None = None,
    tool_format: ToolFormat = HERMES,
    reasoning: ReasoningFormat | None = None,
) -> Structure:
    """The grammar and tool mode of a chat or completions request (StructureError when malformed or over
    `limits`, default GrammarLimits()); calls are written in `tool_format`, reasoning in `reasoning`. `req`: the
    request's fields as the API read them (motet/api/completions/protocol.py)."""
    limits = limits or GrammarLimits()
    backend = req.guided_decoding_backend
    if backend is not None and backend not in BACKEND_NAMES:
        raise _bad("guided_decoding_backend", f"must be one of {', '.join(BACKEND_NAMES)}, got {backend!r}")
    out = Structure(backend=backend, tool_format=tool_format, reasoning=reasoning)
    guided = _guided(req, limits, out.warnings)
    if len(guided) > 1:
        names = ", ".join(name for name, _ in guided)
        raise StructureError(f"set at most one of {names}", guided[1][0])
    if guided:
        out.param, out.spec = guided[0]

    tools_field = getattr(req, "tools", None) if allow_tools else None
    if tools_field is None and getattr(req, "tool_choice", None) not in (None, "none", "auto"):
        raise _bad("tool_choice", "needs tools")
    if tools_field is None:
        return out
    _check_tool_schemas(tools_field, limits)
    try:
        tools = validate_tools(tools_field)
        mode, callable_tools = resolve_tool_choice(req.tool_choice, tools)
    except ToolError as e:
        raise StructureError(str(e), e.param) from None
    out.tool_mode, out.tools = mode, tools
    constrain = req.guided_tool_calls and mode != "none"
    if mode == "required" and out.spec is not None:
        raise StructureError(
            f"tool_choice {req.tool_choice!r} cannot be combined with {out.param}", out.param
        )
    if constrain and (mode == "required" or out.spec is None):
        parallel = parallel_calls(req.tool_choice, req.parallel_tool_calls)
        tag = tool_format.structural_tag(callable_tools, mode, parallel, max_calls=req.max_tool_calls)
        if tag is not None:
            out.spec = _limited(limits, StructuralTagSpec(tag), "tools", "the tools' schemas together")
            out.param = "tools"
    return out


def prompt_messages(
    messages: list[dict], structure: Structure, chat_template: str | None, trusted_template: bool = True
):
    """The messages to render, and extra template arguments (motet/grammar/tool_prompt.py `template_messages`):
    the model's own tool format where its template has one, else the served format's (tools in the system
    prompt, calls as the model writes them: <tool_call> blocks in Hermes's). The request's tools are shown with
    tool_choice "none" too, as vLLM does: the model sees them, cannot call them."""
    try:
        return template_messages(
            messages, structure.tools, structure.tool_format, chat_template, trusted_template
        )
    except ToolError as e:
        raise StructureError(str(e), e.param) from None
