"""Tool-call formats, one small declaration each, chosen once per served model (vLLM's `--tool-call-parser`).

A format says how a model writes its calls and how they are read back:

- `hermes` (the default; Hermes-2-Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, exactly as motet/grammar/tool_calls.py and motet/grammar/tool_call_parser.py define them.
- `mistral` (Mistral 7B v0.3, Mistral Nemo/Small, Mixtral 8x22B): `[TOOL_CALLS]` then a JSON array of
  `{"name": ..., "arguments": {...}}`; the newer tokenizers' `[TOOL_CALLS]name{...}` (and
  `[TOOL_CALLS]name[ARGS]{...}`), one call per marker, is read too.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): `{"name": ..., "parameters": {...}}` objects, several
  separated by `;`, at the start of the output, after `<|python_tag|>`, or anywhere as `{"name": "` opens them.
- `pythonic` (Llama 3.2 / Llama 4 pythonic calling; what vLLM recommends for Gemma 3): `[f(a=1), g(b="x")]` at the
  start of the output or after `<|python_start|>`, arguments as Python literals (returned as JSON).
- `phi4_mini_json` (Phi-4-mini): `functools[{"name": ..., "arguments": {...}}, ...]`.
- `granite` (Granite 3.x): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3.1's `<tool_call>[...]`
  too; the special token dropped from the text, the list at the output's start).
- `openai` (GPT-OSS's harmony, motet/grammar/harmony.py): a message to a recipient `functions.NAME` on the
  commentary channel, its body the arguments:
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may come
  before the channel); the other messages' bodies are content.

Each gives the grammar that holds a call (an xgrammar structural tag, as Hermes's: `tool_choice` "required" or
a named function forces well-formed calls, "auto" constrains the calls the model opens; `pythonic` has none,
its calls are only parsed; `openai` holds "required" calls only, each one call from the output's first token, since
a grammar cannot let the model write harmony's special tokens), the whole and the streamed parser (the same ToolCall objects and stream events as
Hermes's, so the chat output, its deltas and the Responses API are unchanged), and how past calls and the tools
are written into a prompt whose template has no tool support.

The parsers of the new formats read an output as content, then a call section where a format's marker opens
one, then content again (and further sections). Within a section a JSON call object is a call as soon as it
begins `{"name": "X", "arguments": {` ("parameters" alike, any whitespace between tokens): its arguments are the
raw text of that object to its matching brace, or what was written of it when the output ends first (trailing
whitespace stripped); anything after the arguments up to the object's close is ignored. Another object is a call
when, closed, it is exactly one JSON object with a string "name" and an object "arguments" or "parameters" in any
key order. A section whose first element is no call stays in the content as written; after the calls, what is
not a separator or a further call is content again. The streamed parser re-reads the open section on each delta
and releases only what no later text can change, so for any split its events add up to the whole parse.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from motet.grammar import harmony
from motet.grammar.harmony import HarmonyReader, Pieces
from motet.grammar.specs import DEFAULT_MAX_WHITESPACE
from motet.grammar.tool_call_parser import (
    _PREFIX_RE,
    ContentDelta,
    ContentDeltas,
    Event,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    ToolCallStreamParser,
    _object_spans,
    _ObjectScanner,
    _partial_tag_len,
    parse_tool_calls,
)
from motet.grammar.tool_calls import TOOLS_SYSTEM_PROMPT, Tool, tool_call_structural_tag

# ---------------------------------------------------------------------------------------------------
# Reading sections: the pieces every format's parser is built from

_HOLD = "hold"  # not decidable yet: more text may change what this is (never returned when final)
_NOT = "not"  # not a call section: the marker stays in the content as written


@dataclass
class _Content:
    text: str


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def _ws_tail(text: str) -> int:
    return len(text) - len(text.rstrip())


def _close_after(text: str, i: int) -> int | None:
    """Just past the character that closes the object whose inside starts at `i` (depth 1), or None."""
    scanner = _ObjectScanner()
    scanner.depth = 1
    end = scanner.feed(text[i:])
    return None if end is None else i + end


def _call_object(text: str, k: int, final: bool, keys=("arguments", "parameters")):
    """The call object at `k` (text[k] == "{"): (ToolCall, end of the object or None while open), or _HOLD / _NOT."""
    m = _PREFIX_RE.match(text, k)
    name = None
    if m is not None:
        try:
            name = json.loads(m.group(1))
        except ValueError:
            name = None
    if name is not None:
        start = m.end()
        end = _ObjectScanner().feed(text[start:])
        if end is None:  # the arguments are still open (or were cut off)
            args = text[start:]
            args = args.rstrip() if final else args[: len(args) - _ws_tail(args)]
            return ToolCall(name, args), None
        return ToolCall(name, text[start : start + end]), _close_after(text, start + end)
    end = _ObjectScanner().feed(text[k:])
    if end is None:
        return _NOT if final else _HOLD
    spans = _object_spans(text[k : k + end])
    if spans is None or not isinstance(spans.get("name", (None,))[0], str):
        return _NOT
    args = [spans[key] for key in keys if key in spans]
    if len(args) != 1 or not isinstance(args[0][0], dict):
        return _NOT
    _, a, b = args[0]
    return ToolCall(spans["name"][0], text[k + a : k + b]), k + end


def _objects(text: str, k: int, final: bool, separator: str, close: str | None):
    """Call objects from `k`, separated by `separator`, up to `close` (None: the list ends where no separator
    follows). Returns (calls, end: None while the list may go on) or _HOLD / _NOT when its first is no call."""
    n = len(text)
    calls: list = []
    last = k
    while True:
        k = _skip_ws(text, k)
        if k == n:
            if not final:
                return (calls, None) if calls else _HOLD
            return (calls, n) if calls else _NOT
        if close is not None and text[k] == close and not calls:
            return _NOT
        if text[k] != "{":
            return (calls, last) if calls else _NOT
        found = _call_object(text, k, final)
        if found in (_HOLD, _NOT):
            if found == _HOLD:
                return (calls, None) if calls else _HOLD
            return (calls, last) if calls else _NOT
        call, end = found
        calls.append(call)
        if end is None:
            return calls, (n if final else None)
        last = end
        k = _skip_ws(text, end)
        if k == n:
            return calls, (n if final else None)
        if text[k] == separator:
            k += 1
            continue
        if close is not None and text[k] == close:
            return calls, k + 1
        return calls, last


def _scan(fmt: _Sections, text: str, start: int, final: bool, at_start: bool):
    """Content and calls from `start` (at the top level; `at_start`: nothing but whitespace before it), and the
    offset up to which nothing can change any more, with the count of items before it:
    (items, safe, items_before_safe)."""
    items: list = []
    pos, n = start, len(text)
    while True:
        hit = fmt.find(text, pos, at_start)
        if hit is None:
            keep = 0 if final else _partial_tag_len(text[pos:], fmt.markers)
            items.append(_Content(text[pos : n - keep]))
            return items, n - keep, len(items)
        i, after = hit
        items.append(_Content(text[pos:i]))
        at_start = False  # past the first section, or text before it
        found = fmt.section(text, i, after, final)
        if found == _HOLD:
            return items, i, len(items)
        if found == _NOT:
            pos = max(after, i + 1)
            items.append(_Content(text[i:pos]))
            continue
        calls, end = found
        items.extend(calls)
        if end is None:
            return items, i, len(items) - len(calls)
        pos = end


def _whole(fmt: _Sections, text: str) -> tuple[str | None, list[ToolCall]]:
    items, _, _ = _scan(fmt, text, 0, True, True)
    content = "".join(it.text for it in items if isinstance(it, _Content))
    return content.strip() or None, [it for it in items if isinstance(it, ToolCall)]


class _SectionStream:
    """The streamed `_whole`: re-reads from the last offset nothing can change, releases what is new.

    Content comes out as the concatenation of the content pieces, its leading whitespace dropped and trailing
    whitespace held until more content follows (so the deltas add up to the stripped whole content); a call is
    announced once it is known and its arguments stream as they grow.
    """

    def __init__(self, fmt: _Sections):
        self._fmt = fmt
        self._text = ""
        self._base = 0  # offset of the first item not yet final
        self._at_start = True
        self._base_calls = 0  # calls before `_base`
        self._sent_args: list[int] = []  # per call: characters of the arguments released
        self._content_sent = 0  # characters of the raw content after `_base` already handed on
        self._deltas = ContentDeltas()

    def feed(self, delta: str) -> list[Event]:
        self._text += delta
        return self._step(final=False)

    def finish(self) -> list[Event]:
        return self._step(final=True)

    def _step(self, final: bool) -> list[Event]:
        items, safe, before = _scan(self._fmt, self._text, self._base, final, self._at_start)
        events: list[Event] = []
        raw, index = 0, self._base_calls  # raw content after `_base` so far; the next call's index
        for it in items:
            if isinstance(it, _Content):
                if raw + len(it.text) > self._content_sent:
                    self._deltas.emit(it.text[max(0, self._content_sent - raw) :], events)
                    self._content_sent = raw + len(it.text)
                raw += len(it.text)
                continue
            if index == len(self._sent_args):
                self._sent_args.append(0)
                events.append(ToolCallStart(index, it.name))
            if len(it.arguments) > self._sent_args[index]:
                events.append(ToolCallArguments(index, it.arguments[self._sent_args[index] :]))
                self._sent_args[index] = len(it.arguments)
            index += 1
        done = items[:before]  # final: the next read starts after them
        self._base = safe
        self._base_calls += sum(isinstance(it, ToolCall) for it in done)
        self._content_sent -= sum(len(it.text) for it in done if isinstance(it, _Content))
        self._at_start = self._at_start and not self._base_calls and not self._deltas.started
        return events


class _Sections:
    """How a format's sections open (`markers`, and what `find` looks for) and are read (`section`)."""

    markers: tuple[str, ...] = ()

    def find(self, text: str, pos: int, at_start: bool) -> tuple[int, int] | None:
        """The first section's (start, end of its marker) at or after `pos`, or None."""
        hits = [(i, i + len(m)) for m in self.markers if (i := text.find(m, pos)) >= 0]
        return min(hits) if hits else None

    def section(self, text: str, i: int, after: int, final: bool):
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------------
# Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]+")


