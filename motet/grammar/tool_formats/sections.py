"""Reading an output as content and call sections, whole and streamed: the parsers of every format but Hermes's
(motet/grammar/tool_call_parser.py) and harmony's (openai.py).

A format's parser reads an output as content, then a call section where the format's marker opens one, then content
again (and further sections). Within a section a JSON call object is a call as soon as it begins
`{"name": "X", "arguments": {` ("parameters" alike, any whitespace between tokens): its arguments are the raw text
of that object to its matching brace, or what was written of it when the output ends first (trailing whitespace
stripped); anything after the arguments up to the object's close is ignored. Another object is a call when, closed,
it is exactly one JSON object with a string "name" and an object "arguments" or "parameters" in any key order
(motet/grammar/tool_call_parser.py's rules 1 and 2). A section whose first element is no call stays in the content
as written; after the calls, what is not a separator or a further call is content again. The streamed parser
re-reads the open section on each delta and releases only what no later text can change, so for any split its
events add up to the whole parse.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from motet.grammar.stream_text import earliest, partial_marker_len
from motet.grammar.tool_call_parser import (
    ContentDeltas,
    Event,
    ObjectScanner,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    arguments_at,
    call_prefix,
    object_call,
)
from motet.grammar.tool_formats.base import ToolFormat

HOLD = "hold"  # not decidable yet: more text may change what this is (never returned when final)
NOT = "not"  # not a call section: the marker stays in the content as written


def undecided(final: bool) -> str:
    """What a section that more text would decide is: held, or at the output's end no section."""
    return NOT if final else HOLD


@dataclass
class _Content:
    text: str


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def opening(text: str, after: int, final: bool, chars: str) -> int | str:
    """The offset of the first character past the whitespace from `after` when it is one of `chars`, NOT when it is
    another, or `undecided` when there is none yet."""
    k = skip_ws(text, after)
    if k == len(text):
        return undecided(final)
    return k if text[k] in chars else NOT


def _close_after(text: str, i: int) -> int | None:
    """Just past the character that closes the object whose inside starts at `i` (depth 1), or None."""
    scanner = ObjectScanner()
    scanner.depth = 1
    end = scanner.feed(text[i:])
    return None if end is None else i + end


def _call_object(text: str, k: int, final: bool):
    """The call object at `k` (text[k] == "{"): (ToolCall, end of the object or None while open), or HOLD / NOT."""
    prefix = call_prefix(text, k)
    if prefix is not None:
        name, start = prefix
        args, end = arguments_at(text, start)
        return ToolCall(name, args), (None if end is None else _close_after(text, end))
    end = ObjectScanner().feed(text[k:])
    if end is None:
        return undecided(final)
    call = object_call(text[k : k + end])
    return NOT if call is None else (call, k + end)


def objects(text: str, k: int, final: bool, separator: str, close: str | None):
    """Call objects from `k`, separated by `separator`, up to `close` (None: the list ends where no separator
    follows). Returns (calls, end: None while the list may go on) or HOLD / NOT when its first is no call."""
    n = len(text)
    calls: list = []
    last = k
    while True:
        k = skip_ws(text, k)
        if k == n:
            if not final:
                return (calls, None) if calls else HOLD
            return (calls, n) if calls else NOT
        if close is not None and text[k] == close and not calls:
            return NOT
        if text[k] != "{":
            return (calls, last) if calls else NOT
        found = _call_object(text, k, final)
        if found in (HOLD, NOT):
            if found == HOLD:
                return (calls, None) if calls else HOLD
            return (calls, last) if calls else NOT
        call, end = found
        calls.append(call)
        if end is None:
            return calls, (n if final else None)
        last = end
        k = skip_ws(text, end)
        if k == n:
            return calls, (n if final else None)
        if text[k] == separator:
            k += 1
            continue
        if close is not None and text[k] == close:
            return calls, k + 1
        return calls, last


class Sections:
    """Where a format's call sections open (`find`) and how one is read (`section`, each format's own).

    `markers` open a section, read from just after the marker, but those in `bare`, which are the section's own
    first text (`{"name": "` opens a Llama call object). `leading`: (a character, the first one after it or None)
    that opens a section where the output begins with it: a bare call list or object (for Mistral and Granite, a
    list whose marker is a special token the text dropped)."""

    def __init__(
        self,
        markers: tuple[str, ...],
        *,
        bare: tuple[str, ...] = (),
        leading: tuple[str, str | None] | None = None,
    ):
        self.markers = markers
        self._bare = bare
        self._leading = leading

    def find(self, text: str, pos: int, at_start: bool) -> tuple[int, int] | None:
        """The first section's (start, where its reading starts) at or after `pos` (`at_start`: nothing but
        whitespace before `pos`), or None."""
        hit = earliest(text, self.markers, pos)
        if hit is not None:
            i, marker = hit
            hit = (i, i) if marker in self._bare else (i, i + len(marker))
        if at_start and self._leading is not None:
            char, inside = self._leading
            k = skip_ws(text, pos)
            if k < len(text) and text[k] == char and (hit is None or k < hit[0]):
                j = skip_ws(text, k + 1)
                if inside is None or j == len(text) or text[j] == inside:
                    return k, k
        return hit

    def section(self, text: str, i: int, after: int, final: bool):
        """The section at `i`, read from `after`: (calls, end: None while it may go on), or HOLD / NOT."""
        raise NotImplementedError


class ListSections(Sections):
    """A marker then a JSON list of calls (the marker may end with the list's `[`): Phi-4-mini's, Granite's."""

    def section(self, text, i, after, final):
        k = after
        if not text.endswith("[", i, after):
            k = opening(text, after, final, "[")
            if k in (HOLD, NOT):
                return k
            k += 1
        return objects(text, k, final, ",", "]")


def _scan(fmt: Sections, text: str, start: int, final: bool, at_start: bool):
    """Content and calls from `start` (at the top level; `at_start`: nothing but whitespace before it), and the
    offset up to which nothing can change any more, with the count of items before it:
    (items, safe, items_before_safe)."""
    items: list = []
    pos, n = start, len(text)
    while True:
        hit = fmt.find(text, pos, at_start)
        if hit is None:
            keep = 0 if final else partial_marker_len(text[pos:], fmt.markers)
            items.append(_Content(text[pos : n - keep]))
            return items, n - keep, len(items)
        i, after = hit
        items.append(_Content(text[pos:i]))
        at_start = False  # past the first section, or text before it
        found = fmt.section(text, i, after, final)
        if found == HOLD:
            return items, i, len(items)
        if found == NOT:
            pos = max(after, i + 1)
            items.append(_Content(text[i:pos]))
            continue
        calls, end = found
        items.extend(calls)
        if end is None:
            return items, i, len(items) - len(calls)
        pos = end


def _whole(fmt: Sections, text: str) -> tuple[str | None, list[ToolCall]]:
    items, _, _ = _scan(fmt, text, 0, True, True)
    content = "".join(it.text for it in items if isinstance(it, _Content))
    return content.strip() or None, [it for it in items if isinstance(it, ToolCall)]


class _SectionStream:
    """The streamed `_whole`: re-reads from the last offset nothing can change, releases what is new.

    Content comes out as the concatenation of the content pieces, its leading whitespace dropped and trailing
    whitespace held until more content follows (so the deltas add up to the stripped whole content); a call is
    announced once it is known and its arguments stream as they grow.
    """

    def __init__(self, fmt: Sections):
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


def sections_format(name, marker, prompt, tag, sections: Sections, calls_text) -> ToolFormat:
    """The declaration of a format whose calls `sections` reads."""
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
