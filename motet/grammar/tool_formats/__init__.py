"""Tool-call formats, a module each, chosen once per served model by vLLM's `--tool-call-parser` names (`TOOL_FORMATS`).

A format says how a model writes its calls and how they are read back:

- `hermes` (the default): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (hermes.py);
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name{...}` (mistral.py);
- `llama3_json` / `llama4_json`: `{"name": ..., "parameters": {...}}` objects separated by `;` (llama3_json.py);
- `pythonic` / `llama4_pythonic`: `[f(a=1), g(b="x")]` (pythonic.py);
- `phi4_mini_json`: `functools[{"name": ..., "arguments": {...}}, ...]` (phi4_mini_json.py);
- `granite`: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (granite.py);
- `openai` (GPT-OSS's harmony): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
  (openai.py).

Each declares a `ToolFormat` (base.py): the grammar that holds a call (an xgrammar structural tag, as Hermes's:
`tool_choice` "required" or a named function forces well-formed calls, "auto" constrains the calls the model opens;
`pythonic` has none, its calls are only parsed; `openai` holds "required" calls only), the whole and the streamed
parser (the same ToolCall objects and stream events as Hermes's, so the chat output, its deltas and the Responses API
are unchanged), and how past calls and the tools are written into a prompt whose template has no tool support. The
formats but Hermes's and harmony's read their outputs with sections.py.
"""

from __future__ import annotations

from motet.grammar import harmony
from motet.grammar.tool_formats.base import ToolFormat
from motet.grammar.tool_formats.granite import GRANITE, GRANITE_CALLS
from motet.grammar.tool_formats.hermes import HERMES
from motet.grammar.tool_formats.llama3_json import LLAMA3_JSON, LLAMA_PYTHON_TAG
from motet.grammar.tool_formats.mistral import MISTRAL, MISTRAL_CALLS
from motet.grammar.tool_formats.openai import OPENAI
from motet.grammar.tool_formats.phi4_mini_json import PHI4_MINI
from motet.grammar.tool_formats.pythonic import PYTHONIC

__all__ = [
    "GRANITE",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "OPENAI",
    "PHI4_MINI",
    "PYTHONIC",
    "TOOL_FORMATS",
    "ToolFormat",
    "template_tool_format",
    "tool_format",
]

# vLLM's --tool-call-parser names for these formats
TOOL_FORMATS = {
    "hermes": HERMES,
    "mistral": MISTRAL,
    "llama3_json": LLAMA3_JSON,
    "llama4_json": LLAMA3_JSON,
    "pythonic": PYTHONIC,
    "llama4_pythonic": PYTHONIC,
    "phi4_mini_json": PHI4_MINI,
    "granite": GRANITE,
    "openai": OPENAI,
}


def template_tool_format(chat_template: str | None) -> str | None:
    """The tool-call parser a chat template shows its model writes, by its markers: `[TOOL_CALLS]` Mistral's,
    `<|python_tag|>` Llama 3.x's JSON, harmony's `<|channel|>` GPT-OSS's, `functools` or Phi-4-mini's
    `<|/tool|>` Phi-4-mini's, `<|tool_call|>` Granite 3.x's; None for none of them (Hermes)."""
    template = chat_template or ""
    for marker, name in (
        (MISTRAL_CALLS, "mistral"),
        (LLAMA_PYTHON_TAG, "llama3_json"),
        (harmony.CHANNEL, "openai"),
        ("functools", "phi4_mini_json"),
        ("<|/tool|>", "phi4_mini_json"),
        (GRANITE_CALLS, "granite"),
    ):
        if marker in template:
            return name
    return None


def tool_format(name: str | None, chat_template: str | None = None) -> ToolFormat:
    """The format named by --tool-call-parser (or a model family's), or without one the chat template's
    (`template_tool_format`), else Hermes."""
    name = name if name is not None else template_tool_format(chat_template)
    if name is None:
        return HERMES
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(TOOL_FORMATS)}") from None
