"""What the tool-call formats share: the declaration each format's module makes (`ToolFormat`), and the grammar and
the spelling of calls written as a marker then a JSON list (Mistral's, Phi-4-mini's, Granite's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from motet.grammar.specs import DEFAULT_MAX_WHITESPACE
from motet.grammar.tool_call_parser import ToolCall
from motet.grammar.tool_calls import call_sequence, call_tags, check_mode, one_of


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # what opens the model's calls
    system_prompt: (
        str  # the tools in the system prompt of a template without tool support ({tools}: JSON lines)
    )
    stop_repeated_calls: bool  # whether motet/grammar/tool_call_parser.RepeatedCallStop reads this format
    _tag: Callable | None  # (tools, mode, parallel, max_whitespace=, max_calls=) -> structural tag
    _parse: Callable[[str], tuple[str | None, list[ToolCall]]]
    _stream: Callable[[], object]  # a new stream parser
    _calls_text: Callable[[list[tuple[str, object]]], str]
    # Its markers are special tokens the output's text must keep (GPT-OSS's): the request's skip_special_tokens
    # is turned off.
    keeps_special_tokens: bool = False
    # Whether a reasoning parser's reasoning comes before its calls' grammar (the engine's gate: the grammar holds
    # after the reasoning). GPT-OSS's calls are a channel of their own: its grammar holds from the first token.
    grammar_after_reasoning: bool = True

    def structural_tag(self, tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None):
        """The grammar holding calls to `tools` (None: this format has none; its calls are only parsed)."""
        if self._tag is None:
            return None
        return self._tag(tools, mode, parallel, max_whitespace=max_whitespace, max_calls=max_calls)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Content (None when empty) and calls of a whole output."""
        return self._parse(text)

    def stream_parser(self):
        """A parser with `feed(delta)` and `finish()` giving the events that add up to `parse`."""
        return self._stream()

    def calls_text(self, calls: list[tuple[str, object]]) -> str:
        """An assistant turn's calls, (name, arguments as their JSON value, or text that is no JSON: a history's
        JSON text read by motet/grammar/tool_prompt.py `decoded_json`), as the model writes them."""
        return self._calls_text(calls)


def list_structural_tag(opening: str, trigger: str):
    """The grammar of `opening` (the marker and the list's `[`), call (`, ` call)*, `]`: "required" is that and
    nothing else; "auto" free text until the model writes `trigger`, then the calls, and the output ends. Without
    `parallel`, one call."""

    def structural_tag(
        tools, mode, parallel, *, max_whitespace=DEFAULT_MAX_WHITESPACE, max_calls=None
    ) -> dict:
        check_mode(tools, mode)
        tags = call_tags(tools, "arguments", max_whitespace)
        inner = call_sequence(tags, ", ", max_calls) if parallel else one_of(tags)
        if mode == "required":
            fmt = {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": opening},
                    inner,
                    {"type": "const_string", "value": "]"},
                ],
            }
        else:
            section = {"type": "tag", "begin": opening, "content": inner, "end": "]"}
            fmt = {
                "type": "triggered_tags",
                "triggers": [trigger],
                "tags": [section],
                "stop_after_first": True,
            }
        return {"type": "structural_tag", "format": fmt}

    return structural_tag


def json_list_text(opening: str, calls) -> str:
    """Calls as `opening` (the marker and the list's `[`) then their JSON objects, `, ` between them, and `]`."""
    body = ", ".join(
        json.dumps({"name": name, "arguments": args}, ensure_ascii=False) for name, args in calls
    )
    return f"{opening}{body}]"
