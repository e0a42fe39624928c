"""Per-tenant limits from the API keys file (concurrent requests, requests and tokens per minute): OpenAI's
`x-ratelimit-*` headers on every answer, 429 + Retry-After past a limit, other tenants untouched, and the keys
file reloaded on SIGHUP. The buckets with a fake clock, then a real `motet serve` (tiny model) driven by the
openai SDK (`with_raw_response`, as OpenAI's users read the headers); its last test ends that server with SIGTERM
after a storm of SIGHUPs."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import signal
import threading
import time

import anyio
import httpx
import openai
import pytest

from motet.api.auth import TenantLimits
from motet.api.errors import APIError
from motet.api.rate_limits import DEFAULT_TOKEN_S, RateLimiter, duration
from tests.clock import Clock
from tests.live_server import Server, keys_file

MODEL = "tiny"


def test_buckets_refill_continuously_and_say_when_to_come_back():
    clock = Clock(100.0)
    lim = RateLimiter({"a": TenantLimits(rpm=2, tpm=100)}, clock=clock)
    h = lim.admit("a")
    assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "1"
    assert h["x-ratelimit-reset-requests"] == "30s" and h["x-ratelimit-remaining-tokens"] == "100"
    lim.release("a")
    lim.charge("a", 130)  # a request may take the tokens below zero ...
    with pytest.raises(APIError) as e:
        lim.admit("a")  # ... and the next waits for the refill
    assert (
        e.value.status == 429
        and e.value.code == "rate_limit_exceeded"
        and "tokens per minute" in e.value.message
    )
    assert e.value.headers["Retry-After"] == str(round((30 + 1) * 60 / 100))  # back above zero
    clock.now += 19  # +31.67 tokens: 1.67 left
    h = lim.admit("a")
    assert h["x-ratelimit-remaining-requests"] == "0" and h["x-ratelimit-remaining-tokens"] == "1"
    lim.release("a")
    with pytest.raises(APIError, match="requests per minute"):
        lim.admit("a")
    assert lim.admit("b") == {}  # no limits: no headers, never refused


def test_concurrency_and_reload_keep_what_was_used():
    clock = Clock(100.0)
    lim = RateLimiter({"a": TenantLimits(max_concurrent=1, rpm=10)}, clock=clock)
    lim.admit("a")
    with pytest.raises(APIError, match=r"concurrent requests \(1\)"):
        lim.admit("a")
    lim.release("a")
    lim.admit("a")
    lim.release("a")  # 2 of 10 used
    lim.reload({"a": TenantLimits(rpm=4)})
    assert lim.admit("a")["x-ratelimit-remaining-requests"] == "1"  # 4 - 2 used - this one
    lim.release("a")
    assert duration(0.02) == "20ms" and duration(1) == "1s" and duration(360) == "6m0s"


def test_reservations_settle_to_what_was_used_and_a_request_larger_than_the_minute_is_refused_for_good():
    clock = Clock(100.0)
    lim = RateLimiter({"a": TenantLimits(tpm=1000)}, clock=clock)
    first = lim.enter("a")
    first.reserve(600)  # its prompt and n x max_tokens
    assert lim.headers("a")["x-ratelimit-remaining-tokens"] == "400"
    first.settle(250)  # it used less: the rest goes back
    first.leave()
    second = lim.enter("a")
    with pytest.raises(APIError, match=r"may use 800 tokens .*, 750 are left") as e:
        second.reserve(800)
    assert e.value.headers["Retry-After"] == "3"  # 50 more tokens: 3 s at 1000 a minute
    clock.now += 15  # the bucket is full again
    # Issue 57, finding 3: a full bucket let in a request of any size (an n = 8 request took 2.8-3.4x the minute).
    # One larger than the whole minute never fits: OpenAI's "request too large", not to be retried.
    with pytest.raises(APIError, match=r"limit 1000, requested 5000.*Lower max_tokens") as e:
        second.reserve(5000, lower=lambda limit: (f"Lower max_tokens (at most {limit - 200}).", "max_tokens"))
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded" and e.value.param == "max_tokens"
    assert e.value.headers["x-should-retry"] == "false" and "Retry-After" not in e.value.headers
    second.reserve(1000)  # the whole minute fits
    assert lim.headers("a")["x-ratelimit-remaining-tokens"] == "0"
    second.settle(900)
    second.leave()


def test_a_place_frees_when_the_running_requests_tokens_left_are_made():
    """Issue 57, finding 2: a fresh tenant's burst was told `Retry-After: 1` (no history yet, no token yet), and
    with history the tenant's typical duration, 24 s for a request that ended 0.7 s later. The estimate is the
    running request's tokens left (max_tokens less what it made) at the engine's current time per token."""
    clock = Clock(100.0)
    lim = RateLimiter({"b": TenantLimits(max_concurrent=1)}, clock=clock)
    made = [0]
    running = lim.enter("b")
    with pytest.raises(APIError, match=r"concurrent requests \(1\)") as e:
        lim.enter("b")  # its size is not read yet: ask again in a second
    assert e.value.headers["Retry-After"] == "1"
    running.expect(1000)  # the route has read its max_tokens
    with pytest.raises(APIError) as e:
        lim.enter("b", lambda: 0.02)  # no token yet: 1000 tokens at 20 ms
    assert e.value.headers["Retry-After"] == "20"
    running.reserve(0, max_tokens=1000, progress=lambda: made[0])
    made[0] = 400
    with pytest.raises(APIError) as e:
        lim.enter("b", lambda: 0.02)
    assert e.value.headers["Retry-After"] == "12"  # 600 left
    with pytest.raises(APIError) as e:
        lim.enter("b", lambda: 0.2)  # the engine slowed down: 120 s, a client is told 60 at most
    assert e.value.headers["Retry-After"] == "60"
    with pytest.raises(APIError) as e:
        lim.enter("b")  # no step timed yet: DEFAULT_TOKEN_S a token (60 s at most)
    assert e.value.headers["Retry-After"] == str(min(60, math.ceil(600 * DEFAULT_TOKEN_S)))
    clock.now += 100
    running.leave()
    running = lim.enter("b")  # what the tenant's requests took before counts for nothing now
    running.reserve(0, max_tokens=64, progress=lambda: 30)
    with pytest.raises(APIError) as e:
        lim.enter("b", lambda: 0.02)
    assert e.value.headers["Retry-After"] == "1"  # 34 tokens at 20 ms: 0.68 s
    running.leave()


class LinedUp:
    """`RateLimits` in front of an app that holds each request it is given until the test lets it answer; each
    request's client sends its body, then waits (or leaves when told to)."""

    def __init__(self, limiter: RateLimiter):
        from types import SimpleNamespace

        from motet.api.rate_limits import RateLimits

        self.limiter = limiter
        state = SimpleNamespace(
            auth=SimpleNamespace(tenant=lambda authorization: authorization.removeprefix("Bearer ")),
            system=SimpleNamespace(stats=lambda: SimpleNamespace(token_s=0.02)),
        )
        self.middleware = RateLimits(self.app, state, limiter)
        self.bodies: list[bytes] = []  # what the app read, in the order it was let in
        self.answer: dict[bytes, anyio.Event] = {}
        self.statuses: dict[bytes, int] = {}
        self.headers: dict[bytes, dict] = {}

    async def app(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await self.answer.setdefault(body, anyio.Event()).wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def request(self, tenant: str, body: bytes, leave: anyio.Event | None = None) -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"authorization", f"Bearer {tenant}".encode())]}  # fmt: skip
        chunks = [{"type": "http.request", "body": body[:3], "more_body": True},
                  {"type": "http.request", "body": body[3:], "more_body": False}]  # fmt: skip

        async def receive():
            if chunks:
                return chunks.pop(0)
            await (leave or anyio.Event()).wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                self.statuses[body] = message["status"]
                self.headers[body] = {k.decode(): v.decode() for k, v in message["headers"]}

        await self.middleware(scope, receive, send)


