"""Mistral's tool calls (vLLM's `mistral`; Mistral 7B v0.3, Mistral Nemo/Small, Mixtral 8x22B): `[TOOL_CALLS]` then
a JSON array of `{"name": ..., "arguments": {...}}`; the newer tokenizers' `[TOOL_CALLS]name{...}` (and
`[TOOL_CALLS]name[ARGS]{...}`), one call per marker, is read too.

`[TOOL_CALLS]` is a special token in Mistral's tokenizers, dropped from the text where the request skips special
tokens (the default): the call list is then read where `[{"name": "` opens it, or where the output begins with `[`
then `{`."""

from __future__ import annotations

import functools

from motet.grammar.tool_call_parser import ToolCall, arguments_at
from motet.grammar.tool_calls import NAME_CHARS
from motet.grammar.tool_formats.base import json_list_text, list_structural_tag
from motet.grammar.tool_formats.sections import NOT, Sections, objects, sections_format, skip_ws, undecided

MISTRAL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_LIST_OPEN = '[{"name": "'

_PROMPT = (
    "You are a function calling AI model. You may call one or more of these functions to answer the user:\n"
    "[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\n"
    "To call functions, reply with [TOOL_CALLS] followed by a JSON list of calls and nothing else:\n"
    '[TOOL_CALLS][{{"name": <function-name>, "arguments": <args-json-object>}}]'
)


class _MistralSections(Sections):
    def section(self, text, i, after, final):
        n = len(text)
        k = skip_ws(text, after)
        if k == n:
            return undecided(final)
        if text[k] == "[":
            return objects(text, k + 1, final, ",", "]")
        if text[k] == "{":
            return objects(text, k, final, ",", None)
        m = NAME_CHARS.match(text, k)  # [TOOL_CALLS]name{...} / name[ARGS]{...}, one call per marker
        if m is None:
            return NOT
        j = m.end()
        rest = text[j : j + len(_ARGS)]
        if j == n or (_ARGS.startswith(rest) and j + len(rest) == n):
            return undecided(final)
        if rest == _ARGS:
            j += len(_ARGS)
            if j == n:
                return undecided(final)
        if text[j] != "{":
            return NOT
        args, end = arguments_at(text, j)
        if end is None:
            end = n if final else None
        return [ToolCall(m.group(), args)], end


MISTRAL = sections_format(
    "mistral",
    MISTRAL_CALLS,
    _PROMPT,
    list_structural_tag(MISTRAL_CALLS + "[", MISTRAL_CALLS),
    _MistralSections((MISTRAL_CALLS, _LIST_OPEN), bare=(_LIST_OPEN,), leading=("[", "{")),
    functools.partial(json_list_text, MISTRAL_CALLS + "["),
)
