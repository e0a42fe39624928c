"""Normalize loosely typed JSON schemas (BFCL / function-calling style) and check them.

Tool definitions in the wild use Python-ish type names ("dict", "float", "tuple", "any"). We map
them to JSON Schema types at every schema position (never inside `enum`, `const`, `default` or
property names), then check the result against its draft's meta-schema (Draft 2020-12 unless
`$schema` names another), so a bad schema is refused with a message rather than failing deep
inside a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from motet.grammar.specs import GrammarError, short_error

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


def children(schema: dict) -> Iterator[tuple[str, Any]]:
    """Each direct subschema of `schema`, with its JSON-pointer step ("properties/a~1b", "anyOf/0")."""
    for k in _ONE:
        if k in schema:
            yield k, schema[k]
    for k in _LIST:
        if isinstance(schema.get(k), list):
            yield from ((f"{k}/{i}", sub) for i, sub in enumerate(schema[k]))
    for k in (*_MAP, "dependencies"):  # draft-04..07 dependencies: a schema or a list of names
        if isinstance(schema.get(k), dict):
            for name, sub in schema[k].items():
                if not (k == "dependencies" and isinstance(sub, list)):
                    yield f"{k}/{name.replace('~', '~0').replace('/', '~1')}", sub
    items = schema.get("items")
    if isinstance(items, list):
        yield from ((f"items/{i}", sub) for i, sub in enumerate(items))
    elif "items" in schema:
        yield "items", items


def map_children(schema: dict, fn: Callable[[Any], Any]) -> dict:
    """A copy of `schema` with `fn` applied to each direct subschema (the ones `children` yields)."""
    out = dict(schema)
    for k in _ONE:
        if k in out:
            out[k] = fn(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [fn(s) for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: fn(s) for name, s in out[k].items()}
    if "items" in out:
        items = out["items"]
        out["items"] = [fn(s) for s in items] if isinstance(items, list) else fn(items)
    if isinstance(out.get("dependencies"), dict):
        out["dependencies"] = {k: v if isinstance(v, list) else fn(v) for k, v in out["dependencies"].items()}
    return out


def map_subschemas(schema: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply `fn` bottom-up to `schema` and every subschema in it (a new tree; input untouched)."""
    if not isinstance(schema, dict):
        return fn(schema)
    return fn(map_children(schema, lambda sub: map_subschemas(sub, fn)))


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


_LONG_ENUM = 256


def _short_enum(schema: Any) -> Any:
    """For the meta-schema check only: a long enum cut to its first value. Draft-04's meta-schema wants
    enum values unique, and jsonschema checks that by comparing each value with every other one when
    they do not sort (objects, mixed types): 20 s for 4,096 objects. Duplicates harm no grammar."""
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and len(schema["enum"]) > _LONG_ENUM:
        return {**schema, "enum": schema["enum"][:1]}
    return schema


def normalize_schema(schema: Any) -> dict:
    """Return a normalized copy of `schema`, or raise GrammarError naming what is wrong."""
    import jsonschema  # here, at the first schema's check: a start that serves none never imports it
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        raise GrammarError(f"JSON schema must be an object, got {type(schema).__name__}")
    try:
        out = map_subschemas(schema, _fix_type)
    except RecursionError:
        raise GrammarError("JSON schema is nested too deeply") from None
    validator = validator_for(out, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(map_subschemas(out, _short_enum))
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema at {where}: {short_error(e)}") from None
    except RecursionError:
        raise GrammarError("JSON schema is nested too deeply") from None
    return out
