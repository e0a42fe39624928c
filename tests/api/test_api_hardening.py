"""Malformed and abusive requests, each reproduced from an adversarial run against `motet serve`: every one
gets an OpenAI-shaped 4xx that names what to fix (never a 500), and the server keeps serving.

In-process (Starlette TestClient) on a tiny random model: fast. The same app serves the real model.
"""

from __future__ import annotations

import json

import pytest

from motet.actors.system import ServingSystem
from motet.api.auth import Authenticator
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from tests.served_app import served_app

AUTH = {"Authorization": "Bearer k1", "Content-Type": "application/json"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=8, max_model_len=512)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir), max_queue_len=64)
    state = ServerState(system, ["tiny"], auth=Authenticator({"k1": "alice"}), max_body_bytes=4 << 20)
    with served_app(state) as c:
        yield c


def send(client, path, body: dict | str):
    data = body if isinstance(body, str) else json.dumps({"model": "tiny", **body})
    return client.post(path, content=data.encode("utf-8", "surrogatepass"), headers=AUTH)


def refused(r, param=None, status=400, match=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if match is not None:
        assert match in err["message"], err
    return err


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def still_serving(client):
    r = send(client, COMPLETIONS, {"prompt": "The quick", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "text", "text": 42}, "text must be a string"),
        ({"type": "text", "text": None}, "text must be a string"),
        ({"type": "image_url", "image_url": {"url": "http://x"}}, "'image_url' is not supported"),
        ("just a string", "must be an object"),
    ],
)
def test_content_parts_that_are_not_text(client, part, match):
    r = send(client, CHAT, {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
    refused(r, match=match)
    still_serving(client)


def test_text_content_parts_are_joined(client):
    parts = [{"type": "text", "text": "The quick "}, {"type": "text", "text": "brown fox"}]
    r = send(client, CHAT, {"messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_lone_surrogate(client):
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    refused(send(client, CHAT, body), match="lone surrogate")
    refused(send(client, COMPLETIONS, '{"model": "tiny", "prompt": "\\udfff", "max_tokens": 2}'))
    still_serving(client)


def history(arguments: str, result: str) -> dict:
    """A chat after one tool call: its `arguments` and the tool's result `content`, each JSON given as text."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None,
            "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": result}], "max_tokens": 2}  # fmt: skip


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"city": "\\ud800"}', "holds invalid Unicode (a lone surrogate escape) at city"),
        ('{"a": ' + "[" * 64 + "]" * 64 + "}", "nested more than 64 levels deep"),  # 65 levels
        ("[" * 100_000 + "]" * 100_000, "nested more than 64 levels deep"),  # past what the parser recurses
    ],
)
def test_json_text_in_a_history_is_read_as_a_body_is(client, text, match):
    """A call's arguments and a tool's result are JSON given as text, which the body's own check sees as text; the
    prompt reads them as JSON. A lone surrogate escape there (valid JSON, no valid Unicode) was a TypeError out of
    the tokenizer, text nested past the parser's recursion a RecursionError: 500s. Refused as a request body's
    own would be (the 400 of test_lone_surrogate), naming the field; the same history with valid JSON is served."""
    arguments = "messages[1].tool_calls[0].function.arguments"
    refused(send(client, CHAT, history(text, '{"sky": "clear"}')), param=arguments, match=match)
    refused(send(client, CHAT, history('{"city": "Oslo"}', text)), param="messages[2].content", match=match)
    deepest = '{"a": ' + "[" * 63 + "]" * 63 + "}"  # 64 levels, as a body may nest
    assert send(client, CHAT, history('{"city": "\\u00e9"}', deepest)).status_code == 200
    assert send(client, CHAT, history(deepest, "not JSON: shown as text")).status_code == 200
    still_serving(client)


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_bodies(client, depth):
    nested = "[" * depth + "]" * depth
    body = '{"model": "tiny", "prompt": "x", "max_tokens": 2, "metadata": ' + nested + "}"
    refused(send(client, COMPLETIONS, body), match="nested")
    schema = "{" + '"items": {' * depth + '"type": "string"' + "}" * depth + "}"
    rf = '{"type": "json_schema", "json_schema": {"name": "n", "schema": ' + schema + "}}"
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": ' + rf + "}"
    refused(send(client, CHAT, body), match="nested")
    still_serving(client)


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 10**30),
        ("top_k", 10**9),
        ("temperature", 1e308),
        ("repetition_penalty", 1e308),
        ("seed", 2**70),
        ("seed", -(2**70)),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [10**20]),
        ("stop", ["x"] * 100_000),
        ("n", "2"),
        ("stream", "yes"),
        ("temperature", "0.5"),
        ("max_tokens", True),
        ("ignore_eos", 1),
    ],
)
def test_out_of_range_or_mistyped_parameters(client, field, value):
    refused(send(client, COMPLETIONS, {"prompt": "The quick", "max_tokens": 2, field: value}), param=field)
    still_serving(client)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"repetition_penalty": 1e-300, "temperature": 0}, "must be in [0.1, 10.0]"),  # 1/0 in fp32
        ({"repetition_penalty": 1e-40, "temperature": 0.7}, "must be in [0.1, 10.0]"),  # an infinite logit
        ({"allowed_token_ids": [3, 4], "stop_token_ids": [3, 4], "min_tokens": 2}, "banned by min_tokens"),
    ],
)
def test_sampling_parameters_that_leave_no_token_to_sample(client, extra, match):
    """These sampled an index outside the vocabulary (a 500, and a failed step for the batch around it)."""
    param = next(iter(extra))
    for path, body in ((COMPLETIONS, {"prompt": "The quick"}), (CHAT, chat())):
        refused(send(client, path, {**body, "max_tokens": 4, **extra}), param=param, match=match)
    still_serving(client)


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_numbers_are_not_json(client, literal):
    body = '{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": ' + literal + "}"
    refused(send(client, COMPLETIONS, body), match="not a JSON number")


def test_client_chat_templates_are_refused(client):
    """A template in chat_template_kwargs replaced the model's: a 60-byte body became a 1,000,001-token
    prompt. Only data the template reads is accepted (a request's own template only under
    --trust-request-chat-template: tests/api/test_vllm_extras.py)."""
    template = {"chat_template": "{{ 'hello ' * 1000000 }}"}
    refused(send(client, CHAT, chat(chat_template_kwargs=template)), match="--trust-request-chat-template")
    refused(send(client, CHAT, chat(chat_template="{{ 'hello' }}")), match="--trust-request-chat-template")
    refused(send(client, CHAT, chat(chat_template_kwargs={"unknown": 1})), match="'unknown' is not accepted")
    refused(send(client, CHAT, chat(chat_template_kwargs={"enable_thinking": "yes"})), match="must be a bool")
    r = send(client, CHAT, chat(chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200, r.text


def test_prompt_text_beyond_the_context_is_refused_unread(client):
    """512-token context: a 100k-character prompt is refused before tokenization, naming the limit."""
    err = refused(send(client, COMPLETIONS, {"prompt": "a" * 100_000, "max_tokens": 2}), param="prompt")
    assert err["code"] == "context_length_exceeded"
    err = refused(send(client, CHAT, {"messages": [{"role": "user", "content": "b" * 100_000}]}))
    assert err["code"] == "context_length_exceeded"
    still_serving(client)


def test_every_503_says_when_to_retry():
    """Busy grammar compilations answered 503 without Retry-After; every 503 carries it now."""
    from motet.actors.serving_errors import ServerBusy, ShuttingDown
    from motet.api.errors import APIError, from_serving_error

    for e in (ServerBusy("grammar compilations are busy"), ShuttingDown("bye")):
        r = from_serving_error(e).response()
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert int(APIError(503, "the server failed to start").response().headers["retry-after"]) >= 1


def test_a_request_the_model_fails_on_fails_alone(tiny_model_dir):
    """A forward pass that raises for one request's batch (a kernel bug its input triggers): that request
    gets a 500, the four beside it in the same steps get all their tokens, and the server keeps serving."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.actors.test_actors import inject_fault

    def faulty_engine():
        engine = LLMEngine(
            EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128), model_dir=tiny_model_dir
        )
        inject_fault(engine, 299)
        return engine

    state = ServerState(ServingSystem(faulty_engine), ["tiny"], auth=Authenticator({"k1": "alice"}))
    with served_app(state) as c:
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        prompts = [[5, 6, 299, 7]] + [[5, 6, 7 + i] for i in range(4)]
        with ThreadPoolExecutor(5) as pool:
            bad, *good = pool.map(lambda p: send(c, COMPLETIONS, {"prompt": p, **body}), prompts)
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error", bad.text
        for r in good:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 12
        still_serving(c)


def test_logprobs_of_grammar_masked_tokens_are_finite(client):
    """A one-token vocabulary under guided_choice leaves the top alternatives at -inf, which JSON cannot
    carry: found by the fuzzer as a 500 (OpenAI's SDK needs a number there)."""
    body = {"prompt": "0", "guided_choice": [""], "stop": "0", "logprobs": 2, "max_tokens": 3}
    r = send(client, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]
    values = lps["token_logprobs"] + [v for top in lps["top_logprobs"] for v in top.values()]
    assert values and all(isinstance(v, float) and v >= -9999.0 for v in values)
    r = send(client, CHAT, chat(guided_choice=["a"], logprobs=True, top_logprobs=3))
    assert r.status_code == 200, r.text
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        assert all(t["logprob"] >= -9999.0 for t in [entry, *entry["top_logprobs"]])
