"""The executor actor: one dedicated thread owns the device and the model.

The engine (and with it the model and KV cache) is built on that thread, and every forward pass runs
there; the event loop only waits for it. When a batch raises, the batch is split in halves and re-run
until the failing sequences are isolated: they fail alone, the others get their results (re-running is
safe: the KV slots of an unfinished step are simply written again).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from actors.messages import Execute, Executed
from actors.runtime import Actor
from engine.scheduler import ScheduledBatch

log = logging.getLogger("motet.executor")


class DeviceThread:
    """A single long-lived worker thread; `await run(fn)` runs fn there without blocking the loop."""

    def __init__(self, name: str = "motet-device"):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        done = anyio.Event()
        token = anyio.lowlevel.current_token()
        box: dict[str, Any] = {}

        def job():
            try:
                box["value"] = fn(*args)
            except BaseException as e:
                box["error"] = e
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
                anyio.from_thread.run_sync(done.set, token=token)

        self._jobs.put(job)
        # Shielded: a forward pass cannot be abandoned half way, the thread would still be using the batch.
        with anyio.CancelScope(shield=True):
            await done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self) -> None:
        self._jobs.put(None)


def _sub_batch(batch: ScheduledBatch, idx: list[int]) -> ScheduledBatch:
    return ScheduledBatch(
        seqs=[batch.seqs[i] for i in idx], num_new_tokens=[batch.num_new_tokens[i] for i in idx]
    )


def execute_isolating(execute: Callable[[ScheduledBatch], Any], batch: ScheduledBatch) -> Executed:
    """Run the batch; on an exception, bisect to find the sequences that raise (runs on the device thread)."""
    try:
        return Executed(batch, execute(batch))
    except Exception as e:
        if len(batch) == 1:
            return Executed(ScheduledBatch(preempted=batch.preempted), None, [(batch.seqs[0], e)])
    half = len(batch) // 2
    parts = [
        execute_isolating(execute, _sub_batch(batch, idx)) for idx in (range(half), range(half, len(batch)))
    ]
    ok = ScheduledBatch(preempted=batch.preempted)
    results = [p.result for p in parts if p.result is not None]
    merged = None
    if results:
        merged = type(results[0])(**{f: [] for f in ("token_ids", "logprobs", "prompt_logprobs")})
        for p in parts:
            if p.result is None:
                continue
            ok.seqs += p.batch.seqs
            ok.num_new_tokens += p.batch.num_new_tokens
            merged.token_ids += p.result.token_ids
            merged.logprobs += p.result.logprobs
            merged.prompt_logprobs += p.result.prompt_logprobs
    return Executed(ok, merged, parts[0].failed + parts[1].failed)


class InjectedFault(RuntimeError):
    """Test-only (MOTET_TEST_FAULTS=1): raised for batches holding a request marked faulty."""


class ExecutorActor(Actor):
    name = "executor"

    def __init__(self, engine_factory: Callable[[], Any]):
        super().__init__()
        self.engine_factory = engine_factory
        self.engine = None
        self.thread: DeviceThread | None = None

    async def on_start(self) -> None:
        self.thread = DeviceThread()
        self.engine = await self.thread.run(self.engine_factory)

    async def on_stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()

    async def handle(self, message: Execute) -> Executed:
        runner, faulty = self.engine.runner, message.faulty

        def execute(batch: ScheduledBatch):
            if faulty and any(s.request_id in faulty for s in batch.seqs):
                raise InjectedFault("injected executor fault (MOTET_TEST_FAULTS)")
            return runner.execute(batch)

        def run() -> Executed:
            t0 = time.perf_counter()
            out = execute_isolating(execute, message.batch)
            out.seconds = time.perf_counter() - t0
            for seq, err in out.failed:
                if not isinstance(err, InjectedFault):
                    log.error("request %s failed in the executor", seq.request_id, exc_info=err)
            return out

        return await self.thread.run(run)
