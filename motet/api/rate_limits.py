"""Per-tenant limits at the front door, as OpenAI's API enforces them per organization: concurrent requests,
requests per minute and tokens per minute, from the API keys file (`"limits"` of a key's object).

Requests and tokens are token buckets refilled continuously (a minute's allowance per minute, at most a
minute's worth saved up). A generation request (chat, completions, responses) is let in while the tenant
has a request left, has tokens left, and runs fewer than its concurrency limit; otherwise it is answered 429
`rate_limit_exceeded` with `Retry-After` before anything is queued: when the bucket has refilled, or, for the
concurrency limit, when the first of the tenant's running requests is estimated to end: the tokens it has left
(its max_tokens less those it has generated) at the engine's current time between a running request's tokens
(the mean of its last steps, motet/engine/core/latency.py's TokenPace; `DEFAULT_TOKEN_S` before it has timed
any). Nothing of the tenant's past requests goes in: what runs now says when it ends.

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
from collections.abc import Callable
from dataclasses import dataclass, field

from motet.api.asgi import BATCH_SCOPE_KEY, request_headers
from motet.api.auth import TenantLimits
from motet.api.errors import APIError

LIMITED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# An estimate further out is no better than asking again in a minute (what the SDKs wait as told, at most).
MAX_RETRY_AFTER_S = 60
# A running request's time per token before the engine has timed a step: a slow CPU step at a moderate batch
# (an estimate too long costs a client some waiting; one too short, its retries).
DEFAULT_TOKEN_S = 0.1


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


@dataclass
class _Usage:
    running: list[Ticket] = field(default_factory=list)
    requests: _Bucket | None = None
    tokens: _Bucket | None = None


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
    def __init__(self, limits: dict[str, TenantLimits] | None = None, clock=time.monotonic):
        self.limits = dict(limits or {})
        self.clock = clock
        self._usage: dict[str, _Usage] = {}
        self._lock = (
            threading.Lock()
        )  # the event loop's calls, and `reload` from the thread that reads the file

    def reload(self, limits: dict[str, TenantLimits]) -> None:
        with self._lock:
            self.limits = dict(limits)
            self._usage = {t: u for t, u in self._usage.items() if t in self.limits or u.running}
            for tenant, u in self._usage.items():  # new sizes; what was used stays used
                lim = self.limits.get(tenant, TenantLimits())
                u.requests = self._resized(u.requests, lim.rpm)
                u.tokens = self._resized(u.tokens, lim.tpm)

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

    def enter(self, tenant: str, token_s: Callable[[], float | None] = lambda: None) -> Ticket | None:
        """Let one request of `tenant` in: its ticket (None: the tenant has no limits), or a 429 APIError that
        carries the headers. `token_s`: the engine's current seconds per token of a running request (None or 0:
        not timed yet), read only to say when a place frees."""
        with self._lock:
            lim = self.limits.get(tenant)
            if lim is None:
                return None
            now = self.clock()
            u = self._usage_of(tenant, lim, now)
            why, wait = None, 0.0
            if u.requests is not None and u.requests.level < 1:
                why, wait = f"requests per minute ({lim.rpm})", u.requests.seconds_until(1)
            elif u.tokens is not None and u.tokens.level <= 0:
                why, wait = f"tokens per minute ({lim.tpm})", u.tokens.seconds_until(1)
            elif lim.max_concurrent is not None and len(u.running) >= lim.max_concurrent:
                why, wait = f"concurrent requests ({lim.max_concurrent})", self._place_frees_in(u, token_s())
            if why is None:
                if u.requests is not None:
                    u.requests.level -= 1
                ticket = Ticket(self, tenant, now)
                u.running.append(ticket)
                return ticket
            headers = self._headers(u)
        raise _refusal(why, wait, headers)

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


class RateLimits:
    """Pure ASGI middleware: the limits on the generation routes (see the module's docstring)."""

    def __init__(self, app, state, limiter: RateLimiter):
        self.app, self.state, self.limiter = app, state, limiter

    def _token_s(self) -> float | None:
        """The engine's current time between a running request's tokens (0: not timed yet)."""
        return self.state.system.stats().token_s

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
            ticket = self.limiter.enter(tenant, self._token_s)
        except APIError as e:
            response = e.response()
            return await response(scope, receive, send)
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
