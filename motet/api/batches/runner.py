"""The batch runner: the lines of every unfinished batch, sent through the server's own routes at low priority.

Each line is a request to the app itself (an in-process ASGI call on the batch's endpoint): the same
validation, the same serving path, the same answers as over HTTP. It runs as the tenant that created the batch,
named in its ASGI scope (BATCH_SCOPE_KEY), not by a key: a key rotated while the batch runs (SIGHUP) changes
nothing, no line looks through the keys, and the tenant's interactive limits (motet/api/rate_limits.py) do not
count it (batches have their own bounds: `LowPriority` and the tenant's files quota). A line is answered once
(motet/api/batches/store.py records the answer before counting it); a line that was running when the server
stopped has no answer and is sent again after the restart. A busy or starting server (429, 503, 507) is not
the line's fault: the line is sent again after the Retry-After the server gave.

Batches take only the capacity live traffic leaves: `LowPriority` (the one scheduling hook) lets a line go
only while nothing waits (no live request queued or admitted but not running) and at most `max_in_flight`
lines run at once, and `BatchGate` gives the waiting batches turns (round robin), so one tenant's large batch
does not hold back another's. While the server drains (SIGTERM) no line is sent.

What a batch keeps counts against the tenant's files quota (motet/api/batches/store.py): a batch whose next
answer would pass it stops there (`failed`, `quota_exceeded` in its errors; the answers recorded
before are in its files), so its output and error files never take the tenant past its quota.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from motet.actors.front import Stats
from motet.api.auth import DEFAULT_TENANT, Authenticator
from motet.api.batches.lines import (
    CANCELLED,
    EXPIRED,
    MAX_LINES,
    RETRIED_STATUSES,
    parse_lines,
    refusal,
    response_line,
)
from motet.api.batches.priority import LowPriority
from motet.api.batches.store import BatchStore, OverQuota, PendingLine
from motet.api.errors import APIError
from motet.api.files.store import FileStore
from motet.api.in_process import call_route
from motet.api.sqlite_store import StorageFailure

log = logging.getLogger("motet.batches")

POLL_S = 0.02  # how often a waiting line looks at the load again
RETRY_AFTER_DEFAULT_S = 1.0
STORAGE_RETRY_S = 5.0  # a batch whose storage failed tries again after this


class BatchGate:
    """Batch lines wait here for their turn (batches in turn, in the order they asked) and for the policy."""

    def __init__(self, policy: LowPriority, stats: Callable[[], Stats], accepting: Callable[[], bool]):
        self.policy, self.stats, self.accepting = policy, stats, accepting
        self.in_flight = 0
        self._turns: deque[object] = deque()

    async def acquire(self) -> None:
        turn = object()
        self._turns.append(turn)
        try:
            while not (
                self._turns[0] is turn
                and self.accepting()
                and self.policy.admits(self.stats(), self.in_flight)
            ):
                await anyio.sleep(POLL_S)
        finally:
            self._turns.remove(turn)
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


# -- one line through the app ---------------------------------------------------------------------------------
async def answer(
    app, url: str, custom_id: str | None, body: dict, tenant: str = DEFAULT_TENANT
) -> dict | float:
    """A line's answer (an output or error line) run as `tenant`, or, when the server is busy, how long to wait
    to retry."""
    if (refused := refusal(body)) is not None:
        return response_line(custom_id, refused.status, refused.body())
    status, headers, content = await call_route(app, url, json.dumps(body).encode(), tenant)
    if status in RETRIED_STATUSES:
        try:
            return max(RETRY_AFTER_DEFAULT_S, float(headers.get("retry-after", RETRY_AFTER_DEFAULT_S)))
        except ValueError:
            return RETRY_AFTER_DEFAULT_S
    try:
        payload = json.loads(content)
    except ValueError:
        payload = {"error": {"message": "the response was not JSON", "type": "server_error", "param": None,
                             "code": None}}  # fmt: skip
    return response_line(custom_id, status, payload)


def tenant_has_key(auth: Authenticator, tenant: str) -> bool:
    """Whether a batch's tenant still has an API key: a batch runs as its tenant through key rotations, but
    the lines of a tenant whose keys were all removed are answered 401 (one dictionary lookup, never a key
    search: SIGHUP swaps `state.auth`)."""
    return not auth.enabled or auth.key_of(tenant) is not None


def _no_key(custom_id: str | None) -> dict:
    error = APIError(401, "the batch's tenant has no API key any more (the keys file was reloaded without one)",
                     code="invalid_api_key")  # fmt: skip
    return response_line(custom_id, error.status, error.body())


def result_file_id(batch_id: str, kind: str) -> str:
    """A batch's output or error file id: the same each time it is written, so writing it again replaces it."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


