"""The API layer in-process on a tiny random model (Starlette TestClient): wire format, errors, auth, SSE.

Fast companions of the real-server tests in test_api.py.
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

AUTH = {"Authorization": "Bearer k1"}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=8)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir), max_queue_len=16)
    state = ServerState(
        system,
        ["tiny"],
        auth=Authenticator({"k1": "alice", "k-admin": {"admin": True}}),
        max_body_bytes=20_000,
    )
    with served_app(state) as c:
        yield c


def post(client, path, body, headers=AUTH):
    return client.post(path, json={"model": "tiny", **body}, headers=headers)


def error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_chat_response_shape(client):
    r = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                               "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_sse_chunks_and_done(client):
    body = {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/completions", json={"model": "tiny", **body}, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    full = post(client, "/v1/completions", {**body, "stream": False, "n": 1}).json()
    assert texts[0] == texts[1] == full["choices"][0]["text"]  # greedy: both choices equal


def test_echo_logprobs_batch_of_prompts(client):
    r = post(client, "/v1/completions", {"prompt": ["The quick", "Paris is"], "max_tokens": 1, "echo": True,
                                          "logprobs": 2, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c, prompt in zip(choices, ["The quick", "Paris is"], strict=True):
        lp = c["logprobs"]
        assert c["text"].startswith(prompt) and "".join(lp["tokens"]) == c["text"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])


def test_token_id_prompt(client):
    r = post(client, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_errors(client):
    assert (
        error(post(client, "/v1/completions", {"prompt": "x"}, headers={}), 401)["code"] == "invalid_api_key"
    )
    assert error(post(client, "/v1/completions", {"prompt": "x", "top_k": -3}), 400)["param"] == "top_k"
    assert error(post(client, "/v1/completions", {"prompt": "x", "n": 0}), 400)["param"] == "n"
    assert error(post(client, "/v1/completions", {"prompt": []}), 400)["param"] == "prompt"
    assert error(post(client, "/v1/completions", {"prompt": [10**6]}), 400)["param"] == "prompt"
    assert error(post(client, "/v1/chat/completions", {"messages": [{"content": "no role"}]}), 400)["param"]
    assert error(client.post("/v1/completions", json={"model": "x", "prompt": "x"}, headers=AUTH), 404)
    assert error(post(client, "/v1/completions", {"prompt": "x" * 30_000}), 413)
    assert error(client.get("/v1/completions"), 405)


def test_models_and_metrics(client):
    assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]] == ["tiny"]
    assert error(client.get("/metrics"), 401)["code"] == "invalid_api_key"
    assert error(client.get("/metrics", headers=AUTH), 403)["code"] == "admin_key_required"
    text = client.get("/metrics", headers={"Authorization": "Bearer k-admin"}).text
    assert (
        "motet_kv_blocks_used" in text
        and 'motet_requests_total{endpoint="/v1/completions",status="200"}' in text
    )


def test_draining_answers_503(client):
    state = client.app.state.motet
    state.draining = True
    try:
        assert error(post(client, "/v1/completions", {"prompt": "x"}), 503)
        assert client.get("/health").status_code == 503
    finally:
        state.draining = False
