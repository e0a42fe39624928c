"""Usage per tenant, for billing and audit: what each tenant's requests used, by model (the base model or an
adapter) and minute, in `usage.sqlite3` under the data dir, so it survives restarts; read by an admin with
`GET /v1/usage` in the shape of OpenAI's usage API (`/v1/organization/usage/completions`: buckets of
`bucket_width` 1m/1h/1d from `start_time`, each with its results, `group_by` tenant/model/batch).

A request's tenant and model are set when it is accepted (`begin`, in a context variable that its bill sees);
its bill (motet/api/billing.py) adds what it used when it ends, however it ends: for an answer that ends
normally exactly the numbers of the `usage` the client gets, for a stream cut short every token generated.
Counts gather in memory and are written every FLUSH_S seconds (and when the server stops, and before a read),
never on the step's or the event loop's hot path.

`--request-log` adds one JSON line per request to the log (`motet.requests`): tenant, model, tokens, TTFT,
status and duration (`RequestLog`, an ASGI middleware in front of the generation routes).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sqlite3
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from motet.api.asgi import StatusRecorder
from motet.api.sqlite_store import SQLiteStore, StorageFailure

FILENAME = "usage.sqlite3"
FLUSH_S = 2.0
BUCKETS = {"1m": 60, "1h": 3600, "1d": 86400}
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}  # OpenAI's default and most buckets a page
GROUPS = ("tenant", "model", "batch")
MAX_TIME = 253402300799  # 9999-12-31T23:59:59Z: the last unix time a query names
_COUNTS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "training_tokens")
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS usage (
        minute INTEGER NOT NULL,  -- unix time / 60
        tenant TEXT NOT NULL,
        model TEXT NOT NULL,
        batch INTEGER NOT NULL,
        requests INTEGER NOT NULL DEFAULT 0,
        input_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        output_tokens INTEGER NOT NULL DEFAULT 0,
        training_tokens INTEGER NOT NULL DEFAULT 0,  -- fine-tuning jobs' (motet/api/fine_tuning/)
        PRIMARY KEY (minute, tenant, model, batch)
    )""",
)

request_log = logging.getLogger("motet.requests")


@dataclass
class RequestUsage:
    """One API request's tenant, model and what it used so far (its choices add to it as they end)."""

    tenant: str | None = None
    model: str | None = None
    batch: bool = False
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    first_token: float | None = None  # perf_counter
    started: float = field(default_factory=time.perf_counter)


current: contextvars.ContextVar[RequestUsage | None] = contextvars.ContextVar("motet_usage", default=None)


def begin(tenant: str, model: str, batch: bool) -> RequestUsage:
    """The accepted request's record (the request log's, where it made one)."""
    u = current.get()
    if u is None:
        u = RequestUsage()
        current.set(u)
    u.tenant, u.model, u.batch = tenant, model, batch
    return u


