"""Batches (`/v1/batches`) and their lines, in SQLite (`batches.sqlite3` under the data directory).

A batch is a row (its Batch object's fields, its request counts and token usage); its requests are rows of
`batch_lines`, copied from the input file when it is validated. A line is answered once: its result is
written, its request dropped and the batch's counts raised in one transaction, and only while it has no
result yet, so a line run again after a crash (it was running when the server died) is never counted twice.
On a restart the runner (motet/api/batches/runner.py) picks every unfinished batch up where it stopped: the
lines without a result.

Status, as OpenAI's: validating -> in_progress -> finalizing -> completed; failed (the file as a whole is
unusable); cancelling -> cancelled; expired (the completion window passed). A finished batch keeps its
row; its answered lines live on in its output and error files (motet/api/files/store.py) and leave the table.

What an unfinished batch holds counts against its tenant's files quota (`pending_bytes`, which the file store
counts as the tenant's): its copy of the requests not answered yet and its answers, each as its file will
hold it. A batch whose copy and refused lines' answers do not fit is refused whole when it is loaded, and an
answer that does not fit is not recorded (OverQuota: the runner stops the batch).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from motet.api.batches.lines import Line, Usage, compact, error_line, succeeded
from motet.api.sqlite_store import SQLiteStore

FILENAME = "batches.sqlite3"
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's one window
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
          "expired_at", "cancelling_at", "cancelled_at")  # fmt: skip
_STATUS_TIME = {s: f"{s}_at" for s in ("in_progress", "finalizing", "completed", "failed", "expired",
                                        "cancelling", "cancelled")}  # fmt: skip
_CHUNK = 256  # lines read per query

_SCHEMA = (
    f"""CREATE TABLE IF NOT EXISTS batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- listing order
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        metadata TEXT,          -- JSON object, or NULL
        status TEXT NOT NULL,
        model TEXT,             -- the first request's model
        errors TEXT,            -- JSON list of what made the batch fail, or NULL
        output_file_id TEXT,
        error_file_id TEXT,
        {", ".join(f"{t} INTEGER" for t in _TIMES)},
        total INTEGER NOT NULL DEFAULT 0,
        completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        input_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens INTEGER NOT NULL DEFAULT 0,
        output_tokens INTEGER NOT NULL DEFAULT 0,
        reasoning_tokens INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq)",
    "CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS batch_lines (
        batch TEXT NOT NULL,
        line INTEGER NOT NULL,  -- its line in the input file, from 1
        custom_id TEXT,
        url TEXT,
        request TEXT,           -- the body's JSON; NULL once answered
        result TEXT,            -- the answered line's JSON; NULL until answered
        ok INTEGER,             -- 1: in the output file, 0: in the error file
        PRIMARY KEY (batch, line)
    )""",
)
_COLUMNS = ("id", "tenant", "endpoint", "input_file_id", "completion_window", "metadata", "status", "model",
            "errors", "output_file_id", "error_file_id", *_TIMES, "total", "completed", "failed",
            "input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")  # fmt: skip


class _FileRefused(Exception):
    """The input file as a whole cannot be run: (code, message)."""


class OverQuota(Exception):
    """An answer that does not fit in what its tenant may still write (the message says so, for the batch's
    `errors`)."""


def quota_message(what: str, size: int, room: int) -> str:
    return (
        f"{what} ({size} bytes) would take the tenant's files past the server's limit per tenant "
        f"(--files-max-bytes-per-tenant; {max(room, 0)} bytes are left): delete files (DELETE /v1/files/{{id}}) or "
        "ask for less (fewer lines, max_tokens, n, logprobs)"
    )


@dataclass
class PendingLine:
    batch: str
    line: int
    custom_id: str
    url: str
    body: dict


@dataclass
class UnfinishedBatch:
    id: str
    tenant: str
    status: str
    expires_at: int


def _object(row: tuple) -> dict:
    """The OpenAI Batch object of a row."""
    r = dict(zip(_COLUMNS, row, strict=True))
    usage = Usage(r["input_tokens"], r["cached_tokens"], r["output_tokens"], r["reasoning_tokens"])
    return {
        "id": r["id"],
        "object": "batch",
        "endpoint": r["endpoint"],
        "model": r["model"],
        "errors": {"object": "list", "data": json.loads(r["errors"])} if r["errors"] else None,
        "input_file_id": r["input_file_id"],
        "completion_window": r["completion_window"],
        "status": r["status"],
        "output_file_id": r["output_file_id"],
        "error_file_id": r["error_file_id"],
        **{t: r[t] for t in _TIMES},
        "request_counts": {"total": r["total"], "completed": r["completed"], "failed": r["failed"]},
        "usage": usage.object(),
        "metadata": json.loads(r["metadata"]) if r["metadata"] else None,
    }


def _size(result: dict) -> int:
    """The bytes an answered line takes in its file (the line and its newline)."""
    return len(compact(result).encode()) + 1


class BatchStore(SQLiteStore):
    def __init__(self, data_dir: str | Path):
        super().__init__(Path(data_dir) / FILENAME, _SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(batches)")}
        for column in (
            "result_bytes",
            "request_bytes",
        ):  # a store written before they counted against the quota
            if column not in columns:
                self._db.execute(f"ALTER TABLE batches ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")

    # -- the API's side ---------------------------------------------------------------------------------------
    def create(
        self, tenant: str, endpoint: str, input_file_id: str, window: str, metadata: dict | None
    ) -> dict:
        batch_id = f"batch_{secrets.token_hex(12)}"
        now = int(time.time())
        with self._write():
            self._db.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, metadata, status,"
                " created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, 'validating', ?, ?)",
                (batch_id, tenant, endpoint, input_file_id, window, json.dumps(metadata) if metadata else None,
                 now, now + COMPLETION_WINDOWS[window]),
            )  # fmt: skip
            return self._get(tenant, batch_id)

    def get(self, tenant: str, batch_id: str) -> dict | None:
        with self._read():
            return self._get(tenant, batch_id)

    def page(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool] | None:
        """A page of the tenant's batches, newest first, after the batch `after`; and whether more follow.
        None: `after` names no batch of theirs."""
        return self._keyset_page("batches", _COLUMNS, _object, tenant, after, limit)

    def cancel(self, tenant: str, batch_id: str) -> dict | None:
        """Ask a batch to stop (validating or in progress -> cancelling); the batch as it is now, or None."""
        with self._write():
            self._db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ?"
                " WHERE tenant = ? AND id = ? AND status IN ('validating', 'in_progress')",
                (int(time.time()), tenant, batch_id),
            )
            return self._get(tenant, batch_id)

    # -- the runner's side ----------------------------------------------------------------------------------
    def unfinished(self) -> list[UnfinishedBatch]:
        with self._read():
            rows = self._db.execute(
                f"SELECT id, tenant, status, expires_at FROM batches WHERE status IN {UNFINISHED} ORDER BY seq"
            ).fetchall()
        return [UnfinishedBatch(*r) for r in rows]

    def status(self, batch_id: str) -> str:
        with self._read():
            return self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def input_of(self, batch_id: str) -> tuple[str, str, str]:
        """(tenant, input file id, endpoint)."""
        with self._read():
            return self._db.execute(
                "SELECT tenant, input_file_id, endpoint FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()

    def load(
        self, batch_id: str, lines: Iterable[Line], max_lines: int, room: int | None = None
    ) -> tuple[str, str] | None:
        """Copy a validated file's lines in, answer the refused ones, and start the batch (validating ->
        in_progress). All or nothing: a crash leaves the batch validating, to be loaded again. None, or why
        the file as a whole is refused, as (code, message) (then nothing is kept). `room`: the bytes the
        batch's tenant may still write (as `record` reads it); the batch's copy of its requests and its
        refused lines' answers must fit in it."""
        try:
            with self._write():
                self._load(batch_id, lines, max_lines, room)
        except _FileRefused as e:
            return e.args
        return None

    def pending(self, batch_id: str, after_line: int, limit: int = _CHUNK) -> list[PendingLine]:
        """Unanswered lines after `after_line`, in file order."""
        with self._read():
            rows = self._db.execute(
                "SELECT line, custom_id, url, request FROM batch_lines"
                " WHERE batch = ? AND line > ? AND result IS NULL ORDER BY line LIMIT ?",
                (batch_id, after_line, limit),
            ).fetchall()
        return [PendingLine(batch_id, line, cid, url, json.loads(req)) for line, cid, url, req in rows]

    def unanswered(self, batch_id: str) -> int:
        with self._read():
            return self._db.execute(
                "SELECT COUNT(*) FROM batch_lines WHERE batch = ? AND result IS NULL", (batch_id,)
            ).fetchone()[0]

    def record(self, batch_id: str, line: int, result: dict, room: int | None = None) -> bool:
        """Answer a line, once: False if it already had an answer (nothing changes then). `room`: the bytes
        the batch's tenant may still write (its files quota less its files); an answer that would take what
        the tenant's unfinished batches hold (`pending_bytes`) past it is not recorded (OverQuota: the batch
        stops), so no batch writes more than its tenant's quota."""
        with self._write():
            return self._record(batch_id, line, result, room)

    def stop(self, batch_id: str, error: dict) -> bool:
        """End a running batch early (in_progress -> finalizing, `error` in its errors): its answered lines
        are written to its files, the others are not run; it ends `failed`. False if it was no longer
        running (a cancel came first)."""
        with self._write():
            status = self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
            if status != "in_progress":
                return False
            self._db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps([error]), batch_id))
            self._set_status(batch_id, "finalizing")
            return True

    def add_error(self, batch_id: str, error: dict) -> None:
        with self._write():
            (errors,) = self._db.execute("SELECT errors FROM batches WHERE id = ?", (batch_id,)).fetchone()
            errors = [*json.loads(errors or "[]"), error]
            self._db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))

    def stopped(self, batch_id: str) -> bool:
        """Whether the batch was stopped early (`stop`): it ends failed, not completed."""
        with self._read():
            row = self._db.execute("SELECT errors FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] is not None

    def pending_bytes(self, tenant: str) -> int:
        """The bytes the tenant's unfinished batches hold: their answers (their files are not written yet) and
        their copies of the requests not answered yet."""
        with self._read():
            return self._pending_bytes(tenant)

    def answer_rest(self, batch_id: str, code: str, message: str, room: int | None = None) -> int:
        """Answer the unanswered lines with an error (the batch was cancelled, or expired), in file order, as
        far as they fit in `room` (as `record` reads it); the number of lines left without an answer."""
        after, full = 0, False
        while not full and (rows := self.pending(batch_id, after)):
            with self._write():
                for row in rows:
                    try:
                        self._record(batch_id, row.line, error_line(row.custom_id, code, message), room)
                    except OverQuota:  # the lines answered so far stay answered
                        full = True
                        break
                    after = row.line
        return self.unanswered(batch_id) if full else 0

    def results(self, batch_id: str, ok: bool) -> Iterator[bytes]:
        """The answered lines of the output (ok) or the error file, in file order, as JSONL."""
        last = 0
        while True:
            with self._read():
                rows = self._db.execute(
                    "SELECT line, result FROM batch_lines WHERE batch = ? AND line > ? AND ok = ?"
                    " ORDER BY line LIMIT ?",
                    (batch_id, last, int(ok), _CHUNK),
                ).fetchall()
            if not rows:
                return
            for last, result in rows:  # noqa: B007
                yield result.encode() + b"\n"

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed)."""
        with self._read():
            return self._db.execute(
                "SELECT completed, failed FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()

    def advance(self, batch_id: str, from_status: str, to_status: str) -> bool:
        """Move a batch on, if it still is in `from_status` (a cancel may have come in between)."""
        with self._write():
            if (
                self._db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]
                != from_status
            ):
                return False
            self._set_status(batch_id, to_status)
            return True

    def fail(self, batch_id: str, errors: list[dict]) -> None:
        with self._write():
            self._db.execute("DELETE FROM batch_lines WHERE batch = ?", (batch_id,))
            self._db.execute("UPDATE batches SET errors = ? WHERE id = ?", (json.dumps(errors), batch_id))
            self._set_status(batch_id, "failed")

    def finish(
        self, batch_id: str, status: str, output_file_id: str | None, error_file_id: str | None
    ) -> None:
        """The batch's last step: its files are written; its lines leave the table."""
        with self._write():
            self._db.execute(
                "UPDATE batches SET output_file_id = ?, error_file_id = ? WHERE id = ?",
                (output_file_id, error_file_id, batch_id),
            )
            self._set_status(batch_id, status)
            self._db.execute("DELETE FROM batch_lines WHERE batch = ?", (batch_id,))

    # -- under the lock -----------------------------------------------------------------------------------------
    def _load(self, batch_id: str, lines: Iterable[Line], max_lines: int, room: int | None) -> None:
        self._db.execute("DELETE FROM batch_lines WHERE batch = ?", (batch_id,))
        self._db.execute("UPDATE batches SET result_bytes = 0, request_bytes = 0 WHERE id = ?", (batch_id,))
        if room is not None:
            room -= self._pending_bytes(self._tenant(batch_id))
        total = failed = written = copied = 0
        model = first_refused = None
        for line in lines:
            total += 1
            if total > max_lines:
                raise _FileRefused(
                    "invalid_file", f"the file has more than {max_lines} requests, the most a batch may hold"
                )
            if line.error is not None:
                failed += 1
                result = error_line(line.custom_id, *line.error)
                written += _size(result)
                first_refused = first_refused or line.error[1]
                self._db.execute(
                    "INSERT INTO batch_lines (batch, line, custom_id, result, ok) VALUES (?, ?, ?, ?, 0)",
                    (batch_id, line.number, line.custom_id, compact(result)),
                )
            else:
                if model is None and isinstance(line.body.get("model"), str):
                    model = line.body["model"]
                request = json.dumps(line.body)  # ASCII: its length is its bytes
                copied += len(request)
                self._db.execute(
                    "INSERT INTO batch_lines (batch, line, custom_id, url, request) VALUES (?, ?, ?, ?, ?)",
                    (batch_id, line.number, line.custom_id, line.url, request),
                )
            if room is not None and written + copied > room:  # nothing the batch keeps may pass the quota
                what = "the copy of its requests it keeps until they are answered, and its refused lines' answers"
                if first_refused:
                    what += f" (the first refused: {first_refused})"
                raise _FileRefused(
                    "quota_exceeded", quota_message(what, written + copied, room) + "; nothing ran"
                )
        if total == 0:
            raise _FileRefused("invalid_file", "the file holds no requests")
        self._db.execute(
            "UPDATE batches SET total = ?, failed = ?, completed = 0, model = ?, result_bytes = ?, request_bytes = ?"
            " WHERE id = ?",
            (total, failed, model, written, copied, batch_id),
        )
        self._db.execute(
            "UPDATE batches SET status = 'in_progress', in_progress_at = ? WHERE id = ? AND status = 'validating'",
            (int(time.time()), batch_id),
        )

    def _tenant(self, batch_id: str) -> str:
        return self._db.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def _pending_bytes(self, tenant: str) -> int:
        marks = ", ".join("?" * len(UNFINISHED))
        return self._db.execute(
            f"SELECT COALESCE(SUM(result_bytes + request_bytes), 0) FROM batches WHERE tenant = ? AND status IN ({marks})",
            (tenant, *UNFINISHED),
        ).fetchone()[0]

    def _record(self, batch_id: str, line: int, result: dict, room: int | None = None) -> bool:
        """The answer in place of the line's request (`record`)."""
        row = self._db.execute(
            "SELECT length(request) FROM batch_lines WHERE batch = ? AND line = ? AND result IS NULL",
            (batch_id, line),
        ).fetchone()
        if row is None:
            return False
        freed, size = row[0] or 0, _size(result)
        if room is not None:
            room -= self._pending_bytes(self._tenant(batch_id))
            if size - freed > room:
                raise OverQuota(quota_message("its answer", size, room + freed))
        ok = succeeded(result)
        usage = Usage.of(result)
        self._db.execute(
            "UPDATE batch_lines SET result = ?, ok = ?, request = NULL WHERE batch = ? AND line = ?",
            (compact(result), int(ok), batch_id, line),
        )
        counter = "completed" if ok else "failed"
        self._db.execute(
            f"UPDATE batches SET {counter} = {counter} + 1, input_tokens = input_tokens + ?,"
            " cached_tokens = cached_tokens + ?, output_tokens = output_tokens + ?,"
            " reasoning_tokens = reasoning_tokens + ?, result_bytes = result_bytes + ?,"
            " request_bytes = MAX(request_bytes - ?, 0) WHERE id = ?",
            (usage.input_tokens, usage.cached_tokens, usage.output_tokens, usage.reasoning_tokens, size, freed,
             batch_id),
        )  # fmt: skip
        return True

    def _get(self, tenant: str, batch_id: str) -> dict | None:
        row = self._db.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM batches WHERE tenant = ? AND id = ?", (tenant, batch_id)
        ).fetchone()
        return None if row is None else _object(row)

    def _set_status(self, batch_id: str, status: str) -> None:
        self._db.execute(
            f"UPDATE batches SET status = ?, {_STATUS_TIME[status]} = ? WHERE id = ?",
            (status, int(time.time()), batch_id),
        )
