"""Hermes's tool calls (vLLM's `hermes`, the default; Hermes-2-Pro, Qwen2.5, Qwen3):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. The format's markers, prompt and grammar are
motet/grammar/tool_calls.py's, its parsers motet/grammar/tool_call_parser.py's (whose `RepeatedCallStop` reads its
calls), a call block motet/grammar/tool_prompt.py's `format_call`."""

from __future__ import annotations

from motet.grammar.tool_call_parser import ToolCallStreamParser, parse_tool_calls
from motet.grammar.tool_calls import CALL_BEGIN, TOOLS_SYSTEM_PROMPT, tool_call_structural_tag
from motet.grammar.tool_formats.base import ToolFormat
from motet.grammar.tool_prompt import format_call


def _calls_text(calls) -> str:
    return "\n".join(format_call(name, args) for name, args in calls)


HERMES = ToolFormat(
    "hermes",
    CALL_BEGIN,
    TOOLS_SYSTEM_PROMPT,
    True,
    tool_call_structural_tag,
    parse_tool_calls,
    ToolCallStreamParser,
    _calls_text,
)