class UsageStore(SQLiteStore):
    def __init__(self, data_dir: str | Path):
        super().__init__(Path(data_dir) / FILENAME, _SCHEMA)
        if "training_tokens" not in {row[1] for row in self._db.execute("PRAGMA table_info(usage)")}:
            self._db.execute("ALTER TABLE usage ADD COLUMN training_tokens INTEGER NOT NULL DEFAULT 0")
        self._pending_lock = threading.Lock()  # the counts not written yet; the database's is `_lock`
        self._pending: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(_COUNTS))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name="motet-usage", daemon=True)
        self._thread.start()

    def add(self, u: RequestUsage, requests: int, input_tokens: int, cached: int, output: int) -> None:
        if u.tenant is None:
            return
        self._count(
            (int(time.time()) // 60, u.tenant, u.model or "", int(u.batch)),
            (requests, input_tokens, cached, output, 0),
        )

    def add_training(self, tenant: str, model: str, tokens: int) -> None:
        """Tokens a fine-tuning job of the tenant's trained (`model`: the model it makes)."""
        self._count((int(time.time()) // 60, tenant, model, 0), (0, 0, 0, 0, tokens))

    def _count(self, key: tuple, values: tuple[int, ...]) -> None:
        with self._pending_lock:
            counts = self._pending[key]
            for i, v in enumerate(values):
                counts[i] += v

    def flush(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, defaultdict(lambda: [0] * len(_COUNTS))
        if not pending:
            return
        rows = [(*key, *counts) for key, counts in pending.items()]
        try:
            with self._write():
                self._db.executemany(
                    "INSERT INTO usage (minute, tenant, model, batch, requests, input_tokens, cached_tokens,"
                    " output_tokens, training_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (minute, tenant, model, batch)"
                    " DO UPDATE SET requests = requests + excluded.requests, input_tokens = input_tokens +"
                    " excluded.input_tokens, cached_tokens = cached_tokens + excluded.cached_tokens,"
                    " output_tokens = output_tokens + excluded.output_tokens,"
                    " training_tokens = training_tokens + excluded.training_tokens",
                    rows,
                )
        except (StorageFailure, sqlite3.Error):  # a full disk: the counts wait in memory for the next flush
            with self._pending_lock:
                for key, counts in pending.items():
                    mine = self._pending[key]
                    for i, v in enumerate(counts):
                        mine[i] += v
            raise

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_S):
            with contextlib.suppress(StorageFailure):
                self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(StorageFailure):
            self.flush()
        super().close()

    def buckets(
        self, start: int, end: int, width: int, groups: tuple[str, ...], tenant: str | None, model: str | None
    ) -> dict[int, list[dict]]:
        """Bucket start -> its results (one per group), for [start, end)."""
        self.flush()
        where, args = ["minute >= ?", "minute < ?"], [start // 60, -(-end // 60)]
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if model is not None:
            where.append("model = ?")
            args.append(model)
        bucket = f"(((minute * 60) - {start}) / {width}) * {width} + {start}"
        cols = ", ".join(groups)
        sql = (
            f"SELECT {bucket} AS b{', ' + cols if cols else ''}, SUM(requests), SUM(input_tokens),"
            f" SUM(cached_tokens), SUM(output_tokens), SUM(training_tokens) FROM usage WHERE {' AND '.join(where)}"
            f" GROUP BY b{', ' + cols if cols else ''} ORDER BY b{', ' + cols if cols else ''}"
        )
        out: dict[int, list[dict]] = defaultdict(list)
        with self._read():
            rows = self._db.execute(sql, args).fetchall()
        for row in rows:
            b, keys, (requests, input_tokens, cached, output, training) = (
                row[0],
                row[1 : 1 + len(groups)],
                row[-5:],
            )
            result = {
                "object": "organization.usage.completions.result",
                "input_tokens": input_tokens,
                "output_tokens": output,
                "input_cached_tokens": cached,
                "num_model_requests": requests,
                "training_tokens": training,  # fine-tuning jobs' (not in OpenAI's completions usage)
                "tenant": None,
                "model": None,
                "batch": None,
            }
            for name, value in zip(groups, keys, strict=True):
                result[name] = bool(value) if name == "batch" else value
            out[b].append(result)
        return out


class RequestLog:
    """Pure ASGI middleware (`--request-log`): one JSON line per generation request, when it ends."""

    def __init__(self, app, paths: frozenset[str]):
        self.app, self.paths = app, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        u = RequestUsage()
        token = current.set(u)
        sent = StatusRecorder(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            current.reset(token)
            now = time.perf_counter()
            request_log.info(
                json.dumps(
                    {
                        "path": scope["path"],
                        "status": sent.status,
                        "tenant": u.tenant,
                        "model": u.model,
                        "prompt_tokens": u.input_tokens,
                        "cached_tokens": u.cached_tokens,
                        "completion_tokens": u.output_tokens,
                        "ttft_s": None if u.first_token is None else round(u.first_token - u.started, 4),
                        "duration_s": round(now - u.started, 4),
                    }
                )
            )
