"""What `strict: true` refuses, and the rewrite that lets xgrammar enforce more.

References: `jsonschema` says which instances are valid; xgrammar's own matcher says what the grammar
accepts. The promise under test: a schema that passes the check gets a grammar that rejects the
invalid instances.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from jsonschema.validators import validator_for

from motet.grammar.enforceable import simplify, unenforceable
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import DEFAULT_MAX_WHITESPACE
from tests.dev_sets import dev_set, read_jsonl

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from motet.grammar.xgrammar_backend import json_schema_grammar  # noqa: E402

DRAFT7 = "http://json-schema.org/draft-07/schema#"
BENCH, BENCH_IS_FULL = dev_set("jsonschemabench")


def accepts(schema: dict, value) -> bool:
    """Whether the grammar motet compiles for `schema` (xgrammar backend settings) accepts `value`."""
    rewritten = simplify(normalize_schema(schema))
    grammar = json_schema_grammar(rewritten, strict=True, max_whitespace=DEFAULT_MAX_WHITESPACE)
    return _is_grammar_accept_string(grammar, json.dumps(value))


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# (schema, an instance jsonschema rejects): each shape xgrammar 0.2 gets wrong when compiled as is.
PROBES = {
    "not": ({"not": {"type": "integer"}}, 1),
    "if/then": ({**OBJ, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    "dependencies": ({**OBJ, "$schema": DRAFT7, "dependencies": {"a": ["b"]}}, {"a": 1}),
    "dependentRequired": ({**OBJ, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1]),
    "propertyNames": ({**OBJ, "propertyNames": {"pattern": "^b"}}, {"a": 1}),
    "oneOf overlap": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    "oneOf objects": ({"oneOf": [OBJ, {**OBJ, "required": ["a"]}]}, {"a": 1}),
    "pattern+length": ({"type": "string", "pattern": "^a+$", "minLength": 3}, "a"),
    "untyped pattern": ({"anyOf": [{"type": "boolean"}, {"pattern": "^t$"}]}, "x"),
    "$ref beside": (
        {
            "$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}},
            "$ref": "#/$defs/n",
            "type": "integer",
        },
        None,
    ),
}
# Shapes the rewrite turns into something xgrammar enforces exactly.
REWRITTEN = {
    "allOf required": ({"allOf": [OBJ, {"required": ["a"]}]}, {}),
    "allOf of objects": (
        {"allOf": [{**OBJ, "required": ["a"]}, {"properties": {"c": {"type": "string"}}, "required": ["c"]}]},
        {"c": "x"},
    ),
    "allOf $ref": ({"$defs": {"o": OBJ}, "allOf": [{"$ref": "#/$defs/o"}, {"required": ["b"]}]}, {"a": 1}),
    "anyOf siblings": (
        {
            **OBJ,
            "required": ["a"],
            "anyOf": [{"required": ["b"]}, {"properties": {"c": {}}, "required": ["c"]}],
        },
        {"a": 1},
    ),
    "anyOf type sibling": ({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]}, 7),
    "enum under allOf": (
        {"allOf": [{"enum": [{"a": 1}, {"a": "x"}]}, {"properties": {"a": {"type": "string"}}}]},
        {"a": 1},
    ),
    "enum under not": ({"enum": [3, "x"], "not": {"type": "integer"}}, 3),
    "enum beside a root $ref": (
        {
            **OBJ,
            "properties": {
                **OBJ["properties"],
                "x": {"allOf": [{"enum": [1, "s"]}, {"$ref": "#/properties/a"}]},
            },
        },
        {"x": "s"},
    ),
}


@pytest.mark.parametrize("name", PROBES)
def test_unenforced_shapes_are_flagged_and_really_leak(name):
    schema, invalid = PROBES[name]
    assert not validator_for(schema)(schema).is_valid(invalid)
    assert unenforceable(simplify(normalize_schema(schema))), name


def test_the_probed_leaks_are_real():
    """Those flags are needed: xgrammar accepts the invalid instance of most probes (if a new xgrammar
    starts enforcing one, its rule can go)."""
    leaking = [n for n, (schema, bad) in PROBES.items() if n != "$ref beside" and accepts(schema, bad)]
    assert len(leaking) >= 8, leaking


@pytest.mark.parametrize("name", REWRITTEN)
def test_rewritten_shapes_pass_the_check_and_are_enforced(name):
    schema, invalid = REWRITTEN[name]
    assert not validator_for(schema)(schema).is_valid(invalid)
    assert unenforceable(simplify(normalize_schema(schema))) == []
    assert not accepts(schema, invalid)


def test_oneof_with_provably_disjoint_branches_is_exact():
    tagged = [
        {"type": "object", "properties": {"kind": {"const": k}, "x": {"type": t}}, "required": ["kind"]}
        for k, t in (("a", "integer"), ("b", "string"))
    ]
    closed = [
        {
            "type": "object",
            "properties": {p: {"type": "string"}},
            "required": [p],
            "additionalProperties": False,
        }
        for p in ("src", "dst")
    ]
    refs = {"$defs": {"n": {"type": "integer"}}, "oneOf": [{"$ref": "#/$defs/n"}, {"enum": [False, None]}]}
    for schema, invalid in (
        ({"oneOf": tagged}, {"kind": "a", "x": "s"}),
        ({"oneOf": closed}, {"src": "a", "dst": "b"}),
        (refs, "s"),
    ):
        assert unenforceable(simplify(schema)) == [], schema
        assert not jsonschema.Draft202012Validator(schema).is_valid(invalid)
        assert not accepts(schema, invalid)


def test_messages_name_keyword_and_place():
    schema = {"type": "object", "properties": {"x/y": {"not": {}}}}
    assert unenforceable(schema) == ["'not' at #/properties/x~1y"]
    assert unenforceable(simplify({"type": "object", "x-extension": 1, "anyOf": [{"required": []}]})) == []


def bench_records(step: int) -> list[dict]:
    return read_jsonl(BENCH)[::step]


def test_simplify_keeps_the_meaning_on_the_bench():
    """Every test instance of every bench schema is valid under the rewrite iff under the original."""
    checked = 0
    for rec in bench_records(1):
        try:
            schema = normalize_schema(rec["schema"])
        except Exception:
            continue
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
        before, after = cls(schema), cls(simplify(schema))
        for test in rec["tests"]:
            assert before.is_valid(test["data"]) == after.is_valid(test["data"]), (rec["id"], test)
            checked += 1
    assert checked > (3000 if BENCH_IS_FULL else 300)


def passing_the_check(records):
    """(record, normalized schema) for each bench record whose schema normalizes and passes the strict check."""
    for rec in records:
        try:
            schema = normalize_schema(rec["schema"])
        except Exception:
            continue
        if not unenforceable(simplify(schema)):
            yield rec, schema


def test_schemas_passing_the_check_reject_their_invalid_instances():
    """A fixed sample of the bench: what the check lets through, xgrammar enforces. Known exceptions:
    `format` values that only a calendar can refuse (2022-02-31) and one xgrammar regex bug."""
    known = {"Github_easy---o44373", "Github_medium---o9819"}
    records = [r for r in bench_records(5 if BENCH_IS_FULL else 1) if r["id"] not in known]
    random.Random(0).shuffle(records)
    leaks, passed = [], 0
    for rec, schema in passing_the_check(records[:120]):
        try:
            accepts(schema, None)
        except RuntimeError:  # xgrammar refuses to compile it (e.g. an empty enum): a 400, never a leak
            continue
        passed += 1
        for test in rec["tests"]:
            if not test["valid"] and accepts(schema, test["data"]):
                leaks.append((rec["id"], test["description"]))
    assert passed > (80 if BENCH_IS_FULL else 50) and not leaks, (passed, leaks)
