"""Stored responses (`store`, `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`) in SQLite.

One table in `responses.sqlite3` under the data directory, keyed by (tenant, id): every read and write
names the tenant, so one tenant's ids never find another's responses (a foreign id reads as missing).
Each row holds the Response object and its context: the input items the model saw after the
instructions (the earlier turns' inputs and outputs, then this request's input), so a later turn
rebuilds its conversation from one row, and deleting or expiring an earlier turn breaks no chain.
Retention: rows older than `max_age_s` are gone (not read, and deleted on the next write), and each
tenant keeps its `max_per_tenant` newest. Synchronous, one connection behind a lock (WAL mode); the
routes call it from a worker thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FILENAME = "responses.sqlite3"
DEFAULT_MAX_AGE_DAYS = 30.0  # as OpenAI keeps stored responses
DEFAULT_MAX_PER_TENANT = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (tenant, created_at);
"""


@dataclass
class StoredResponse:
    response: dict  # the Response object, as returned
    context: list[dict]  # the input items before its output (instructions apart)

    def conversation(self) -> list[dict]:
        """The items a next turn continues from: this one's context, then its output."""
        return [*self.context, *self.response.get("output", [])]


class ResponseStore:
    def __init__(
        self,
        data_dir: str | Path,
        max_age_s: float = DEFAULT_MAX_AGE_DAYS * 86400,
        max_per_tenant: int = DEFAULT_MAX_PER_TENANT,
    ):
        if max_age_s <= 0 or max_per_tenant < 1:
            raise ValueError("stored responses need a positive retention (age and count)")
        self.max_age_s, self.max_per_tenant = max_age_s, max_per_tenant
        self.path = Path(data_dir) / FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def put(self, tenant: str, response: dict, context: list[dict]) -> None:
        row = (tenant, response["id"], time.time(), json.dumps(response), json.dumps(context))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)
                self._db.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest(),))
                self._db.execute(
                    "DELETE FROM responses WHERE tenant = ? AND id IN (SELECT id FROM responses WHERE tenant = ?"
                    " ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
                    (tenant, tenant, self.max_per_tenant),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, context FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                (tenant, response_id, self._oldest()),
            ).fetchone()
        return StoredResponse(json.loads(row[0]), json.loads(row[1])) if row else None

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        return cur.rowcount > 0

    def count(self, tenant: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses WHERE tenant = ?", (tenant,)).fetchone()[
                0
            ]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _oldest(self) -> float:
        return time.time() - self.max_age_s
