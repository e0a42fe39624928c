"""Tool calling: `tools` and `tool_choice` validated and the pieces of the calls' grammars (every format's), and
the Hermes format's markers, prompt and grammar.

Models whose chat template has no tool support (the default SmolLM2, ChatML) get the format of
NousResearch Hermes-2-Pro / Qwen2.5: the tools are listed in the system prompt, and a call is

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

(several calls separated by "\\n"). Tool results come back as a user turn of `<tool_response>` blocks.

These modules are pure and synchronous (no torch, no xgrammar import): the API validates `tools` and
`tool_choice` here, renders the history into plain ChatML messages, asks for the xgrammar structural tag
that constrains the output to well-formed calls, and splits the output into content and calls, whole
(`parse_tool_calls`) or while streaming (`ToolCallStreamParser`); the two parsers agree exactly.

Rendering the history into a prompt: motet/grammar/tool_prompt.py; parsing the output: motet/grammar/tool_call_parser.py;
the other formats, built from the same grammar pieces: motet/grammar/tool_formats/.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from motet.grammar.enforceable import strict_refusal
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import DEFAULT_MAX_WHITESPACE, GrammarError

CALL_BEGIN = "<tool_call>"
MAX_TOOL_CALLS = 64  # the largest `max_tool_calls` (the grammar holds one copy of the tools per call)
CALL_END = "</tool_call>"
RESPONSE_BEGIN, RESPONSE_END = "<tool_response>", "</tool_response>"  # a tool's result, in the prompt

# A function's name: OpenAI's rule (1 to 64 of these characters), the one every tool-call format writes and parses
# back as the same name (the formats that write it outside JSON read NAME_CHARS; a newline or a `</tool_call>` in a
# name would end the call's text early).
NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]+")
MAX_NAME_CHARS = 64

TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools:\n"
    "<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


# ---------------------------------------------------------------------------------------------------
# Validation


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / `messages` field; `param` names it (OpenAI error's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tool_error(param: str, reason: str) -> ToolError:
    return ToolError(f"Invalid '{param}': {reason}", param)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # normalized JSON schema of type object

    def openai_dict(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


def validate_tools(tools: list) -> list[Tool]:
    """Validate the OpenAI `tools` list (or BFCL-style bare function dicts) into Tools."""
    if not isinstance(tools, list) or not tools:
        raise tool_error("tools", "expected a non-empty list of tools")
    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(tools):
        if not isinstance(entry, dict):
            raise tool_error(f"tools[{i}]", f"expected an object, got {type(entry).__name__}")
        if entry.get("type", "function") != "function":
            raise tool_error(
                f"tools[{i}].type", f"only 'function' tools are supported, got {entry['type']!r}"
            )
        if "function" in entry or "name" not in entry:  # the OpenAI wrapper
            fn, base = entry.get("function"), f"tools[{i}].function"
            if not isinstance(fn, dict):
                raise tool_error(base, "expected an object with 'name' and 'parameters'")
        else:  # a bare function dict (BFCL; also the flat Responses API shape)
            fn, base = entry, f"tools[{i}]"
        tool = _validate_function(fn, base)
        if tool.name in seen:
            raise tool_error(
                f"{base}.name", f"duplicate tool name {tool.name!r} (also tools[{seen[tool.name]}])"
            )
        seen[tool.name] = i
        out.append(tool)
    return out


def check_name(name, param: str) -> str:
    """`name` when it can be a function's (NAME_CHARS, at most MAX_NAME_CHARS), else a ToolError naming `param`:
    a tool's, and a call's in a conversation (motet/training/data_format.py)."""
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or not NAME_CHARS.fullmatch(name):
        raise tool_error(
            param, f"expected 1 to {MAX_NAME_CHARS} characters from [A-Za-z0-9_.-], got {name!r}"
        )
    return name


def _validate_function(fn: dict, base: str) -> Tool:
    name = check_name(fn.get("name"), f"{base}.name")
    description = fn.get("description")
    if description is None:
        description = ""
    elif not isinstance(description, str):
        raise tool_error(f"{base}.description", "expected a string")
    if not isinstance(fn.get("strict", False), bool):
        raise tool_error(f"{base}.strict", "expected a boolean")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    elif not isinstance(params, dict):
        raise tool_error(f"{base}.parameters", f"expected a JSON schema object, got {type(params).__name__}")
    else:
        try:
            params = normalize_schema(params)  # also checks it against the meta-schema
        except GrammarError as e:
            raise tool_error(f"{base}.parameters", str(e)) from None
        if "type" not in params:  # `{"properties": ...}` without a type: arguments are still an object
            params = {"type": "object", **params}
        if params["type"] != "object":
            raise tool_error(
                f"{base}.parameters", f"the top-level type must be 'object', got {params['type']!r}"
            )
        refusal = strict_refusal(params) if fn.get("strict") is True else None
        if refusal:
            raise tool_error(
                f"{base}.parameters", f"{refusal} (set strict to false for best-effort constraining)"
            )
    return Tool(name, description, params)


def resolve_tool_choice(tool_choice, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """Map `tool_choice` to a mode ("none" | "auto" | "required") and the tools the output may call."""
    if tool_choice is None or tool_choice == "auto":
        return ("auto", list(tools)) if tools else ("none", [])
    if tool_choice == "none":
        return "none", []
    if tool_choice == "required":
        if not tools:
            raise tool_error("tool_choice", "'required' needs a non-empty 'tools' list")
        return "required", list(tools)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if (
            tool_choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise tool_error("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
        if not tools:
            raise tool_error("tool_choice", f"names function {fn['name']!r} but no 'tools' were given")
        for tool in tools:
            if tool.name == fn["name"]:
                return "required", [tool]
        names = ", ".join(repr(t.name) for t in tools)
        raise tool_error("tool_choice", f"no tool named {fn['name']!r}; the tools are {names}")
    raise tool_error(
        "tool_choice", f"expected 'none', 'auto', 'required' or a named function, got {tool_choice!r}"
    )


def parallel_calls(tool_choice, parallel_tool_calls: bool | None) -> bool:
    """Whether the output may hold several calls. A named function is one call of it (OpenAI's forced function:
    "call exactly one specific function"), unless the request sets `parallel_tool_calls` true; otherwise several
    unless `parallel_tool_calls` is false (OpenAI's default is true)."""
    if isinstance(tool_choice, dict):
        return parallel_tool_calls is True
    return parallel_tool_calls is not False


# ---------------------------------------------------------------------------------------------------
# Constraining the output (xgrammar structural tags): the pieces every format's grammar is made of, and Hermes's


def check_mode(tools: list[Tool], mode: str) -> None:
    if mode not in ("auto", "required") or not tools:
        raise ValueError(f"a structural tag needs tools and mode 'auto' or 'required', got {mode!r}")


def json_arguments(tool: Tool, max_whitespace: int | None) -> dict:
    """The arguments' grammar: `tool`'s schema, whitespace runs bounded by `max_whitespace` (None: free)."""
    content = {"type": "json_schema", "json_schema": tool.parameters}
    if max_whitespace is not None:
        content["max_whitespace_cnt"] = max_whitespace
    return content


def call_tags(
    tools: list[Tool], key: str, max_whitespace: int | None, begin: str = "", end: str = ""
) -> list[dict]:
    """A tag per tool: `begin`, `{"name": NAME, "KEY": ` then the arguments, `}` then `end`."""
    return [
        {
            "type": "tag",
            "begin": f'{begin}{{"name": {json.dumps(tool.name)}, "{key}": ',
            "content": json_arguments(tool, max_whitespace),
            "end": "}" + end,
        }
        for tool in tools
    ]


def one_of(tags: list[dict]) -> dict:
    return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}


