"""Grammar specs: what a request constrains its output to, in a backend-neutral form.

Each spec has a canonical `key()` (the compile cache's key) and a `kind`. JSON specs bound the
whitespace between JSON tokens (`max_whitespace` characters from " \\n\\r\\t"), so a constrained
model cannot pad forever; 0 means compact JSON (`{"a":1}`), 1 (the default) also allows
`json.dumps`' default `{"a": 1}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The grammar backends, by name, in the fallback order (motet/grammar/cache.py has their classes); the first is
# the default (chosen by measurement: docs/api/structured-output.md).
BACKEND_NAMES = ("xgrammar", "llguidance", "outlines")
DEFAULT_BACKEND = BACKEND_NAMES[0]


class GrammarError(ValueError):
    """A grammar that cannot be compiled: `reason` is one of
    "invalid" (bad spec, or over a size limit), "unsupported" (no backend handles it), "timeout",
    "busy" (the requester has too many compilations running past their time limit)."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


DEFAULT_MAX_WHITESPACE = 1


@dataclass(frozen=True)
class JsonSchemaSpec:
    """Output is one JSON value valid under `schema` (a dict or its JSON text).

    strict: objects admit no properties beyond those the schema names unless it says otherwise
    (xgrammar's strict mode, OpenAI's `strict`); outlines is always strict in this sense."""

    schema: dict | str
    strict: bool = True
    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    kind = "json_schema"

    def schema_dict(self) -> dict:
        if isinstance(self.schema, dict):
            return self.schema
        try:
            schema = json.loads(self.schema)
        except ValueError as e:
            raise GrammarError(f"JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("JSON schema is nested too deeply") from None
        if not isinstance(schema, dict):
            raise GrammarError("JSON schema must be a JSON object")
        return schema

    def key(self) -> str:
        # Property order matters (the grammar emits properties in schema order): no sort_keys.
        body = json.dumps(self.schema_dict(), separators=(",", ":"), ensure_ascii=False)
        return f"json_schema:{int(self.strict)}:{self.max_whitespace}:{body}"


@dataclass(frozen=True)
class JsonObjectSpec:
    """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""

    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    kind = "json_object"

    def as_schema(self) -> JsonSchemaSpec:
        return JsonSchemaSpec({"type": "object"}, strict=False, max_whitespace=self.max_whitespace)

    def key(self) -> str:
        return f"json_object:{self.max_whitespace}"


@dataclass(frozen=True)
class RegexSpec:
    """The whole output matches `pattern` (anchored at both ends)."""

    pattern: str
    kind = "regex"

    def key(self) -> str:
        return f"regex:{self.pattern}"


@dataclass(frozen=True)
class ChoiceSpec:
    """The output is exactly one of `choices`."""

    choices: tuple[str, ...]
    kind = "choice"

    def __post_init__(self):
        object.__setattr__(self, "choices", tuple(self.choices))
        if not self.choices or not all(isinstance(c, str) for c in self.choices):
            raise GrammarError("choice needs a non-empty list of strings")

    def as_regex(self) -> RegexSpec:
        # Longest first: outlines-core's DFA has leftmost-first semantics, so in "(yes|yes please)"
        # the match "yes" would cut off the longer choice.
        ordered = sorted(self.choices, key=len, reverse=True)
        return RegexSpec("(" + "|".join(escape_regex(c) for c in ordered) + ")")

    def key(self) -> str:
        return "choice:" + json.dumps(self.choices, ensure_ascii=False)


@dataclass(frozen=True)
class EbnfSpec:
    """An EBNF grammar in xgrammar's dialect (GBNF-compatible: `root ::= ...`)."""

    grammar: str
    root: str = "root"
    kind = "ebnf"

    def key(self) -> str:
        return f"ebnf:{self.root}:{self.grammar}"


@dataclass(frozen=True)
class StructuralTagSpec:
    """An xgrammar structural tag (`{"type": "structural_tag", "format": {...}}`): free text and
    schema-constrained tagged regions, e.g. tool calls (grammar.tool_calls builds them). xgrammar only."""

    tag: dict | str
    kind = "structural_tag"

    def tag_json(self) -> str:
        return self.tag if isinstance(self.tag, str) else json.dumps(self.tag, ensure_ascii=False)

    def key(self) -> str:
        return "structural_tag:" + self.tag_json()


GrammarSpec = JsonSchemaSpec | JsonObjectSpec | RegexSpec | ChoiceSpec | EbnfSpec | StructuralTagSpec


def reduced(spec: GrammarSpec) -> GrammarSpec:
    """`spec` as a kind the backends compile themselves: a JSON object as its schema, a choice as its regex (every
    backend reads them so); the other kinds as they are."""
    if isinstance(spec, JsonObjectSpec):
        return spec.as_schema()
    if isinstance(spec, ChoiceSpec):
        return spec.as_regex()
    return spec


# Metacharacters of both regex dialects (xgrammar's ECMAScript-like, outlines' Rust regex).
_REGEX_META = set("\\.^$|?*+()[]{}")


def escape_regex(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def whitespace_regex(max_whitespace: int) -> str:
    """The regex of whitespace between JSON tokens (outlines), matching xgrammar's bounded rule."""
    return f"[ \\n\\r\\t]{{0,{max_whitespace}}}" if max_whitespace > 0 else ""


_CPP_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def short_error(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, bounded (backend errors can be very long)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = _CPP_LOG_PREFIX.sub("", text)  # xgrammar: "[12:00:00] /project/cpp/x.cc:42: message"
    return text if len(text) <= limit else text[: limit - 3] + "..."
