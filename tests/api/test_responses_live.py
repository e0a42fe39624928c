"""Against a real `motet serve` subprocess on a tiny random model: a Responses conversation continued after a
restart (stored in SQLite under --data-dir) and scoped to its tenant; vLLM's load/unload_lora_adapter (from
--lora-load-dir only) and an adapter as a Responses `model`; and vLLM's metric series, scraped with
prometheus_client's parser, moving as the load does.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motet.api.responses.store import FILENAME
from tests.live_server import Server, tiny_server
from tests.peft_adapters import make_adapter

MODEL = "tiny"
KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-admin": {"admin": True}}


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses-live")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    loadable = tmp / "loadable"
    for name, seed in (("a1", 1), ("b1", 2)):
        make_adapter(tiny_model_dir, loadable / name, seed)
    make_adapter(tiny_model_dir, tmp / "outside", 3)
    os.symlink(tmp / "outside", loadable / "escape")  # inside the listed directory, pointing out of it
    return tmp


def start(tiny_model_dir, dirs: Path, data: str = "data") -> Server:
    return tiny_server(
        tiny_model_dir, dirs, "--lora-load-dir", str(dirs / "loadable"), "--max-num-seqs", "2",
        "--max-waiting", "2", "--max-loras", "1", data=data, name=MODEL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir, dirs):
    srv = start(tiny_model_dir, dirs)
    yield srv
    srv.stop()


def sdk(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def load(client: httpx.Client, name: str, path) -> httpx.Response:
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


# -- vLLM's adapter management --------------------------------------------------------------------------------
def test_load_and_unload_lora_adapter_from_listed_directories_only(server, dirs):
    alice, bob = server.client("sk-alice"), server.client("sk-bob")
    r = load(alice, "a1", dirs / "loadable" / "a1")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' added successfully."
    assert "a1" in [m["id"] for m in alice.get("/v1/models").json()["data"]]
    assert "a1" not in [m["id"] for m in bob.get("/v1/models").json()["data"]]  # alice's, not bob's

    for path, status in ((dirs / "outside", 403), (dirs / "loadable" / "escape", 403), ("/etc", 403),
                         (dirs / "loadable" / "missing", 400), ("loadable/a1", 400)):  # fmt: skip
        r = load(alice, "x", path)
        assert r.status_code == status and r.json()["error"]["param"] == "lora_path", (path, r.text)
    r = alice.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp", "load_inplace": True}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
    r = alice.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp", "base_model_name": "m"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model_name"

    assert load(bob, "tmp", dirs / "loadable" / "b1").status_code == 200  # bob's own
    r = bob.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert r.status_code == 404  # alice's adapter is not bob's to unload
    r = bob.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'tmp' removed successfully."
    assert bob.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"}).status_code == 404


def test_a_lora_adapter_as_the_responses_model(server, dirs):
    alice = sdk(server, "sk-alice")
    load(
        server.client("sk-alice"), "a1", dirs / "loadable" / "a1"
    )  # (200, or 409 if the test above loaded it)
    kw = dict(input="The quick brown fox", max_output_tokens=8, temperature=0)
    with_adapter = alice.responses.create(model="a1", **kw)
    base = alice.responses.create(model=MODEL, **kw)
    ref = alice.chat.completions.create(model="a1", messages=[{"role": "user", "content": kw["input"]}], max_tokens=8,
                                        temperature=0)  # fmt: skip
    assert with_adapter.model == "a1" and with_adapter.output_text == ref.choices[0].message.content
    assert with_adapter.output_text != base.output_text  # the adapter changes the greedy tokens
    with pytest.raises(openai.NotFoundError):
        sdk(server, "sk-bob").responses.create(model="a1", **kw)


# -- vLLM's metric series ---------------------------------------------------------------------------------------
def scrape(server: Server) -> dict:
    """The vLLM series, read with prometheus_client's parser: {name: value} and the LoRA info labels."""
    out: dict = {}
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer sk-admin"}, timeout=10)
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "vllm:lora_requests_info":
                out["lora"] = s.labels
            elif s.name.startswith("vllm:") and not s.name.endswith("_bucket"):
                out[s.name] = s.value
    return out


