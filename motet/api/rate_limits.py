"""Per-tenant limits at the front door, as OpenAI's API enforces them per organization: concurrent requests,
requests per minute and tokens per minute, from the API keys file (`"limits"` of a key's object).

Requests and tokens are token buckets refilled continuously (a minute's allowance per minute, at most a
minute's worth saved up). A generation request (chat, completions, responses) is let in while the tenant
has a request left, has tokens left, and runs fewer than its concurrency limit. One that finds the tenant at its
concurrency limit waits in the tenant's line, as a gateway's queue holds it, first come first served: at most
`LINE_PER_PLACE` times the limit wait, each at most `wait_s` seconds (`motet serve --tenant-wait-timeout`), and
a waiting request holds nothing of the engine's (it is not read, tokenized nor queued; the middleware reads at
most `WAIT_BODY_BYTES` of its body, to see its client leave, which frees its place in line). When a running
request ends, the first in line takes its place. Otherwise (the line full, the wait over, no requests or tokens
left) it is answered 429 `rate_limit_exceeded` with `Retry-After` before anything is queued: when the bucket has
refilled, or, for the concurrency limit, when the first of the tenant's running requests is estimated to end: the
tokens it has left (its max_tokens less those it has generated) at the engine's current time between a running
request's tokens (the mean of its last steps, motet/engine/core/latency.py's TokenPace; `DEFAULT_TOKEN_S` before
it has timed any). Nothing of the tenant's past requests goes in: what runs now says when it ends.

Tokens are reserved, then settled, as OpenAI and LiteLLM do: once a request's prompts are tokenized
(motet/api/billing.py) it reserves its prompt tokens plus n times its max_tokens (without one, the rest of the
context window). A reservation larger than the tenant's whole tokens per minute can never be let in: it is
refused at once with 429 naming the limit and what to lower (OpenAI's "request too large", with
`x-should-retry: false`, so the SDKs do not retry it). One that fits the minute but not the tokens left is
refused with 429 and `Retry-After` until they are back. When a request ends, however it ends, it is charged what
it used and the rest goes back. So a tenant's concurrent requests, `n` and requests without max_tokens stay
within the limit. Every answer of those routes to a limited tenant carries
OpenAI's headers: `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`
and the same for tokens, as of the answer's start (a stream's tokens reserved, a whole answer's charged).

`RateLimits` is an ASGI middleware that `motet serve` puts in front of the app (motet/api/server.py): the
Batch API's lines call the app from inside and are not counted (OpenAI gives batches their own limits).
The counters live in the one front process, so with Ray Serve replicas behind it (motet/cluster/) a
tenant's limit is one limit, not one per replica. `reload` swaps the limits (after SIGHUP, when the server's loop
has the keys file read again: never inside the signal handler, motet/api/draining.py) and keeps what each
tenant has used.
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from motet.api.asgi import BATCH_SCOPE_KEY, request_headers
from motet.api.auth import TenantLimits
from motet.api.errors import APIError
from motet.api.tenant_line import DEFAULT_WAIT_S, LINE_PER_PLACE

LIMITED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# An estimate further out is no better than asking again in a minute (what the SDKs wait as told, at most).
MAX_RETRY_AFTER_S = 60
# A running request's time per token before the engine has timed a step: a slow CPU step at a moderate batch
# (an estimate too long costs a client some waiting; one too short, its retries).
DEFAULT_TOKEN_S = 0.1
# Of a waiting request's body, what the line reads to see its client leave (a longer one waits unread in the socket,
# its client's leaving seen once it is let in).
WAIT_BODY_BYTES = 256 << 10


class _Bucket:
    """`per_minute` units, refilled continuously, at most `per_minute` saved up; may go below zero."""

    def __init__(self, per_minute: int, now: float):
        self.per_minute, self.level, self.at = per_minute, float(per_minute), now

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) * 60 / self.per_minute)

    def seconds_to_full(self) -> float:
        return self.seconds_until(self.per_minute)


def duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6m0s`."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    seconds = math.ceil(seconds)
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


class Ticket:
    """One running request of a limited tenant: its tokens reserved against the tokens per minute, and how far it
    has got (for when its place frees)."""

    def __init__(self, limiter: RateLimiter, tenant: str, started: float):
        self.limiter, self.tenant, self.started = limiter, tenant, started
        self.reserved = 0
        # The most tokens its longest choice may generate (None: the route has not read it yet).
        self.max_tokens: int | None = None
        self.progress: Callable[[], int] | None = None  # the tokens its longest choice has generated so far

    def expect(self, max_tokens: int) -> None:
        """Its longest choice's bound, as soon as the route has read it (before its prompt is tokenized)."""
        self.max_tokens = max_tokens

    def remaining_s(self, token_s: float) -> float | None:
        """Its estimated time left: the tokens it has left at `token_s` seconds each; None while its size is not
        known (the route has not read it yet)."""
        if self.max_tokens is None:
            return None
        done = self.progress() if self.progress is not None else 0
        return max(0, self.max_tokens - done) * token_s

    def reserve(
        self,
        tokens: int,
        max_tokens: int | None = None,
        progress: Callable[[], int] | None = None,
        lower: Callable[[int], tuple[str, str | None]] | None = None,
    ):
        self.limiter.reserve(self, tokens, max_tokens, progress, lower)

    def settle(self, used: int) -> None:
        self.limiter.settle(self, used)

    def leave(self) -> None:
        self.limiter.leave(self)