MISTRAL_LIST_OPEN = '[{"name": "'


class _MistralSections(_Sections):
    """`[TOOL_CALLS]` is a special token in Mistral's tokenizers, dropped from the text where the request skips
    special tokens (the default): the call list is then read where `[{"name": "` opens it, or where the output
    begins with `[` then `{`."""

    markers = (MISTRAL_CALLS, MISTRAL_LIST_OPEN)

    def find(self, text, pos, at_start):
        hit = super().find(text, pos, at_start)
        if at_start:
            k = _skip_ws(text, pos)
            if k < len(text) and text[k] == "[" and (hit is None or k < hit[0]):
                j = _skip_ws(text, k + 1)
                if j == len(text) or text[j] == "{":
                    return k, k
        if hit is not None and text.startswith(MISTRAL_LIST_OPEN, hit[0]):
            return hit[0], hit[0]
        return hit

    def section(self, text, i, after, final):
        n = len(text)
        k = _skip_ws(text, after)
        if k == n:
            return _NOT if final else _HOLD
        if text[k] == "[":
            return _objects(text, k + 1, final, ",", "]")
        if text[k] == "{":
            return _objects(text, k, final, ",", None)
        m = _NAME_CHARS.match(text, k)  # [TOOL_CALLS]name{...} / name[ARGS]{...}, one call per marker
        if m is None:
            return _NOT
        j = m.end()
        rest = text[j : j + len(_MISTRAL_ARGS)]
        if j == n or (_MISTRAL_ARGS.startswith(rest) and j + len(rest) == n):
            return _NOT if final else _HOLD
        if rest == _MISTRAL_ARGS:
            j += len(_MISTRAL_ARGS)
            if j == n:
                return _NOT if final else _HOLD
        if text[j] != "{":
            return _NOT
        end = _ObjectScanner().feed(text[j:])
        if end is None:
            args = text[j:]
            args = args.rstrip() if final else args[: len(args) - _ws_tail(args)]
            return [ToolCall(m.group(), args)], (n if final else None)
        return [ToolCall(m.group(), text[j : j + end])], j + end


