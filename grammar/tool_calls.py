"""Tool calling in the Hermes format: validate tools, render prompts, constrain and parse outputs.

Models whose chat template has no tool support (the default SmolLM2, ChatML) get the format of
NousResearch Hermes-2-Pro / Qwen2.5: the tools are listed in the system prompt, and a call is

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

(several calls separated by "\\n"). Tool results come back as a user turn of `<tool_response>` blocks.

This module is pure and synchronous (no torch, no xgrammar import): the API validates `tools` and
`tool_choice` here, renders the history into plain ChatML messages, asks for the xgrammar structural tag
that constrains the output to well-formed calls, and splits the output into content and calls, whole
(`parse_tool_calls`) or while streaming (`ToolCallStreamParser`); the two parsers agree exactly.

What counts as a call (both parsers): a block runs from `<tool_call>` to the first `</tool_call>`, or
to the next `<tool_call>` or the end of the text when the close tag is missing. Its body is a call when

  1. it begins `{"name": "X", "arguments": {` (any whitespace between tokens; "parameters" is accepted
     for "arguments"): the name is known, and this is what lets the stream announce the call early.
     The arguments are the raw text of that object up to its matching brace; if it never closes (output
     cut by max_tokens) they are the text written so far, trailing whitespace stripped - OpenAI too
     returns truncated arguments on a length cut. Whatever follows the arguments object is ignored.
  2. otherwise, the whole body is one JSON object with a string "name" and an object "arguments" (or
     "parameters"), in any key order (e.g. arguments before name), no duplicate keys.

Any other block stays in the content as written, tags included. Content is the text outside calls,
concatenated, then stripped of surrounding whitespace (None when empty); the stream gets the same by
dropping leading whitespace and holding back trailing whitespace until more content follows it.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass

from grammar.enforceable import strict_refusal
from grammar.schema_normalize import normalize_schema
from grammar.specs import DEFAULT_MAX_WHITESPACE, GrammarError

CALL_BEGIN = "<tool_call>"
MAX_TOOL_CALLS = 64  # the largest `max_tool_calls` (the grammar holds one copy of the tools per call)
CALL_END = "</tool_call>"

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # used with fullmatch

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


def _fail(param: str, reason: str) -> ToolError:
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
        raise _fail("tools", "expected a non-empty list of tools")
    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(tools):
        if not isinstance(entry, dict):
            raise _fail(f"tools[{i}]", f"expected an object, got {type(entry).__name__}")
        if entry.get("type", "function") != "function":
            raise _fail(f"tools[{i}].type", f"only 'function' tools are supported, got {entry['type']!r}")
        if "function" in entry or "name" not in entry:  # the OpenAI wrapper
            fn, base = entry.get("function"), f"tools[{i}].function"
            if not isinstance(fn, dict):
                raise _fail(base, "expected an object with 'name' and 'parameters'")
        else:  # a bare function dict (BFCL; also the flat Responses API shape)
            fn, base = entry, f"tools[{i}]"
        tool = _validate_function(fn, base)
        if tool.name in seen:
            raise _fail(f"{base}.name", f"duplicate tool name {tool.name!r} (also tools[{seen[tool.name]}])")
        seen[tool.name] = i
        out.append(tool)
    return out


def _validate_function(fn: dict, base: str) -> Tool:
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise _fail(f"{base}.name", f"expected 1 to 64 characters from [A-Za-z0-9_.-], got {name!r}")
    description = fn.get("description")
    if description is None:
        description = ""
    elif not isinstance(description, str):
        raise _fail(f"{base}.description", "expected a string")
    if not isinstance(fn.get("strict", False), bool):
        raise _fail(f"{base}.strict", "expected a boolean")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    elif not isinstance(params, dict):
        raise _fail(f"{base}.parameters", f"expected a JSON schema object, got {type(params).__name__}")
    else:
        try:
            params = normalize_schema(params)  # also checks it against the meta-schema
        except GrammarError as e:
            raise _fail(f"{base}.parameters", str(e)) from None
        if "type" not in params:  # `{"properties": ...}` without a type: arguments are still an object
            params = {"type": "object", **params}
        if params["type"] != "object":
            raise _fail(f"{base}.parameters", f"the top-level type must be 'object', got {params['type']!r}")
        refusal = strict_refusal(params) if fn.get("strict") is True else None
        if refusal:
            raise _fail(f"{base}.parameters", f"{refusal} (set strict to false for best-effort constraining)")
    return Tool(name, description, params)


def resolve_tool_choice(tool_choice, tools: list[Tool]) -> tuple[str, list[Tool]]:
    """Map `tool_choice` to a mode ("none" | "auto" | "required") and the tools the output may call."""
    if tool_choice is None or tool_choice == "auto":
        return ("auto", list(tools)) if tools else ("none", [])
    if tool_choice == "none":
        return "none", []
    if tool_choice == "required":
        if not tools:
            raise _fail("tool_choice", "'required' needs a non-empty 'tools' list")
        return "required", list(tools)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if (
            tool_choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise _fail("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
        if not tools:
            raise _fail("tool_choice", f"names function {fn['name']!r} but no 'tools' were given")
        for tool in tools:
            if tool.name == fn["name"]:
                return "required", [tool]
        names = ", ".join(repr(t.name) for t in tools)
        raise _fail("tool_choice", f"no tool named {fn['name']!r}; the tools are {names}")
    raise _fail(
        "tool_choice", f"expected 'none', 'auto', 'required' or a named function, got {tool_choice!r}"
    )


# ---------------------------------------------------------------------------------------------------
# Prompt rendering


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders `tools` itself (then pass tools to it instead)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tools_system_prompt(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
    return TOOLS_SYSTEM_PROMPT.format(tools=lines)


def format_call(name: str, arguments) -> str:
    """One Hermes call block; `arguments` is a dict or its JSON text (kept as a string if not JSON)."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    args = json.dumps(arguments, ensure_ascii=False)
    return (
        f'{CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CALL_END}'
    )


