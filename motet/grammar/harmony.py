"""GPT-OSS's harmony output read from its text: messages, each a header naming a channel and a body, streamed.

An output is a series of messages (OpenAI's harmony format, as the gpt-oss chat template prompts them):

    <|channel|>analysis<|message|>The user asks for the weather in Tokyo. Call get_weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>

or, answering, `<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The first message's
`<|start|>assistant` is the prompt's last words. A header names the channel (`analysis`: the chain of thought;
`commentary`: calls and preambles; `final`: the answer), a recipient (`to=functions.NAME`, after the channel or
before it: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`) and a content type
(`<|constrain|>json`, or a bare ` json`). The markers are special tokens: a request served in this format keeps
them in its text (the engine's detokenizer would otherwise drop them).

`HarmonyReader` reads the text, whole or fed piecewise, into events that add up the same for any split:

- ("text", s): text outside any message (a model that writes no harmony), every marker dropped from it;
- ("open", Header): a message's header is complete (read up to `<|message|>`);
- ("body", s): a piece of the open message's body;
- ("close", end): the message ended: at `<|end|>`, `<|call|>` or `<|return|>` (`end` is that marker), or at the
  next header's `<|start|>` or `<|channel|>`, or at the end of the output (`end` is "").

A header opens at `<|start|>`, `<|channel|>` or `<|message|>` (a message with no header), and at the output's start
also at `to=` (the recipient continuing the prompt's `<|start|>assistant`). A header the output never completes is
dropped. The reader holds back only what is undecided: a partial marker, and a header until its `<|message|>`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from motet.grammar.stream_text import earliest, partial_marker_len

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
FINAL_HEADER = CHANNEL + "final" + MESSAGE  # what begins the answer (vLLM's end of gpt-oss's reasoning)

_OPENERS = (START, CHANNEL, MESSAGE)
_ENDS = (END, CALL, RETURN)
# the output's first header may be the recipient, after the prompt's `<|start|>assistant`
_FIRST = ("to=", " to=")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass(frozen=True)
class Header:
    text: str  # as written, from its first marker up to `<|message|>`
    channel: str | None
    recipient: str | None


def read_header(text: str) -> Header:
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return Header(text, channel and channel.group(1), recipient and recipient.group(1))


class HarmonyReader:
    """The events of a harmony output (module docstring), fed piecewise: `feed(delta)`, then `finish()`."""

    def __init__(self):
        self._buf = ""
        self._state = "first"  # "first" (undecided: may open with `to=`), "top", "header", "body"

    def feed(self, delta: str) -> list[tuple]:
        self._buf += delta
        return self._read(final=False)

    def finish(self) -> list[tuple]:
        return self._read(final=True)

    def _read(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while True:
            buf = self._buf
            if self._state == "first":
                if any(buf.startswith(p) for p in _FIRST):
                    self._state = "header"
                elif final or not any(p.startswith(buf) for p in _FIRST):
                    self._state = "top"
                else:
                    return out  # nothing yet, or a partial `to=`
            elif self._state == "top":
                hit = earliest(buf, _OPENERS + _ENDS)
                if hit is None:
                    keep = 0 if final else partial_marker_len(buf, _OPENERS + _ENDS)
                    if len(buf) > keep:
                        out.append(("text", buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep :]
                    return out
                i, tag = hit
                if i:
                    out.append(("text", buf[:i]))
                if tag in _ENDS:  # a stray end marker: dropped
                    self._buf = buf[i + len(tag) :]
                else:
                    self._buf, self._state = buf[i:], "header"
            elif self._state == "header":
                i = buf.find(MESSAGE)
                if i < 0:
                    if final:  # never completed: dropped
                        self._buf = ""
                    return out
                out.append(("open", read_header(buf[:i])))
                self._buf, self._state = buf[i + len(MESSAGE) :], "body"
            else:  # body
                hit = earliest(buf, _ENDS + (START, CHANNEL))
                if hit is None:
                    keep = 0 if final else partial_marker_len(buf, _ENDS + (START, CHANNEL))
                    if len(buf) > keep:
                        out.append(("body", buf[: len(buf) - keep]))
                    self._buf = buf[len(buf) - keep :]
                    if final:
                        out.append(("close", ""))
                        self._state = "top"
                    return out
                i, tag = hit
                if i:
                    out.append(("body", buf[:i]))
                if tag in _ENDS:
                    out.append(("close", tag))
                    self._buf = buf[i + len(tag) :]
                else:  # the next header begins: this body ends without its marker
                    out.append(("close", ""))
                    self._buf = buf[i:]
                self._state = "top"


class Pieces:
    """One output stream (reasoning, or content) made of pieces (message bodies, runs of text) joined by "\\n":
    `start()` begins a piece, `add(text)` returns what to release (the "\\n" before a piece's first text when
    something came before it)."""

    def __init__(self):
        self.started = False  # whether any text was released
        self._fresh = False

    def start(self) -> None:
        self._fresh = True

    def add(self, text: str) -> str:
        if not text:
            return ""
        if self._fresh and self.started:
            text = "\n" + text
        self._fresh, self.started = False, True
        return text