class Waiting:
    """A request in its tenant's line for a place under the concurrency limit. `let_in` is set once it has left the
    line: with its `ticket` (None: the tenant's limits were removed meanwhile), or its `error` (the 429 of the
    requests or tokens per minute it found spent when its place came)."""

    def __init__(self, tenant: str):
        self.tenant = tenant
        self.let_in = anyio.Event()
        self.ticket: Ticket | None = None
        self.error: APIError | None = None


@dataclass
class _Usage:
    running: list[Ticket] = field(default_factory=list)
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    line: deque[Waiting] = field(default_factory=deque)  # first come, first let in


_current: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("motet_rate_limit", default=None)


def current() -> Ticket | None:
    """The ticket of the request being answered; None where the limits do not count it (a tenant without limits,
    the Batch API's lines, routes without limits)."""
    return _current.get()


def _refusal(why: str, wait: float, headers: dict[str, str]) -> APIError:
    return APIError(
        429,
        f"rate limit reached for this tenant's {why}: try again in {duration(wait)} (the server's limits for its "
        "API key, in the keys file)",
        code="rate_limit_exceeded",
        headers={**headers, "Retry-After": str(max(1, math.ceil(wait)))},
    )


def _too_large(tpm: int, tokens: int, lower: str, param: str | None, headers: dict[str, str]) -> APIError:
    """OpenAI's "request too large": a request that can never fit the tenant's tokens per minute; retrying does
    not help (`x-should-retry`, which the openai SDKs obey)."""
    return APIError(
        429,
        f"request too large for this tenant's tokens per minute: limit {tpm}, requested {tokens} (its prompt and "
        f"n times its max_tokens). {lower}",
        code="rate_limit_exceeded",
        param=param,
        headers={**headers, "x-should-retry": "false"},
    )