def _text(content, param: str) -> str:
    """Message content as a string: None -> "", OpenAI text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _fail(param, "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _fail(param, f"expected a string or a list of text parts, got {type(content).__name__}")


def _assistant_text(msg: dict, i: int) -> str:
    text = _text(msg.get("content"), f"messages[{i}].content")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise _fail(f"messages[{i}].tool_calls", "expected a list")
    blocks = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _fail(f"messages[{i}].tool_calls[{j}]", "expected {'function': {'name', 'arguments'}}")
        blocks.append(format_call(fn["name"], fn.get("arguments") or {}))
    return "\n".join([text, *blocks] if text else blocks)  # Qwen2.5: content, then "\n" + each call


def render_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Rewrite an OpenAI history (tool calls, tool results) into plain role/content messages for a
    template without tool support; with tools, their Hermes system prompt is prepended (after the
    user's own system message text when there is one)."""
    out: list[dict] = []
    prev_tool = False
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _fail(f"messages[{i}]", "expected an object")
        role = msg.get("role")
        if role == "tool":
            block = (
                f"<tool_response>\n{_text(msg.get('content'), f'messages[{i}].content')}\n</tool_response>"
            )
            if prev_tool:  # consecutive results share one user turn (as Qwen2.5)
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(msg, i)})
        else:
            out.append({"role": role, "content": _text(msg.get("content"), f"messages[{i}].content")})
        prev_tool = role == "tool"
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---------------------------------------------------------------------------------------------------
# Constraining the output (xgrammar structural tag)


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
    if mode not in ("auto", "required") or not tools:
        raise ValueError(f"a structural tag needs tools and mode 'auto' or 'required', got {mode!r}")
    tags = []
    for tool in tools:
        content = {"type": "json_schema", "json_schema": tool.parameters}
        if max_whitespace is not None:
            content["max_whitespace_cnt"] = max_whitespace
        begin = f'{CALL_BEGIN}\n{{"name": {json.dumps(tool.name)}, "arguments": '
        tags.append({"type": "tag", "begin": begin, "content": content, "end": "}\n" + CALL_END})
    one = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    if mode == "auto":
        trigger = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags}
        if parallel and max_calls is not None:  # text and calls, the output ending at the last call
            fmt = {"type": "sequence", "elements": [trigger | {"stop_after_first": True}] * max_calls}
        else:
            fmt = trigger | {"stop_after_first": not parallel}
    elif parallel and max_calls is not None:  # call ("\n" call (... )?)?, up to max_calls deep
        fmt = one
        for _ in range(max_calls - 1):
            more = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, fmt]}
            fmt = {
                "type": "sequence",
                "elements": [one, {"type": "or", "elements": [{"type": "const_string", "value": ""}, more]}],
            }
    elif parallel:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    else:
        fmt = one
    return {"type": "structural_tag", "format": fmt}


