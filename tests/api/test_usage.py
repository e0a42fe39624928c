"""Usage per tenant: `GET /v1/usage` (an admin key's, OpenAI's usage API shape) totals equal the sum of the
`usage` fields the clients received, per tenant and model (the base model or an adapter), across a restart;
`--request-log` writes one JSON line per request. A real `motet serve` (tiny model), the openai SDK."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.live_server import Server, keys_file
from tests.peft_adapters import make_adapter

MODEL = "tiny"
KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-ops": {"admin": True}}


def start(tiny_model_dir, tmp) -> Server:
    return Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys_file(tmp, KEYS),
        "--data-dir", str(tmp / "data"), "--threads", "1", "--max-model-len", "256", "--request-log",
        start_timeout=120,
    )  # fmt: skip


def sdk(srv, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def traffic(srv, sums: Counter) -> None:
    """Every kind of request; each answer's usage added to `sums[(tenant, model, field)]`."""

    def add(tenant, model, prompt, completion, cached):
        sums[(tenant, model, "input")] += prompt
        sums[(tenant, model, "output")] += completion
        sums[(tenant, model, "cached")] += cached
        sums[(tenant, model, "requests")] += 1

    msg = [{"role": "user", "content": "Tell me about the sea and the sky."}]
    for tenant, key in (("alice", "sk-alice"), ("bob", "sk-bob")):
        c = sdk(srv, key)
        for model in [MODEL, "SmolTiny"] if tenant == "alice" else [MODEL]:
            r = c.chat.completions.create(model=model, messages=msg, max_tokens=5, n=2)
            add(tenant, model, r.usage.prompt_tokens, r.usage.completion_tokens,
                r.usage.prompt_tokens_details.cached_tokens)  # fmt: skip
            stream = c.chat.completions.create(model=model, messages=msg, max_tokens=4, stream=True,
                                               stream_options={"include_usage": True})  # fmt: skip
            last = [chunk for chunk in stream][-1]
            add(tenant, model, last.usage.prompt_tokens, last.usage.completion_tokens,
                last.usage.prompt_tokens_details.cached_tokens)  # fmt: skip
            r = c.completions.create(model=model, prompt=["one two", "three four five"], max_tokens=3, n=2)
            add(tenant, model, r.usage.prompt_tokens, r.usage.completion_tokens,
                (r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0))  # fmt: skip
            r = c.responses.create(model=model, input="hello there", max_output_tokens=3)
            add(
                tenant,
                model,
                r.usage.input_tokens,
                r.usage.output_tokens,
                r.usage.input_tokens_details.cached_tokens,
            )


def totals(srv, start_time: int) -> Counter:
    r = httpx.get(
        f"{srv.url}/v1/usage",
        params={"start_time": start_time, "bucket_width": "1h", "group_by": "tenant,model"},
        headers={"Authorization": "Bearer sk-ops"},
    )
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["object"] == "page" and all(b["object"] == "bucket" for b in page["data"])
    out = Counter()
    for bucket in page["data"]:
        for res in bucket["results"]:
            key = (res["tenant"], res["model"])
            out[(*key, "input")] += res["input_tokens"]
            out[(*key, "output")] += res["output_tokens"]
            out[(*key, "cached")] += res["input_cached_tokens"]
            out[(*key, "requests")] += res["num_model_requests"]
    return out


def test_usage_totals_equal_what_clients_received_across_a_restart(tiny_model_dir, tmp_path):
    start_time = int(time.time()) - 60
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=3)
    files = [("files", (f.name, f.read_bytes())) for f in sorted(adapter.iterdir()) if f.name != "README.md"]
    srv = start(tiny_model_dir, tmp_path)
    sums: Counter = Counter()
    try:
        r = httpx.post(f"{srv.url}/v1/adapters", data={"name": "SmolTiny"}, files=files,
                       headers={"Authorization": "Bearer sk-alice"}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        traffic(srv, sums)
        assert totals(srv, start_time) == +sums
        for key in ("sk-alice", None):  # a tenant's key, or none: not the usage of every tenant
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(f"{srv.url}/v1/usage", params={"start_time": start_time}, headers=headers)
            assert r.status_code in (401, 403)
        r = httpx.get(f"{srv.url}/v1/usage", params={"start_time": start_time, "bucket_width": "1w"},
                      headers={"Authorization": "Bearer sk-ops"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "bucket_width"
        log = srv.log_path
    finally:
        srv.stop()
    lines = [
        json.loads(x.split("motet.requests: ", 1)[1])
        for x in log.read_text().splitlines()
        if "motet.requests: " in x
    ]
    assert len(lines) == sum(v for (_, _, f), v in sums.items() if f == "requests")
    assert {(x["tenant"], x["model"]) for x in lines} == {
        ("alice", MODEL),
        ("alice", "SmolTiny"),
        ("bob", MODEL),
    }
    assert all(x["status"] == 200 and x["ttft_s"] is not None for x in lines)
    srv = start(tiny_model_dir, tmp_path)  # the same data dir: the records survived
    try:
        assert totals(srv, start_time) == +sums
        traffic(srv, sums)
        assert totals(srv, start_time) == +sums
        # one tenant, per day, not grouped: the sums of that tenant
        r = httpx.get(f"{srv.url}/v1/usage", params={"start_time": start_time, "tenant": "bob"},
                      headers={"Authorization": "Bearer sk-ops"})  # fmt: skip
        (bucket,) = [b for b in r.json()["data"] if b["results"]]
        (res,) = bucket["results"]
        assert res["tenant"] is None and res["num_model_requests"] == sums[("bob", MODEL, "requests")]
        assert res["output_tokens"] == sums[("bob", MODEL, "output")]
    finally:
        srv.stop()


@pytest.mark.parametrize("width, seconds", [("1m", 60), ("1h", 3600), ("1d", 86400)])
def test_bucket_paging(tmp_path, width, seconds):
    from motet.api.usage import RequestUsage, UsageStore

    store = UsageStore(tmp_path)
    try:
        store.add(RequestUsage(tenant="a", model="m"), 1, 10, 2, 5)
        now = int(time.time())
        found = store.buckets(now - 3 * seconds, now + seconds, seconds, ("tenant",), None, None)
        (results,) = [r for r in found.values() if r]
        assert results == [
            {"object": "organization.usage.completions.result", "input_tokens": 10, "output_tokens": 5,
             "input_cached_tokens": 2, "num_model_requests": 1, "training_tokens": 0, "tenant": "a", "model": None,
             "batch": None}
        ]  # fmt: skip
    finally:
        store.close()
