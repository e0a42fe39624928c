"""Grammar compilation as a bounded resource: size limits checked before anything compiles, overrunning
compilations counted against the tenant that sent them, and schema features the grammar would ignore
refused under `strict` (warned about otherwise).

Unit tests need no model; the API tests run in-process (Starlette TestClient) on a tiny random model.
"""

from __future__ import annotations

import json
import time

import pytest
from starlette.testclient import TestClient

from motet.actors.system import ServingSystem
from motet.api.app import create_app
from motet.api.auth import Authenticator
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.grammar.cache import GrammarCache
from motet.grammar.enforceable import regex_features, strict_refusal, unenforceable
from motet.grammar.limits import GrammarLimitError, GrammarLimits, schema_stats
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import ChoiceSpec, EbnfSpec, GrammarError, JsonSchemaSpec, RegexSpec
from tests.dev_sets import dev_set, read_jsonl
from tests.grammar.slow_backend import FakeTokenizer, SlowBackend, SlowCompiled
from tests.served_app import wait_healthy

ALICE = {"Authorization": "Bearer k1", "Content-Type": "application/json"}
BOB = {"Authorization": "Bearer k2", "Content-Type": "application/json"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BIG_ENUM = 100_000


def nested(depth: int, leaf=None) -> dict:
    """`{"items": {"items": ... leaf}}`, `depth` objects deep, built without recursion."""
    schema = {"type": "string"} if leaf is None else leaf
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


# ---------------------------------------------------------------------------------------------- the limits


def test_defaults_pass_every_jsonschemabench_schema():
    """The defaults leave room above the largest real-world schemas (the maxima are in the limits' docs)."""
    path, _ = dev_set("jsonschemabench")
    limits = GrammarLimits()
    rows = read_jsonl(path)
    assert rows
    for row in rows:
        limits.check_schema(row["schema"])
    stats = [schema_stats(row["schema"]) for row in rows]
    assert max(s.depth for s in stats) * 2 <= limits.max_depth
    assert max(s.enum_values for s in stats) * 2 <= limits.max_enum_values
    assert max(s.properties for s in stats) * 2 <= limits.max_properties
    assert max(s.pattern_length for s in stats) * 2 <= limits.max_pattern_length
    assert max(s.size_bytes for s in stats) * 2 <= limits.max_schema_bytes


@pytest.mark.parametrize(
    "schema, limit",
    [
        ({"type": "string", "enum": [str(i) for i in range(BIG_ENUM)]}, "max_enum_values"),
        (
            {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
            "max_properties",
        ),
        (nested(80), "max_depth"),
        ({"type": "string", "pattern": "a" * 5000}, "max_pattern_length"),
        ({"type": "object", "patternProperties": {"b" * 5000: {}}}, "max_pattern_length"),
        ({"type": "string", "description": "x" * 300_000}, "max_schema_bytes"),
    ],
    ids=["enum", "properties", "depth", "pattern", "patternProperties", "bytes"],
)
def test_each_limit_refuses_naming_itself(schema, limit):
    with pytest.raises(GrammarLimitError, match=limit) as e:
        GrammarLimits().check_schema(schema)
    assert e.value.limit == limit and e.value.reason == "invalid"
    loose = GrammarLimits(**{limit: 10**7, "max_schema_bytes": 10**7})
    loose.check_schema(schema)  # configurable: a higher limit lets it through


def test_limits_name_where_the_offender_is():
    schema = {"type": "object", "properties": {"color": {"enum": list(range(10))}}}
    with pytest.raises(GrammarLimitError, match="#/properties/color"):
        GrammarLimits(max_enum_values=5).check_schema(schema)


def test_deep_schemas_are_refused_without_recursion_error(slow_backend):
    deep = nested(200_000)  # far past the interpreter's recursion limit
    with pytest.raises(GrammarLimitError, match="max_depth"):
        GrammarLimits().check_schema(deep)
    text = '{"items":' * 200_000 + "{}" + "}" * 200_000
    with pytest.raises(GrammarError, match="nested too deeply"):
        JsonSchemaSpec(text).schema_dict()
    with pytest.raises(GrammarError, match="nested too deeply"):  # the cache too (its key is the JSON)
        GrammarCache().compile_with_fallback(JsonSchemaSpec(deep), FakeTokenizer(), "slow", timeout_s=0.1)


def test_other_specs_are_limited_too():
    limits = GrammarLimits(max_enum_values=3, max_pattern_length=10, max_schema_bytes=100)
    with pytest.raises(GrammarLimitError, match="max_enum_values"):
        limits.check_spec(ChoiceSpec(("a", "b", "c", "d")))
    with pytest.raises(GrammarLimitError, match="max_pattern_length"):
        limits.check_spec(RegexSpec("a" * 11))
    with pytest.raises(GrammarLimitError, match="max_schema_bytes"):
        limits.check_spec(EbnfSpec('root ::= "' + "a" * 200 + '"'))
    limits.check_spec(ChoiceSpec(("a", "b", "c")))
    limits.check_spec(RegexSpec("[a-z]+"))


def test_limits_are_validated_and_configurable():
    with pytest.raises(ValueError, match="max_depth"):
        GrammarLimits(max_depth=0)
    # the API's own limits (it checks them as it reads a request), kept with its state, not the engine's config
    assert ServerState(None, ["tiny"]).grammar_limits == GrammarLimits()
    with pytest.raises(ValueError, match="grammar_limits"):
        ServerState(None, ["tiny"], grammar_limits={"max_depth": 3})


def test_serve_flags_set_the_limits():
    from motet.api.cli import build_parser
    from motet.api.server import grammar_limits

    args = build_parser().parse_args(["serve"])
    assert grammar_limits(args) == GrammarLimits()
    args = build_parser().parse_args(
        [
            "serve",
            "--grammar-max-enum-values", "7",
            "--grammar-max-properties", "8",
            "--grammar-max-depth", "9",
            "--grammar-max-pattern-length", "10",
            "--grammar-max-schema-bytes", "11",
        ]
    )  # fmt: skip
    assert grammar_limits(args) == GrammarLimits(7, 8, 9, 10, 11)


def test_large_enums_are_linear_to_check():
    """`strict` checking and the meta-schema check compared every enum value with every other one:
    20,000 values took 18 s and 4,096 objects under draft-04 took 20 s, on the event loop."""
    schema = normalize_schema({"type": "string", "enum": [f"v{i}" for i in range(10_000)]})
    t0 = time.monotonic()
    assert strict_refusal(schema) is None
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "enum": [{"a": i} for i in range(2048)]}
    normalize_schema(draft4)
    assert time.monotonic() - t0 < 1.5


# ------------------------------------------------------------------------ features the grammar ignores


@pytest.mark.parametrize(
    "pattern, found",
    [
        ("^(?=a)[a-z]+$", ["lookahead"]),
        ("^(?!a)[a-z]+$", ["lookahead"]),
        ("(?<=a)b", ["lookbehind"]),
        ("(?<!a)b", ["lookbehind"]),
        ("^(a+)b\\1$", ["backreference"]),
        ("^(?<x>a+)b\\k<x>$", ["backreference"]),
        ("^\\(?=$", []),  # an optional literal "(" then "="
        ("^[\\1(?=]$", []),  # inside a class: plain characters
        ("^(?:ab)+(?<name>c)\\\\1$", []),  # a non-capturing group, a named group, a literal backslash
        ("^\\d{3}$", []),
    ],
)
def test_regex_features(pattern, found):
    assert regex_features(pattern) == found


@pytest.mark.parametrize(
    "schema, feature, where",
    [
        ({"type": "string", "pattern": "^(a+)b\\1$"}, "backreference", "#/properties/x"),
        ({"type": "string", "pattern": "(?<=a)b"}, "lookbehind", "#/properties/x"),
        ({"type": "string", "pattern": "^(?!a)"}, "lookahead", "#/properties/x"),
        ({"$ref": "https://example.com/s.json"}, "external '$ref'", "#/properties/x"),
        ({"$ref": "http://example.com/s.json#/a"}, "external '$ref'", "#/properties/x"),
        ({"$ref": "file:///etc/passwd"}, "external '$ref'", "#/properties/x"),
        ({"$ref": "other.json#/$defs/a"}, "external '$ref'", "#/properties/x"),
    ],
)
def test_ignored_features_are_named_with_their_place(schema, feature, where):
    root = {"type": "object", "properties": {"x": schema}}
    problems = unenforceable(root)
    assert any(feature in p and p.endswith(where) for p in problems), problems
    assert feature in strict_refusal(root)


def test_local_and_id_refs_are_not_external():
    local = {"$defs": {"a": {"type": "string"}}, "properties": {"x": {"$ref": "#/$defs/a"}}}
    by_id = {"$defs": {"a": {"$id": "a.json", "type": "string"}}, "properties": {"x": {"$ref": "a.json"}}}
    for schema in (local, by_id):
        assert not [p for p in unenforceable(schema) if "external" in p]


# -------------------------------------------------------------------- overrunning compiles, per tenant


def test_overrunning_compiles_count_against_the_tenant_that_started_them(slow_backend):
    cache, tok = GrammarCache(max_stuck=2), FakeTokenizer()
    for pattern in ("a1", "a2"):
        with pytest.raises(GrammarError) as e:
            cache.compile(RegexSpec(pattern), tok, "slow", timeout_s=0.05, owner="alice")
        assert e.value.reason == "timeout"
    assert cache.overrunning("alice") == 2 and cache.overrunning("bob") == 0
    with pytest.raises(GrammarError, match="still running past their time limit") as e:
        cache.compile(RegexSpec("a3"), tok, "slow", timeout_s=0.05, owner="alice")
    assert e.value.reason == "busy"
    # bob still compiles, through the fallback path too
    assert isinstance(
        cache.compile_with_fallback(RegexSpec("fast"), tok, "slow", 1.0, owner="bob"), SlowCompiled
    )
    # the same pattern from bob is bob's own compilation (the cache is kept per tenant): it counts against bob
    with pytest.raises(GrammarError) as e:
        cache.compile(RegexSpec("a1"), tok, "slow", timeout_s=0.05, owner="bob")
    assert e.value.reason == "timeout"
    assert cache.overrunning("alice") == 2 and cache.overrunning("bob") == 1
    SlowBackend.release.set()  # they finish: alice may compile again
    deadline = time.monotonic() + 5
    while cache.overrunning("alice") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(cache.compile(RegexSpec("a3"), tok, "slow", timeout_s=1.0, owner="alice"), SlowCompiled)


# ------------------------------------------------------------------------------------------- over HTTP


def _serve(tiny_model_dir, grammar_limits: GrammarLimits | None = None, **config):
    cfg = EngineConfig(
        model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=8, max_model_len=512, **config
    )
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir), max_queue_len=64)
    auth = Authenticator({"k1": "alice", "k2": "bob"})
    state = ServerState(
        system, ["tiny"], auth=auth, max_body_bytes=4 << 20, grammar_limits=grammar_limits or GrammarLimits()
    )
    client = TestClient(create_app(state))
    return client, state


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    c, _ = _serve(tiny_model_dir)
    with c:
        wait_healthy(c)
        yield c


