"""Pythonic tool calls (vLLM's `pythonic`, `llama4_pythonic`; Llama 3.2 / Llama 4's pythonic calling, what vLLM
recommends for Gemma 3): `[f(a=1), g(b="x")]` at the start of the output or after `<|python_start|>`, the arguments
Python literals (returned as JSON). No grammar: the calls are only parsed."""

from __future__ import annotations

import ast
import json

from motet.grammar.tool_call_parser import ToolCall
from motet.grammar.tool_calls import NAME_CHARS
from motet.grammar.tool_formats.sections import (
    HOLD,
    NOT,
    Sections,
    opening,
    sections_format,
    skip_ws,
    undecided,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"

_PROMPT = (
    "You have access to the following functions:\n{tools}\n\n"
    "To call functions, respond only with a Python list of calls with keyword arguments, "
    "[func_name1(param1=value1, param2=value2), func_name2(param=value)], and nothing else."
)


def _bracket_end(text: str, k: int) -> int | None:
    """Just past the `]` that closes the list opening at `k`, skipping Python strings, or None."""
    depth, quote, escaped = 0, None, False
    for j in range(k, len(text)):
        ch = text[j]
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _python_value(node: ast.AST):
    """A Python literal as its JSON value (ValueError if it is none)."""
    value = ast.literal_eval(node)

    def check(v):
        if isinstance(v, tuple):
            v = list(v)
        if isinstance(v, list):
            return [check(x) for x in v]
        if isinstance(v, dict):
            if not all(isinstance(key, str) for key in v):
                raise ValueError("non-string key")
            return {key: check(x) for key, x in v.items()}
        if v is None or isinstance(v, bool | int | float | str):
            return v
        raise ValueError(f"not a JSON value: {type(v).__name__}")

    return check(value)


def _calls(source: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not NAME_CHARS.fullmatch(name) or any(kw.arg is None for kw in node.keywords):
            return None
        try:
            args = {kw.arg: _python_value(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


class _PythonicSections(Sections):
    def section(self, text, i, after, final):
        k = opening(text, after, final, "[")
        if k in (HOLD, NOT):
            return k
        end = _bracket_end(text, k)
        if end is None:
            return undecided(final)
        calls = _calls(text[k:end])
        if calls is None:
            return NOT
        if after > i:  # <|python_start|> ... <|python_end|>
            j = skip_ws(text, end)
            if text.startswith(PYTHON_END, j):
                end = j + len(PYTHON_END)
            elif not final and PYTHON_END.startswith(text[j:]):
                return HOLD
        return calls, end


def _python_literal(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python_literal(k)}: {_python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    return repr(value)  # str, int, float, bool, None: Python's own spelling


def _calls_text(calls) -> str:
    def one(name, args):
        if not isinstance(args, dict):
            return f"{name}()"
        return f"{name}(" + ", ".join(f"{k}={_python_literal(v)}" for k, v in args.items()) + ")"

    return "[" + ", ".join(one(name, args) for name, args in calls) + "]"


PYTHONIC = sections_format(
    "pythonic", "[", _PROMPT, None, _PythonicSections((PYTHON_START,), leading=("[", None)), _calls_text
)
