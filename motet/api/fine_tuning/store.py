"""Fine-tuning jobs, their events and checkpoints, in SQLite (`fine_tuning.sqlite3` under the data directory).

A job is a row with its OpenAI FineTuningJob fields, what it was validated to be (examples, tokens an epoch) and
how far it has got; its events (OpenAI's FineTuningJobEvent: status changes, a metrics event a step) and its
checkpoints (one an epoch, each a model of the tenant's) are rows of their own. Every read and change the API
makes is scoped to the tenant: another tenant's job reads as missing. Statuses, as OpenAI's: queued -> running ->
succeeded | failed | cancelled, and paused (from queued or running; resumed: queued again). A job whose files are
validated after its create call answers is `validating_files` until then (motet/api/fine_tuning/validation.py):
queued, or failed with its files' error. A job `running` when the server stopped is queued again when it starts
(`recover`): it goes on from its last checkpoint, or from the start, as its event says.

A job admitted holds the room its adapters will take in the tenant's adapter quota (motet/api/adapters/store.py)
until it ends: the bytes of each (`adapter_bytes`) times the adapters it has yet to store (`adapters_left`: one a
checkpoint, then its model), one fewer in the transaction that records each one stored. The reservation is rows of
this file, so a restart keeps it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from motet.api.sqlite_store import SQLiteStore
from motet.training.fair_queue import Queued
from motet.training.hyperparameters import OPENAI_NAMES, Hyperparameters

FILENAME = "fine_tuning.sqlite3"
DAY_S = 86_400
ACTIVE = ("validating_files", "queued", "running", "paused")
FINISHED = ("succeeded", "failed", "cancelled")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- listing and queue order
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        model TEXT NOT NULL,            -- as asked: the base model's name, or an adapter of the tenant's
        model_name TEXT NOT NULL,       -- the fine-tuned model it makes (fine_tuned_model once it succeeds)
        training_file TEXT NOT NULL,
        validation_file TEXT,
        suffix TEXT,
        seed INTEGER NOT NULL,
        method TEXT NOT NULL,           -- supervised | dpo
        hyperparameters TEXT NOT NULL,  -- JSON: the resolved ones
        metadata TEXT,                  -- JSON object, or NULL
        status TEXT NOT NULL,
        error TEXT,                     -- JSON {code, message, param}, or NULL
        fine_tuned_model TEXT,
        created_at INTEGER NOT NULL,
        finished_at INTEGER,
        trained_tokens INTEGER NOT NULL DEFAULT 0,
        estimated_finish INTEGER,
        result_files TEXT NOT NULL DEFAULT '[]',
        examples INTEGER NOT NULL,
        tokens_per_epoch INTEGER NOT NULL,
        total_steps INTEGER,
        step INTEGER NOT NULL DEFAULT 0,
        -- each adapter it stores (a checkpoint an epoch, its model), and those it has yet to store: reserved
        -- while it is active
        adapter_bytes INTEGER NOT NULL DEFAULT 0,
        adapters_left INTEGER NOT NULL DEFAULT 0,
        eval_file TEXT                  -- motet's eval file, or NULL
    )""",
    "CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, seq)",
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status)",
    """CREATE TABLE IF NOT EXISTS events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        job TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        level TEXT NOT NULL,
        message TEXT NOT NULL,
        type TEXT NOT NULL,             -- message | metrics
        data TEXT                       -- JSON, or NULL
    )""",
    "CREATE INDEX IF NOT EXISTS events_by_job ON events (job, seq)",
    """CREATE TABLE IF NOT EXISTS checkpoints (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        job TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        step INTEGER NOT NULL,
        model TEXT NOT NULL,
        metrics TEXT NOT NULL,
        deleted INTEGER NOT NULL DEFAULT 0,  -- 1: the tenant deleted its model (no longer listed)
        UNIQUE (job, step)
    )""",
)
_JOB = ("id", "tenant", "model", "model_name", "training_file", "validation_file", "suffix", "seed", "method",
        "hyperparameters", "metadata", "status", "error", "fine_tuned_model", "created_at", "finished_at",
        "trained_tokens", "estimated_finish", "result_files", "examples", "tokens_per_epoch", "total_steps",
        "step")  # fmt: skip