class RateLimiter:
    def __init__(
        self,
        limits: dict[str, TenantLimits] | None = None,
        clock=time.monotonic,
        wait_s: float = DEFAULT_WAIT_S,
    ):
        self.limits = dict(limits or {})
        self.clock = clock
        self.wait_s = wait_s  # how long a request over the concurrency limit waits in line (0: no line)
        self.lines_closed = False  # the server drains: no request waits in line
        self._usage: dict[str, _Usage] = {}
        self._lock = (
            threading.Lock()
        )  # the event loop's calls, and `reload` from the thread that reads the file

    def reload(self, limits: dict[str, TenantLimits]) -> None:
        with self._lock:
            self.limits = dict(limits)
            self._usage = {t: u for t, u in self._usage.items() if t in self.limits or u.running or u.line}
            for tenant, u in self._usage.items():  # new sizes; what was used stays used
                lim = self.limits.get(tenant, TenantLimits())
                u.requests = self._resized(u.requests, lim.rpm)
                u.tokens = self._resized(u.tokens, lim.tpm)
                self._let_in(tenant, u)  # a larger limit, or none: places for those in line

    def _resized(self, bucket: _Bucket | None, per_minute: int | None) -> _Bucket | None:
        if per_minute is None:
            return None
        now = self.clock()
        if bucket is None:
            return _Bucket(per_minute, now)
        bucket.refill(now)
        used = bucket.per_minute - bucket.level
        bucket.per_minute, bucket.level = per_minute, per_minute - used
        return bucket

    def _usage_of(self, tenant: str, lim: TenantLimits, now: float) -> _Usage:
        u = self._usage.get(tenant)
        if u is None:
            u = self._usage[tenant] = _Usage(
                requests=_Bucket(lim.rpm, now) if lim.rpm else None,
                tokens=_Bucket(lim.tpm, now) if lim.tpm else None,
            )
        for bucket in (u.requests, u.tokens):
            if bucket is not None:
                bucket.refill(now)
        return u

    def enter(
        self, tenant: str, token_s: Callable[[], float | None] = lambda: None, line: bool = False
    ) -> Ticket | Waiting | None:
        """Let one request of `tenant` in: its ticket (None: the tenant has no limits), or a 429 APIError that
        carries the headers. `token_s`: the engine's current seconds per token of a running request (None or 0:
        not timed yet), read only to say when a place frees. `line`: a request over the concurrency limit may
        wait for a place (on the event loop): its place in the tenant's line, while the line has room."""
        with self._lock:
            lim = self.limits.get(tenant)
            if lim is None:
                return None
            now = self.clock()
            u = self._usage_of(tenant, lim, now)
            why, wait = self._spent(u, lim)
            if (
                why is None
                and lim.max_concurrent is not None
                and (len(u.running) >= lim.max_concurrent or u.line)
            ):
                if (
                    line
                    and self.wait_s > 0
                    and not self.lines_closed
                    and len(u.line) < LINE_PER_PLACE * lim.max_concurrent
                ):
                    u.line.append(waiting := Waiting(tenant))
                    return waiting
                why, wait = f"concurrent requests ({lim.max_concurrent})", self._place_frees_in(u, token_s())
            if why is None:
                return self._admit(tenant, u, now)
            headers = self._headers(u)
        raise _refusal(why, wait, headers)

    @staticmethod
    def _spent(u: _Usage, lim: TenantLimits) -> tuple[str | None, float]:
        """The tenant's requests or tokens per minute, where one is spent: which, and when it is back."""
        if u.requests is not None and u.requests.level < 1:
            return f"requests per minute ({lim.rpm})", u.requests.seconds_until(1)
        if u.tokens is not None and u.tokens.level <= 0:
            return f"tokens per minute ({lim.tpm})", u.tokens.seconds_until(1)
        return None, 0.0

    def _admit(self, tenant: str, u: _Usage, now: float) -> Ticket:
        if u.requests is not None:
            u.requests.level -= 1
        ticket = Ticket(self, tenant, now)
        u.running.append(ticket)
        return ticket

    def _let_in(self, tenant: str, u: _Usage) -> None:
        """Those first in the tenant's line, while it has places (under the lock)."""
        lim = self.limits.get(tenant)
        while u.line and (lim is None or lim.max_concurrent is None or len(u.running) < lim.max_concurrent):
            waiting = u.line.popleft()
            if lim is not None:
                now = self.clock()
                u = self._usage_of(tenant, lim, now)
                why, wait = self._spent(u, lim)
                if why is None:
                    waiting.ticket = self._admit(tenant, u, now)
                else:
                    waiting.error = _refusal(why, wait, self._headers(u))
            waiting.let_in.set()

    def close_lines(self) -> None:
        """The server drains: those waiting in line go on (without a ticket) to the app, which answers them 503 as
        it answers every new request now, and no request waits in line any more."""
        with self._lock:
            self.lines_closed = True
            for u in self._usage.values():
                while u.line:
                    u.line.popleft().let_in.set()

    def leave_line(
        self, waiting: Waiting, token_s: Callable[[], float | None] = lambda: None
    ) -> APIError | None:
        """A request leaves the line before it was let in (its wait is over, or its client left): the 429 that
        says when a place frees; None if it was let in meanwhile (its `ticket`, or `error`, is set)."""
        with self._lock:
            u = self._usage.get(waiting.tenant)
            if u is None or waiting not in u.line:
                return None
            u.line.remove(waiting)
            lim = self.limits.get(waiting.tenant, TenantLimits())
            why = f"concurrent requests ({lim.max_concurrent}), after waiting {self.wait_s:g} s in line"
            wait, headers = self._place_frees_in(u, token_s()), self._headers(u)
        return _refusal(why, wait, headers)

    @staticmethod
    def _place_frees_in(u: _Usage, token_s: float | None) -> float:
        """When the first of the tenant's running requests is estimated to end (1 s while none has been read yet:
        it will be in a moment)."""
        pace = token_s or DEFAULT_TOKEN_S
        estimates = [s for t in u.running if (s := t.remaining_s(pace)) is not None]
        return min(MAX_RETRY_AFTER_S, min(estimates)) if estimates else 1.0

    def reserve(
        self,
        ticket: Ticket,
        tokens: int,
        max_tokens: int | None = None,
        progress: Callable[[], int] | None = None,
        lower: Callable[[int], tuple[str, str | None]] | None = None,
    ) -> None:
        """Reserve `tokens` (the most the request can use) against the tokens per minute, or raise 429; record
        how the request's progress is read (`max_tokens`: its longest choice's bound, `progress`: its tokens).
        `lower(limit)`: what the client should lower for the request to fit a limit (the advice, and the
        parameter it names), for a request larger than the whole minute."""
        with self._lock:
            ticket.max_tokens, ticket.progress = max_tokens, progress
            lim = self.limits.get(ticket.tenant, TenantLimits())
            u = self._usage_of(ticket.tenant, lim, self.clock())
            bucket = u.tokens
            if bucket is None or tokens <= 0:
                return
            if tokens <= bucket.level:
                bucket.level -= tokens
                ticket.reserved += tokens
                return
            wait = bucket.seconds_until(tokens)
            headers = self._headers(u)
        if tokens > bucket.per_minute:  # it can never fit, however long it waits
            advice, param = lower(bucket.per_minute) if lower is not None else ("", None)
            raise _too_large(bucket.per_minute, tokens, advice, param, headers)
        raise _refusal(
            f"tokens per minute ({lim.tpm}): this request may use {tokens} tokens (its prompt and n times its "
            f"max_tokens), {max(0, math.floor(bucket.level))} are left",
            wait,
            headers,
        )

    def settle(self, ticket: Ticket, used: int) -> None:
        """Charge what the request used in place of what it reserved."""
        with self._lock:
            u = self._usage.get(ticket.tenant)
            reserved, ticket.reserved = ticket.reserved, 0
            if u is not None and u.tokens is not None:
                u.tokens.refill(self.clock())
                u.tokens.level += reserved - used

    def leave(self, ticket: Ticket) -> None:
        """The request has ended: its place is free (a reservation never settled stays charged)."""
        with self._lock:
            u = self._usage.get(ticket.tenant)
            if u is None or ticket not in u.running:
                return
            u.running.remove(ticket)
            self._let_in(ticket.tenant, u)

    def admit(self, tenant: str) -> dict[str, str]:
        """`enter` for a caller that releases by tenant (`release`): the request's headers."""
        ticket = self.enter(tenant)
        return {} if ticket is None else self.headers(tenant)

    def release(self, tenant: str) -> None:
        """One of `tenant`'s requests (the oldest) has ended."""
        with self._lock:
            u = self._usage.get(tenant)
            ticket = u.running[0] if u is not None and u.running else None
        if ticket is not None:
            self.leave(ticket)

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens used that no reservation covered."""
        with self._lock:
            u = self._usage.get(tenant)
            if u is not None and u.tokens is not None:
                u.tokens.refill(self.clock())
                u.tokens.level -= tokens

    def headers(self, tenant: str) -> dict[str, str]:
        """OpenAI's x-ratelimit headers of `tenant`, as of now ({}: it has no limits)."""
        with self._lock:
            lim = self.limits.get(tenant)
            if lim is None:
                return {}
            return self._headers(self._usage_of(tenant, lim, self.clock()))

    @staticmethod
    def _headers(u: _Usage) -> dict[str, str]:
        out = {}
        for kind, bucket in (("requests", u.requests), ("tokens", u.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(bucket.per_minute)
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
                out[f"x-ratelimit-reset-{kind}"] = duration(bucket.seconds_to_full())
        return out


class ClientLeft(Exception):
    """The client of a request waiting in line went away."""


class RateLimits:
    """Pure ASGI middleware: the limits on the generation routes (see the module's docstring)."""

    def __init__(self, app, state, limiter: RateLimiter):
        self.app, self.state, self.limiter = app, state, limiter

    def _token_s(self) -> float | None:
        """The engine's current time between a running request's tokens (0: not timed yet)."""
        return self.state.system.stats().token_s

    async def _wait(self, waiting: Waiting, receive):
        """A request in its tenant's line until it is let in: its ticket, and the `receive` that gives the app the
        body read meanwhile, then the rest. Its body is read while it waits (up to WAIT_BODY_BYTES), so that its
        client's leaving is seen: ClientLeft, its place in line freed. A wait over is the 429 saying when a place
        frees."""
        read: list[dict] = []
        left = False

        async def watch() -> None:
            nonlocal left
            size = 0
            while size <= WAIT_BODY_BYTES:
                message = await receive()
                if message["type"] == "http.disconnect":
                    left = True
                    tg.cancel_scope.cancel()
                    return
                read.append(message)
                size += len(message.get("body", b""))
            await anyio.sleep_forever()  # the rest of a long body waits in the socket until the app reads it

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            with anyio.move_on_after(self.limiter.wait_s):
                await waiting.let_in.wait()
            tg.cancel_scope.cancel()
        refusal = self.limiter.leave_line(waiting, self._token_s)  # (None: it was let in)
        if left:
            if waiting.ticket is not None:
                waiting.ticket.leave()
            raise ClientLeft
        if refusal is not None:
            raise refusal
        if waiting.error is not None:
            raise waiting.error

        async def replay():
            return read.pop(0) if read else await receive()

        return waiting.ticket, replay

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LIMITED_ROUTES:
            return await self.app(scope, receive, send)
        if (
            BATCH_SCOPE_KEY in scope
        ):  # a Batch API line: batches have their own bounds (api/batches/runner.py)
            return await self.app(scope, receive, send)
        try:
            tenant = self.state.auth.tenant(request_headers(scope).get("authorization"))
        except APIError:  # the route answers the 401 / 403 itself
            return await self.app(scope, receive, send)
        try:
            ticket = self.limiter.enter(tenant, self._token_s, line=True)
            if isinstance(ticket, Waiting):
                ticket, receive = await self._wait(ticket, receive)
        except APIError as e:
            response = e.response()
            return await response(scope, receive, send)
        except ClientLeft:
            return None
        if ticket is None:
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":  # as of now: this request's reservation taken
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in self.limiter.headers(tenant).items()]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), *(h for h in extra if h[0] not in have)],
                }
            await send(message)

        token = _current.set(ticket)
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _current.reset(token)
            ticket.leave()
