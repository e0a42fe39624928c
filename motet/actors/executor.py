"""The executor actor: one dedicated thread owns the engine, and with it the device and the model.

The engine is built on that thread and only that thread touches its state: each `Step` message applies
the scheduler's changes (new requests, aborts, adapter removals) and runs one `engine.step()` there; the
event loop only waits. While the engine has work the thread does not wait for the loop: as soon as a step's
result is handed over it runs the next step (`_step_ahead`), while the loop streams the deltas and makes the next
`Step`; that message then gets the step run ahead, and its changes go into the step after (vLLM's engine core runs
its busy loop so, beside its API process). One step ahead at most; a message that admits requests gets a step
with them too (they start at the next step, as without the step ahead); an abort lands a step later. Once loaded, the engine is described there once for the API (`model`, a frozen
ModelView that any thread may read). The engine isolates a request that fails inside a step (it bisects the
batch), so here a failure is an output like any other.
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

from motet.actors.messages import Step, StepDone
from motet.actors.runtime import Actor
from motet.actors.serving_errors import EngineFailure, request_refusal
from motet.engine.model_view import ModelView

log = logging.getLogger("motet.executor")


class EngineThread:
    """The thread that drives the engine (`motet-engine`: its `step()` and the calls around it; an overlapped
    engine runs its forward passes on a thread of its own, `motet-forward`): a single long-lived worker thread;
    `await run(fn)` runs fn there without blocking the loop."""

    def __init__(self, name: str = "motet-engine"):
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

    def post(self, fn: Callable[[], None]) -> None:
        """Run fn on the thread after the jobs before it, without waiting for it (from the thread itself)."""
        self._jobs.put(fn)

    def stop(self) -> None:
        self._jobs.put(None)


class ExecutorActor(Actor):
    name = "executor"

    def __init__(self, engine_factory: Callable[[], Any], loras: dict[str, Any] | None = None):
        super().__init__()
        self.engine_factory = engine_factory
        self.preload = dict(loras or {})  # the server's shared adapters: a bad one fails the start
        self.engine = None
        self.model: ModelView | None = None  # the API's view of the model, once it has loaded
        self.stats = None  # the engine's EngineStats after the latest step
        self.thread: EngineThread | None = None
        # the step run ahead of the next Step message, or the error it raised (the engine thread's only)
        self._ahead: StepDone | Exception | None = None

    async def on_start(self) -> None:
        self.thread = EngineThread()

        def start():
            engine = self.engine_factory()
            for name, path in self.preload.items():
                engine.add_lora(name, path)
            return engine

        self.engine = await self.thread.run(start)
        self.model = await self.thread.run(ModelView.of_engine, self.engine)
        self.stats = await self.thread.run(self.engine.stats)

    async def on_stop(self) -> None:
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
        """On the engine thread: the step run ahead (if any) and then the message's changes, else the changes and a
        step; either way, the next step is queued to run ahead while the loop handles this one's result."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            done = self._changes_and_step(message)
        else:
            refused = self._apply(message)
            if isinstance(ahead, BaseException):  # the step run ahead failed: the scheduler hears it now
                raise ahead
            outputs, engine = ahead.outputs, self.engine
            # A request admitted now starts now, not a step later (a light tenant's request at the next step);
            # where every request has ended, the step in flight lands now, giving back their blocks.
            if len(refused) < len(message.admit) or (engine.in_flight and not engine.requests):
                outputs = outputs + engine.step()
            done = StepDone(outputs, refused, engine.stats(), ahead.ran, ahead.seconds)
        if self.engine.has_unfinished() or self.engine.in_flight:
            self.thread.post(self._step_ahead)
        return done

    def _step_ahead(self) -> None:
        """On the engine thread: the next step, its result kept for the next `Step` message."""
        t0 = time.perf_counter()
        engine = self.engine
        steps = engine.num_steps
        try:
            outputs = engine.step() if engine.has_unfinished() or engine.in_flight else []
        except Exception as e:  # (kept for the next Step's answer, as a step it ran itself would raise)
            self._ahead = e
            return
        ran = engine.num_steps > steps or engine.in_flight
        self._ahead = StepDone(outputs, [], None, ran, time.perf_counter() - t0)

    def _apply(self, message: Step) -> list:
        """The message's changes to the engine; the requests it refused, and why."""
        engine = self.engine
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
        return refused

    def _changes_and_step(self, message: Step) -> StepDone:
        engine = self.engine
        t0 = time.perf_counter()
        refused = self._apply(message)
        steps = engine.num_steps
        outputs = engine.step() if engine.has_unfinished() else []
        ran = engine.num_steps > steps or engine.in_flight  # (a step launched, to be committed by the next)
        return StepDone(outputs, refused, engine.stats(), ran, time.perf_counter() - t0)
