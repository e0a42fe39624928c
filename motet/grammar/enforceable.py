"""Which parts of a JSON schema the grammar cannot enforce (what `strict: true` refuses).

A grammar mask can only enforce what a context-free grammar over the output's text can say.
xgrammar (0.2) compiles the rest without complaint and ignores it, so a "constrained" output can
still fail `jsonschema`. Probed one keyword at a time with a violating instance (see
tests/grammar/test_enforceable.py), these are ignored or mis-handled:

- `not`, `if`/`then`/`else`, `dependencies`, `dependentRequired`, `dependentSchemas`,
  `propertyNames`, `contains`/`minContains`/`maxContains`, `uniqueItems`: relations between parts
  of a value that a grammar does not track;
- `allOf` with several subschemas: only one of them is applied;
- `allOf` / `anyOf` / `oneOf` / `$ref` beside other validation keywords: the siblings are dropped
  (`{"required": ["a"], "anyOf": [...]}` no longer requires "a");
- `oneOf` is read as `anyOf` (a value matching two branches passes), which is exact only when no value
  can match two branches (checked: distinct types or values, a required discriminator property,
  closed objects); `pattern` beside `minLength`/`maxLength` drops the lengths; lookaheads in
  `pattern`; `multipleOf` on numbers; a `$ref` to another document (`https://...`, `file://...`,
  `other.json#/x`), which is never fetched. (Lookbehinds and backreferences in `pattern` xgrammar
  refuses to compile; they are named here too, so that `strict` says where they are.)

OpenAI's strict mode refuses schemas it cannot guarantee; so do we, for `strict: true`, naming each
keyword and where it is. Without `strict` the grammar is best effort, and `best_effort_warning` says
what it leaves out (the API returns it as a warning).

Before the check, `simplify` rewrites the common shapes into equivalent ones the grammar does
enforce: an `allOf` whose parts do not overlap is merged into one schema, the keywords beside an
`anyOf` / `oneOf` are copied into each branch, a local `$ref` in the way is inlined when it is not
recursive, and an `enum` / `const` under further constraints becomes the enum of its values that pass
them (checked with jsonschema here, so any keyword works there).
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from motet.grammar.schema_normalize import children, map_children

_RELATIONAL = (
    "not",
    "if",
    "then",
    "else",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "contains",
    "minContains",
    "maxContains",
)
COMPOSITION = ("allOf", "anyOf", "oneOf", "$ref")  # the keywords that compose schemas (a $ref: one)
# The validation keywords the grammar handles when they stand alone (others, such as annotations or
# "x-..." extensions, constrain nothing and may sit beside anything).
_VALIDATION = {
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "minProperties",
    "maxProperties",
    "items",
    "prefixItems",
    "additionalItems",
    "unevaluatedItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
}


_STRING_KEYWORDS = ("pattern", "minLength", "maxLength", "format")
_GROUP_FEATURES = {
    "(?=": "lookahead",
    "(?!": "lookahead",
    "(?<=": "lookbehind",
    "(?<!": "lookbehind",
    "(?P=": "backreference",  # Python's named backreference
}


def regex_features(pattern: str) -> list[str]:
    """What of `pattern` a grammar cannot express: "lookahead", "lookbehind", "backreference" (each
    once, in the order found). Escaped characters and character classes are read as such."""
    found: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        ch, feature = pattern[i], None
        if ch == "\\":
            nxt = pattern[i + 1 : i + 2]
            if not in_class and ((nxt and nxt in "123456789") or pattern.startswith("k<", i + 1)):
                feature = "backreference"  # \1 .. \9, \k<name>
            i += 1  # skip the escaped character
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            feature = next((f for start, f in _GROUP_FEATURES.items() if pattern.startswith(start, i)), None)
        if feature is not None and feature not in found:
            found.append(feature)
        i += 1
    return found


def _types(schema: dict) -> set[str] | None:
    """The JSON types a branch admits, when it says (integer counted as number too)."""
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    elif "type" in schema:
        t = schema["type"]
        types = set(t if isinstance(t, list) else [t])
        return types | {"number"} if "integer" in types else types
    else:
        return None
    names = {"dict": "object", "list": "array", "str": "string", "bool": "boolean", "NoneType": "null"}
    types = {names.get(type(v).__name__, "number") for v in values}
    return types | {"integer"} if "number" in types else types


def _values(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _excludes(a: dict, b: dict) -> bool:
    """Whether no value can match both `a` and `b`, by simple sufficient tests."""
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
        return not {json.dumps(x, sort_keys=True) for x in va} & {json.dumps(x, sort_keys=True) for x in vb}
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    both = set(a.get("required") or []) & set(b.get("required") or [])
    for name in both:  # a discriminator: a property both require, with disjoint values
        sa, sb = pa.get(name), pb.get(name)
        finite = isinstance(sa, dict) and isinstance(sb, dict) and None not in (_values(sa), _values(sb))
        if finite and _excludes(sa, sb):
            return True
    for x, y in ((a, b), (b, a)):  # a closed object cannot hold a property the other requires
        closed = x.get("additionalProperties") is False and not x.get("patternProperties")
        if closed and set(y.get("required") or []) - set(x.get("properties") or {}):
            return True
    return False


def _disjoint(branches: list, refs: _Refs) -> bool:
    """Whether no value can match two oneOf branches (so reading oneOf as anyOf is exact)."""
    resolved = []
    for b in branches:
        if isinstance(b, dict) and "$ref" in b:
            b = refs.inline(b)
        if not isinstance(b, dict):
            return False
        resolved.append(b)
    return all(_excludes(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1 :])


def unenforceable(schema: Any, where: str = "#", refs: _Refs | None = None) -> list[str]:
    """Descriptions ("'not' at #/properties/x") of what the grammar would not enforce; [] if none."""
    if not isinstance(schema, dict):
        return []
    refs = refs or _Refs(schema)
    found = [f"{k!r} at {where}" for k in _RELATIONAL if k in schema]
    if schema.get("uniqueItems") is True:
        found.append(f"'uniqueItems' at {where}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        found.append(f"'allOf' with {len(schema['allOf'])} subschemas at {where}")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        found.append(f"'pattern' beside a length bound at {where}")
    patterns = [("'pattern'", schema.get("pattern"))]
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [("a 'patternProperties' name", p) for p in schema["patternProperties"]]
    for place, p in patterns:
        for feature in regex_features(p) if isinstance(p, str) else []:
            found.append(f"a regex {feature} in {place} at {where}")
    ref = schema.get("$ref")
    if isinstance(ref, str) and refs.is_external(ref):
        shown = ref if len(ref) <= 80 else ref[:77] + "..."
        found.append(
            f"an external '$ref' ({shown!r}: only references within the schema are followed) at {where}"
        )
    if "type" not in schema and any(k in schema for k in _STRING_KEYWORDS):
        found.append(f"string keywords without 'type' at {where}")  # read as "any value"
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [n for n in schema.get("required") or [] if n not in props]
    if missing and "patternProperties" not in schema and "additionalProperties" not in schema:
        found.append(f"'required' beyond 'properties' ({missing[0]!r}) at {where}")
    if "multipleOf" in schema and schema.get("type") != "integer":
        found.append(f"'multipleOf' on a non-integer at {where}")
    if isinstance(schema.get("oneOf"), list) and not _disjoint(schema["oneOf"], refs):
        found.append(f"'oneOf' whose branches may overlap at {where}")
    composed = [k for k in COMPOSITION if k in schema]
    if composed:
        siblings = sorted(k for k in schema if k in _VALIDATION)
        if siblings or len(composed) > 1:
            others = ", ".join(repr(k) for k in [*composed[1:], *siblings])
            found.append(f"{composed[0]!r} beside {others} at {where}")
    for step, sub in children(schema):
        found += unenforceable(sub, f"{where}/{step}", refs)
    return found


def _not_enforced(problems: list[str]) -> str:
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    return f"the grammar does not enforce {'; '.join(problems[:3])}{more}"


def strict_refusal(schema: dict) -> str | None:
    """Why `strict: true` must refuse `schema` (a sentence naming up to three places), or None."""
    problems = unenforceable(simplify(schema))
    return f"strict mode cannot guarantee this schema; {_not_enforced(problems)}" if problems else None


def best_effort_warning(schema: dict) -> str | None:
    """What a request without `strict` should be told its grammar leaves out (one sentence), or None."""
    problems = unenforceable(simplify(schema))
    return f"{_not_enforced(problems)}: outputs may not validate against the schema" if problems else None


# ---------------------------------------------------------------------------------------------------
# Rewriting into enforceable shapes


def _merge(a: dict, b: dict) -> dict | None:
    """One schema equivalent to allOf [a, b] where that is plain, else None."""
    out = dict(a)
    for k, v in b.items():
        if k not in out or out[k] == v:
            out[k] = v
        elif k == "required":
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k == "properties" and isinstance(v, dict) and isinstance(out[k], dict):
            props = dict(out[k])
            for name, sub in v.items():
                if name in props and props[name] != sub:
                    both = isinstance(sub, dict) and isinstance(props[name], dict)
                    merged = _merge(props[name], sub) if both else None
                    if merged is None:
                        return None
                    sub = merged
                props[name] = sub
            out[k] = props
        elif k in ("title", "description", "$comment", "examples", "default"):
            pass  # annotations: keep the first
        else:
            return None
    for part in (a, b):  # additionalProperties only sees its own schema's properties
        if "additionalProperties" in part and set(part.get("properties", {})) != set(
            out.get("properties", {})
        ):
            return None
    return out


class _Refs:
    """Local `$ref`s ("#/$defs/x", "#/definitions/x") of one root schema, inlined when not recursive."""

    def __init__(self, root: dict):
        self.root = root

    @cached_property
    def ids(self) -> set[str]:
        """The `$id`s in the document (a `$ref` to one of them stays inside it)."""
        ids, stack = set(), [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("$id"), str):
                    ids.add(node["$id"].split("#", 1)[0])
                stack += node.values()
            elif isinstance(node, list):
                stack += node
        return ids

    def is_external(self, ref: str) -> bool:
        """Whether `ref` points outside the document ("https://...", "file://...", "other.json#/x")."""
        base = ref.split("#", 1)[0]
        return base != "" and base not in self.ids

    def target(self, ref: str) -> dict | None:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return None
        node: Any = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node if isinstance(node, dict) else None

    def inline(self, schema: dict, seen: tuple[str, ...] = ()) -> dict | None:
        """`schema` with its top-level `$ref` replaced by the target's keywords, or None."""
        ref = schema.get("$ref")
        target = self.target(ref)
        if target is None or ref in seen or _mentions(target, ref):
            return None
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        if "$ref" in target:
            target = self.inline(target, (*seen, ref))
            if target is None:
                return None
        return _merge(target, rest)


