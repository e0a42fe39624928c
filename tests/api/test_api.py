"""The HTTP API end to end: `motet serve` as a real subprocess on the real default model, real sockets.

One server per module (model loading dominates); it runs with authentication on (two tenants' API keys and an
admin key) and a 100,000-byte body limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import ROOT, Server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY, OTHER_KEY, ADMIN_KEY = "sk-test-alice", "sk-test-bob", "sk-test-admin"
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY: "alice", OTHER_KEY: "bob", ADMIN_KEY: {"admin": True}}))
    # (outputs not overlapped: the path of a server whose step has every core, as by default; the suite's one
    # thread a process leaves a core spare, where "auto" overlaps them: scripts/test.sh)
    srv = Server(tmp, "--api-keys", str(keys), "--max-body-bytes", "100000", "--overlap-output", "off",
                 admin_key=ADMIN_KEY)  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


# -- the OpenAI SDK -----------------------------------------------------------------------------------------
def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_the_readmes_first_request_ends(server):
    """Issue 57: the README's first request as written (no max_tokens, no sampling field: the default model's
    generation_config.json decides), 6 at once; on a third of them the model went on ("L'Étoile, la Marseillaise, la
    femme, la femme, ...") to the end of its 8,192-token context. Every answer ends with the model's end of turn."""

    async def six():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await asyncio.gather(
            *(client.chat.completions.create(model=MODEL, messages=USER) for _ in range(6))
        )

    answers = [r.choices[0] for r in asyncio.run(six())]
    assert [a.finish_reason for a in answers] == ["stop"] * 6, [a.message.content[:80] for a in answers]
    assert all(a.message.content for a in answers)


def test_the_start_up_log_says_each_long_step_before_ready(server):
    """Issue 57: the native CPU step's packing of the weights (13-28 s on a busy CPU) logged nothing until it was
    done, if it took 5 s. A long start-up step says so as it begins (then its progress, every few seconds), before
    the server says it is ready. A start that finds the model in the prepared-weights cache (an earlier server of
    this test process wrote it) packs nothing: it says it mapped them instead."""
    deadline = time.monotonic() + 60  # (the line may come a moment after /health answers 200)
    while "ready on http://" not in (log := server.log_path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    ready = log.index("ready on http://")
    packing = log.find("packing the weights for the native CPU step (30 layers) ...")
    mapped = log.find("prepared weights: the model mapped from ")
    assert -1 < max(packing, mapped) < ready and min(packing, mapped) == -1, log[:ready]


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.created > 0
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [choice.finish_reason]
    assert chunks[-1].choices == []
    u = chunks[-1].usage
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)
    assert u.prompt_tokens_details.cached_tokens > 0  # the second time, the prompt came from the prefix cache


def test_usage_counts_tokens(client, default_model_dir):
    from motet.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.prompt_tokens == len(tok.encode_chat(USER))
    assert resp.usage.completion_tokens == 10 and resp.choices[0].finish_reason == "length"


def test_completions_with_logprobs_and_n(client):
    resp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0.8, n=2, seed=7, logprobs=2
    )
    assert resp.object == "text_completion" and [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 1
        assert "".join(lp.tokens) == c.text
        assert all(v <= 0 for v in lp.token_logprobs)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)


def test_stop_strings(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=24, temperature=0)
    text = client.chat.completions.create(**kw).choices[0].message.content
    word = re.findall(r"[A-Za-z]{4,}", text)[1]  # a word in the middle of the greedy answer
    cut = client.chat.completions.create(**kw, stop=[word, "zzzz"])
    assert cut.choices[0].message.content == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop"


def test_seed_reproducible(client):
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0)
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    assert a == b
    others = {client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_chat_logprobs_and_extra_fields(client):
    kwargs = dict(model=MODEL, messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    extra = {"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 1}
    # A field motet does not know is refused by name, never ignored (the openai SDK raises the 400)
    with pytest.raises(openai.BadRequestError, match="unknown_field"):
        client.chat.completions.create(**kwargs, extra_body={**extra, "unknown_field": 1})
    resp = client.chat.completions.create(**kwargs, extra_body=extra)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-4 for t in content)


def test_echo_prompt_logprobs_max_tokens_zero(server):
    body = {
        "model": MODEL,
        "prompt": "The capital of France is Paris",
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    r = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == body["prompt"]
    assert "".join(lp["tokens"]) == body["prompt"]
    assert lp["token_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0
    # lm-eval's request: max_tokens 1 with echo; the last token is the generated one
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    lp1 = r.json()["choices"][0]["logprobs"]
    assert lp1["token_logprobs"][:-1] == pytest.approx(
        lp["token_logprobs"][:1] + lp["token_logprobs"][1:], abs=1e-4
    )
    assert len(lp1["tokens"]) == len(lp["tokens"]) + 1


# -- errors -------------------------------------------------------------------------------------------------
def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_auth(server, client):
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER}, key=None), 401)
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER}, key="sk-wrong"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-bad", max_retries=0).models.list()
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=120)
    assert other.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices


