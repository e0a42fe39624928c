"""Llama 3.x's JSON tool calls (vLLM's `llama3_json`, `llama4_json`; Llama 3.1 / 3.2 / 3.3):
`{"name": ..., "parameters": {...}}` objects, several separated by `;`, at the start of the output, after
`<|python_tag|>`, or anywhere as `{"name": "` opens them."""

from __future__ import annotations

import json

from motet.grammar.specs import DEFAULT_MAX_WHITESPACE
from motet.grammar.tool_calls import call_tags, calls_structural_tag, check_mode
from motet.grammar.tool_formats.sections import HOLD, NOT, Sections, objects, opening, sections_format

LLAMA_PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL_OPEN = '{"name": "'

_PROMPT = (
    "You have access to the following functions:\n{tools}\n\n"
    "To call a function, respond only with a JSON object in the format "
    '{{"name": <function-name>, "parameters": <dictionary of argument name and its value>}}; several calls '
    "are separated by '; '. Do not use variables."
)


class _LlamaJsonSections(Sections):
    def section(self, text, i, after, final):
        k = opening(text, after, final, "{")
        return k if k in (HOLD, NOT) else objects(text, k, final, ";", None)


def _structural_tag(tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None) -> dict:
    """`{"name": ..., "parameters": {...}}` objects (`; ` between them with `parallel`): "required" is that
    and nothing else; "auto" free text in which `{"name": "` opens a call (with `parallel`, more may follow)."""
    check_mode(tools, mode)
    tags = call_tags(tools, "parameters", max_whitespace)
    return calls_structural_tag(tags, mode, parallel, "; ", LLAMA_CALL_OPEN, max_calls)


def _calls_text(calls) -> str:
    return "; ".join(
        json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls
    )


LLAMA3_JSON = sections_format(
    "llama3_json",
    LLAMA_CALL_OPEN,
    _PROMPT,
    _structural_tag,
    _LlamaJsonSections((LLAMA_PYTHON_TAG, LLAMA_CALL_OPEN), bare=(LLAMA_CALL_OPEN,), leading=("{", None)),
    _calls_text,
)