def _mentions(schema: Any, ref: str) -> bool:
    if isinstance(schema, dict):
        return schema.get("$ref") == ref or any(_mentions(v, ref) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions(v, ref) for v in schema)
    return False


_BESIDE_VALUES = (_VALIDATION | set(_RELATIONAL) | set(COMPOSITION)) - {"enum", "const"}


def _finite_values(schema: dict) -> list | None:
    """The values an `enum` / `const` (of the schema or one of its allOf parts) limits it to."""
    for part in [schema, *(p for p in schema.get("allOf", []) if isinstance(p, dict))]:
        if "const" in part:
            return [part["const"]]
        if isinstance(part.get("enum"), list):
            return part["enum"]
    return None


def _simplify_node(schema: dict, refs: _Refs) -> dict:
    values = _finite_values(schema)
    if values is not None and set(schema) & _BESIDE_VALUES:
        # A finite set of values under further constraints: keep the values that pass them all.
        # Each value passes the keyword it was taken from, so that one is left out of the check: with it,
        # checking n enum values would compare each against all n (minutes for 100,000 values).
        source = "const" if "const" in schema else "enum" if isinstance(schema.get("enum"), list) else None
        rest = {k: v for k, v in schema.items() if k != source}
        # evolve: the node's keywords, with "#/..." references still resolved against the root (jsonschema is
        # imported here, by the first schema that needs it, not with the engine: motet serve's start never does)
        from jsonschema import Draft202012Validator
        from jsonschema.validators import validator_for

        checker = validator_for(refs.root, default=Draft202012Validator)(refs.root).evolve(schema=rest)
        return {"enum": [v for v in values if checker.is_valid(v)]}
    out = schema
    if isinstance(out.get("allOf"), list) and all(isinstance(s, dict) for s in out["allOf"]):
        merged: dict | None = {k: v for k, v in out.items() if k != "allOf"}
        for part in out["allOf"]:
            if "$ref" in part and merged is not None:
                part = refs.inline(part)  # a $ref beside other keywords means different things by draft
            merged = _merge(merged, part) if merged is not None and part is not None else None
        if merged is not None:
            out = merged
    if "$ref" in out and any(k in _VALIDATION for k in out):
        out = refs.inline(out) or out
    for key in ("anyOf", "oneOf"):
        branches = out.get(key)
        siblings = {k: v for k, v in out.items() if k in _VALIDATION}
        if not siblings or not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
            continue
        pushed = []
        for b in branches:
            b = refs.inline(b) if "$ref" in b else b
            pushed.append(_merge(siblings, b) if b is not None else None)
        if all(p is not None for p in pushed):
            out = {k: v for k, v in out.items() if k not in siblings} | {key: pushed}
    return out


def simplify(schema: dict) -> dict:
    """An equivalent schema with plain `allOf`s merged and composition siblings pushed into branches."""
    refs = _Refs(schema)

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        return map_children(_simplify_node(node, refs), walk)

    try:
        return walk(schema)
    except Exception:  # e.g. a $ref jsonschema cannot resolve in isolation: the schema as given is equivalent
        return schema
