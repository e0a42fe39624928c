"""Stored responses (`store`, `previous_response_id`, `GET` / `DELETE /v1/responses/{id}`) in SQLite.

One table in `responses.sqlite3` under the data directory, keyed by (tenant, id): every read and write
names the tenant, so one tenant's ids never find another's responses (a foreign id reads as missing).

A conversation is a chain of rows. Each row holds one response (the Response object, its output apart),
the input items its own request added, reduced to what the model sees of them (motet/api/responses/items.py
`model_visible`: no reasoning items, `encrypted_content`, annotations or logprobs), and the id of the
response it continued. So a turn costs what it adds, never the whole history again, and continuing a
conversation walks the chain back (at most MAX_TURNS rows). As with OpenAI, a stored response can be
continued from, and read, until it is itself deleted or expired: deleting or expiring a response that a
later stored turn continued from only hides it, and its conversation items stay until no stored turn needs
them.

Bounds: each tenant stores at most `max_per_tenant` responses and `max_bytes_per_tenant` bytes (its rows'
JSON); a write past either is refused with `QuotaExceeded` naming the limit, never made room for by
evicting what the tenant stored. Rows older than `max_age_s` are gone (not read, purged by later writes).
The file failing (a full disk, an I/O error) raises `StorageFailure`, and a failed write leaves nothing
behind: its transaction is rolled back, and the connection stays usable. The layout's version is SQLite's
`user_version`; the first layout (a copy of the whole conversation in every row, version 1) is migrated on
open. Synchronous, one connection behind a lock (motet/api/sqlite_store.py); the routes call it from a
worker thread.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from motet.api.responses.items import model_visible
from motet.api.sqlite_store import SQLiteStore

FILENAME = "responses.sqlite3"
SCHEMA_VERSION = 2  # 1: user_version 0 and `responses (tenant, id, created_at, response, context)`, migrated
DEFAULT_MAX_AGE_DAYS = 30.0  # as OpenAI keeps stored responses
DEFAULT_MAX_PER_TENANT = 10_000
DEFAULT_MAX_BYTES_PER_TENANT = 1 << 30
MAX_TURNS = 4096  # stored turns in one conversation: bounds what continuing it reads
_PURGE_BATCH = 256  # expired rows purged per write (the rest by the next ones: a write stays short)

_SCHEMA = (
    """CREATE TABLE responses (
        tenant TEXT NOT NULL,
        id TEXT NOT NULL,
        parent TEXT,               -- the response this one continued (previous_response_id); NULL: none
        turn INTEGER NOT NULL,     -- rows before this one in its chain
        created_at REAL NOT NULL,
        visible INTEGER NOT NULL,  -- 0: deleted or expired, kept while a later stored turn continues from it
        response TEXT,             -- the Response object with an empty output; NULL once not visible
        input TEXT NOT NULL,       -- the input items its request added, as the model sees them
        output TEXT NOT NULL,      -- its output items (only what the model sees, once not visible)
        bytes INTEGER NOT NULL,    -- what the row holds, counted against the tenant's quota
        PRIMARY KEY (tenant, id)
    )""",
    "CREATE INDEX responses_by_parent ON responses (tenant, parent)",
    "CREATE INDEX responses_by_age ON responses (created_at) WHERE visible = 1",
    "CREATE INDEX responses_by_tenant ON responses (tenant, visible, created_at, bytes)",
)


class QuotaExceeded(Exception):
    """A response the tenant's limits have no room for (the message names the limit)."""


class ConversationTooLong(Exception):
    """A conversation already MAX_TURNS stored turns long."""


@dataclass
class Conversation:
    items: list[dict]  # oldest first: each turn's input, then its output, as the model sees them
    turns: int  # stored turns it spans


@dataclass
class Turn:
    response_id: str
    input: list[dict]  # the input items its request added, as the model sees them
    output: list[dict]  # its output items as stored