def test_bad_parameters(server, client):
    err = _error(
        _post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "temperature": -1}), 400
    )
    assert err["param"] == "temperature"
    err = _error(
        _post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": "x"}), 400
    )
    assert err["param"] == "max_tokens"
    err = _error(_post(server, "/v1/chat/completions", {"model": MODEL}), 400)
    assert err["param"] == "messages"
    err = _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}), 400)
    assert err["param"] == "max_tokens"
    r = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    _error(r, 400)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, top_p=5)


def test_unknown_model_and_route(server, client):
    err = _error(_post(server, "/v1/chat/completions", {"model": "nope", "messages": USER}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    _error(httpx.get(f"{server.url}/v1/nothing", timeout=10), 404)


def test_body_too_large(server):
    big = {"model": MODEL, "prompt": "x" * 200_000}
    _error(_post(server, "/v1/completions", big), 413)


def test_health_openapi_metrics(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    spec = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
    m = server.metrics()
    for name in (
        "motet_kv_blocks_used",
        "motet_kv_blocks_free",
        "motet_num_requests_running",
        "motet_queue_depth",
        "motet_prefix_cache_hit_rate",
        "motet_prompt_tokens_total",
        "motet_generation_tokens_total",
        "motet_time_to_first_token_seconds_count",
        "motet_time_per_output_token_seconds_count",
        "motet_e2e_request_latency_seconds_count",
    ):
        assert name in m, name
    assert m['motet_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m["motet_kv_blocks_free"] > 0


# -- disconnects ---------------------------------------------------------------------------------
def test_disconnects_free_everything(server):
    n, max_tokens = 32, 24

    async def stream(c, i):
        body = {
            "model": MODEL,
            "prompt": f"Count to fifty: {i},",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        chunks = 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if i % 2 and chunks == 3:
                        return "dropped"  # leaving the block closes the connection mid-stream
            return chunks

    async def run():
        limits = httpx.Limits(max_connections=n + 4)
        async with httpx.AsyncClient(
            base_url=server.url, timeout=600, limits=limits, headers={"Authorization": f"Bearer {KEY}"}
        ) as c:
            results = await asyncio.gather(*(stream(c, i) for i in range(n)))
            # the server keeps answering
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            return results, r

    results, after = asyncio.run(run())
    assert after.status_code == 200
    assert results[1::2] == ["dropped"] * (n // 2)
    assert all(isinstance(x, int) and x >= 1 for x in results[0::2])
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["motet_kv_blocks_used"] == 0 and m["motet_num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


# -- lm-eval ------------------------------------------------------------------------------------------------
# lm_eval's own evaluation, as its CLI (docs/evals.md) runs it, in a process of its own, with a task manager that
# knows only motet's tasks: the CLI's indexes lm-eval's thousands of built-in task files first (half its run here).
LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
model, model_args, task, chat, out = sys.argv[1:]
tasks = TaskManager(include_path="motet/evals/lm_eval_tasks", include_defaults=False)
res = simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=25, task_manager=tasks,
                      apply_chat_template=chat == "chat")
open(out, "w").write(json.dumps({k: res[k] for k in ("results", "n-samples")}, default=str))
"""


def _lm_eval(server, model: str, model_args: str, task: str, chat: bool = False, *, tmp: Path) -> dict:
    out = tmp / f"{task}.json"
    cmd = [sys.executable, "-c", LM_EVAL, model, model_args, task, "chat" if chat else "-", str(out)]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_lm_eval_loglikelihood(server, default_model_dir, tmp_path):
    pytest.importorskip("lm_eval")
    args = (
        f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={default_model_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent=8,max_retries=1"
    )
    res = _lm_eval(server, "local-completions", args, "motet_mc", tmp=tmp_path)
    assert res["n-samples"]["motet_mc"]["effective"] >= 20
    acc = res["results"]["motet_mc"]["acc,none"]
    print(f"motet_mc acc={acc}")
    assert acc > 0.25  # better than chance (4 choices)


def test_lm_eval_generate_chat(server, tmp_path):
    pytest.importorskip("lm_eval")
    args = f"model={MODEL},base_url={server.url}/v1/chat/completions,num_concurrent=8,max_retries=1"
    res = _lm_eval(server, "local-chat-completions", args, "motet_arith", chat=True, tmp=tmp_path)
    assert res["n-samples"]["motet_arith"]["effective"] >= 20
    print(f"motet_arith exact_match={res['results']['motet_arith']['exact_match,last_number']}")
