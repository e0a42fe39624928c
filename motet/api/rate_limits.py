"""Per-tenant limits at the front door, as OpenAI's API enforces them per organization: concurrent requests,
requests per minute and tokens per minute, from the API keys file (`"limits"` of a key's object).

Requests and tokens are token buckets refilled continuously (a minute's allowance per minute, at most a
minute's worth saved up). A generation request (chat, completions, responses) is admitted while the tenant
has a request left, has not spent more tokens than its bucket holds, and runs fewer than its concurrency
limit; otherwise it is answered 429 `rate_limit_exceeded` with `Retry-After` (when the refused resource
comes back) before anything is queued. Tokens (prompt + completion) are charged as each choice finishes
(motet/api/streams.py calls `charge`), so a request may take the bucket below zero and the next waits for
the refill. Every answer of those routes carries OpenAI's headers: `x-ratelimit-limit-requests`,
`x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` and the same for tokens, for the limits the
tenant has.

`RateLimits` is an ASGI middleware that `motet serve` puts in front of the app (motet/api/server.py): the
Batch API's lines call the app from inside and are not counted (OpenAI gives batches their own limits).
The counters live in the one front process, so with Ray Serve replicas behind it (motet/cluster/) a
tenant's limit is one limit, not one per replica. `reload` swaps the limits (SIGHUP re-reads the keys file)
and keeps what each tenant has used.
"""

from __future__ import annotations

import contextvars
import json
import math
import threading
import time
from dataclasses import dataclass

from motet.api.asgi import request_headers
from motet.api.errors import APIError
from motet.api.usage import BATCH_SCOPE_KEY

LIMITED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_FIELDS = {
    "max_concurrent_requests": "max_concurrent",
    "requests_per_minute": "rpm",
    "tokens_per_minute": "tpm",
}


@dataclass(frozen=True)
class TenantLimits:
    max_concurrent: int | None = None
    rpm: int | None = None
    tpm: int | None = None

    @classmethod
    def parse(cls, where: str, value) -> TenantLimits:
        if not isinstance(value, dict) or set(value) - set(_FIELDS):
            raise ValueError(
                f"{where}: limits is an object of {', '.join(_FIELDS)}, got {json.dumps(value)[:80]}"
            )
        for key, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"{where}: limits.{key} must be a positive integer, got {json.dumps(v)[:40]}"
                )
        return cls(**{_FIELDS[k]: v for k, v in value.items()})


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


@dataclass
class _Usage:
    running: int = 0
    requests: _Bucket | None = None
    tokens: _Bucket | None = None


_charging: contextvars.ContextVar[tuple[RateLimiter, str] | None] = contextvars.ContextVar(
    "motet_rate_limit", default=None
)


def charge(tokens: int) -> None:
    """Charge the tokens of a finished choice to the tenant of the request being answered (a no-op for
    requests the limits do not count: batch lines, routes without limits)."""
    current = _charging.get()
    if current is not None and tokens > 0:
        current[0].charge(current[1], tokens)


class RateLimiter:
    def __init__(self, limits: dict[str, TenantLimits] | None = None, clock=time.monotonic):
        self.limits = dict(limits or {})
        self.clock = clock
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()  # admits on the event loop, charges from it too; reload from a signal

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

    def _usage_of(self, tenant: str, lim: TenantLimits) -> _Usage:
        u = self._usage.get(tenant)
        if u is None:
            now = self.clock()
            u = self._usage[tenant] = _Usage(
                requests=_Bucket(lim.rpm, now) if lim.rpm else None,
                tokens=_Bucket(lim.tpm, now) if lim.tpm else None,
            )
        return u

    def admit(self, tenant: str) -> dict[str, str]:
        """Take one request for `tenant`: its rate-limit headers, or a 429 APIError that carries them."""
        with self._lock:
            lim = self.limits.get(tenant)
            if lim is None:
                return {}
            u = self._usage_of(tenant, lim)
            now = self.clock()
            for bucket in (u.requests, u.tokens):
                if bucket is not None:
                    bucket.refill(now)
            why, wait = None, 0.0
            if u.requests is not None and u.requests.level < 1:
                why, wait = f"requests per minute ({lim.rpm})", u.requests.seconds_until(1)
            elif u.tokens is not None and u.tokens.level <= 0:
                why, wait = f"tokens per minute ({lim.tpm})", u.tokens.seconds_until(1)
            elif lim.max_concurrent is not None and u.running >= lim.max_concurrent:
                why, wait = f"concurrent requests ({lim.max_concurrent})", 1.0
            if why is None:
                if u.requests is not None:
                    u.requests.level -= 1
                u.running += 1
            headers = self._headers(lim, u)
        if why is not None:
            raise APIError(
                429,
                f"rate limit reached for this tenant's {why}: try again in {duration(wait)} (the server's limits "
                "for its API key, in the keys file)",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(max(1, math.ceil(wait)))},
            )
        return headers

    def release(self, tenant: str) -> None:
        with self._lock:
            u = self._usage.get(tenant)
            if u is not None and u.running > 0:
                u.running -= 1

    def charge(self, tenant: str, tokens: int) -> None:
        with self._lock:
            u = self._usage.get(tenant)
            if u is not None and u.tokens is not None:
                u.tokens.refill(self.clock())
                u.tokens.level -= tokens

    @staticmethod
    def _headers(lim: TenantLimits, u: _Usage) -> dict[str, str]:
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
            extra = self.limiter.admit(tenant)
        except APIError as e:
            response = e.response()
            return await response(scope, receive, send)
        raw = [(k.encode(), v.encode()) for k, v in extra.items()]

        async def send_with_headers(message):
            if message["type"] == "http.response.start" and raw:
                message = {**message, "headers": [*message.get("headers", []), *raw]}
            await send(message)

        token = _charging.set((self.limiter, tenant))
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _charging.reset(token)
            self.limiter.release(tenant)