_EVENT = ("id", "created_at", "level", "message", "type", "data")
_CHECKPOINT = ("id", "job", "created_at", "step", "model", "metrics")


class QuotaExceeded(Exception):
    """A job the tenant's quotas have no room for: `code` (OpenAI's) and the message."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Quotas:
    """Per tenant: jobs queued, running or paused at once; tokens its jobs train in a day (None: no limit); jobs
    whose files are validated at once (the others wait their turn)."""

    max_active: int | None = 4
    max_tokens_per_day: int | None = None
    max_validating: int = 1


def stored_adapters(h: Hyperparameters) -> int:
    """The adapters a job stores as the tenant's: each epoch's checkpoint, then its model."""
    return h.n_epochs + 1


def new_job_id() -> str:
    return f"ftjob-{secrets.token_hex(12)}"


def _job(row: tuple) -> dict:
    """The OpenAI FineTuningJob of a row (the resolved LoRA options beside OpenAI's hyperparameters)."""
    r = dict(zip(_JOB, row, strict=True))
    hyper = json.loads(r["hyperparameters"])
    openai = {n: hyper[n] for n in OPENAI_NAMES}
    return {
        "id": r["id"],
        "object": "fine_tuning.job",
        "created_at": r["created_at"],
        "error": json.loads(r["error"]) if r["error"] else None,
        "fine_tuned_model": r["fine_tuned_model"],
        "finished_at": r["finished_at"],
        "hyperparameters": openai,
        "model": r["model"],
        "organization_id": r["tenant"],
        "result_files": json.loads(r["result_files"]),
        "seed": r["seed"],
        "status": r["status"],
        "trained_tokens": r["trained_tokens"],
        "training_file": r["training_file"],
        "validation_file": r["validation_file"],
        "estimated_finish": r["estimated_finish"] if r["status"] in ACTIVE else None,
        "integrations": [],
        "metadata": json.loads(r["metadata"]) if r["metadata"] else None,
        "method": {"type": r["method"], r["method"]: {"hyperparameters": hyper}},
        "suffix": r["suffix"],
    }


def _event(row: tuple) -> dict:
    r = dict(zip(_EVENT, row, strict=True))
    return {
        "id": r["id"],
        "object": "fine_tuning.job.event",
        "created_at": r["created_at"],
        "level": r["level"],
        "message": r["message"],
        "type": r["type"],
        "data": json.loads(r["data"]) if r["data"] else {},
    }


def _checkpoint(row: tuple) -> dict:
    r = dict(zip(_CHECKPOINT, row, strict=True))
    return {
        "id": r["id"],
        "object": "fine_tuning.job.checkpoint",
        "created_at": r["created_at"],
        "fine_tuned_model_checkpoint": r["model"],
        "fine_tuning_job_id": r["job"],
        "metrics": json.loads(r["metrics"]),
        "step_number": r["step"],
    }


class FineTuningStore(SQLiteStore):
    def __init__(self, data_dir: str | Path):
        super().__init__(Path(data_dir) / FILENAME, _SCHEMA)
        # the columns a store written by an earlier motet lacks (jobs reserving their room, checkpoints deleted)
        for table, column in (
            ("jobs", "adapter_bytes"),
            ("jobs", "adapters_left"),
            ("checkpoints", "deleted"),
            ("jobs", "eval_file"),
        ):
            if column not in {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}:
                kind = "TEXT" if column == "eval_file" else "INTEGER NOT NULL DEFAULT 0"
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self.jobs_dir = Path(data_dir) / "fine_tuning"  # each job's run directory (motet/training/trainer.py)

    def run_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    # -- the API's side ---------------------------------------------------------------------------------------
    def create(
        self,
        job_id: str,
        tenant: str,
        *,
        model: str,
        model_name: str,
        training_file: str,
        validation_file: str | None,
        eval_file: str | None = None,
        suffix: str | None,
        seed: int,
        method: str,
        hyperparameters: Hyperparameters,
        metadata: dict | None,
        examples: int,
        tokens_per_epoch: int,
        events: list[str],
        quotas: Quotas = Quotas(),
        adapter_bytes: int = 0,
        validated: bool = True,
    ) -> dict:
        """A job, queued with its first events where its files are `validated` (else `validating_files`, until
        `validated` says how it went); QuotaExceeded where the tenant's quotas have no room for it (checked and taken
        in one transaction: two jobs at once cannot both take the last room). It reserves `adapter_bytes` for each
        adapter it will store (`stored_adapters`)."""
        now = int(time.time())
        with self._write():
            self._check(tenant, tokens_per_epoch * hyperparameters.n_epochs, quotas, now)
            self._db.execute(
                "INSERT INTO jobs (id, tenant, model, model_name, training_file, validation_file, eval_file, suffix,"
                " seed, method, hyperparameters, metadata, status, created_at, examples, tokens_per_epoch,"
                " adapter_bytes, adapters_left) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, tenant, model, model_name, training_file, validation_file, eval_file, suffix, seed, method,
                 json.dumps(hyperparameters.object()), json.dumps(metadata) if metadata else None,
                 "queued" if validated else "validating_files", now, examples, tokens_per_epoch, adapter_bytes,
                 stored_adapters(hyperparameters)),
            )  # fmt: skip
            for message in events:
                self._add_event(job_id, message)
            return self._get(tenant, job_id)

    def get(self, tenant: str, job_id: str) -> dict | None:
        with self._read():
            return self._get(tenant, job_id)

    def page(
        self,
        tenant: str,
        after: str | None,
        limit: int,
        metadata: dict[str, str] | None = None,
        without_metadata: bool = False,
    ) -> tuple[list[dict], bool] | None:
        """The tenant's jobs, newest first (None: `after` names no job of theirs); only those whose metadata holds
        each key of `metadata` with its value, or (`without_metadata`) those that have none: OpenAI's filters."""
        if without_metadata:
            only, only_args = "metadata IS NULL", ()
        else:  # (json_each: a key of any characters, given as a parameter)
            has = ("EXISTS (SELECT 1 FROM json_each(jobs.metadata) AS m WHERE m.key = ? AND m.type = 'text'"
                   " AND m.value = ?)")  # fmt: skip
            only = " AND ".join([has] * len(metadata or {}))
            only_args = tuple(x for item in (metadata or {}).items() for x in item)
        return self._keyset_page("jobs", _JOB, _job, tenant, after, limit, only=only, only_args=only_args)

    def events(self, tenant: str, job_id: str, after: str | None, limit: int):
        """A page of the job's events, newest first (None: `after` names no event of the job's)."""
        return self._keyset_page(
            "events", _EVENT, _event, tenant, after, limit, where="job = ?", args=(job_id,)
        )

    def checkpoints(self, tenant: str, job_id: str, after: str | None, limit: int):
        """A page of the job's checkpoints whose models the tenant has not deleted, newest first."""
        return self._keyset_page(
            "checkpoints", _CHECKPOINT, _checkpoint, tenant, after, limit, where="job = ?", args=(job_id,),
            only="deleted = 0",
        )  # fmt: skip

    def model_deleted(self, tenant: str, model: str) -> None:
        """The tenant deleted its model `model`: a checkpoint that was it is no longer listed, as OpenAI's (its row
        stays, so that a job that goes on after a restart does not store it again)."""
        with self._write():
            self._db.execute(
                "UPDATE checkpoints SET deleted = 1 WHERE tenant = ? AND model = ?", (tenant, model)
            )

    def reserved_bytes(self, tenant: str, besides: str | None = None) -> int:
        """The bytes of adapters the tenant's active jobs (but `besides`) have yet to store."""
        marks = ", ".join("?" * len(ACTIVE))
        with self._read():
            return self._db.execute(
                f"SELECT COALESCE(SUM(adapter_bytes * adapters_left), 0) FROM jobs WHERE tenant = ? AND"
                f" status IN ({marks}) AND id IS NOT ?",
                (tenant, *ACTIVE, besides),
            ).fetchone()[0]

    def check_quotas(self, tenant: str, tokens: int, quotas: Quotas) -> None:
        """QuotaExceeded where a job of `tokens` training tokens would not fit now (`create` checks again)."""
        with self._read():
            self._check(tenant, tokens, quotas, int(time.time()))

    def change(
        self, tenant: str, job_id: str, to: str, allowed: tuple[str, ...], message: str
    ) -> tuple[dict, bool] | None:
        """Move the tenant's job to `to` if its status is one of `allowed` (with an event); the job as it is now and
        whether it moved (None: no such job of theirs)."""
        with self._write():
            job = self._get(tenant, job_id)
            if job is None:
                return None
            if job["status"] not in allowed:
                return job, False
            self._set_status(job_id, to)
            self._add_event(job_id, message)
            return self._get(tenant, job_id), True

    # -- the runner's side ----------------------------------------------------------------------------------
    def validating(self) -> list[tuple[str, str]]:
        """(job id, tenant) of the jobs whose files are being validated (after a restart: to be validated again)."""
        with self._read():
            rows = self._db.execute(
                "SELECT id, tenant FROM jobs WHERE status = 'validating_files' ORDER BY seq"
            )
            return [tuple(r) for r in rows.fetchall()]

    def files_of(self, job_id: str) -> dict[str, str | None]:
        """The job's files, by their parameters' names."""
        with self._read():
            row = self._db.execute(
                "SELECT training_file, validation_file, eval_file FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
        return dict(zip(("training_file", "validation_file", "eval_file"), row, strict=True))

    def validated(
        self, job_id: str, examples: int, tokens_per_epoch: int, quotas: Quotas, event: str
    ) -> bool:
        """Its files validated: the job is queued (False: it was cancelled meanwhile); QuotaExceeded where its
        tokens no longer fit in the tenant's day."""
        with self._write():
            if self._status(job_id) != "validating_files":
                return False
            tenant, hyper = self._db.execute(
                "SELECT tenant, hyperparameters FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            self._check(tenant, tokens_per_epoch * json.loads(hyper)["n_epochs"], quotas, int(time.time()),
                        active=False)  # fmt: skip
            self._db.execute(
                "UPDATE jobs SET examples = ?, tokens_per_epoch = ? WHERE id = ?",
                (examples, tokens_per_epoch, job_id),
            )
            self._set_status(job_id, "queued")
            self._add_event(job_id, event)
            return True

    def queued(self) -> list[Queued]:
        with self._read():
            rows = self._db.execute(
                "SELECT id, tenant, seq FROM jobs WHERE status = 'queued' ORDER BY seq"
            ).fetchall()
        return [Queued(*r) for r in rows]

    def recover(self, resumes_from: Callable[[str], int | None]) -> list[str]:
        """Jobs that were running when the server stopped: queued again, their event saying where each goes on from
        (`resumes_from(job_id)`: the step of its last checkpoint; None: it starts over); those whose files were
        being validated are told they are validated again (the runner does it: `validating`)."""
        with self._write():
            for (job_id,) in self._db.execute(
                "SELECT id FROM jobs WHERE status = 'validating_files'"
            ).fetchall():
                self._add_event(
                    job_id,
                    "The server restarted while the job's files were validated: they are validated again",
                )
            ids = [r[0] for r in self._db.execute("SELECT id FROM jobs WHERE status = 'running'").fetchall()]
            for job_id in ids:
                step = resumes_from(job_id)
                where = (
                    "starts over: it had no checkpoint yet"
                    if step is None
                    else f"goes on from its checkpoint of step {step}"
                )
                self._set_status(job_id, "queued")
                self._add_event(job_id, f"The server restarted: the job is queued again and {where}")
        return ids

    def job(self, job_id: str) -> dict:
        """Any tenant's job, for the runner."""
        with self._read():
            tenant = self._db.execute("SELECT tenant FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
            return self._get(tenant, job_id)

    def internals(self, job_id: str) -> dict:
        """What the runner needs that the job's object does not show."""
        with self._read():
            row = self._db.execute(
                "SELECT model_name, model, examples, tokens_per_epoch, total_steps, step FROM jobs WHERE id = ?",
                (job_id,),
            ).fetchone()
        names = ("model_name", "model", "examples", "tokens_per_epoch", "total_steps", "step")
        return dict(zip(names, row, strict=True))

    def start(self, job_id: str) -> bool:
        """queued -> running (False: it was paused or cancelled meanwhile)."""
        with self._write():
            if self._status(job_id) != "queued":
                return False
            self._set_status(job_id, "running")
            return True

    def progress(
        self, job_id: str, step: int, total_steps: int, trained_tokens: int, finish: int | None
    ) -> None:
        with self._write():
            self._db.execute(
                "UPDATE jobs SET step = ?, total_steps = ?, trained_tokens = MAX(trained_tokens, ?),"
                " estimated_finish = ? WHERE id = ?",
                (step, total_steps, trained_tokens, finish, job_id),
            )

    def add_event(
        self, job_id: str, message: str, level: str = "info", kind: str = "message", data=None
    ) -> None:
        with self._write():
            self._add_event(job_id, message, level, kind, data)

    def has_checkpoint(self, job_id: str, step: int) -> bool:
        with self._read():
            row = self._db.execute("SELECT 1 FROM checkpoints WHERE job = ? AND step = ?", (job_id, step))
            return row.fetchone() is not None

    def add_checkpoint(self, job_id: str, step: int, model: str, metrics: dict) -> bool:
        """False: the job has it already (a job that went on from a checkpoint saves it no more, but a restart
        may report a step again)."""
        with self._write():
            tenant = self._db.execute("SELECT tenant FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
            done = self._db.execute(
                "INSERT OR IGNORE INTO checkpoints (id, tenant, job, created_at, step, model, metrics)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    f"ftckpt-{secrets.token_hex(12)}",
                    tenant,
                    job_id,
                    int(time.time()),
                    step,
                    model,
                    json.dumps(metrics),
                ),
            ).rowcount
            if done:
                self._stored_one(job_id)
                self._add_event(
                    job_id, f"Checkpoint created at step {step}", data={"step": step, "model": model}
                )
            return bool(done)

    def model_stored(self, job_id: str) -> None:
        """The job's model is stored as the tenant's adapter: it has no more room reserved."""
        with self._write():
            self._stored_one(job_id)

    def metrics(self, job_id: str) -> list[dict]:
        """The job's metrics events' data, in order."""
        with self._read():
            rows = self._db.execute(
                "SELECT data FROM events WHERE job = ? AND type = 'metrics' ORDER BY seq", (job_id,)
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def succeed(self, job_id: str, trained_tokens: int, result_files: list[str]) -> bool:
        """The job's model is stored: succeeded (False: it was cancelled meanwhile)."""
        with self._write():
            if self._status(job_id) not in ("running", "paused"):
                return False
            self._db.execute(
                "UPDATE jobs SET fine_tuned_model = model_name, trained_tokens = ?, result_files = ?,"
                " estimated_finish = NULL WHERE id = ?",
                (trained_tokens, json.dumps(result_files), job_id),
            )
            self._set_status(job_id, "succeeded")
            model = self._db.execute("SELECT model_name FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
            self._add_event(job_id, f"New fine-tuned model created: {model}")
            self._add_event(job_id, "The job has successfully completed")
            return True

    def fail(self, job_id: str, code: str, message: str, param: str | None = None) -> bool:
        with self._write():
            if self._status(job_id) in FINISHED:
                return False
            error = {"code": code, "message": message, "param": param}
            self._db.execute("UPDATE jobs SET error = ? WHERE id = ?", (json.dumps(error), job_id))
            self._set_status(job_id, "failed")
            self._add_event(job_id, f"The job failed: {message}", level="error")
            return True

    def status(self, job_id: str) -> str:
        with self._read():
            return self._status(job_id)

    # -- under the lock -----------------------------------------------------------------------------------------
    def _check(self, tenant: str, tokens: int, quotas: Quotas, now: int, active: bool = True) -> None:
        """QuotaExceeded where one more job (`active`: counted among the tenant's active jobs) of `tokens` does not
        fit."""
        if active and quotas.max_active is not None:
            marks = ", ".join("?" * len(ACTIVE))
            count = self._db.execute(
                f"SELECT COUNT(*) FROM jobs WHERE tenant = ? AND status IN ({marks})", (tenant, *ACTIVE)
            ).fetchone()[0]
            if count >= quotas.max_active:
                raise QuotaExceeded(
                    f"this tenant has {count} fine-tuning jobs validating, queued, running or paused, the most it may have at "
                    f"once (--fine-tuning-max-jobs-per-tenant): wait for one to finish, or cancel one",
                    "rate_limit_exceeded",
                )
        if quotas.max_tokens_per_day is not None:
            used = self._tokens_since(tenant, now - DAY_S)
            if used + tokens > quotas.max_tokens_per_day:
                raise QuotaExceeded(
                    f"this job trains {tokens} tokens and this tenant's jobs of the last 24 hours {used}, over the "
                    f"server's limit of {quotas.max_tokens_per_day} training tokens a day per tenant "
                    "(--fine-tuning-max-tokens-per-day): train on fewer examples or epochs, or later",
                    "insufficient_quota",
                )

    def _tokens_since(self, tenant: str, since: int) -> int:
        """The training tokens of the tenant's jobs created since `since`: what a job will train (its tokens an
        epoch times its epochs), or what it trained where it failed or was cancelled."""
        rows = self._db.execute(
            "SELECT status, trained_tokens, tokens_per_epoch, hyperparameters FROM jobs"
            " WHERE tenant = ? AND created_at >= ?",
            (tenant, since),
        ).fetchall()
        total = 0
        for status, trained, per_epoch, hyper in rows:
            total += (
                trained if status in ("failed", "cancelled") else per_epoch * json.loads(hyper)["n_epochs"]
            )
        return total

    def _stored_one(self, job_id: str) -> None:
        self._db.execute("UPDATE jobs SET adapters_left = MAX(adapters_left - 1, 0) WHERE id = ?", (job_id,))

    def _get(self, tenant: str, job_id: str) -> dict | None:
        row = self._db.execute(
            f"SELECT {', '.join(_JOB)} FROM jobs WHERE tenant = ? AND id = ?", (tenant, job_id)
        ).fetchone()
        return None if row is None else _job(row)

    def _status(self, job_id: str) -> str:
        return self._db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]

    def _set_status(self, job_id: str, status: str) -> None:
        finished = int(time.time()) if status in FINISHED else None
        self._db.execute(
            "UPDATE jobs SET status = ?, finished_at = ? WHERE id = ?", (status, finished, job_id)
        )

    def _add_event(
        self, job_id: str, message: str, level: str = "info", kind: str = "message", data=None
    ) -> None:
        tenant = self._db.execute("SELECT tenant FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
        self._db.execute(
            "INSERT INTO events (id, tenant, job, created_at, level, message, type, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (f"ftevent-{secrets.token_hex(12)}", tenant, job_id, int(time.time()), level, message, kind,
             json.dumps(data) if data is not None else None),
        )  # fmt: skip