# ---------------------------------------------------------------------------------------------------
# Llama 3.x JSON: <|python_tag|>{"name": ..., "parameters": {...}}; {...}

LLAMA_PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL_OPEN = '{"name": "'


class _LlamaJsonSections(_Sections):
    markers = (LLAMA_PYTHON_TAG, LLAMA_CALL_OPEN)

    def find(self, text, pos, at_start):
        hit = super().find(text, pos, at_start)
        if at_start:
            k = _skip_ws(text, pos)
            if k < len(text) and text[k] == "{" and (hit is None or k < hit[0]):
                return k, k
        if hit is not None and text.startswith(LLAMA_CALL_OPEN, hit[0]):
            return hit[0], hit[0]  # the object is the section
        return hit

    def section(self, text, i, after, final):
        k = _skip_ws(text, after)
        if k == len(text):
            return _NOT if final else _HOLD
        if text[k] != "{":
            return _NOT
        return _objects(text, k, final, ";", None)


# ---------------------------------------------------------------------------------------------------
# Pythonic: [f(a=1), g(b="x")]

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _bracket_end(text: str, k: int) -> int | None:
    """Just past the `]` that closes the list opening at `k`, skipping Python strings, or None."""
    depth, quote, escaped = 0, None, False
    for j in range(k, len(text)):
        ch = text[j]
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _python_value(node: ast.AST):
    """A Python literal as its JSON value (ValueError if it is none)."""
    value = ast.literal_eval(node)

    def check(v):
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, list):
            return [check(x) for x in v]
        if isinstance(v, dict):
            if not all(isinstance(key, str) for key in v):
                raise ValueError("non-string key")
            return {key: check(x) for key, x in v.items()}
        if v is None or isinstance(v, bool | int | float | str):
            return v
        raise ValueError(f"not a JSON value: {type(v).__name__}")

    return check(value)


