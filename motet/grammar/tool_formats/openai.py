"""GPT-OSS's tool calls in harmony (vLLM's `openai`; motet/grammar/harmony.py reads the messages): a message to a
recipient `functions.NAME` on the commentary channel, its body the arguments:
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may come before
the channel); the other messages' bodies are content.

Its grammar holds "required" calls only, each one call from the output's first token: a grammar cannot let the model
write harmony's special tokens, which the output's text keeps (`keeps_special_tokens`)."""

from __future__ import annotations

import json

from motet.grammar import harmony
from motet.grammar.harmony import HarmonyReader, Pieces
from motet.grammar.specs import DEFAULT_MAX_WHITESPACE
from motet.grammar.stream_text import Stripped
from motet.grammar.tool_call_parser import (
    ContentDelta,
    ContentDeltas,
    Event,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
)
from motet.grammar.tool_calls import NAME_CHARS, check_mode, json_arguments, one_of
from motet.grammar.tool_formats.base import ToolFormat

FUNCTIONS = "functions."  # a recipient that is one of the request's tools
HARMONY_CALL_OPEN = f"{harmony.CHANNEL}commentary to={FUNCTIONS}"

_PROMPT = (
    "You can call these functions:\n{tools}\n\n"
    "To call one, write <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> followed by its "
    "arguments as a JSON object, then <|call|>."
)


class _HarmonyCalls:
    """The stream parser over motet/grammar/harmony.py's reader: a message to `functions.NAME` is a call (announced
    once its header is complete, its body streamed as the arguments, surrounding whitespace dropped); a message to
    another recipient (a built-in tool's: `browser.search`, `python`) is dropped; every other message's body and the
    text outside messages is content (pieces joined by "\n")."""

    def __init__(self):
        self._reader = HarmonyReader()
        self._deltas = ContentDeltas()
        self._pieces = Pieces()
        self._route: str | None = None  # "top" (text outside messages), "content" or "call"
        self._index = 0  # the next call's
        self._arguments = Stripped()  # the open call's

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
                if recipient.startswith(FUNCTIONS) and NAME_CHARS.fullmatch(name):
                    events.append(ToolCallStart(self._index, name))
                    self._route, self._arguments = "call", Stripped()
                elif (
                    value.recipient is not None
                ):  # a built-in tool's call (browser, python): not for the user
                    self._route = "dropped"
                else:
                    self._pieces.start()
                    self._route = "content"
            elif kind == "body":
                if self._route == "call":
                    if fragment := self._arguments.add(value):
                        events.append(ToolCallArguments(self._index, fragment))
                elif self._route != "dropped":
                    self._deltas.emit(self._pieces.add(value), events)
            else:  # close
                if self._route == "call":
                    self._index += 1
                self._route = None
        return events


def _parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """The stream's events of the whole text as content (None when empty) and calls."""
    parser = _HarmonyCalls()
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append(ToolCall(e.name, ""))
        elif isinstance(e, ToolCallArguments):
            calls[e.index].arguments += e.fragment
    return content or None, calls


def _structural_tag(
    tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None
) -> dict | None:
    """ "required": one call on the commentary channel from the output's first token,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` then the arguments (the grammar ends
    there: `<|call|>` is one of GPT-OSS's stop tokens). "auto": None, the calls only parsed: the grammar backends
    never let a model write special tokens, and harmony writes every message's header with them."""
    check_mode(tools, mode)
    if mode != "required":
        return None
    tags = [
        {
            "type": "tag",
            "begin": f"{HARMONY_CALL_OPEN}{tool.name} {harmony.CONSTRAIN}json{harmony.MESSAGE}",
            "content": json_arguments(tool, max_whitespace),
            "end": "",
        }
        for tool in tools
    ]
    return {"type": "structural_tag", "format": one_of(tags)}


def _calls_text(calls) -> str:
    """Each call a message of its own (the first one's `<|start|>assistant` is the template's)."""
    return (harmony.START + "assistant").join(
        f"{HARMONY_CALL_OPEN}{name} {harmony.CONSTRAIN}json{harmony.MESSAGE}"
        f"{json.dumps(args, ensure_ascii=False)}{harmony.CALL}"
        for name, args in calls
    )


OPENAI = ToolFormat(
    "openai",
    HARMONY_CALL_OPEN,
    _PROMPT,
    False,
    _structural_tag,
    _parse,
    _HarmonyCalls,
    _calls_text,
    keeps_special_tokens=True,
    grammar_after_reasoning=False,
)
