"""The executor actor: one dedicated thread owns the engine, and with it the device and the model.

The engine is built on that thread and only that thread drives it: each `Step` message applies the scheduler's
changes (new requests, aborts, adapter removals) and runs one `engine.step()` there; the event loop only waits.
(An overlapped engine's forward thread is given each step as values, made on this thread:
motet/engine/stepping.py, docs/DESIGN.md.) Once loaded, the engine is described there once for the API (`model`, a frozen
ModelView that any thread may read). The engine isolates a request that fails inside a step (it bisects the
batch), so here a failure is an output like any other.

The thread is also the one owner of the machine's cores beside fine-tuning: with a training lease
(motet/actors/training_lease.py), a worker that holds the cores is stopped before each step, and between steps (or
while the engine is idle) the lease lets one run; the engine does not step meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from motet.actors.messages import Step, StepDone
from motet.actors.runtime import Actor
from motet.actors.serving_errors import EngineFailure, request_refusal
from motet.actors.training_lease import TrainingLease
from motet.engine.model_view import ModelView

log = logging.getLogger("motet.executor")


class EngineThread:
    """The thread that drives the engine (`motet-engine`: its `step()` and the calls around it; an overlapped
    engine runs its forward passes on a thread of its own, `motet-forward`): a single long-lived worker thread;
    `await run(fn)` runs fn there without blocking the loop. Before it takes each job it calls `between()` (the
    training lease's turn, motet/actors/training_lease.py), which says how long it may then wait for one at most
    (None: until one comes)."""

    def __init__(self, name: str = "motet-engine", between: Callable[[], float | None] | None = None):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._between = between
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            wait = None
            if self._between is not None:
                try:
                    wait = self._between()
                except Exception:  # (a bug there must not stop the engine)
                    log.exception("the engine thread's turn between jobs failed")
            try:
                job = self._jobs.get(timeout=wait)
            except queue.Empty:
                continue
            if job is None:
                return
            job()

    def nudge(self) -> None:
        """The thread takes its turn between jobs again now (from any thread)."""
        self._jobs.put(lambda: None)

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


class ExecutorActor(Actor):
    name = "executor"

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        loras: dict[str, Any] | None = None,
        cache_period_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        lease: TrainingLease | None = None,
    ):
        """`cache_period_s`: the stats carry what the engine's caches hold (EngineStats.cache), made anew at most
        that often (by `clock`) and whenever the engine has nothing left to run; None: never. `lease`: the
        fine-tuning workers this thread lends the cores to between steps (motet/actors/training_lease.py)."""
        super().__init__()
        self.lease = lease
        self.engine_factory = engine_factory
        self.preload = dict(loras or {})  # the server's shared adapters: a bad one fails the start
        self.engine = None
        self.model: ModelView | None = None  # the API's view of the model, once it has loaded
        self.stats = None  # the engine's EngineStats after the latest step
        self.thread: EngineThread | None = None
        self.cache_period_s, self.clock = cache_period_s, clock
        # the latest CacheContents, and when it was made (the engine's thread)
        self._cache, self._cache_at = None, -math.inf

    async def on_start(self) -> None:
        self.thread = EngineThread(between=self._between if self.lease is not None else None)

        def start():
            engine = self.engine_factory()
            for name, path in self.preload.items():
                engine.add_lora(name, path)
            return engine

        self.engine = await self.thread.run(start)
        if self.lease is not None:
            # on a GPU serving computes on the device and training on the CPU: nothing to share
            self.lease.shares_cores = self.engine.runner.device.type == "cpu"
            self.lease.wake = self.thread.nudge
        self.model = await self.thread.run(ModelView.of_engine, self.engine)
        self.stats = await self.thread.run(self._stats)

    async def on_stop(self) -> None:
        if self.lease is not None:
            self.lease.wake = lambda: None
        if self.thread is not None:
            if self.engine is not None:
                with contextlib.suppress(Exception):  # (the engine may be what failed)
                    await self.thread.run(self.engine.close)
            self.thread.stop()

    async def handle(self, message: Step) -> StepDone:
        done = await self.thread.run(self._step, message)
        self.stats = done.stats
        return done

    def _step(self, message: Step) -> StepDone:
        """On the engine thread: the step, with the cores taken back from a fine-tuning worker first."""
        if self.lease is None:
            return self._run_step(message)
        self.lease.step_starts()
        busy = True
        try:
            start = self.lease.clock()
            done = self._run_step(message)
            busy = self.engine.has_unfinished()
            self.lease.record_step(start, self.lease.clock())
            return done
        finally:
            self.lease.step_ends(busy)

    def _between(self) -> float | None:
        """The engine thread's turn between jobs: a fine-tuning worker may hold the cores."""
        if self.engine is None:
            return None
        return self.lease.between_steps(self._settle)

    def _settle(self) -> None:
        """Returns once the engine computes nothing: its forward pass in flight (overlapped steps) done."""
        if self.engine.in_flight:
            start = self.lease.clock()
            self.engine.wait_forward()
            self.lease.record_step(start, self.lease.clock())

    def _run_step(self, message: Step) -> StepDone:
        engine = self.engine
        t0 = time.perf_counter()
        for name in message.removals:
            engine.remove_lora(name)  # requests already using it finish with it
        for request_id in message.aborts:
            engine.abort(request_id)
        refused = []
        for request in message.admit:
            try:
                engine.add(request)
            except Exception as e:
                error = request_refusal(e, request.adapter)
                if isinstance(error, EngineFailure):
                    log.error("request %s could not be added", request.request_id, exc_info=e)
                refused.append((request.request_id, error))
        steps = engine.num_steps
        outputs = engine.step() if engine.has_unfinished() else []
        ran = engine.num_steps > steps or engine.in_flight  # (a step launched, to be committed by the next)
        return StepDone(outputs, refused, self._stats(), ran, time.perf_counter() - t0)

    def _stats(self):
        """The engine's stats, on its thread. What its caches hold is a copy of its prefix cache's hashes: made
        at most every `cache_period_s` while it runs (the latest carried meanwhile), and once it is idle."""
        engine = self.engine
        if self.cache_period_s is None:
            return engine.stats()
        now = self.clock()
        if now - self._cache_at < self.cache_period_s and engine.has_unfinished():
            return dataclasses.replace(engine.stats(), cache=self._cache)
        stats = engine.stats(cache=True)
        self._cache, self._cache_at = stats.cache, now
        return stats
