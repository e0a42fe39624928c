"""Soak: three tenants hammer a real `motet serve` (tiny model, loopback) with mixed requests (chat and
completions, streamed or not, their own adapters or the base model, JSON-schema constrained or free, n up to
3) and random disconnects: clients that leave mid-stream, and clients that time out while queued or running.

Throughout, /health answers 200; afterwards everything returns to idle: nothing queued, waiting or running,
no KV block in use, no adapter pinned; and the server still answers.
"""

from __future__ import annotations

import random
import time

import anyio
import httpx
import pytest

from tests.live_server import Server, keys_file
from tests.peft_adapters import make_adapter

pytestmark = pytest.mark.smoke  # CI's command runs it (scripts/test.sh); a plain pytest leaves it out

KEYS = {"sk-a": "alice", "sk-b": "bob", "sk-c": "carol"}
ADMIN_KEY = "sk-admin"  # reads /metrics
MODEL = "tiny"
REQUESTS, CONCURRENCY = 300, 24
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("soak")
    keys = keys_file(tmp, {**KEYS, ADMIN_KEY: {"admin": True}})
    srv = Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys,
        "--data-dir", str(tmp / "data"), "--threads", "1", "--max-model-len", "256", "--max-num-seqs", "8",
        "--max-queue-len", "24", "--max-waiting", "4", "--max-loras", "2",
        start_timeout=120,
    )  # fmt: skip
    for key, seed in (("sk-a", 1), ("sk-b", 2)):
        path = make_adapter(tiny_model_dir, tmp / f"adapter-{seed}", seed)
        files = [
            ("files", (f, (path / f).read_bytes()))
            for f in ("adapter_config.json", "adapter_model.safetensors")
        ]
        r = httpx.post(
            f"{srv.url}/v1/adapters",
            data={"name": "mine"},
            files=files,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
    yield srv
    srv.stop()


def metrics(url: str) -> dict[str, float]:
    out = {}
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    r.raise_for_status()
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def request_plan(rng: random.Random) -> dict:
    key = rng.choice(list(KEYS))
    model = "mine" if key != "sk-c" and rng.random() < 0.6 else MODEL
    chat = rng.random() < 0.6
    body: dict = {"model": model, "max_tokens": rng.randint(4, 96), "n": rng.randint(1, 3)}
    body["temperature"] = rng.choice([0, 0.8])
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "The quick brown fox", "Paris?"])}]
        if rng.random() < 0.3:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    else:
        body["prompt"] = rng.choice(["The quick", "def add(a, b):", [5, 6, 7, 8]])
    body["stream"] = rng.random() < 0.5
    leave = rng.choice(["stay", "stay", "mid-stream", "timeout"])
    return {
        "key": key,
        "path": "/v1/chat/completions" if chat else "/v1/completions",
        "body": body,
        "leave": leave,
    }


async def one_request(client: httpx.AsyncClient, plan: dict, rng: random.Random, statuses: list) -> None:
    headers = {"Authorization": f"Bearer {plan['key']}"}
    timeout = rng.uniform(0.02, 0.5) if plan["leave"] == "timeout" else 120
    try:
        with anyio.fail_after(timeout):
            if plan["body"]["stream"]:
                async with client.stream("POST", plan["path"], json=plan["body"], headers=headers) as r:
                    statuses.append(r.status_code)
                    chunks = 0
                    async for _ in r.aiter_lines():
                        chunks += 1
                        if plan["leave"] == "mid-stream" and chunks >= 2:
                            return  # closes the connection: the server must abort the rest
            else:
                r = await client.post(plan["path"], json=plan["body"], headers=headers)
                statuses.append(r.status_code)
    except TimeoutError:
        statuses.append("left")


def test_mixed_tenants_with_disconnects_return_to_idle(server):
    rng = random.Random(13)
    plans = [request_plan(rng) for _ in range(REQUESTS)]
    statuses: list = []
    health: list[int] = []

    async def main():
        limiter = anyio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            done = anyio.Event()

            async def watch_health():
                while not done.is_set():
                    health.append((await client.get("/health")).status_code)
                    await anyio.sleep(0.1)

            async def run(plan, seed):
                async with limiter:
                    await one_request(client, plan, random.Random(seed), statuses)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_health)
                async with anyio.create_task_group() as requests:
                    for i, plan in enumerate(plans):
                        requests.start_soon(run, plan, i)
                done.set()

    anyio.run(main)
    assert health and set(health) == {200}, f"/health answered {sorted(set(health))}"
    unexpected = [s for s in statuses if s not in (200, 429, "left")]
    assert not unexpected, f"{unexpected}; server log: {server.log_path}"
    assert statuses.count(200) > REQUESTS // 3

    # Back to idle: the queues, the engine, the KV cache and the adapter pins.
    idle = {
        "motet_queue_depth": 0,
        "motet_num_requests_waiting": 0,
        "motet_num_requests_running": 0,
        "motet_kv_blocks_used": 0,
        "motet_lora_adapters_pinned": 0,
    }
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server.url)
        now = {k: m[k] for k in idle}
        if now == idle:
            break
        assert time.monotonic() < deadline, f"not idle after 30 s: {now}"
        time.sleep(0.2)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "mine", "prompt": "The quick", "max_tokens": 4},
        headers={"Authorization": "Bearer sk-a"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