def test_requests_over_the_concurrency_limit_wait_in_line_and_are_let_in_as_places_free():
    """Issue 68, finding 15: a request over its tenant's concurrency limit was answered 429 at once, so a client's
    concurrent calls came back on Retry-After estimates (and the SDK's 2 retries ran out). Now it waits in the
    tenant's line, first come first served, and holds nothing meanwhile: the app (the route) has not seen it. Its
    body reaches the app whole once it is let in; the line is bounded (LINE_PER_PLACE a place: the next one is
    429 at once), a client that leaves frees its place in line, and a wait past `wait_s` is a 429 saying when a
    place frees. Another tenant never waits."""
    from motet.api.rate_limits import LINE_PER_PLACE

    async def main():
        limiter = RateLimiter({"t": TenantLimits(max_concurrent=1)})  # the server's default wait
        lined = LinedUp(limiter)
        leaves = anyio.Event()
        bodies = [f"body {i}".encode() for i in range(LINE_PER_PLACE + 1)]
        running, waiting, refused = bodies[0], bodies[1:LINE_PER_PLACE], bodies[LINE_PER_PLACE]
        line = limiter._usage.get  # (the tenant's usage once it has one)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lined.request, "t", running)
            await wait_until(lambda: lined.bodies == [running])
            tg.start_soon(lined.request, "t", waiting[0])
            await wait_until(lambda: waiting[0] in lined.statuses or len(getattr(line("t"), "line", ())) == 1)
            assert waiting[0] not in lined.statuses  # not answered (it was: 429 at once): it waits
            tg.start_soon(lined.request, "t", b"leaves", leaves)
            await wait_until(lambda: len(line("t").line) == 2)
            for n, body in enumerate(waiting[1:], start=3):
                tg.start_soon(lined.request, "t", body)
                await wait_until(lambda n=n: len(line("t").line) == n)
            assert len(line("t").line) == LINE_PER_PLACE and lined.bodies == [running]
            await lined.request("t", refused)  # the line is full: refused at once
            assert lined.statuses[refused] == 429 and int(lined.headers[refused]["retry-after"]) >= 1
            lined.answer[b"other"] = anyio.Event()
            lined.answer[b"other"].set()
            await lined.request("u", b"other")  # another tenant: no limits, no wait
            assert lined.statuses[b"other"] == 200
            leaves.set()  # a client in line leaves: its place in line is freed, the app never sees it
            await wait_until(lambda: len(line("t").line) == LINE_PER_PLACE - 1)
            for n, body in enumerate([running, *waiting], start=3):  # each answer lets the next in, in order
                lined.answer.setdefault(body, anyio.Event()).set()
                await wait_until(lambda n=n: len(lined.bodies) == min(n, LINE_PER_PLACE + 1))
        assert lined.bodies == [running, b"other", *waiting]
        assert all(lined.statuses[b] == 200 for b in [running, *waiting])
        assert b"leaves" not in lined.statuses and not line("t").running and not line("t").line

        limiter.wait_s = 0.2  # a wait past its bound: 429, with when the running request is estimated to end
        holder = anyio.Event()
        async with anyio.create_task_group() as tg:
            lined.answer[b"holder"] = holder
            tg.start_soon(lined.request, "t", b"holder")
            await wait_until(lambda: limiter._usage["t"].running)
            limiter._usage["t"].running[0].expect(100)  # 100 tokens at 20 ms
            await lined.request("t", b"too late")
            holder.set()
        assert lined.statuses[b"too late"] == 429 and lined.headers[b"too late"]["retry-after"] == "2"
        assert b"too late" not in lined.bodies and not limiter._usage["t"].line

        limiter.wait_s = 60  # the server drains: those in line go on to the app (its 503 while draining)
        async with anyio.create_task_group() as tg:
            lined.answer[b"holder 2"], lined.answer[b"in line"] = anyio.Event(), anyio.Event()
            tg.start_soon(lined.request, "t", b"holder 2")
            await wait_until(lambda: limiter._usage["t"].running)
            tg.start_soon(lined.request, "t", b"in line")
            await wait_until(lambda: limiter._usage["t"].line)
            limiter.close_lines()
            await wait_until(lambda: b"in line" in lined.bodies)
            lined.answer[b"holder 2"].set()
            lined.answer[b"in line"].set()

    anyio.run(main)