def _pythonic_calls(source: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not _NAME_CHARS.fullmatch(name) or any(kw.arg is None for kw in node.keywords):
            return None
        try:
            args = {kw.arg: _python_value(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


class _PythonicSections(_Sections):
    markers = (PYTHON_START,)

    def find(self, text, pos, at_start):
        hit = super().find(text, pos, at_start)
        if at_start:
            k = _skip_ws(text, pos)
            if k < len(text) and text[k] == "[" and (hit is None or k < hit[0]):
                return k, k
        return hit

    def section(self, text, i, after, final):
        k = _skip_ws(text, after)
        if k == len(text):
            return _NOT if final else _HOLD
        if text[k] != "[":
            return _NOT
        end = _bracket_end(text, k)
        if end is None:
            return _NOT if final else _HOLD
        calls = _pythonic_calls(text[k:end])
        if calls is None:
            return _NOT
        if after > i:  # <|python_start|> ... <|python_end|>
            j = _skip_ws(text, end)
            if text.startswith(PYTHON_END, j):
                end = j + len(PYTHON_END)
            elif not final and PYTHON_END.startswith(text[j:]):
                return _HOLD
        return calls, end


def _python_literal(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    return repr(value)  # str, int, float, bool, None: Python's own spelling


# ---------------------------------------------------------------------------------------------------
# A marker then a JSON list: Phi-4-mini's functools[...], Granite 3.x's <|tool_call|>[...]

PHI4_CALLS = "functools["
GRANITE_CALLS, GRANITE_31_CALLS = "<|tool_call|>", "<tool_call>"


class _ListSections(_Sections):
    """One of `markers` then a JSON list of calls (a marker may end with the list's `[`); with `list_at_start`, also
    a list the output begins with (where the marker is a special token the text dropped)."""

    def __init__(self, markers: tuple[str, ...], list_at_start: bool = False):
        self.markers = markers
        self._list_at_start = list_at_start

    def find(self, text, pos, at_start):
        hit = super().find(text, pos, at_start)
        if at_start and self._list_at_start:
            k = _skip_ws(text, pos)
            if k < len(text) and text[k] == "[" and (hit is None or k < hit[0]):
                j = _skip_ws(text, k + 1)
                if j == len(text) or text[j] == "{":
                    return k, k
        return hit

    def section(self, text, i, after, final):
        k = after
        if not text.endswith("[", i, after):
            k = _skip_ws(text, after)
            if k == len(text):
                return _NOT if final else _HOLD
            if text[k] != "[":
                return _NOT
            k += 1
        return _objects(text, k, final, ",", "]")


# ---------------------------------------------------------------------------------------------------
# GPT-OSS's harmony: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

FUNCTIONS = "functions."  # a recipient that is one of the request's tools
HARMONY_CALL_OPEN = f"{harmony.CHANNEL}commentary to={FUNCTIONS}"


class _HarmonyCalls:
    """The `openai` format's stream parser over motet/grammar/harmony.py's reader: a message to `functions.NAME` is
    a call (announced once its header is complete, its body streamed as the arguments, surrounding whitespace
    dropped); a message to another recipient (a built-in tool's: `browser.search`, `python`) is dropped; every
    other message's body and the text outside messages is content (pieces joined by "\n")."""

    def __init__(self):
        self._reader = HarmonyReader()
        self._deltas = ContentDeltas()
        self._pieces = Pieces()
        self._route: str | None = None  # "top" (text outside messages), "content" or "call"
        self._index = 0  # the next call's
        self._args_started = False
        self._args_ws = ""  # the call's trailing whitespace, released when more arguments follow

    def feed(self, delta: str) -> list[Event]:
        return self._events(self._reader.feed(delta))

    def finish(self) -> list[Event]:
        return self._events(self._reader.finish())

    def _events(self, items) -> list[Event]:
        events: list[Event] = []
        for kind, value in items:
            if kind == "text":
                if self._route != "top":
                    self._pieces.start()
                    self._route = "top"
                self._deltas.emit(self._pieces.add(value), events)
            elif kind == "open":
                recipient = value.recipient or ""
                name = recipient[len(FUNCTIONS) :]
                if recipient.startswith(FUNCTIONS) and _NAME_CHARS.fullmatch(name):
                    events.append(ToolCallStart(self._index, name))
                    self._route, self._args_started, self._args_ws = "call", False, ""
                elif (
                    value.recipient is not None
                ):  # a built-in tool's call (browser, python): not for the user
                    self._route = "dropped"
                else:
                    self._pieces.start()
                    self._route = "content"
            elif kind == "body":
                if self._route == "call":
                    self._arguments(value, events)
                elif self._route != "dropped":
                    self._deltas.emit(self._pieces.add(value), events)
            else:  # close
                if self._route == "call":
                    self._index += 1
                self._route = None
        return events

    def _arguments(self, text: str, events: list[Event]) -> None:
        if not self._args_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._args_ws += text
            return
        events.append(ToolCallArguments(self._index, self._args_ws + body))
        self._args_ws, self._args_started = text[len(body) :], True


def _collected(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """A stream's events as the whole parse: content (None when empty) and calls."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append(ToolCall(e.name, ""))
        elif isinstance(e, ToolCallArguments):
            calls[e.index].arguments += e.fragment
    return content or None, calls


def _harmony_parse(text: str) -> tuple[str | None, list[ToolCall]]:
    parser = _HarmonyCalls()
    return _collected(parser.feed(text) + parser.finish())


# ---------------------------------------------------------------------------------------------------
# Grammars


def _json_args(tool: Tool, max_whitespace: int | None) -> dict:
    content = {"type": "json_schema", "json_schema": tool.parameters}
    if max_whitespace is not None:
        content["max_whitespace_cnt"] = max_whitespace
    return content


def _list_of(one: dict, tags: list[dict], separator: str, max_calls: int | None) -> dict:
    """One or more calls separated by `separator` (at most `max_calls`)."""
    if max_calls is None:
        return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True}
    fmt = one
    for _ in range(max_calls - 1):
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, fmt]}
        fmt = {
            "type": "sequence",
            "elements": [one, {"type": "or", "elements": [{"type": "const_string", "value": ""}, more]}],
        }
    return fmt


def _object_tags(tools: list[Tool], key: str, max_whitespace: int | None) -> list[dict]:
    return [
        {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(tool.name)}, "{key}": ',
            "content": _json_args(tool, max_whitespace),
            "end": "}",
        }
        for tool in tools
    ]


def _check(tools, mode) -> None:
    if mode not in ("auto", "required") or not tools:
        raise ValueError(f"a structural tag needs tools and mode 'auto' or 'required', got {mode!r}")


def _list_structural_tag(opening: str, trigger: str):
    """The grammar of `opening` (the marker and the list's `[`), call (`, ` call)*, `]`: "required" is that and
    nothing else; "auto" free text until the model writes `trigger`, then the calls, and the output ends. Without
    `parallel`, one call."""

    def structural_tag(
        tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None
    ) -> dict:
        _check(tools, mode)
        tags = _object_tags(tools, "arguments", max_whitespace)
        one = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        inner = _list_of(one, tags, ", ", max_calls) if parallel else one
        if mode == "required":
            fmt = {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": opening},
                    inner,
                    {"type": "const_string", "value": "]"},
                ],
            }
        else:
            section = {"type": "tag", "begin": opening, "content": inner, "end": "]"}
            fmt = {
                "type": "triggered_tags",
                "triggers": [trigger],
                "tags": [section],
                "stop_after_first": True,
            }
        return {"type": "structural_tag", "format": fmt}

    return structural_tag


mistral_structural_tag = _list_structural_tag(MISTRAL_CALLS + "[", MISTRAL_CALLS)
phi4_mini_structural_tag = _list_structural_tag(PHI4_CALLS, PHI4_CALLS)
granite_structural_tag = _list_structural_tag(GRANITE_CALLS + "[", GRANITE_CALLS)


def openai_structural_tag(
    tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None
) -> dict | None:
    """ "required": one call on the commentary channel from the output's first token,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` then the arguments (the grammar ends
    there: `<|call|>` is one of GPT-OSS's stop tokens). "auto": None, the calls only parsed: the grammar backends
    never let a model write special tokens, and harmony writes every message's header with them."""
    _check(tools, mode)
    if mode != "required":
        return None
    tags = [
        {
            "type": "tag",
            "begin": f"{HARMONY_CALL_OPEN}{tool.name} {harmony.CONSTRAIN}json{harmony.MESSAGE}",
            "content": _json_args(tool, max_whitespace),
            "end": "",
        }
        for tool in tools
    ]
    return {
        "type": "structural_tag",
        "format": tags[0] if len(tags) == 1 else {"type": "or", "elements": tags},
    }


def llama3_json_structural_tag(
    tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None
) -> dict:
    """`{"name": ..., "parameters": {...}}` objects (`; ` between them with `parallel`): "required" is that
    and nothing else; "auto" free text in which `{"name": "` opens a call (with `parallel`, more may follow)."""
    _check(tools, mode)
    tags = _object_tags(tools, "parameters", max_whitespace)
    one = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    if mode == "required":
        fmt = _list_of(one, tags, "; ", max_calls) if parallel else one
    else:
        trigger = {"type": "triggered_tags", "triggers": [LLAMA_CALL_OPEN], "tags": tags}
        if parallel and max_calls is not None:
            fmt = {"type": "sequence", "elements": [trigger | {"stop_after_first": True}] * max_calls}
        else:
            fmt = trigger | {"stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


# ---------------------------------------------------------------------------------------------------
# The declarations

_MISTRAL_PROMPT = (
    "You are a function calling AI model. You may call one or more of these functions to answer the user:\n"
    "[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\n"
    "To call functions, reply with [TOOL_CALLS] followed by a JSON list of calls and nothing else:\n"
    '[TOOL_CALLS][{{"name": <function-name>, "arguments": <args-json-object>}}]'
)
_LLAMA_PROMPT = (
    "You have access to the following functions:\n{tools}\n\n"
    "To call a function, respond only with a JSON object in the format "
    '{{"name": <function-name>, "parameters": <dictionary of argument name and its value>}}; several calls '
    "are separated by '; '. Do not use variables."
)
_PYTHONIC_PROMPT = (
    "You have access to the following functions:\n{tools}\n\n"
    "To call functions, respond only with a Python list of calls with keyword arguments, "
    "[func_name1(param1=value1, param2=value2), func_name2(param=value)], and nothing else."
)
_PHI4_PROMPT = (  # vLLM's examples/tool_chat_template_phi4_mini.jinja, shortened
    "You can call these functions:\n{tools}\n\n"
    "If you decide to call functions, write them as one JSON list after the functools marker and nothing else: "
    'functools[{{"name": <function-name>, "arguments": <args-json-object>}}, ...]'
)
_GRANITE_PROMPT = (  # Granite 3.x's own system prompt for tools
    "You are a helpful assistant with access to the following function calls. Your task is to produce a list of "
    "function calls necessary to generate response to the user utterance. Use the following function calls as "
    "required.\n{tools}\n\n"
    "When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON list "
    'of tools used: <|tool_call|>[{{"name": <function-name>, "arguments": <args-json-object>}}]'
)
_OPENAI_PROMPT = (
    "You can call these functions:\n{tools}\n\n"
    "To call one, write <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> followed by its "
    "arguments as a JSON object, then <|call|>."
)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # what opens the model's calls
    system_prompt: (
        str  # the tools in the system prompt of a template without tool support ({tools}: JSON lines)
    )
    stop_repeated_calls: bool  # whether motet/grammar/tool_call_parser.RepeatedCallStop reads this format
    _tag: Callable | None  # (tools, mode, parallel, max_whitespace=, max_calls=) -> structural tag
    _parse: Callable[[str], tuple[str | None, list[ToolCall]]]
    _stream: Callable[[], object]  # a new stream parser
    _calls_text: Callable[[list[tuple[str, object]]], str]
    # Its markers are special tokens the output's text must keep (GPT-OSS's): the request's skip_special_tokens
    # is turned off.
    keeps_special_tokens: bool = False
    # Whether a reasoning parser's reasoning comes before its calls' grammar (the engine's gate: the grammar holds
    # after the reasoning). GPT-OSS's calls are a channel of their own: its grammar holds from the first token.
    grammar_after_reasoning: bool = True

    def structural_tag(self, tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None):
        """The grammar holding calls to `tools` (None: this format has none; its calls are only parsed)."""
        if self._tag is None:
            return None
        return self._tag(tools, mode, parallel, max_whitespace=max_whitespace, max_calls=max_calls)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content (None when empty) and calls of a whole output."""
        return self._parse(text)

    def stream_parser(self):
        """A parser with `feed(delta)` and `finish()` giving the events that add up to `parse`."""
        return self._stream()

    def calls_text(self, calls: list[tuple[str, object]]) -> str:
        """An assistant turn's calls, (name, arguments as a dict or its JSON text), as the model writes them."""
        return self._calls_text([(name, _arguments(args)) for name, args in calls])


def _sections_format(name, marker, prompt, tag, sections: _Sections, calls_text) -> ToolFormat:
    return ToolFormat(
        name,
        marker,
        prompt,
        False,
        tag,
        functools.partial(_whole, sections),
        functools.partial(_SectionStream, sections),
        calls_text,
    )


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _hermes_calls(calls) -> str:
    from motet.grammar.tool_prompt import format_call

    return "\n".join(format_call(name, args) for name, args in calls)


def _json_list(opening: str, calls) -> str:
    body = ", ".join(
        json.dumps({"name": name, "arguments": args}, ensure_ascii=False) for name, args in calls
    )
    return f"{opening}{body}]"


def _llama_calls(calls) -> str:
    return "; ".join(
        json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls
    )


def _pythonic_text(calls) -> str:
    def one(name, args):
        if not isinstance(args, dict):
            return f"{name}()"
        return f"{name}(" + ", ".join(f"{k}={_python_literal(v)}" for k, v in args.items()) + ")"

    return "[" + ", ".join(one(name, args) for name, args in calls) + "]"


def _harmony_calls(calls) -> str:
    """Each call a message of its own (the first one's `<|start|>assistant` is the template's)."""
    return (harmony.START + "assistant").join(
        f"{HARMONY_CALL_OPEN}{name} {harmony.CONSTRAIN}json{harmony.MESSAGE}"
        f"{json.dumps(args, ensure_ascii=False)}{harmony.CALL}"
        for name, args in calls
    )


HERMES = ToolFormat(
    "hermes",
    "<tool_call>",
    TOOLS_SYSTEM_PROMPT,
    True,
    tool_call_structural_tag,
    parse_tool_calls,
    ToolCallStreamParser,
    _hermes_calls,
)
MISTRAL = _sections_format(
    "mistral",
    MISTRAL_CALLS,
    _MISTRAL_PROMPT,
    mistral_structural_tag,
    _MistralSections(),
    functools.partial(_json_list, MISTRAL_CALLS + "["),
)
LLAMA3_JSON = _sections_format(
    "llama3_json",
    LLAMA_CALL_OPEN,
    _LLAMA_PROMPT,
    llama3_json_structural_tag,
    _LlamaJsonSections(),
    _llama_calls,
)
PYTHONIC = _sections_format("pythonic", "[", _PYTHONIC_PROMPT, None, _PythonicSections(), _pythonic_text)
PHI4_MINI = _sections_format(
    "phi4_mini_json",
    PHI4_CALLS,
    _PHI4_PROMPT,
    phi4_mini_structural_tag,
    _ListSections((PHI4_CALLS,)),
    functools.partial(_json_list, PHI4_CALLS),
)
GRANITE = _sections_format(
    "granite",
    GRANITE_CALLS,
    _GRANITE_PROMPT,
    granite_structural_tag,
    _ListSections((GRANITE_CALLS, GRANITE_31_CALLS), list_at_start=True),
    functools.partial(_json_list, GRANITE_CALLS + "["),
)
OPENAI = ToolFormat(
    "openai",
    HARMONY_CALL_OPEN,
    _OPENAI_PROMPT,
    False,
    openai_structural_tag,
    _harmony_parse,
    _HarmonyCalls,
    _harmony_calls,
    keeps_special_tokens=True,
    grammar_after_reasoning=False,
)

# vLLM's --tool-call-parser names for these formats
TOOL_FORMATS = {
    "hermes": HERMES,
    "mistral": MISTRAL,
    "llama3_json": LLAMA3_JSON,
    "llama4_json": LLAMA3_JSON,
    "pythonic": PYTHONIC,
    "llama4_pythonic": PYTHONIC,
    "phi4_mini_json": PHI4_MINI,
    "granite": GRANITE,
    "openai": OPENAI,
}


def template_tool_format(chat_template: str | None) -> str | None:
    """The tool-call parser a chat template shows its model writes, by its markers: `[TOOL_CALLS]` Mistral's,
    `<|python_tag|>` Llama 3.x's JSON, harmony's `<|channel|>` GPT-OSS's, `functools` or Phi-4-mini's
    `<|/tool|>` Phi-4-mini's, `<|tool_call|>` Granite 3.x's; None for none of them (Hermes)."""
    template = chat_template or ""
    for marker, name in (
        (MISTRAL_CALLS, "mistral"),
        (LLAMA_PYTHON_TAG, "llama3_json"),
        (harmony.CHANNEL, "openai"),
        ("functools", "phi4_mini_json"),
        ("<|/tool|>", "phi4_mini_json"),
        (GRANITE_CALLS, "granite"),
    ):
        if marker in template:
            return name
    return None


def tool_format(name: str | None, chat_template: str | None = None) -> ToolFormat:
    """The format named by --tool-call-parser (or a model family's), or without one the chat template's
    (`template_tool_format`), else Hermes."""
    name = name if name is not None else template_tool_format(chat_template)
    if name is None:
        return HERMES
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_FORMATS)}") from None