def call_sequence(tags: list[dict], separator: str, max_calls: int | None) -> dict:
    """One or more calls separated by `separator`; at most `max_calls` (call (separator call (...)?)?, nested)."""
    if max_calls is None:
        return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True}
    one = one_of(tags)
    fmt = one
    for _ in range(max_calls - 1):
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, fmt]}
        fmt = {
            "type": "sequence",
            "elements": [one, {"type": "or", "elements": [{"type": "const_string", "value": ""}, more]}],
        }
    return fmt


def calls_structural_tag(
    tags: list[dict], mode: str, parallel: bool, separator: str, trigger: str, max_calls: int | None
) -> dict:
    """Calls written one after another: "required" is the call(s) and nothing else (one, or with `parallel` one
    or more separated by `separator`); "auto" is free text in which `trigger` opens a call (at most one, and
    then the output ends, unless `parallel`; in "auto" the output ends with the last call `max_calls` allows)."""
    if mode == "required":
        fmt = call_sequence(tags, separator, max_calls) if parallel else one_of(tags)
    else:
        trigger_tags = {"type": "triggered_tags", "triggers": [trigger], "tags": tags}
        if parallel and max_calls is not None:  # text and calls, the output ending at the last call
            fmt = {"type": "sequence", "elements": [trigger_tags | {"stop_after_first": True}] * max_calls}
        else:
            fmt = trigger_tags | {"stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


def tool_call_structural_tag(
    tools: list[Tool],
    mode: str,
    parallel: bool,
    *,
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
    max_calls: int | None = None,
) -> dict:
    """The xgrammar structural tag for Hermes calls to `tools` with schema-valid arguments.

    "required": the output is the call(s) and nothing else: one call, or with `parallel` one or more
    separated by "\\n". "auto": free text, but from `<tool_call>` on a well-formed call (at most one, and
    then the output ends, unless `parallel`). `max_calls` bounds the calls of a parallel output (in
    "auto" the output ends with the last one allowed). `max_whitespace` bounds whitespace runs inside
    the arguments JSON (small models otherwise pad forever); None leaves it free.
    """
    check_mode(tools, mode)
    tags = call_tags(tools, "arguments", max_whitespace, begin=CALL_BEGIN + "\n", end="\n" + CALL_END)
    return calls_structural_tag(tags, mode, parallel, "\n", CALL_BEGIN, max_calls)
