"""Normalize loosely typed JSON schemas (BFCL / function-calling style) and check them.

Tool definitions in the wild use Python-ish type names ("dict", "float", "tuple", "any"). We map
them to JSON Schema types at every schema position (never inside `enum`, `const`, `default` or
property names), then check the result against its draft's meta-schema (Draft 2020-12 unless
`$schema` names another), so a bad schema is refused with a message rather than failing deep
inside a backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from grammar.specs import GrammarError, short_error

_TYPE_ALIASES: dict[str, str | None] = {
    "dict": "object",
    "map": "object",
    "float": "number",
    "double": "number",
    "tuple": "array",
    "list": "array",
    "int": "integer",
    "long": "integer",
    "bool": "boolean",
    "str": "string",
    "any": None,  # no constraint
}
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}

# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _type_name(t: Any) -> str | None | Any:
    if not isinstance(t, str) or t in _JSON_TYPES:
        return t
    low = t.lower()
    return low if low in _JSON_TYPES else _TYPE_ALIASES.get(low, t)


def map_subschemas(schema: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` bottom-up to `schema` and every subschema in it (a new tree; input untouched)."""
    if not isinstance(schema, dict):
        return fn(schema)
    out = dict(schema)
    for k in _ONE:
        if k in out:
            out[k] = map_subschemas(out[k], fn)
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [map_subschemas(s, fn) for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: map_subschemas(s, fn) for name, s in out[k].items()}
    if "items" in out:
        items = out["items"]
        out["items"] = (
            [map_subschemas(s, fn) for s in items] if isinstance(items, list) else map_subschemas(items, fn)
        )
    if isinstance(out.get("dependencies"), dict):  # draft-04..07: a schema or a list of names
        out["dependencies"] = {
            k: v if isinstance(v, list) else map_subschemas(v, fn) for k, v in out["dependencies"].items()
        }
    return fn(out)


def _fix_type(schema: Any) -> Any:
    if not isinstance(schema, dict) or "type" not in schema:
        return schema
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    mapped = [_type_name(t) for t in types]
    out = dict(schema)
    if None in mapped:
        del out["type"]
    else:
        mapped = list(dict.fromkeys(mapped))  # "float" and "number" both -> one "number"
        out["type"] = mapped if isinstance(schema["type"], list) else mapped[0]
    return out


def normalize_schema(schema: Any) -> dict:
    """Return a normalized copy of `schema`, or raise GrammarError naming what is wrong."""
    if not isinstance(schema, dict):
        raise GrammarError(f"JSON schema must be an object, got {type(schema).__name__}")
    try:
        out = map_subschemas(schema, _fix_type)
    except RecursionError:
        raise GrammarError("JSON schema is nested too deeply") from None
    validator = validator_for(out, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(out)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema at {where}: {short_error(e)}") from None
    except RecursionError:
        raise GrammarError("JSON schema is nested too deeply") from None
    return out