class ResponseStore(SQLiteStore):
    def __init__(
        self,
        data_dir: str | Path,
        max_age_s: float = DEFAULT_MAX_AGE_DAYS * 86400,
        max_per_tenant: int = DEFAULT_MAX_PER_TENANT,
        max_bytes_per_tenant: int = DEFAULT_MAX_BYTES_PER_TENANT,
    ):
        if not max_age_s > 0 or max_per_tenant < 1 or max_bytes_per_tenant < 1:  # `not >`: NaN too
            raise ValueError("stored responses need positive limits (age, count and bytes per tenant)")
        self.max_age_s, self.max_per_tenant = max_age_s, max_per_tenant
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self.path = Path(data_dir) / FILENAME
        super().__init__(self.path)  # the layout: `_migrate`
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} has layout {version}, newer than this motet's {SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            self._migrate()

    # -- writing ---------------------------------------------------------------------------------------------
    def put(
        self,
        tenant: str,
        response: dict,
        input_items: list[dict],
        previous: str | None = None,
        history: list[dict] | None = None,
    ) -> None:
        """Store `response`, the input items its own request added and, if it continued `previous`, a link
        to it; if `previous` is gone by now, its conversation (`history`) is stored in the row instead."""
        with self._write():
            self._purge()
            turn = self._turn(tenant, previous) if previous else None
            if previous is not None and turn is None:
                input_items, previous = [*(history or []), *input_items], None
            envelope = _dumps({**response, "output": []})
            stored_input, output = _dumps(model_visible(input_items)), _dumps(response.get("output", []))
            size = _size(envelope, stored_input, output)
            self._check_quota(tenant, size)
            self._db.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
                (tenant, response["id"], previous, 0 if turn is None else turn + 1, time.time(), envelope,
                 stored_input, output, size),
            )  # fmt: skip

    def admit(self, tenant: str, input_items: list[dict], turns: int = 0) -> None:
        """Refuse, before the answer is generated, a response that cannot be stored: the tenant is at a
        limit (QuotaExceeded), or the conversation it continues (`turns` long) is (ConversationTooLong)."""
        if turns >= MAX_TURNS:
            raise ConversationTooLong(
                f"the conversation is {turns} stored turns long, the limit: start a new one (send its "
                "items as input)"
            )
        with self._read():
            self._check_quota(tenant, len(_dumps(model_visible(input_items)).encode()))

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._write():
            found = self._visible(tenant, response_id)
            if found:
                self._remove(tenant, response_id)
        return found

    # -- reading ---------------------------------------------------------------------------------------------
    def get(self, tenant: str, response_id: str) -> dict | None:
        """The Response object, as it was returned."""
        with self._read():
            return self._get(tenant, response_id)

    def conversation(self, tenant: str, response_id: str) -> Conversation | None:
        """What a next turn continues from: every turn's input and output up to this response's output."""
        turns = self.turns(tenant, response_id)
        if turns is None:
            return None
        items: list[dict] = []
        for turn in turns:
            items += turn.input
            items += model_visible(turn.output)
        return Conversation(items, len(turns))

    def turns(self, tenant: str, response_id: str) -> list[Turn] | None:
        """The stored turns of a response's conversation, oldest first, the response itself last (None: no
        such visible response for this tenant). A hidden turn's output holds only what the model sees."""
        with self._read():
            if not self._visible(tenant, response_id):
                return None
            rows = self._db.execute(
                """WITH RECURSIVE chain(id, parent, n) AS (
                       SELECT id, parent, 0 FROM responses WHERE tenant = :tenant AND id = :id
                       UNION ALL
                       SELECT r.id, r.parent, chain.n + 1 FROM chain
                       JOIN responses r ON r.tenant = :tenant AND r.id = chain.parent
                       WHERE chain.n < :max
                   )
                   SELECT r.id, r.input, r.output FROM chain
                   JOIN responses r ON r.tenant = :tenant AND r.id = chain.id
                   ORDER BY chain.n DESC""",
                {"tenant": tenant, "id": response_id, "max": MAX_TURNS},
            ).fetchall()
        return [Turn(rid, json.loads(stored_input), json.loads(output)) for rid, stored_input, output in rows]

    def usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's stored responses and the bytes its rows hold (hidden ones too)."""
        with self._read():
            return self._usage(tenant)

    def count(self, tenant: str) -> int:
        return self.usage(tenant)[0]

    # -- under the lock -------------------------------------------------------------------------------------------
    def _get(self, tenant: str, response_id: str) -> dict | None:
        row = self._db.execute(
            "SELECT response, output FROM responses"
            " WHERE tenant = ? AND id = ? AND visible = 1 AND created_at >= ?",
            (tenant, response_id, self._oldest()),
        ).fetchone()
        if row is None:
            return None
        response = json.loads(row[0])
        response["output"] = json.loads(row[1])
        return response

    def _visible(self, tenant: str, response_id: str) -> bool:
        return (
            self._db.execute(
                "SELECT 1 FROM responses WHERE tenant = ? AND id = ? AND visible = 1 AND created_at >= ?",
                (tenant, response_id, self._oldest()),
            ).fetchone()
            is not None
        )

    def _usage(self, tenant: str) -> tuple[int, int]:
        rows, size = self._db.execute(
            "SELECT COALESCE(SUM(visible = 1 AND created_at >= ?), 0), COALESCE(SUM(bytes), 0)"
            " FROM responses WHERE tenant = ?",
            (self._oldest(), tenant),
        ).fetchone()
        return rows, size

    def _check_quota(self, tenant: str, size: int) -> None:
        rows, used = self._usage(tenant)
        if rows >= self.max_per_tenant:
            raise QuotaExceeded(
                f"this tenant stores {rows} responses, the server's limit of {self.max_per_tenant} per "
                "tenant: delete some (DELETE /v1/responses/{id}) or send store: false"
            )
        if used + size > self.max_bytes_per_tenant:
            raise QuotaExceeded(
                f"this tenant's stored responses hold {used} bytes and this one needs {size}, over the "
                f"server's limit of {self.max_bytes_per_tenant} bytes per tenant: delete some (DELETE "
                "/v1/responses/{id}) or send store: false"
            )

    def _turn(self, tenant: str, response_id: str) -> int | None:
        row = self._db.execute(
            "SELECT turn FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
        ).fetchone()
        return None if row is None else row[0]

    def _continued(self, tenant: str, response_id: str) -> bool:
        return (
            self._db.execute(
                "SELECT 1 FROM responses WHERE tenant = ? AND parent = ? LIMIT 1", (tenant, response_id)
            ).fetchone()
            is not None
        )

    def _remove(self, tenant: str, response_id: str) -> None:
        """Delete a response; hide it instead while a later turn continues from it, and delete the hidden
        ancestors that no turn needs any more."""
        if self._continued(tenant, response_id):
            stored_input, output = self._db.execute(
                "SELECT input, output FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
            ).fetchone()
            output = _dumps(model_visible(json.loads(output)))
            self._db.execute(
                "UPDATE responses SET visible = 0, response = NULL, output = ?, bytes = ?"
                " WHERE tenant = ? AND id = ?",
                (output, _size(stored_input, output), tenant, response_id),
            )
            return
        while response_id is not None:
            (parent,) = self._db.execute(
                "SELECT parent FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
            ).fetchone()
            self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
            hidden = (
                parent is not None
                and self._db.execute(
                    "SELECT 1 FROM responses WHERE tenant = ? AND id = ? AND visible = 0", (tenant, parent)
                ).fetchone()
            )
            response_id = parent if hidden and not self._continued(tenant, parent) else None

    def _purge(self) -> None:
        expired = self._db.execute(
            "SELECT tenant, id FROM responses WHERE visible = 1 AND created_at < ? LIMIT ?",
            (self._oldest(), _PURGE_BATCH),
        ).fetchall()
        for tenant, response_id in expired:
            self._remove(tenant, response_id)

    def _oldest(self) -> float:
        return time.time() - self.max_age_s

    # -- layout ------------------------------------------------------------------------------------------------
    def _migrate(self) -> None:
        """Create the layout, or move the first one's rows (a whole conversation each) into it: each
        becomes a conversation of its own, reduced to what the model sees. One transaction: all or nothing."""
        with self._write():
            legacy = self._db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'responses'"
            ).fetchone()
            if legacy:
                self._db.execute("ALTER TABLE responses RENAME TO responses_v1")
                self._db.execute("DROP INDEX IF EXISTS responses_by_age")
            for statement in _SCHEMA:
                self._db.execute(statement)
            if legacy:
                self._copy_legacy_rows()
                self._db.execute("DROP TABLE responses_v1")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _copy_legacy_rows(self) -> None:
        last = -1
        while rows := self._db.execute(
            "SELECT rowid, tenant, id, created_at, response, context FROM responses_v1 WHERE rowid > ?"
            " ORDER BY rowid LIMIT 256",
            (last,),
        ).fetchall():
            for last, tenant, response_id, created_at, response, context in rows:  # noqa: B007
                response = json.loads(response)
                envelope = _dumps({**response, "output": []})
                stored_input = _dumps(model_visible(json.loads(context)))
                output = _dumps(response.get("output", []))
                self._db.execute(
                    "INSERT INTO responses VALUES (?, ?, NULL, 0, ?, 1, ?, ?, ?, ?)",
                    (tenant, response_id, created_at, envelope, stored_input, output,
                     _size(envelope, stored_input, output)),
                )  # fmt: skip


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _size(*texts: str) -> int:
    return sum(len(t.encode()) for t in texts)
