"""Parsing tool calls out of a model's output (the Hermes format, motet/grammar/tool_calls.py), whole or streamed.

What counts as a call (both parsers): a block runs from `<tool_call>` to the first `</tool_call>`, or
to the next `<tool_call>` or the end of the text when the close tag is missing. Its body is a call when

  1. it begins `{"name": "X", "arguments": {` (any whitespace between tokens; "parameters" is accepted
     for "arguments"): the name is known, and this is what lets the stream announce the call early.
     The arguments are the raw text of that object up to its matching brace; if it never closes (output
     cut by max_tokens) they are the text written so far, trailing whitespace stripped - OpenAI too
     returns truncated arguments on a length cut. Whatever follows the arguments object is ignored.
  2. otherwise, the whole body is one JSON object with a string "name" and an object "arguments" (or
     "parameters"), in any key order (e.g. arguments before name), no duplicate keys.

Any other block stays in the content as written, tags included. Content is everything that is no call, as
the model wrote it (vLLM's Hermes parser's rule: text that does not parse as a call is content, markup such as
a `<tool_response>` block the model copied from its prompt included; dropping it left an answer that was only
such text empty), concatenated, then stripped of surrounding whitespace (None when empty); the stream gets the
same by dropping leading whitespace and holding back trailing whitespace until more content follows it.

`RepeatedCallStop` ends an output at a call that repeats an earlier one of the same output (the engine
applies it beside the stop strings when a request has tools).

The calls, the stream's events and the reading of a JSON call object (rules 1 and 2: `call_prefix`, `object_call`)
are every tool-call format's (motet/grammar/tool_formats/).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from motet.grammar.stream_text import Stripped, partial_marker_len
from motet.grammar.tool_calls import CALL_BEGIN, CALL_END

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


class ObjectScanner:
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


def call_prefix(text: str, pos: int = 0) -> tuple[str, int] | None:
    """(name, offset of the arguments object) when `text` at `pos` begins with the call prefix (rule 1)."""
    m = _PREFIX_RE.match(text, pos)
    if m is None:
        return None
    try:
        return json.loads(m.group(1)), m.end()
    except ValueError:
        return None


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


def object_call(text: str) -> ToolCall | None:
    """The call `text` is when it is exactly one JSON object with a string "name" and an object "arguments" or
    "parameters" in any key order (rule 2), else None."""
    spans = _object_spans(text)
    if spans is None or not isinstance(spans.get("name", (None,))[0], str):
        return None
    args = [spans[k] for k in ("arguments", "parameters") if k in spans]
    if len(args) != 1 or not isinstance(args[0][0], dict):
        return None
    _, start, end = args[0]
    return ToolCall(spans["name"][0], text[start:end])


def arguments_at(text: str, start: int) -> tuple[str, int | None]:
    """The arguments object opening at `start` (rule 1): its text and the offset just past it, or while it is open
    (or was cut off) what was written of it, trailing whitespace stripped, and None."""
    end = ObjectScanner().feed(text[start:])
    if end is None:
        return text[start:].rstrip(), None
    return text[start : start + end], start + end


def _parse_block(body: str) -> ToolCall | None:
    """The call in a block body (text between the tags), or None if it is not one (module docstring)."""
    prefix = call_prefix(body)
    if prefix is None:
        return object_call(body)
    name, start = prefix
    return ToolCall(name, arguments_at(body, start)[0])


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


class ContentDeltas(Stripped):
    """A stream's content deltas, which add up to the stripped concatenation of all its content (every format's
    parser)."""

    def emit(self, text: str, events: list[Event]) -> None:
        if released := self.add(text):
            events.append(ContentDelta(released))


@dataclass
class ToolCallStart:
    index: int
    name: str


@dataclass
class ToolCallArguments:
    index: int
    fragment: str


Event = ContentDelta | ToolCallStart | ToolCallArguments


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
        self._deltas = ContentDeltas()
        self._args_start: int | None = None  # offset of the arguments in the body once announced
        self._sent = 0  # characters of the arguments already emitted
        self._scanner: ObjectScanner | None = None
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
                self._deltas.emit(self._buf[:begin], events)
                self._buf = self._buf[begin + len(CALL_BEGIN) :]
                self._in_call = True
                return True
            keep = 0 if final else partial_marker_len(self._buf, (CALL_BEGIN,))
            self._deltas.emit(self._buf[: len(self._buf) - keep], events)
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
            prefix = call_prefix(self._buf)
            if prefix is None:
                return
            name, self._args_start = prefix
            self._scanner, self._scanned = ObjectScanner(), self._args_start
            events.append(ToolCallStart(self._index, name))
        # The text that is surely body (not a partial close tag), then within it the arguments so far.
        avail = len(self._buf) - partial_marker_len(self._buf, (CALL_BEGIN, CALL_END))
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
        else:  # not a call: content as written
            self._deltas.emit(CALL_BEGIN + body + close_tag, events)
        if call is not None:
            self._index += 1
        self._in_call = False
        self._args_start, self._sent, self._scanner = None, 0, None


def _whole_call(text: str) -> bool:
    """Whether a block's text between its tags is a whole call: a JSON object."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class RepeatedCallStop:
    """Ends an output at a tool call that repeats an earlier call of the same output, character for character:
    a small model asked for calls tends to repeat its call until max_tokens, and a parallel call identical to
    one already made adds nothing (OpenAI's parallel calls are independent). Likewise at a later call that is no
    call: its `</tool_call>` written before its JSON was whole (the model ended the call from inside an argument
    string, where the grammar keeps it: it then writes on inside that string until max_tokens).

    A stop matcher as the engine's stop strings are (motet/engine/detokenizer.py): `feed` returns the text
    safe to release and whether the output stopped there. The first call is released as it comes; a later one is
    held back until it is whole, then released, or dropped with everything after it (a repeat, or no call). A call
    is a block from `<tool_call>` to its `</tool_call>` (a block cut short by the next `<tool_call>` is none).
    """

    matched = None  # no stop string: the request ends as if the model had stopped
    reads_text = True

    def __init__(self):
        self.stopped = False
        self._calls: list[str] = []  # the whole blocks so far, tags included
        self._buf = ""  # text not yet looked at (outside a block: at most a partial `<tool_call>`)
        self._block: str | None = None  # the current block's text, from its `<tool_call>`
        self._sent = 0  # how much of the current block was released

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._buf += delta
        out: list[str] = []
        while True:
            if self._block is None:
                begin = self._buf.find(CALL_BEGIN)
                if begin < 0:
                    keep = partial_marker_len(self._buf, (CALL_BEGIN,))
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return "".join(out), False
                out.append(self._buf[:begin])
                self._block, self._sent = "", 0
                self._buf = self._buf[begin:]
            self._block += self._buf
            self._buf = ""
            close = self._block.find(CALL_END, len(CALL_BEGIN))
            reopen = self._block.find(CALL_BEGIN, len(CALL_BEGIN))
            if close >= 0 and (reopen < 0 or close < reopen):
                end = close + len(CALL_END)
                whole, self._buf = self._block[:end], self._block[end:]
                if whole in self._calls or self._calls and not _whole_call(whole[len(CALL_BEGIN) : close]):
                    self.stopped, self._buf = True, ""
                    return "".join(out), True
                self._calls.append(whole)
                out.append(whole[self._sent :])
                self._block = None
                continue
            if reopen >= 0:  # cut short by the next block: not a call, released as it is
                out.append(self._block[self._sent : reopen])
                self._buf, self._block = self._block[reopen:], None
                continue
            if not self._calls:  # the first block is released as it comes (a later one once whole), but for
                # what may open the next block
                upto = len(self._block) - partial_marker_len(self._block, (CALL_BEGIN,))
                out.append(self._block[self._sent : upto])
                self._sent = max(self._sent, upto)
            return "".join(out), False

    def flush(self) -> str:
        """The held-back text, at the end of an output that repeated no call (a later call cut by max_tokens is
        released: the parser reads what it can of it)."""
        if self.stopped:
            return ""
        held = (self._block[self._sent :] if self._block is not None else "") + self._buf
        self._block, self._buf = None, ""
        return held
