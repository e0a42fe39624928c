"""Size limits on a request's grammar, checked before anything normalizes or compiles it.

A grammar's compile time grows with its size (an enum of 100,000 values takes xgrammar seconds of CPU
even on a tiny vocabulary), and the code that reads a schema before that runs on the request's path.
So a schema is measured first, in one pass with an explicit stack (a deep schema cannot recurse us),
and one over a limit is refused, naming the limit and where in the schema it is exceeded.

The defaults leave at least twice the room the largest schemas of JSONSchemaBench need (its 1,134
dev-set schemas, from GitHub, JSON Schema Store, Kubernetes, BFCL tools and others; the maxima are in
the comments). The counts are taken over the whole document, so keywords inside `default`, `examples`
or `const` values count too: they are compiled into no grammar, but they are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, NoReturn

from motet.grammar.specs import (
    ChoiceSpec,
    EbnfSpec,
    GrammarError,
    GrammarSpec,
    JsonSchemaSpec,
    RegexSpec,
    StructuralTagSpec,
)


class GrammarLimitError(GrammarError):
    """A grammar over one of the limits; `limit` names the GrammarLimits field."""

    def __init__(self, message: str, limit: str):
        super().__init__(message, "invalid")
        self.limit = limit


@dataclass(frozen=True)
class SchemaStats:
    """What the limits measure of one schema (or other JSON document)."""

    depth: int  # nesting of its objects and arrays (the top level is 1)
    enum_values: int  # values of its largest `enum`
    enum_at: str  # where that enum is (a JSON pointer)
    properties: int  # names under all its `properties` together
    pattern_length: int  # characters of its longest regex: `pattern`, or a `patternProperties` name
    pattern_at: str
    size_bytes: int  # as compact UTF-8 JSON; 0 when the walk stopped early (too deep)


@dataclass(frozen=True)
class GrammarLimits:
    max_enum_values: int = 4096  # values in one enum or guided_choice (bench max: 865)
    max_properties: int = 2048  # property names in one schema, all objects together (bench max: 408)
    max_depth: int = 64  # nesting of objects and arrays, as MAX_JSON_DEPTH of request bodies (bench max: 21)
    max_pattern_length: int = 4096  # characters in one regex: pattern, guided_regex (bench max: 1,239)
    max_schema_bytes: int = 256 << 10  # a schema, EBNF grammar or choice list (bench max: 67,636)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")

    def check_schema(self, schema: Any, what: str = "the schema") -> None:
        """GrammarLimitError if `schema` (a parsed JSON schema or structural tag) is over a limit."""
        s = schema_stats(schema, stop_depth=self.max_depth)
        if s.depth > self.max_depth:
            self._refuse("max_depth", f"{what} is nested {s.depth} or more levels deep")
        if s.enum_values > self.max_enum_values:
            self._refuse("max_enum_values", f"{what} has an enum of {s.enum_values} values at {s.enum_at}")
        if s.properties > self.max_properties:
            self._refuse("max_properties", f"{what} names {s.properties} properties in all")
        if s.pattern_length > self.max_pattern_length:
            at = s.pattern_at
            self._refuse("max_pattern_length", f"{what} has a regex of {s.pattern_length} characters at {at}")
        if s.size_bytes > self.max_schema_bytes:
            self._refuse("max_schema_bytes", f"{what} is {s.size_bytes} bytes as JSON")

    def check_text(self, text: str, what: str = "the schema") -> None:
        """The size limit, on a schema or grammar still in text form (before parsing it)."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_schema_bytes:
            self._refuse("max_schema_bytes", f"{what} is {size} bytes")

    def loads(self, text: str, what: str = "the schema") -> Any:
        """Parse JSON text within the size limit (ValueError if it is not JSON); text nested deeper than
        json can parse is over `max_depth`, whatever it is set to."""
        self.check_text(text, what)
        try:
            return json.loads(text)
        except RecursionError:
            self._refuse("max_depth", f"{what} is nested too deeply to parse")

    def check_spec(self, spec: GrammarSpec, what: str | None = None) -> None:
        """The limits that apply to one grammar spec of any kind."""
        if isinstance(spec, JsonSchemaSpec):
            if isinstance(spec.schema, str):
                self.check_text(spec.schema, what or "the schema")
            self.check_schema(spec.schema_dict(), what or "the schema")
        elif isinstance(spec, StructuralTagSpec):
            what = what or "the structural tag"
            self.check_schema(spec.tag if isinstance(spec.tag, dict) else self.loads(spec.tag, what), what)
        elif isinstance(spec, RegexSpec):
            if len(spec.pattern) > self.max_pattern_length:
                self._refuse("max_pattern_length", f"{what or 'the regex'} is {len(spec.pattern)} characters")
        elif isinstance(spec, ChoiceSpec):
            what = what or "the choice"
            if len(spec.choices) > self.max_enum_values:
                self._refuse("max_enum_values", f"{what} has {len(spec.choices)} choices")
            self.check_text(json.dumps(spec.choices, ensure_ascii=False), what)
        elif isinstance(spec, EbnfSpec):
            self.check_text(spec.grammar, what or "the grammar")

    def _refuse(self, limit: str, message: str) -> NoReturn:
        raise GrammarLimitError(f"{message}, over the limit of {getattr(self, limit)} ({limit})", limit)


def schema_stats(schema: Any, stop_depth: int | None = None) -> SchemaStats:
    """Measure `schema` in one pass (no recursion); past `stop_depth` levels, stop and say so."""
    depth = enum_values = properties = pattern_length = 0
    enum_at = pattern_at = None
    # (value, its depth, its place: None at the root, else (parent's place, key))
    stack: list[tuple[Any, int, tuple | None]] = [(schema, 1, None)]
    while stack:
        value, d, place = stack.pop()
        if isinstance(value, dict):
            items = value.items()
            enum = value.get("enum")
            if isinstance(enum, list) and len(enum) > enum_values:
                enum_values, enum_at = len(enum), place
            props = value.get("properties")
            if isinstance(props, dict):
                properties += len(props)
            pattern = value.get("pattern")
            if isinstance(pattern, str) and len(pattern) > pattern_length:
                pattern_length, pattern_at = len(pattern), place
            pattern_props = value.get("patternProperties")
            if isinstance(pattern_props, dict):
                for name in pattern_props:
                    if isinstance(name, str) and len(name) > pattern_length:
                        pattern_length, pattern_at = len(name), place
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            continue
        depth = max(depth, d)
        if stop_depth is not None and d > stop_depth:
            break
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, d + 1, (place, key)))
    size = 0
    if stop_depth is None or depth <= stop_depth:
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            size = len(text.encode("utf-8", "surrogatepass"))
        except RecursionError:  # deeper than json can write: only without stop_depth
            pass
    return SchemaStats(
        depth, enum_values, _pointer(enum_at), properties, pattern_length, _pointer(pattern_at), size
    )


def _pointer(place: tuple | None) -> str:
    """The JSON pointer ("#/properties/a~1b") of a place the walk recorded."""
    parts: list[str] = []
    while place is not None:
        place, key = place
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
    return "#" + "".join("/" + p for p in reversed(parts))
