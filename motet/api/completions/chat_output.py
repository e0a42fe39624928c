"""One chat choice's text as the API returns it: reasoning, content and tool calls, whole or streamed.

With a reasoning parser, the model's reasoning (`<think>...</think>`, GPT-OSS's analysis channel, ...:
motet/grammar/reasoning.py) becomes `reasoning_content`; with tools, the calls in the served tool-call format
(motet/grammar/tool_formats/; Hermes's `<tool_call>` blocks by default) in the rest become `tool_calls` and the
finish reason "tool_calls". Streaming runs the same rules incrementally, so the client's accumulation of the
deltas equals the non-streamed message.
"""

from __future__ import annotations

import uuid

from motet.api.completions import protocol as P
from motet.grammar.reasoning import THINK, ReasoningFormat
from motet.grammar.tool_call_parser import ContentDelta, ToolCallArguments, ToolCallStart
from motet.grammar.tool_formats import HERMES, ToolFormat


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


class ChatOutput:
    def __init__(
        self,
        reasoning: ReasoningFormat | bool | None = None,
        reasoning_started: bool = False,
        tools: bool = False,
        tool_format: ToolFormat = HERMES,
    ):
        """`reasoning`: the served reasoning format (True: `<think>`'s; None or False: none)."""
        self.reasoning = THINK if reasoning is True else (reasoning or None)
        self.started, self.tools = reasoning_started, tools
        self.tool_format = tool_format
        self._reasoning_stream = self.reasoning.stream_parser(reasoning_started) if self.reasoning else None
        self._tool_stream = tool_format.stream_parser() if tools else None
        self._num_calls = 0

    @property
    def plain(self) -> bool:
        return not (self.reasoning or self.tools)

    # -- whole ----------------------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[P.ChatMessageOut, str | None]:
        reasoning = None
        if self.reasoning:
            reasoning, text = self.reasoning.split(text, self.started)
        calls = []
        if self.tools:
            content, calls = self.tool_format.parse(text)
        else:
            content = text
        tool_calls = [
            P.ToolCallOut(id=_call_id(), function=P.FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        message = P.ChatMessageOut(
            content=content, reasoning_content=reasoning, tool_calls=tool_calls or None
        )
        return message, _finish_reason(finish_reason, bool(calls))

    # -- streamed -------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        """The chunk deltas for new text."""
        return self._deltas(*self._reasoning_stream.feed(text)) if self.reasoning else self._content(text)

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas, and the finish reason."""
        if self.reasoning:
            deltas = self._deltas(*self._reasoning_stream.finish())
        else:
            deltas = []
        if self.tools:
            deltas += self._events(self._tool_stream.finish())
        return deltas, _finish_reason(finish_reason, self._num_calls > 0)

    def _deltas(self, reasoning: str, content: str) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        return out + (self._content(content) if content else [])

    def _content(self, text: str) -> list[dict]:
        if not self.tools:
            return [{"content": text}] if text else []
        return self._events(self._tool_stream.feed(text))

    def _events(self, events) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, ContentDelta):
                if e.text:
                    out.append({"content": e.text})
            elif isinstance(e, ToolCallStart):
                self._num_calls = max(self._num_calls, e.index + 1)
                call = {"index": e.index, "id": _call_id(), "type": "function"}
                out.append({"tool_calls": [call | {"function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolCallArguments) and e.fragment:
                out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]})
        return out
