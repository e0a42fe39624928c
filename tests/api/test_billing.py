"""What a request is billed (issue 48, finding 2): every token generated, however the request ends, in the
tenant's usage records (`GET /v1/usage`) and its tokens per minute; and a request reserves its prompt plus n times
its max_tokens (the rest of the context without one) before it runs, so that neither concurrency, `n` nor a
missing max_tokens takes a tenant past its limit. A real server on loopback in a thread (the tiny model, the
flags `motet serve` parses), the openai SDK as the client; the references are the engine's own count of the
tokens it generated (vLLM's `vllm:generation_tokens_total` on /metrics), the `usage` the SDK parsed and the
tokens the clients read. The limiter's clock is stopped, so no bucket refills while the tests run: its level is
exactly what was charged."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import ThreadServer, keys_file

MODEL = "tiny"
CONTEXT = 384
KEYS = {
    "sk-erin": {"tenant": "erin", "limits": {"tokens_per_minute": 10_000_000}},
    "sk-fay": {"tenant": "fay", "limits": {"tokens_per_minute": 600}},
    "sk-gil": {"tenant": "gil", "limits": {"tokens_per_minute": 700}},
    "sk-hal": {"tenant": "hal", "limits": {"tokens_per_minute": 300}},
    "sk-ops": {"admin": True},
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("billing")
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys_file(tmp, KEYS),
        "--data-dir", str(tmp / "data"), "--threads", "1", "--max-model-len", str(CONTEXT),
    )  # fmt: skip
    stopped = srv.state.limiter.clock()
    srv.state.limiter.clock = lambda: stopped
    yield srv
    srv.stop()


def sdk(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def ops(srv) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer sk-ops"}, timeout=30)


def quiet(srv) -> None:
    """Waits until no request is in flight anywhere: every bill closed, the engine idle."""
    deadline = time.monotonic() + 60
    while srv.state.inflight or (s := srv.state.system.stats()).num_running or s.num_waiting or s.queued:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def figures(srv, tenant: str) -> dict:
    """The engine's generated tokens (all tenants), the tenant's usage records and its tokens per minute left."""
    quiet(srv)
    with ops(srv) as client:
        metrics = client.get("/metrics").text
        page = client.get(
            "/v1/usage", params={"start_time": int(time.time()) - 86400, "tenant": tenant}
        ).json()
    (generated,) = [
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "vllm:generation_tokens_total"
    ]
    results = [r for bucket in page["data"] for r in bucket["results"]]
    return {
        "generated": generated,
        "input": sum(r["input_tokens"] for r in results),
        "output": sum(r["output_tokens"] for r in results),
        "requests": sum(r["num_model_requests"] for r in results),
        "left": int(srv.state.limiter.headers(tenant)["x-ratelimit-remaining-tokens"]),
    }


def test_streams_their_clients_cut_are_billed_every_token_generated(server):
    """Before: 756 tokens read, 2 recorded in /v1/usage, the tokens per minute unchanged."""
    before = figures(server, "erin")
    read, prompts = [], []

    def cut(n: int) -> None:
        stream = sdk(server, "sk-erin").chat.completions.create(
            model=MODEL, messages=MESSAGES, n=n, max_tokens=CONTEXT - 30, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        got, prompt = 0, None
        for chunk in stream:
            if prompt is None:
                prompt = len(chunk.prompt_token_ids)  # (vLLM's return_token_ids: with the first chunk)
            got += sum(len(choice.token_ids) for choice in chunk.choices)
            if got >= 250 * n:
                break
        stream.close()  # the client goes: the rest is never read
        read.append(got)
        prompts.append(prompt)

    clients = [threading.Thread(target=cut, args=(n,)) for n in (1, 1, 2)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    after = figures(server, "erin")
    generated, billed = after["generated"] - before["generated"], after["output"] - before["output"]
    assert len(read) == 3 and after["requests"] - before["requests"] == 3
    assert sum(read) <= billed <= generated  # what the clients read, and what the engine made, at most
    # (the engine may generate a token for a row in the step it is running when the client goes)
    assert billed >= 0.99 * generated, (billed, generated)
    assert after["input"] - before["input"] == sum(prompts)
    charged = before["left"] - after["left"]
    assert charged == (after["input"] - before["input"]) + billed  # the tokens per minute: the same tokens


def test_concurrent_requests_with_n_stay_within_the_tokens_per_minute(server):
    """Before: tokens were charged as each answer finished, so 8 concurrent requests of n=8 all got in while
    the bucket was above zero (2.8-3.6x the limit within a minute). Each reserves 18 + 8 x 16 tokens now: 4 fit
    in fay's 600, whenever the others come, and each is charged exactly what its usage says."""
    before = figures(server, "fay")
    answers, refused = [], []

    def ask() -> None:
        try:
            r = sdk(server, "sk-fay").chat.completions.create(
                model=MODEL, messages=MESSAGES, n=8, max_tokens=16, extra_body={"ignore_eos": True}
            )
            answers.append(r.usage)
        except openai.RateLimitError as e:
            refused.append(e)

    clients = [threading.Thread(target=ask) for _ in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(120)
    after = figures(server, "fay")
    used = sum(u.total_tokens for u in answers)
    assert len(answers) == 600 // (answers[0].prompt_tokens + 8 * 16) and len(refused) == 8 - len(answers)
    assert used <= 600 and before["left"] - after["left"] == used
    assert after["output"] - before["output"] == sum(u.completion_tokens for u in answers)
    assert all("tokens per minute (600)" in e.body["message"] for e in refused)


def test_a_request_without_max_tokens_reserves_the_rest_of_the_context(server):
    """Without max_tokens a request may generate up to the context window: gil's 700 tokens hold one such
    request (384 tokens), not two, and the one is charged what its usage says."""
    gil = sdk(server, "sk-gil")
    first = gil.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
    assert first.usage.total_tokens == CONTEXT
    with pytest.raises(openai.RateLimitError, match=r"tokens per minute \(700\)"):
        gil.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
    assert figures(server, "gil")["left"] == 700 - CONTEXT


def test_a_request_larger_than_the_tenants_minute_is_refused_naming_what_to_lower(server):
    """Issue 57, finding 3: on a full bucket a request of any size got in, so one request of n = 8 or one without
    max_tokens took 2.8-3.4x the tenant's tokens per minute. OpenAI's way: a request whose prompt and n times its
    max_tokens (the rest of the context without one) exceed the whole minute is refused at once, naming the limit
    and what to lower, and the SDK does not retry it (`x-should-retry: false`; with its default 2 retries it sends
    one request)."""
    prompt = sdk(server, "sk-erin").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    prompt = prompt.usage.prompt_tokens
    sent = []
    hal = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-hal", timeout=120,
                        http_client=httpx.Client(event_hooks={"request": [sent.append]}))  # fmt: skip
    with pytest.raises(openai.RateLimitError) as e:  # the rest of the context: 384 tokens
        hal.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"ignore_eos": True})
    fits = (300 - prompt) // 8
    assert len(sent) == 1 and e.value.response.headers["x-should-retry"] == "false"
    assert e.value.body["code"] == "rate_limit_exceeded" and e.value.body["param"] == "max_tokens"
    assert f"limit 300, requested {CONTEXT}" in e.value.body["message"]
    assert f"set max_tokens (at most {300 - prompt}" in e.value.body["message"]
    with pytest.raises(openai.RateLimitError) as e:
        hal.chat.completions.create(model=MODEL, messages=MESSAGES, n=8, max_tokens=fits + 1)
    assert len(sent) == 2 and f"limit 300, requested {prompt + 8 * (fits + 1)}" in e.value.body["message"]
    assert f"Lower max_tokens (at most {fits} with this prompt and n) or n" in e.value.body["message"]
    r = hal.chat.completions.create(model=MODEL, messages=MESSAGES, n=8, max_tokens=fits,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.total_tokens == prompt + 8 * fits <= 300
    assert figures(server, "hal")["left"] == 300 - r.usage.total_tokens


def test_a_stream_its_client_cuts_counts_as_aborted(server):
    """Issue 57, finding 4: a stream its client closed midway was counted in no `vllm:request_success_total`
    reason (nor as `abort`, vLLM's reason for it); its tokens are billed as before."""

    def finishes() -> dict:
        quiet(server)
        with ops(server) as client:
            text = client.get("/metrics").text
        return {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "vllm:request_success_total"}  # fmt: skip

    before, billed = finishes(), figures(server, "erin")
    stream = sdk(server, "sk-erin").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=CONTEXT - 30, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    after = finishes()
    assert after["abort"] - before["abort"] == 1
    assert after["length"] == before["length"] and after["stop"] == before["stop"]
    assert figures(server, "erin")["requests"] == billed["requests"] + 1


@pytest.mark.parametrize(
    "params, param",
    [
        ({"start_time": 0, "page": 864 * 10**27}, "page"),
        ({"start_time": 10**30}, "start_time"),
        ({"start_time": 0, "end_time": 10**30}, "end_time"),
        ({"start_time": -1}, "start_time"),
        ({"start_time": 0, "limit": 10**30}, "limit"),
    ],
)
def test_usage_times_past_any_date_are_refused_naming_the_parameter(server, params, param):
    """Before: 500 (the times went to SQLite, whose integers end at 2**63)."""
    with ops(server) as client:
        r = client.get("/v1/usage", params=params)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