# ---------------------------------------------------------------------------------------------------
# Parsing the output


@dataclass
class ToolCall:
    name: str
    arguments: str  # raw JSON text of the arguments object, as the model wrote it


# `{"name": "X", "arguments": ` followed by `{` (lookahead): the prefix that names a call early.
_PREFIX_RE = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class _ObjectScanner:
    """Finds where a JSON object closes, fed piecewise: tracks strings and bracket depth only."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.pos = 0
        self.end: int | None = None  # offset just past the closing brace, once seen

    def feed(self, text: str) -> int | None:
        for ch in text:
            if self.end is not None:
                break
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.end


def _match_prefix(body: str) -> tuple[str, int] | None:
    """(name, offset of the arguments object) when the body begins with the call prefix."""
    m = _PREFIX_RE.match(body)
    if m is None:
        return None
    try:
        return json.loads(m.group(1)), m.end()
    except ValueError:
        return None


def _prefix_arguments(body: str, start: int) -> str:
    end = _ObjectScanner().feed(body[start:])
    return body[start : start + end] if end is not None else body[start:].rstrip()


_decoder = json.JSONDecoder()


def _object_spans(text: str) -> dict[str, tuple[object, int, int]] | None:
    """key -> (value, start, end) for `text` holding exactly one JSON object; None if it does not
    (or has duplicate keys)."""
    n, i = len(text), 0

    def skip(i: int) -> int:
        while i < n and text[i].isspace():
            i += 1
        return i

    i = skip(i)
    if i >= n or text[i] != "{":
        return None
    spans: dict[str, tuple[object, int, int]] = {}
    i = skip(i + 1)
    if i < n and text[i] == "}":
        return spans if skip(i + 1) == n else None
    try:
        while True:
            key, i = _decoder.raw_decode(text, i)
            i = skip(i)
            if not isinstance(key, str) or key in spans or i >= n or text[i] != ":":
                return None
            start = skip(i + 1)
            value, end = _decoder.raw_decode(text, start)
            spans[key] = (value, start, end)
            i = skip(end)
            if i < n and text[i] == ",":
                i = skip(i + 1)
            elif i < n and text[i] == "}":
                return spans if skip(i + 1) == n else None
            else:
                return None
    except ValueError:
        return None


def _parse_block(body: str) -> ToolCall | None:
    """The call in a block body (text between the tags), or None if it is not one (module docstring)."""
    prefix = _match_prefix(body)
    if prefix is not None:
        name, start = prefix
        return ToolCall(name, _prefix_arguments(body, start))
    spans = _object_spans(body)
    if spans is None or not isinstance(spans.get("name", (None,))[0], str):
        return None
    args = [spans[k] for k in ("arguments", "parameters") if k in spans]
    if len(args) != 1 or not isinstance(args[0][0], dict):
        return None
    _, start, end = args[0]
    return ToolCall(spans["name"][0], body[start:end])


def _block_end(text: str, start: int) -> tuple[int, int]:
    """(end of the body, end of the block) for a body starting at `start`: the first close tag, else
    the next open tag (left for the next block), else the end of the text."""
    close = text.find(CALL_END, start)
    reopen = text.find(CALL_BEGIN, start)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close, close + len(CALL_END)
    if reopen >= 0:
        return reopen, reopen
    return len(text), len(text)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a complete output into content (None when empty) and tool calls."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (begin := text.find(CALL_BEGIN, pos)) >= 0:
        content.append(text[pos:begin])
        body_start = begin + len(CALL_BEGIN)
        body_end, pos = _block_end(text, body_start)
        call = _parse_block(text[body_start:body_end])
        if call is not None:
            calls.append(call)
        else:
            content.append(text[begin:pos])
    content.append(text[pos:])
    return "".join(content).strip() or None, calls


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    name: str


@dataclass
class ToolCallArguments:
    index: int
    fragment: str


Event = ContentDelta | ToolCallStart | ToolCallArguments


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for k in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-k:]) for t in tags):
            return k
    return 0


def _strip_tail_len(text: str) -> int:
    """Length of `text` without trailing whitespace and `}` (which may close the call, not the args)."""
    i = len(text)
    while i and (text[i - 1].isspace() or text[i - 1] == "}"):
        i -= 1
    return i


class ToolCallStreamParser:
    """Incremental `parse_tool_calls` for streaming: feed text deltas, get events.

    Content is released as soon as it cannot be the start of `<tool_call>`; a call is announced
    (ToolCallStart) once its `{"name": "X", "arguments": {` prefix is complete, then its arguments stream,
    holding back trailing whitespace and `}` that may close the call rather than the arguments. A block
    without that prefix is held whole until it closes, then emitted as a call or as content. For any
    split of an output, the events add up to `parse_tool_calls` of the whole.
    """

    def __init__(self):
        self._buf = ""  # unprocessed text: outside a call, or the current block's body
        self._in_call = False
        self._index = 0  # index of the next (or current) call
        self._content_started = False
        self._pending_ws = ""  # trailing content whitespace, released only if content follows
        self._args_start: int | None = None  # offset of the arguments in the body once announced
        self._sent = 0  # characters of the arguments already emitted
        self._scanner: _ObjectScanner | None = None
        self._scanned = 0

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Process what the buffer allows; True when a state change asks for another step."""
        if not self._in_call:
            begin = self._buf.find(CALL_BEGIN)
            if begin >= 0:
                self._content(self._buf[:begin], events)
                self._buf = self._buf[begin + len(CALL_BEGIN) :]
                self._in_call = True
                return True
            keep = 0 if final else _partial_tag_len(self._buf, (CALL_BEGIN,))
            self._content(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return False

        body_end, block_end = _block_end(self._buf, 0)
        if body_end < len(self._buf) or final:  # the block is complete
            self._close_block(self._buf[:body_end], self._buf[body_end:block_end], events)
            self._buf = self._buf[block_end:]
            return True
        self._stream_arguments(events)
        return False

    def _stream_arguments(self, events: list[Event]) -> None:
        if self._args_start is None:
            prefix = _match_prefix(self._buf)
            if prefix is None:
                return
            name, self._args_start = prefix
            self._scanner, self._scanned = _ObjectScanner(), self._args_start
            events.append(ToolCallStart(self._index, name))
        # The text that is surely body (not a partial close tag), then within it the arguments so far.
        avail = len(self._buf) - _partial_tag_len(self._buf, (CALL_BEGIN, CALL_END))
        if self._scanner.end is None and avail > self._scanned:
            self._scanner.feed(self._buf[self._scanned : avail])
            self._scanned = avail
        args = self._buf[self._args_start : avail]
        upto = self._scanner.end if self._scanner.end is not None else _strip_tail_len(args)
        self._emit_arguments(args[:upto], events)

    def _emit_arguments(self, args: str, events: list[Event]) -> None:
        if len(args) > self._sent:
            events.append(ToolCallArguments(self._index, args[self._sent :]))
            self._sent = len(args)

    def _close_block(self, body: str, close_tag: str, events: list[Event]) -> None:
        call = _parse_block(body)
        if self._args_start is not None:  # announced: the prefix path, so `call` is not None
            self._emit_arguments(call.arguments, events)
        elif call is not None:
            events.append(ToolCallStart(self._index, call.name))
            self._emit_arguments(call.arguments, events)
        else:
            self._content(CALL_BEGIN + body + close_tag, events)
        if call is not None:
            self._index += 1
        self._in_call = False
        self._args_start, self._sent, self._scanner = None, 0, None

    def _content(self, text: str, events: list[Event]) -> None:
        """Emit content so that the deltas add up to the stripped concatenation of all content."""
        if not self._content_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        events.append(ContentDelta(self._pending_ws + body))
        self._pending_ws = text[len(body) :]
        self._content_started = True
