"""Granite 3.x's tool calls (vLLM's `granite`): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, Granite
3.1's `<tool_call>[...]` too; where the text dropped the special token, the list the output begins with."""

from __future__ import annotations

import functools

from motet.grammar.tool_formats.base import json_list_text, list_structural_tag
from motet.grammar.tool_formats.sections import ListSections, sections_format

GRANITE_CALLS, GRANITE_31_CALLS = "<|tool_call|>", "<tool_call>"

_PROMPT = (  # Granite 3.x's own system prompt for tools
    "You are a helpful assistant with access to the following function calls. Your task is to produce a list of "
    "function calls necessary to generate response to the user utterance. Use the following function calls as "
    "required.\n{tools}\n\n"
    "When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON list "
    'of tools used: <|tool_call|>[{{"name": <function-name>, "arguments": <args-json-object>}}]'
)

GRANITE = sections_format(
    "granite",
    GRANITE_CALLS,
    _PROMPT,
    list_structural_tag(GRANITE_CALLS + "[", GRANITE_CALLS),
    ListSections((GRANITE_CALLS, GRANITE_31_CALLS), leading=("[", "{")),
    functools.partial(json_list_text, GRANITE_CALLS + "["),
)