def test_vllm_series_move_as_the_load_does(server, dirs):
    alice, bob = server.client("sk-alice"), server.client("sk-bob")
    load(alice, "a1", dirs / "loadable" / "a1")
    assert load(bob, "b1", dirs / "loadable" / "b1").status_code == 200
    idle = scrape(server)
    assert idle["vllm:num_requests_waiting"] == idle["vllm:num_requests_running"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == 0
    assert idle["lora"]["max_lora"] == "1" and idle["lora"]["running_lora_adapters"] == ""

    n, tokens = 6, 120
    samples: list[dict] = []

    async def one(key: str, model: str, i: int) -> dict:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            body = {
                "model": model,
                "prompt": f"Request {i}:",
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]

    async def load_and_watch():
        jobs = [
            asyncio.create_task(one(*(("sk-alice", "a1") if i % 2 else ("sk-bob", "b1")), i))
            for i in range(n)
        ]
        while not all(j.done() for j in jobs):
            samples.append(await asyncio.to_thread(scrape, server))
            await asyncio.sleep(0.02)
        return [await j for j in jobs]

    usages = asyncio.run(load_and_watch())
    assert 1 <= max(s["vllm:num_requests_running"] for s in samples) <= 2  # --max-num-seqs
    assert max(s["vllm:num_requests_waiting"] for s in samples) >= 1
    assert max(s["vllm:kv_cache_usage_perc"] for s in samples) > 0
    assert all(0 <= s["vllm:kv_cache_usage_perc"] <= 1 for s in samples)
    both = [
        s["lora"]
        for s in samples
        if s["lora"]["running_lora_adapters"] and s["lora"]["waiting_lora_adapters"]
    ]
    assert both, "never saw one adapter running while the other waited"
    for labels in both:  # one device slot (--max-loras 1): one adapter runs while the other waits
        running, waiting = (
            set(labels["running_lora_adapters"].split(",")),
            set(labels["waiting_lora_adapters"].split(",")),
        )
        assert len(running) == 1 and running | waiting == {"a1", "b1"} and not running & waiting

    deadline = time.monotonic() + 30
    while (after := scrape(server))["vllm:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after["vllm:num_requests_waiting"] == after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["lora"]["running_lora_adapters"] == after["lora"]["waiting_lora_adapters"] == ""
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert after[f"{name}_count"] - idle.get(f"{name}_count", 0) == n
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == n * tokens
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        added = after[f"{name}_count"] - idle.get(f"{name}_count", 0)
        assert 0 < added <= generated - n  # one per token after each request's first delta
        assert after[f"{name}_sum"] > idle.get(f"{name}_sum", 0)


# -- conversation state across a restart ----------------------------------------------------------------------
def test_previous_response_id_after_a_restart_and_only_for_its_tenant(tiny_model_dir, dirs):
    first_server = start(tiny_model_dir, dirs, data="restart-data")
    try:
        first = sdk(first_server, "sk-alice").responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=6,
                                                              temperature=0)  # fmt: skip
    finally:
        first_server.stop()
    assert (dirs / "restart-data" / FILENAME).is_file()

    second_server = start(tiny_model_dir, dirs, data="restart-data")
    try:
        alice, bob = sdk(second_server, "sk-alice"), sdk(second_server, "sk-bob")
        assert alice.responses.retrieve(first.id).output_text == first.output_text
        second = alice.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                        max_output_tokens=6, temperature=0)  # fmt: skip
        ref = alice.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "What is my name?"}],
            max_tokens=6, temperature=0,
        )  # fmt: skip
        assert second.usage.input_tokens == ref.usage.prompt_tokens
        assert second.output_text == ref.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError):
            bob.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    finally:
        second_server.stop()