def send(client, path, body: dict, headers=ALICE):
    return client.post(path, content=json.dumps({"model": "tiny", **body}).encode(), headers=headers)


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, **kw}


def json_schema(schema, strict: bool | None = None) -> dict:
    js = {"name": "out", "schema": schema}
    if strict is not None:
        js["strict"] = strict
    return {"response_format": {"type": "json_schema", "json_schema": js}}


def refused(r, status=400, match=None, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if match is not None:
        assert match in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serving(client):
    r = send(client, COMPLETIONS, {"prompt": "The quick", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_one_tenants_100k_enums_do_not_lock_out_another(tiny_model_dir):
    """Two 100,000-value enums overran the compile limit, kept compiling in their threads, and for that
    time every tenant's JSON-schema request got 503. Now they count against the tenant who sent them."""
    limits = GrammarLimits(max_enum_values=2 * BIG_ENUM, max_schema_bytes=4 << 20)
    c, state = _serve(tiny_model_dir, grammar_timeout_s=0.3, grammar_limits=limits)
    with c:
        wait_healthy(c)
        for first in (0, 1):  # two distinct schemas: two compilations, ~4 s each on the tiny vocabulary
            r = send(c, CHAT, chat(**json_schema({"enum": list(range(first, first + BIG_ENUM))})))
            refused(r, match="took longer than", param="response_format")
        r = send(c, CHAT, chat(**json_schema({"type": "integer", "minimum": 3})))
        err = refused(r, status=503, match="still running past their time limit")
        assert err["type"] == "service_unavailable" and int(r.headers["retry-after"]) >= 1
        r = send(c, CHAT, chat(**json_schema({"type": "integer", "minimum": 3})), headers=BOB)
        assert r.status_code == 200, r.text
        json.loads(
            r.json()["choices"][0]["message"]["content"] or "0"
        )  # constrained: an integer (or cut off)
        cache = state.system.executor.engine.grammar_cache
        deadline = time.monotonic() + 30  # let them finish: they would slow the tests after this one
        while cache.overrunning("alice") and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.mark.parametrize(
    "body, limit, param",
    [
        (
            json_schema({"type": "string", "enum": [str(i) for i in range(BIG_ENUM)]}),
            "max_enum_values",
            "response_format.json_schema.schema",
        ),
        (
            {"guided_json": json.dumps({"enum": list(range(10_000))})},  # as JSON text, under the bytes limit
            "max_enum_values",
            "guided_json",
        ),
        (
            json_schema(
                {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
            ),
            "max_properties",
            "response_format.json_schema.schema",
        ),
        ({"guided_json": json.dumps(nested(100))}, "max_depth", "guided_json"),
        ({"guided_json": {"type": "string", "pattern": "a" * 5000}}, "max_pattern_length", "guided_json"),
        ({"guided_regex": "a" * 5000}, "max_pattern_length", "guided_regex"),
        ({"guided_choice": [str(i) for i in range(BIG_ENUM)]}, "max_enum_values", "guided_choice"),
        (
            {"guided_json": {"type": "string", "description": "x" * 300_000}},
            "max_schema_bytes",
            "guided_json",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"enum": list(range(BIG_ENUM))}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "max_enum_values",
            "tools[0].function.parameters",
        ),
    ],
    ids=["enum", "enum-text", "properties", "depth", "pattern", "regex", "choice", "bytes", "tool"],
)
def test_oversized_grammars_get_400_naming_the_limit(client, body, limit, param):
    t0 = time.monotonic()
    err = refused(send(client, CHAT, chat(**body)), match=limit, param=param)
    assert err["code"] == "grammar_limit_exceeded"
    assert time.monotonic() - t0 < 5  # refused before anything compiled
    still_serving(client)


@pytest.mark.parametrize("field", ["guided_json", "response_format"])
def test_deeply_nested_schema_text_is_a_400_not_a_500(client, field):
    text = '{"items":' * 20_000 + "{}" + "}" * 20_000  # 200 kB: under the bytes limit; json.loads recursed
    body = {"guided_json": text} if field == "guided_json" else json_schema(text)
    err = refused(send(client, CHAT, chat(**body)), match="nested too deeply")
    assert "max_depth" in err["message"], err
    still_serving(client)


# What xgrammar compiles without complaint and does not enforce ...
IGNORED = {
    "lookahead": {"type": "string", "pattern": "^(?=a)[a-z]{1,3}$"},
    "external '$ref'": {"$ref": "https://example.com/schemas/x.json"},
}
# ... and what it refuses to compile (so no backend can serve it, strict or not).
REFUSED = {
    "lookbehind": {"type": "string", "pattern": "^[a-z]{1,3}(?<!b)$"},
    "backreference": {"type": "string", "pattern": "^(a)\\1$"},
}


@pytest.mark.parametrize("feature", [*IGNORED, *REFUSED])
def test_strict_refuses_what_the_grammar_would_ignore(client, feature):
    sub = {**IGNORED, **REFUSED}[feature]
    schema = {"type": "object", "properties": {"x": sub}, "required": ["x"]}
    err = refused(send(client, CHAT, chat(**json_schema(schema, strict=True))), match=feature)
    assert "#/properties/x" in err["message"] and err["code"] == "unsupported_schema", err
    assert err["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize("feature", IGNORED)
@pytest.mark.parametrize("stream", [False, True])
def test_without_strict_they_proceed_with_a_warning(client, feature, stream, caplog):
    schema = {"type": "object", "properties": {"x": IGNORED[feature]}, "required": ["x"]}
    for body in (json_schema(schema), {"guided_json": schema}):
        with caplog.at_level("INFO", logger="motet.api"):
            r = send(client, CHAT, chat(stream=stream, **body))
        assert r.status_code == 200, r.text
        warning = r.headers["x-motet-warning"]
        assert feature in warning and "#/properties/x" in warning, warning
        assert any(feature in rec.getMessage() for rec in caplog.records)
        caplog.clear()
    r = send(client, COMPLETIONS, {"prompt": "a", "max_tokens": 2, "guided_json": schema})
    assert r.status_code == 200 and feature in r.headers["x-motet-warning"]


@pytest.mark.parametrize("feature", REFUSED)
def test_without_strict_what_no_backend_compiles_is_refused_naming_it(client, feature):
    schema = {"type": "object", "properties": {"x": REFUSED[feature]}, "required": ["x"]}
    refused(send(client, CHAT, chat(**json_schema(schema))), match=feature.capitalize())
    still_serving(client)


def test_enforceable_schemas_carry_no_warning(client):
    r = send(client, CHAT, chat(**json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})))
    assert r.status_code == 200 and "x-motet-warning" not in r.headers


def test_warnings_are_safe_header_values(client):
    name = "naïve\r\nX-Evil: 1"
    schema = {"type": "object", "properties": {name: {"type": "string", "pattern": "(?=a)a"}}}
    r = send(client, CHAT, chat(guided_json=schema))
    assert r.status_code == 200, r.text
    warning = r.headers["x-motet-warning"]
    assert "x-evil" not in {k.lower() for k in r.headers} and warning.isascii() and "\n" not in warning
