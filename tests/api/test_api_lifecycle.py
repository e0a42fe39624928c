"""Overload (429 + Retry-After) and graceful shutdown (SIGTERM drains) against a real `motet serve`.

One small-limits server for the module; the shutdown test runs last and ends it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.api.test_api import MODEL
from tests.live_server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    srv = Server(
        tmp_path_factory.mktemp("lifecycle"),
        "--max-num-seqs", "2", "--max-waiting", "1", "--max-queue-len", "2", "--drain-timeout", "120",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_overload_gets_429_and_accepted_requests_complete(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(c.post("/v1/completions", json={**body, "prompt": f"Request {i}:"}) for i in range(16))
            )

    with_timeout = asyncio.wait_for(run(), 600)
    responses = asyncio.run(with_timeout)
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 3, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    m = server.metrics()
    assert m['motet_requests_total{endpoint="/v1/completions",status="429"}'] == codes.count(429)
    assert m["motet_num_requests_running"] == 0 and m["motet_queue_depth"] == 0


def test_sigterm_drains_in_flight_and_refuses_new(server):
    max_tokens = 96  # long enough that the streams are still running after SIGTERM (the step is fast)

    async def stream(c, i, started):
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        tokens, done = 0, False
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    started.set()
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens, done

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            started = asyncio.Event()
            streams = [asyncio.create_task(stream(c, i, started)) for i in range(2)]
            await started.wait()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = []
            while server.proc.poll() is None and not all(s.done() for s in streams):
                try:
                    r = await c.post(
                        "/v1/completions", json={"model": MODEL, "prompt": "new", "max_tokens": 2}
                    )
                    h = await c.get("/health")
                except httpx.TransportError:
                    break
                refused.append((r.status_code, h.status_code))
                await asyncio.sleep(0.2)
            return await asyncio.gather(*streams), refused

    results, refused = asyncio.run(asyncio.wait_for(run(), 600))
    assert refused and all(codes == (503, 503) for codes in refused), refused
    for tokens, done in results:
        assert done and tokens == max_tokens  # in-flight requests ran to completion
    t0 = time.monotonic()
    assert server.proc.wait(60) == 0
    assert time.monotonic() - t0 < 60