async def wait_until(condition) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.001)


KEYS = {
    "sk-alice": {"tenant": "alice", "limits": {"requests_per_minute": 3}},
    "sk-carol": {"tenant": "carol", "limits": {"max_concurrent_requests": 1}},
    "sk-dave": {"tenant": "dave", "limits": {"tokens_per_minute": 60}},
    "sk-bob": "bob",
    "sk-gus": {"tenant": "gus", "limits": {"max_concurrent_requests": 2, "requests_per_minute": 100000}},
    "sk-frank": {"tenant": "frank", "limits": {"max_concurrent_requests": 1}},
}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    srv = Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", str(keys),
        "--data-dir", str(tmp / "data"), "--threads", "1", "--max-model-len", "4096",
        "--tenant-wait-timeout", "0",  # no line: a request over the concurrency limit is refused at once
        start_timeout=120,
    )  # fmt: skip
    yield srv, keys
    srv.stop()


def sdk(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(client: openai.OpenAI, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    return client.chat.completions.with_raw_response.create(**body)


def test_requests_per_minute_with_openais_headers(served):
    srv, _ = served
    alice, bob = sdk(srv, "sk-alice"), sdk(srv, "sk-bob")
    for remaining in (2, 1, 0):
        raw = ask(alice)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(remaining)
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
        assert raw.parse().choices[0].message is not None
    with pytest.raises(openai.RateLimitError) as e:
        ask(alice)
    assert (
        e.value.body["code"] == "rate_limit_exceeded" and "requests per minute (3)" in e.value.body["message"]
    )
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 20  # a request back every 20 s
    assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    for _ in range(5):  # another tenant: untouched, and without limits no headers
        raw = ask(bob)
        assert raw.http_response.status_code == 200 and "x-ratelimit-limit-requests" not in raw.headers
    # the same limit on the completions and responses routes
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                   headers={"Authorization": "Bearer sk-alice"})  # fmt: skip
    assert r.status_code == 429 and r.headers["retry-after"]


def test_concurrent_requests(served):
    srv, _ = served
    carol = sdk(srv, "sk-carol")
    started, done = threading.Event(), threading.Event()

    def hold():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer sk-carol"}, timeout=120) as s:  # fmt: skip
            assert s.status_code == 200
            lines = s.iter_lines()
            next(lines)
            started.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert started.wait(60)
        with pytest.raises(openai.RateLimitError, match=r"concurrent requests \(1\)"):
            ask(carol)
    finally:
        done.set()
        t.join(60)
    deadline = time.monotonic() + 30  # the stream's end freed its place
    while True:
        try:
            assert ask(carol).http_response.status_code == 200
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_tokens_per_minute_count_the_tokens_used(served):
    srv, _ = served
    dave = sdk(srv, "sk-dave")
    raw = ask(dave, max_tokens=40, extra_body={"ignore_eos": True})
    used = raw.parse().usage.total_tokens
    assert used > 40
    assert raw.headers["x-ratelimit-limit-tokens"] == "60"  # as the answer starts, its tokens are spent
    assert 60 - used <= int(raw.headers["x-ratelimit-remaining-tokens"]) <= 60 - used + 5  # (1 a second back)
    # the next answer sees them spent (a little refilled meanwhile), or is refused until they come back
    try:
        raw = ask(dave, max_tokens=1)
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 60 - used + 10
    except openai.RateLimitError as e:
        assert "tokens per minute (60)" in e.body["message"]


def test_sighup_reloads_the_keys_file(served):
    srv, keys = served
    keys.write_text(json.dumps({**KEYS, "sk-alice": {"tenant": "alice", "limits": {"requests_per_minute": 100}},
                                "sk-erin": "erin"}))  # fmt: skip
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-erin"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})  # fmt: skip
        if r.status_code == 200:
            break
        assert r.status_code == 401 and time.monotonic() < deadline
        time.sleep(0.2)
    raw = ask(sdk(srv, "sk-alice"))  # alice's limit raised; what she used stays used
    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    keys.write_text("{not json")  # a broken file: the running keys stay
    srv.proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert ask(sdk(srv, "sk-erin")).http_response.status_code == 200
    assert "were not reloaded" in srv.log_path.read_text()


def test_a_keys_file_that_is_a_fifo_is_refused_and_a_later_sighup_revokes_a_key(served):
    """Issue 57: a SIGHUP whose reload did not return (the keys path a FIFO: opening it waits for a writer)
    wedged the server's loop, so a later reload revoking a key never applied. A FIFO is refused (logged), and
    the next SIGHUP's file applies: bob's removed key is answered 401."""
    srv, keys = served
    assert ask(sdk(srv, "sk-bob")).http_response.status_code == 200
    keys.unlink()
    os.mkfifo(keys)
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "not a regular file (a FIFO)" not in srv.log_path.read_text():
        assert time.monotonic() < deadline, "the FIFO's refusal was not logged"
        time.sleep(0.2)
    assert ask(sdk(srv, "sk-bob")).http_response.status_code == 200  # the running keys stay
    keys.unlink()
    keys.write_text(json.dumps({k: v for k, v in KEYS.items() if k != "sk-bob"}))
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while True:
        try:
            ask(sdk(srv, "sk-bob"))
        except openai.AuthenticationError:
            break
        assert time.monotonic() < deadline, "the revoking reload never applied"
        time.sleep(0.2)
    keys.write_text(json.dumps(KEYS))  # (bob back for the module's next tests)
    srv.proc.send_signal(signal.SIGHUP)


def test_a_reload_that_never_returns_never_holds_the_loop():
    """Issue 57: the server's tick awaited the reload's thread, so a read that never returned (a hung mount)
    stopped the loop: no later reload, and SIGTERM ignored. Now each tick returns at once; a read past its
    deadline is logged and dropped (what it reads later is never applied), and the next SIGHUP's read applies."""
    import logging
    from types import SimpleNamespace

    import anyio
    import uvicorn

    from motet.api.draining import DrainingServer

    hung = threading.Event()
    reads = iter([lambda: hung.wait() and "the hung read's keys", lambda: "the revoking keys"])
    applied: list[str] = []
    server = DrainingServer(
        uvicorn.Config(app=None), SimpleNamespace(draining=False, inflight=0, fatal=None), 1
    )
    before = signal.getsignal(signal.SIGHUP)
    try:
        server.reload_on_sighup(lambda: next(reads)(), applied.append)
    finally:
        signal.signal(signal.SIGHUP, before)
    server.reload_deadline_s = 0.5
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("motet.server").addHandler(handler)

    async def ticks():
        with anyio.fail_after(20):  # every tick returns; the revoking reload applies past the hung one
            server.reload_requested = True  # (what SIGHUP's handler does)
            assert await server.on_tick(1) is False
            server.reload_requested = True  # a later SIGHUP, while the first read hangs
            while applied != ["the revoking keys"]:
                assert await server.on_tick(1) is False
                await anyio.sleep(0.05)
            server.should_exit = True  # SIGTERM still ends the server
            assert await server.on_tick(1) is True
            hung.set()  # the hung read returns at last: dropped
            await anyio.sleep(0.2)
            await server.on_tick(1)
        assert applied == ["the revoking keys"]

    try:
        anyio.run(ticks)
    finally:
        hung.set()
        logging.getLogger("motet.server").removeHandler(handler)
    assert any("did not return within 0.5 s" in r.getMessage() for r in records)


def stream_tokens(srv, key: str, max_tokens: int, first_token: threading.Event | None = None) -> list[float]:
    """Streams a chat of `max_tokens` tokens; the times its tokens came (`first_token` is set at the first)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120) as s:  # fmt: skip
        assert s.status_code == 200
        for line in s.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                times.append(time.monotonic())
                if first_token is not None:
                    first_token.set()
    return times


def test_a_request_over_the_concurrency_limit_gets_in_by_the_sdks_own_retries(served):
    """Issue 48, finding 3: the concurrency limit answered `Retry-After: 1` however long the place stayed taken,
    so the SDK's 2 retries gave up after ~2 s. Its Retry-After now estimates when the running request ends: a
    request while another holds carol's one place for ~3 s gets in with the SDK's default retries."""
    srv, _ = served
    times = stream_tokens(srv, "sk-carol", 48)  # how fast this machine streams: the holder runs ~3 s here
    hold_tokens = min(4000, max(48, round(3.0 * (len(times) - 1) / (times[-1] - times[0]))))
    running = threading.Event()
    holder = threading.Thread(target=stream_tokens, args=(srv, "sk-carol", hold_tokens, running))
    holder.start()
    try:
        assert running.wait(60)
        default_retries = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-carol", timeout=120)
        raw = ask(default_retries)
        assert raw.http_response.status_code == 200 and raw.parse().choices[0].message is not None
        assert raw.retries_taken >= 1  # refused at first: the place was taken
    finally:
        holder.join(120)


def test_three_concurrent_calls_of_a_tenant_limited_to_one_all_succeed_with_the_sdks_defaults(
    tiny_model_dir, tmp_path
):
    """Issue 68, finding 15: a tenant limited to one concurrent request, 3 concurrent calls of the openai SDK with
    its default retries (2, honouring Retry-After): one failed. The two refused calls were told the running one's
    estimated end (7 s) and came back together; one got in, the other was told the next one's (16 s, then 20 s:
    an estimate, a little short as the steps slow with the context) and ran out of retries. Now the calls over the
    limit wait in the tenant's line (the server's defaults) and are let in as places free, one at a time. The first
    call streams and has made tokens (the server has timed its steps) when the other two come."""
    keys = keys_file(tmp_path, {"sk-carol": {"tenant": "carol", "limits": {"max_concurrent_requests": 1}}})
    srv = Server(
        tmp_path, "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys,
        "--data-dir", str(tmp_path / "data"), "--threads", "1", "--max-model-len", "4096", start_timeout=120,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-carol", timeout=300)  # default retries
        assert client.max_retries == 2
        body = {"model": MODEL, "max_tokens": 2000, "extra_body": {"ignore_eos": True}}
        running = threading.Event()

        def streamed() -> int:
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": "hi 0"}], stream=True,
                stream_options={"include_usage": True}, **body,
            )  # fmt: skip
            for n, chunk in enumerate(stream):
                if n == 50:
                    running.set()
                if chunk.usage is not None:
                    return chunk.usage.completion_tokens
            return 0

        def call(i: int) -> int:
            reply = client.chat.completions.create(messages=[{"role": "user", "content": f"hi {i}"}], **body)
            return reply.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(streamed)
            assert running.wait(120)
            others = [pool.submit(call, i) for i in (1, 2)]
            made = [first.result(), *(f.result() for f in others)]  # raises a call's error, if one failed
        assert made == [2000] * 3
        log = srv.log_path.read_text()
        assert log.count('"POST /v1/chat/completions HTTP/1.1" 200') == 3, log[-2000:]
    finally:
        srv.stop()


def test_retry_after_is_the_running_requests_tokens_left_at_the_servers_pace(served):
    """Issue 57, finding 2: a fresh tenant limited to one request was told `Retry-After: 1` on its first burst while
    its running request had no token yet and took 98 s (the SDK's retries gave up after 2 s): before a first token
    the estimate came from how long the tenant's past requests took, and it had none. The running request here has
    a ~2,000-token prompt (8 steps before its first token) and the rest of the context to make, after another
    tenant's request of the same size (the server's recent steps). The reference: its tokens at the server's time
    per token, measured on its own stream after the refusal."""
    srv, _ = served

    def chat(key: str, text: str, max_tokens: int):
        return sdk(srv, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text * 666}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip

    *_, last = chat(
        "sk-bob", "ho ", 100
    )  # (the tiny model's steps slow down as its context grows: the same size)
    max_tokens = 4096 - last.usage.prompt_tokens
    stream = chat("sk-frank", "hi ", max_tokens)
    chunks = iter(stream)
    next(chunks)  # the answer has started (its role; no token yet): the request holds frank's one place
    with pytest.raises(openai.RateLimitError, match=r"concurrent requests \(1\)") as e:
        ask(sdk(srv, "sk-frank"))
    retry_after = int(e.value.response.headers["retry-after"])
    arrivals, tokens = [], 0  # the server's pace: the running request's tokens as they come
    for chunk in chunks:
        if got := sum(len(c.token_ids or []) for c in chunk.choices):
            arrivals.append((time.monotonic(), got))
            tokens += got
            if tokens >= 300:
                break
    stream.close()
    seconds_per_token = (arrivals[-1][0] - arrivals[0][0]) / (tokens - arrivals[0][1])
    reference = min(60, max_tokens * seconds_per_token)
    # Within a factor of 4 (the finding was off by 98x): the server's pace moves with what the suite's other worker
    # runs beside it, between the steps the estimate read and the ones the reference times (3.2x seen in a full run).
    assert reference / 4 <= retry_after <= 4 * reference + 1, (retry_after, reference)


def test_sighup_storm_while_requests_are_admitted_then_sigterm(served):
    """Issue 48, finding 1: the SIGHUP handler reloaded the keys itself, inside whatever the main thread was
    doing: within the limiter's lock (a deadlock: SIGTERM ignored for good) or within the previous handler
    (RecursionError in requests). 100 SIGHUPs 3 ms apart, then 100 100 ms apart (the issue's two rates), while 4 clients flood a limited
    tenant: /health answers throughout, every request is answered 200 or 429, and SIGTERM ends the server.
    The module's last test: it stops the module's server."""
    srv, keys = served
    keys.write_text(json.dumps(KEYS))
    stop = threading.Event()
    statuses: list[int | str] = []
    health: list[int | str] = []

    def flood():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        with srv.client("sk-gus") as client:
            while not stop.is_set():
                try:
                    statuses.append(client.post("/v1/chat/completions", json=body, timeout=30).status_code)
                except httpx.HTTPError as e:
                    statuses.append(repr(e))

    def poll_health():
        while not stop.is_set():
            try:
                health.append(httpx.get(f"{srv.url}/health", timeout=10).status_code)
            except httpx.HTTPError as e:
                health.append(repr(e))
            time.sleep(0.02)

    threads = [threading.Thread(target=flood) for _ in range(4)] + [threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    try:
        while len(statuses) < 8:  # the flood is on
            assert all(t.is_alive() for t in threads) and srv.proc.poll() is None
            time.sleep(0.05)
        for count, gap in ((100, 0.003), (100, 0.1)):
            for _ in range(count):
                srv.proc.send_signal(signal.SIGHUP)
                time.sleep(gap)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert statuses and set(statuses) <= {200, 429}, [s for s in statuses if s not in (200, 429)][:5]
    assert health and set(health) == {200}, [h for h in health if h != 200][:5]
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(5)  # raises if it does not end (a deadlocked server never does)
    assert "RecursionError" not in srv.log_path.read_text()
