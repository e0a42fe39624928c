"""The llguidance backend: what it compiles it enforces (jsonschema is the reference), strict mode closes
objects as xgrammar's strict mode does (xgrammar is the reference there), a request cannot loosen it, and
its matcher keeps motet's Matcher contract (stop tokens, rollback, special tokens)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from jsonschema.validators import validator_for

from motet.grammar.backend import GrammarTokenizer, allocate_bitmask, allowed_token_ids, bitmask_allows
from motet.grammar.cache import GrammarCache
from motet.grammar.enforceable import simplify
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import DEFAULT_MAX_WHITESPACE, GrammarError, JsonSchemaSpec, RegexSpec
from tests.grammar.test_enforceable import PROBES, REWRITTEN, bench_records, passing_the_check
from tests.tiny_models import build_tokenizer

pytest.importorskip("llguidance")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

from motet.grammar.xgrammar_backend import json_schema_grammar  # noqa: E402


@pytest.fixture(scope="module")
def hf_tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tok(hf_tok):
    return GrammarTokenizer(hf_tok)


@pytest.fixture(scope="module")
def cache():
    return GrammarCache(max_entries=64)


def feed(compiled, hf_tok, tok, text: str) -> bool:
    """Whether every token of `text`, then the stop token, is accepted (and each agrees with the mask)."""
    m = compiled.matcher()
    bitmask = allocate_bitmask(1, tok.vocab_size)
    for t in [*hf_tok.encode(text, add_special_tokens=False), tok.stop_token_ids[0]]:
        m.fill_bitmask(bitmask, 0)
        allowed = bitmask_allows(bitmask, 0, t)
        accepted = m.accept_token(t)
        assert allowed == accepted, f"mask and matcher disagree on token {t} of {text!r}"
        if not accepted:
            return False
    return m.is_terminated()


def llg_accepts(cache, hf_tok, tok, schema, value, strict: bool = True) -> bool | None:
    """Whether llguidance's grammar accepts `value` (None: it refuses to compile the schema)."""
    try:
        compiled = cache.compile(JsonSchemaSpec(schema, strict=strict), tok, "llguidance")
    except GrammarError as e:
        assert e.reason in ("unsupported", "invalid"), e
        return None
    return feed(compiled, hf_tok, tok, json.dumps(value))


@pytest.mark.parametrize("name", [*PROBES, *REWRITTEN])
def test_what_xgrammar_would_leak_llguidance_refuses_or_enforces(name, cache, hf_tok, tok):
    schema, invalid = {**PROBES, **REWRITTEN}[name]
    assert not validator_for(schema)(schema).is_valid(invalid)
    assert llg_accepts(cache, hf_tok, tok, schema, invalid, strict=False) in (None, False), name


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
STRICT_CASES = [
    (OBJ, {"a": 1}),
    (OBJ, {"a": 1, "b": 2}),
    ({"type": "object"}, {"x": 1}),
    ({**OBJ, "additionalProperties": {"type": "string"}}, {"a": 1, "b": "s"}),
    ({**OBJ, "additionalProperties": {"type": "string"}}, {"a": 1, "b": 2}),
    ({"type": "object", "patternProperties": {"^x": {}}}, {"y": 1}),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, [1, 2]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, [1, "s"]),
    ({"type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}}]}, {"a": 1}),
    ({"type": "object", "anyOf": [{"properties": {"a": {"type": "integer"}}}]}, {"b": 1}),
    ({"type": "object", "properties": {"o": OBJ}}, {"o": {"a": 1, "z": 0}}),
    ({"$defs": {"o": OBJ}, "type": "array", "items": {"$ref": "#/$defs/o"}}, [{"a": 1, "z": 0}]),
]


@pytest.mark.parametrize("case", range(len(STRICT_CASES)))
def test_strict_mode_closes_like_xgrammars(case, cache, hf_tok, tok):
    schema, value = STRICT_CASES[case]
    text = json.dumps(value)
    grammar = json_schema_grammar(simplify(normalize_schema(schema)), True, DEFAULT_MAX_WHITESPACE)
    assert llg_accepts(cache, hf_tok, tok, schema, value) == _is_grammar_accept_string(grammar, text)


def test_a_request_cannot_loosen_the_grammar(cache, hf_tok, tok):
    lenient = {"x-guidance": {"lenient": True}, "type": "integer", "not": {"const": 3}}
    assert llg_accepts(cache, hf_tok, tok, lenient, 3) is None  # `not` stays unimplemented: refused
    spaced = {"x-guidance": {"whitespace_flexible": True}, **OBJ}
    assert llg_accepts(cache, hf_tok, tok, spaced, {"a": 1})
    assert not feed(cache.compile(JsonSchemaSpec(spaced), tok, "llguidance"), hf_tok, tok, '{"a":    1}')


def test_stop_token_rollback_and_special_tokens(cache, hf_tok, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    compiled = cache.compile(JsonSchemaSpec(schema), tok, "llguidance")
    ids = hf_tok.encode('{"name": "abc"}', add_special_tokens=False)
    m = compiled.matcher()
    assert all(m.accept_token(t) for t in ids)
    stop = tok.stop_token_ids[0]
    assert m.accept_token(stop) and m.is_terminated() and not m.accept_token(ids[0])
    m.rollback(2)  # the stop token and "}" (the grammar had already ended before the stop token)
    assert not m.is_terminated() and not m.accept_token(stop)
    assert m.accept_token(ids[-1]) and m.accept_token(stop)

    m = cache.compile(RegexSpec("[a-z ]*"), tok, "llguidance").matcher()  # a grammar that never ends
    words = hf_tok.encode("the quick brown fox", add_special_tokens=False)
    assert all(m.accept_token(t) for t in words) and m.accept_token(stop)
    m.rollback(1)
    assert not m.is_terminated() and m.accept_token(words[0])

    m = compiled.matcher()
    assert all(m.accept_token(t) for t in hf_tok.encode('{"name": "a', add_special_tokens=False))
    bitmask = allocate_bitmask(1, tok.vocab_size)
    m.fill_bitmask(bitmask, 0)
    allowed = set(allowed_token_ids(bitmask, 0, tok.vocab_size).tolist())
    assert allowed and not allowed & set(tok.special_token_ids)


def test_bench_schemas_passing_the_strict_check_reject_their_invalid_instances(cache, hf_tok, tok):
    """What strict mode lets through (the backend-neutral check of grammar.enforceable) and llguidance
    compiles, it enforces: no invalid instance of a fixed sample of the bench is accepted."""
    records = bench_records(3)
    random.Random(0).shuffle(records)
    leaks, passed = [], 0
    for rec, schema in passing_the_check(records[:150]):
        try:
            compiled = cache.compile(JsonSchemaSpec(schema, strict=False), tok, "llguidance", timeout_s=30)
        except GrammarError:
            continue  # refused: the fallback or a 400, never a leak
        passed += 1
        validator = validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
        for test in rec["tests"]:
            if validator.is_valid(test["data"]):
                continue
            if feed(compiled, hf_tok, tok, json.dumps(test["data"])):
                leaks.append((rec["id"], test["description"]))
    assert passed > 40 and not leaks, (passed, leaks)