# -- the runner -----------------------------------------------------------------------------------------------
def _storage_failure(e: BaseException) -> StorageFailure | None:
    """The storage failure `e` is, or holds (a task group raises its tasks' errors as a group)."""
    if isinstance(e, StorageFailure):
        return e
    for inner in e.exceptions if isinstance(e, BaseExceptionGroup) else ():
        if (found := _storage_failure(inner)) is not None:
            return found
    return None


async def _thread(call, *args):
    return await anyio.to_thread.run_sync(functools.partial(call, *args))


class BatchRunner:
    def __init__(self, store: BatchStore, files: FileStore, policy: LowPriority | None = None):
        self.store, self.files = store, files
        files.reserved = store.pending_bytes  # a tenant's running batches' answers count as its files
        self.policy = policy or LowPriority()
        self.gate: BatchGate | None = None
        self._app: Any = None
        self._tg: TaskGroup | None = None
        self._drivers: set[str] = set()
        self._lines: dict[str, anyio.CancelScope] = {}  # batch id -> the scope its running lines live in

    async def run(self, app) -> None:
        """Run every unfinished batch, and those created later, until cancelled (the app's lifespan)."""
        state = app.state.motet
        while not state.system.ready:  # the model is loading
            await anyio.sleep(0.1)
        self._app = app
        self.gate = BatchGate(
            self.policy, state.system.stats, lambda: state.system.ready and not state.draining
        )
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while True:  # what was running when the server stopped resumes
                try:
                    unfinished = await _thread(self.store.unfinished)
                    break
                except StorageFailure as e:
                    log.warning("batches: storage failed (%s); trying again in %gs", e.cause, STORAGE_RETRY_S)
                    await anyio.sleep(STORAGE_RETRY_S)
            for batch in unfinished:
                self.start(batch.id)
            await anyio.sleep_forever()

    def start(self, batch_id: str) -> None:
        """Run a batch now (if the runner has not started yet, it finds the batch in the store when it does)."""
        if self._tg is not None and batch_id not in self._drivers:
            self._drivers.add(batch_id)
            self._tg.start_soon(self._drive, batch_id)

    def cancel(self, batch_id: str) -> None:
        """The batch was marked cancelling: stop its running lines now (they stay unanswered)."""
        if (scope := self._lines.get(batch_id)) is not None:
            scope.cancel()

    async def _drive(self, batch_id: str) -> None:
        """Take a batch through its states to a finished one, from wherever it stands."""
        try:
            while True:
                try:
                    status = await _thread(self.store.status, batch_id)
                    if status == "validating":
                        await self._validate(batch_id)
                    elif status == "in_progress":
                        await self._run_lines(batch_id)
                    elif status == "finalizing":  # stopped early (over the quota): failed
                        stopped = await _thread(self.store.stopped, batch_id)
                        await self._finish(batch_id, "failed" if stopped else "completed")
                    elif status == "cancelling":
                        await self._answer_rest(batch_id, *CANCELLED)
                        await self._finish(batch_id, "cancelled")
                    else:
                        return
                except Exception as e:  # a full or failing disk: the batch waits, it is not lost
                    if (failure := _storage_failure(e)) is None:
                        raise
                    log.warning(
                        "batch %s: storage failed (%s); trying again in %gs",
                        batch_id,
                        failure.cause,
                        STORAGE_RETRY_S,
                    )
                    await anyio.sleep(STORAGE_RETRY_S)
        except Exception:  # a bug: fail this batch, never the runner or another batch
            log.exception("batch %s failed", batch_id)
            error = {
                "code": "server_error",
                "message": "the batch failed on the server",
                "param": None,
                "line": None,
            }
            try:
                await _thread(self.store.fail, batch_id, [error])
            except Exception:
                log.exception("batch %s could not be marked failed", batch_id)
        finally:
            self._drivers.discard(batch_id)

    async def _validate(self, batch_id: str) -> None:
        tenant, file_id, endpoint = await _thread(self.store.input_of, batch_id)
        stored = await _thread(self.files.get, tenant, file_id)

        def load() -> tuple[str, str] | None:
            if stored is None:
                return "invalid_file", f"the input file {file_id!r} was deleted before the batch read it"
            with self.files.open(stored) as f:
                return self.store.load(batch_id, parse_lines(f, endpoint), MAX_LINES, self._room(tenant))

        if (refused := await _thread(load)) is not None:
            code, why = refused
            error = {"code": code, "message": why, "param": "input_file_id", "line": None}
            await _thread(self.store.fail, batch_id, [error])

    async def _run_lines(self, batch_id: str) -> None:
        """Send the batch's unanswered lines, until all are answered, it is cancelled or it expires."""
        tenant, _, _ = await _thread(self.store.input_of, batch_id)
        batch = await _thread(self.store.get, tenant, batch_id)
        in_flight: set[int] = set()
        retry: deque[PendingLine] = deque()
        with anyio.move_on_after(max(0.0, batch["expires_at"] - time.time())) as window:
            try:
                async with anyio.create_task_group() as lines:
                    self._lines[batch_id] = lines.cancel_scope
                    buffered: deque[PendingLine] = deque()
                    cursor = 0
                    while True:
                        if not buffered and not retry:
                            if await _thread(self.store.status, batch_id) != "in_progress":
                                lines.cancel_scope.cancel()  # cancelled meanwhile
                                break
                            buffered.extend(await _thread(self.store.pending, batch_id, cursor))
                            cursor = buffered[-1].line if buffered else cursor
                        line = retry.popleft() if retry else buffered.popleft() if buffered else None
                        if line is None:
                            if not in_flight:
                                break
                            await anyio.sleep(POLL_S)
                            continue
                        await self.gate.acquire()
                        in_flight.add(line.line)
                        lines.start_soon(self._line, line, tenant, in_flight, retry)
            finally:
                self._lines.pop(batch_id, None)
        if window.cancelled_caught:
            await self._answer_rest(batch_id, *EXPIRED)
            await self._finish(batch_id, "expired")
        elif await _thread(self.store.unanswered, batch_id) == 0:
            await _thread(self.store.advance, batch_id, "in_progress", "finalizing")
        # else cancelled (the drive loop reads `cancelling` and answers the rest) or stopped over the quota
        # (it reads `finalizing`)

    def _record(self, line: PendingLine, tenant: str, result: dict) -> None:
        """The answer, within what the tenant may still write (OverQuota: it does not fit)."""
        self.store.record(line.batch, line.line, result, self._room(tenant))

    def _room(self, tenant: str) -> int:
        """The bytes the tenant's batches may still write: its files quota less its files (the store takes its
        unfinished batches' answers off too)."""
        return self.files.max_bytes_per_tenant - self.files.usage(tenant)

    async def _answer_rest(self, batch_id: str, code: str, message: str) -> None:
        """Answer the lines that never ran (cancelled, expired) as far as the tenant's quota lets; the batch's
        errors say how many were left without an answer."""

        def run() -> None:
            tenant, _, _ = self.store.input_of(batch_id)
            if left := self.store.answer_rest(batch_id, code, message, self._room(tenant)):
                why = (
                    f"{left} lines that never ran are in neither file: their {code} answers would take the "
                    "tenant's files past the server's limit per tenant (--files-max-bytes-per-tenant)"
                )
                self.store.add_error(
                    batch_id, {"code": "quota_exceeded", "message": why, "param": None, "line": None}
                )

        await _thread(run)

    async def _stop(self, line: PendingLine, why: str) -> None:
        """The line's answer does not fit in the tenant's quota: the batch stops here (its other running lines
        are stopped unanswered) and ends failed, its answers so far in its files."""
        message = (
            f"the batch stopped at line {line.line} (the lines answered before it are in its files): {why}"
        )
        error = {"code": "quota_exceeded", "message": message, "param": None, "line": line.line}
        if await _thread(self.store.stop, line.batch, error):
            log.info("batch %s stopped at line %d: over its tenant's files quota", line.batch, line.line)
            self.cancel(line.batch)

    async def _line(self, line: PendingLine, tenant: str, in_flight: set[int], retry: deque) -> None:
        try:
            try:
                if tenant_has_key(self._app.state.motet.auth, tenant):
                    result = await answer(self._app, line.url, line.custom_id, line.body, tenant)
                else:
                    result = _no_key(line.custom_id)
            except Exception as e:  # a bug in a route: this line's answer, not the batch's end
                log.exception("batch %s line %d failed", line.batch, line.line)
                body = {"error": {"message": f"internal server error: {type(e).__name__}", "type": "server_error",
                                  "param": None, "code": None}}  # fmt: skip
                result = response_line(line.custom_id, 500, body)
            if not isinstance(result, float):
                try:
                    await _thread(self._record, line, tenant, result)
                    return
                except OverQuota as e:
                    await self._stop(line, str(e))
                    return
                except StorageFailure as e:
                    log.warning(
                        "batch %s: storage failed (%s); line %d runs again", line.batch, e.cause, line.line
                    )
                    result = STORAGE_RETRY_S
            await anyio.sleep(
                result
            )  # the server is busy, or its disk failed: this line waits, then goes again
            retry.append(line)
        finally:
            in_flight.discard(line.line)
            self.gate.release()

    async def _finish(self, batch_id: str, status: str) -> None:
        """Write the output and error files (none for no lines), then the final status."""

        def write() -> None:
            tenant, _, _ = self.store.input_of(batch_id)
            completed, failed = self.store.counts(batch_id)
            ids = {}
            for kind, ok, n in (("output", True, completed), ("error", False, failed)):
                if n:
                    file_id = result_file_id(batch_id, kind)
                    self.files.put(file_id, tenant, f"{batch_id}_{kind}.jsonl", "batch_output",
                                   self.store.results(batch_id, ok))  # fmt: skip
                    ids[kind] = file_id
            self.store.finish(batch_id, status, ids.get("output"), ids.get("error"))

        await _thread(write)
