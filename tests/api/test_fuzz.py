"""Property-based fuzzing of the HTTP API on a real `motet serve` (tiny model, loopback): no input, however
malformed, gets a 5xx.

- schemathesis generates requests from the app's own OpenAPI document (every route, valid and invalid);
- hypothesis generates chat and completion bodies that are nearly valid (right shape, wrong details:
  mistyped fields, odd content parts, random tool and response-format schemas), which reach deeper code
  than schema-driven generation does.

Bounded in examples so the suite stays in CI's time; the server's /health answers after each test.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.live_server import Server

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True)
MODEL = "tiny"


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    srv = Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--max-model-len", "128",
        "--threads", "1", "--data-dir", str(tmp / "data"), "--grammar-timeout", "2",
        "--max-body-bytes", "200000",
        start_timeout=120,
    )  # fmt: skip
    yield srv
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    srv.stop()


def _cases() -> list[tuple[str, str, GenerationMode]]:
    """Every operation with valid inputs; those that take inputs with invalid ones too."""
    from tests.served_app import openapi_schema

    out = []
    for path, item in openapi_schema()["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            out.append((method.upper(), path, GenerationMode.POSITIVE))
            if "requestBody" in op:
                out.append((method.upper(), path, GenerationMode.NEGATIVE))
    return out


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


# schemathesis' own pytest integration (`from_fixture`) does not run on pytest 9: its strategies are
# driven by hypothesis directly, one test per operation and generation mode.
@pytest.mark.parametrize("method, path, mode", _cases(), ids=lambda v: getattr(v, "value", v))
def test_openapi_operations_never_answer_5xx(api_schema, fuzz_server, method, path, mode):
    (operation,) = [op.ok() for op in api_schema.get_all_operations() if op.ok().label == f"{method} {path}"]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, **SETTINGS)
    def check(case):
        response = case.call(base_url=fuzz_server.url, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
        )

    check()


# -- nearly valid bodies ----------------------------------------------------------------------------------
json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# JSON schemas: mostly meaningful keywords, some contradictory, some pointing where they should not.
schema_like = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array"])},
        optional={
            "enum": st.lists(json_value, min_size=1, max_size=4),
            "pattern": st.sampled_from(["^a+$", "(?=x)a", "[", "\\d{2,3}", "(a|b)*c"]),
            "minLength": st.integers(-2, 5),
            "maxLength": st.integers(0, 3),
            "minimum": st.integers(-5, 5),
            "maxItems": st.integers(-1, 4),
            "format": st.sampled_from(["date", "email", "uuid", "nonsense"]),
            "$ref": st.sampled_from(
                ["#", "#/$defs/x", "#/nope", "http://example.com/s.json", "file:///etc/passwd"]
            ),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("object")},
        optional={
            "properties": st.dictionaries(st.text(min_size=1, max_size=6), inner, max_size=3),
            "required": st.lists(st.text(max_size=6), max_size=3),
            "items": inner,
            "anyOf": st.lists(inner, max_size=3),
            "oneOf": st.lists(inner, max_size=3),
            "allOf": st.lists(inner, max_size=2),
            "not": inner,
            "$defs": st.dictionaries(st.just("x"), inner, max_size=1),
            "additionalProperties": st.booleans() | inner,
        },
    ),
    max_leaves=6,
)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=30)})
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.text(max_size=40) | st.lists(text_part, min_size=1, max_size=2),
    },
    optional={
        "name": st.text(max_size=8),
        "tool_call_id": st.text(max_size=8),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": st.text(max_size=6),
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {"name": st.text(max_size=8), "arguments": st.text(max_size=20) | st.just('{"a": 1}')}
                    ),
                }
            ),
            max_size=2,
        ),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f", "a.b", ""])},
            optional={
                "parameters": schema_like,
                "strict": st.booleans(),
                "description": st.text(max_size=20),
            },
        ),
    }
)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": st.text(min_size=1, max_size=8), "schema": schema_like},
                optional={"strict": st.booleans()},
            ),
        }
    ),
)
# Each field's valid values (in range, right type); a body takes a few, and sometimes one junk value.
VALID = {
    "max_tokens": st.integers(0, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 60),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "repetition_penalty": st.floats(0.5, 2),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "guided_regex": st.sampled_from(["a+", "(", "(?=a)b", "[0-9]{1,3}", "(a|b){0,5}"]),
    "guided_choice": st.lists(st.text(max_size=5), max_size=3),
    "guided_json": schema_like,
    "guided_grammar": st.sampled_from(['root ::= "a"', "root ::=", "x", 'root ::= [a-z]+ "!"']),
    "guided_decoding_backend": st.sampled_from(["xgrammar", "outlines", "nope"]),
}
CHAT_VALID = {
    **VALID,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"])
    | st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}),
        }
    ),
    "parallel_tool_calls": st.booleans(),
    "max_tool_calls": st.integers(1, 4),
    "response_format": response_format,
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
    "add_generation_prompt": st.booleans(),
}
COMPLETION_VALID = {**VALID, "logprobs": st.integers(0, 3), "echo": st.booleans()}


@st.composite
def nearly_valid(draw, base: dict, valid: dict) -> dict:
    body = {k: draw(v) for k, v in base.items()}
    for key in draw(st.lists(st.sampled_from(sorted(valid)), max_size=5, unique=True)):
        body[key] = draw(valid[key])
    if draw(st.integers(0, 3)) == 0:  # one field of the wrong shape
        body[draw(st.sampled_from(sorted({**base, **valid})))] = draw(json_value)
    return body


chat_body = nearly_valid(
    {"model": st.just(MODEL), "messages": st.lists(message, min_size=1, max_size=3)}, CHAT_VALID
)
completion_body = nearly_valid(
    {
        "model": st.just(MODEL),
        "prompt": st.text(min_size=1, max_size=40)
        | st.lists(st.integers(0, 319), min_size=1, max_size=8)
        | st.lists(st.lists(st.integers(0, 319), min_size=1, max_size=4), min_size=1, max_size=3),
    },
    COMPLETION_VALID,
)


def assert_no_5xx(server, path: str, body) -> None:
    """The body gets a 2xx, or a 4xx with an OpenAI-shaped error; never a 5xx."""
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code < 500, f"{r.status_code} {r.text[:500]}\nbody: {body}"
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@given(body=chat_body)
@settings(max_examples=150, **SETTINGS)
def test_chat_bodies_never_answer_5xx(fuzz_server, body):
    assert_no_5xx(fuzz_server, "/v1/chat/completions", body)


@given(body=completion_body)
@settings(max_examples=100, **SETTINGS)
def test_completion_bodies_never_answer_5xx(fuzz_server, body):
    assert_no_5xx(fuzz_server, "/v1/completions", body)
