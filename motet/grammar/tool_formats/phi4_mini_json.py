"""Phi-4-mini's tool calls (vLLM's `phi4_mini_json`): `functools[{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

import functools

from motet.grammar.tool_formats.base import json_list_text, list_structural_tag
from motet.grammar.tool_formats.sections import ListSections, sections_format

PHI4_CALLS = "functools["

_PROMPT = (  # vLLM's examples/tool_chat_template_phi4_mini.jinja, shortened
    "You can call these functions:\n{tools}\n\n"
    "If you decide to call functions, write them as one JSON list after the functools marker and nothing else: "
    'functools[{{"name": <function-name>, "arguments": <args-json-object>}}, ...]'
)

PHI4_MINI = sections_format(
    "phi4_mini_json",
    PHI4_CALLS,
    _PROMPT,
    list_structural_tag(PHI4_CALLS, PHI4_CALLS),
    ListSections((PHI4_CALLS,)),
    functools.partial(json_list_text, PHI4_CALLS),
)
