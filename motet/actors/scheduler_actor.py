"""The scheduler actor: moves work into the engine and results out of it, one step at a time.

Each iteration: take the mailbox (aborts, adapter removals, news of queued work), take requests from the
adapter queues into the engine (which tenants' and how many: the engine's `AdmissionGate`, built from its
state after the latest step, motet/engine/core/policy.py), send all of it to the executor as one `Step`, and put
each request's delta, the engine's record as it is, on its reply stream (never blocking: slow readers get merged
deltas). It never waits while admitted or queued work exists. Policy lives in the engine (fairness between tenants
included); this actor only moves requests and deltas, and it never touches the engine itself.
"""

from __future__ import annotations

import logging

import anyio

from motet.actors.messages import Abort, RemoveLora, Step, StepDone, Take, Taken, WorkQueued
from motet.actors.reply import ReplyStream
from motet.actors.runtime import Actor, ActorStopped
from motet.actors.serving_errors import EngineFailure, ServingError, ShuttingDown
from motet.engine.core.policy import AdmissionGate
from motet.engine.outputs import OutputDelta
from motet.engine.request import EngineRequest

log = logging.getLogger("motet.scheduler")


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, executor: Actor, max_waiting: int = 16):
        super().__init__()
        self.executor = executor
        self.queues: Actor | None = None  # set by the system
        # Requests admitted but not yet running (up to twice as many for tenants' first ones); the rest wait in
        # the queues.
        self.max_waiting = max_waiting
        self.live: dict[str, ReplyStream] = {}  # request id -> reply stream
        self.steps = 0
        self._aborts: list[str] = []
        self._removals: list[str] = []
        self._maybe_queued = False
        self._closed = False

    # -- the mailbox (never awaited while work is pending) --------------------------------------------------
    def _on_message(self, message) -> None:
        if isinstance(message, Abort):
            # Not yet admitted: the queues drop it (a cancelled stream is never admitted).
            if self.live.pop(message.request_id, None) is not None:
                self._aborts.append(message.request_id)
        elif isinstance(message, RemoveLora):
            self._removals.append(message.name)
        elif isinstance(message, WorkQueued):
            self._maybe_queued = True
        else:
            log.error("scheduler: unexpected message %r", message)

    def _drain_mailbox(self) -> None:
        while True:
            try:
                envelope = self._recv.receive_nowait()
            except anyio.WouldBlock:
                return
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._closed = True
                return
            self._on_message(envelope.message)

    async def _wait_message(self, timeout: float | None = None) -> None:
        with anyio.move_on_after(timeout):
            try:
                envelope = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._closed = True
                return
            self._on_message(envelope.message)

    # -- the loop --------------------------------------------------------------------------------------------
    async def main(self) -> None:
        while True:
            self._drain_mailbox()
            if self._closed:
                break
            step = Step(await self._admit(), self._aborts, self._removals)
            self._aborts, self._removals = [], []
            if not (self.live or step.aborts or step.removals):
                if not self._maybe_queued:  # (queued work whose taken requests were all cancelled: go on)
                    await self._wait_message()  # idle: sleep until a request or abort arrives
                continue
            done = await self._step(step)
            if done is not None and not done.ran and not done.outputs and not self._mailbox_pending():
                await self._wait_message(timeout=0.005)  # nothing fits right now (blocks pinned)

    def _mailbox_pending(self) -> bool:
        return self._recv.statistics().current_buffer_used > 0

    async def on_stop(self) -> None:
        # Also after a crash: no reader is left waiting for a delta that will never come.
        for stream in self.live.values():
            stream.fail(ShuttingDown("the server shut down before the request finished"))
        self.live.clear()

    async def _admit(self) -> list[EngineRequest]:
        """Take requests from the adapter queues into the engine: one for each tenant with none waiting there,
        then while the engine has room, the fairest tenants' first. Their records go to the engine whole; their
        reply streams stay here."""
        if not (self._maybe_queued and self.queues is not None):
            return []
        stats = self.executor.stats
        room = min(stats.free_seq_slots, self.max_waiting - stats.num_waiting)
        # A tenant's first waiting request may go beyond that, up to twice `max_waiting` in all.
        gate = AdmissionGate(stats.tenants, room, spare=2 * self.max_waiting - stats.num_waiting)
        try:
            taken: Taken = await self.queues.ask(Take(gate.pick))
        except ActorStopped:
            return []
        self._maybe_queued = taken.more  # a later WorkQueued sets it again
        admitted = []
        for queued in taken.requests:
            if queued.stream.cancelled:  # its client went away while we asked: nobody to serve
                continue
            admitted.append(queued.request)
            self.live[queued.request.request_id] = queued.stream
        return admitted

    async def _step(self, step: Step) -> StepDone | None:
        self.steps += 1
        try:
            done: StepDone = await self.executor.ask(step)
        except Exception as e:  # the engine broke outside any one request: none of its requests can go on
            log.exception("the engine step failed")
            for request_id in list(self.live):
                self._fail(request_id, EngineFailure(f"internal error in the engine step: {e}"))
            if getattr(
                e, "fatal", False
            ):  # no step can run again (a tensor-parallel rank died): stop the system
                raise
            return None
        for request_id, error in done.refused:
            self._fail(request_id, error if isinstance(error, ServingError) else EngineFailure(str(error)))
        self._emit(done.outputs)
        return done

    def _emit(self, outputs: list[OutputDelta]) -> None:
        for out in outputs:
            stream = self.live.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:  # it failed alone in the step: the engine has already dropped it
                self.live.pop(out.request_id)
                stream.fail(EngineFailure(f"the model failed on this request: {out.error}"))
                continue
            stream.put(out)  # the engine's delta as it is
            if out.finished:
                del self.live[out.request_id]

    def _fail(self, request_id: str, error: ServingError) -> None:
        stream = self.live.pop(request_id, None)
        if stream is None:
            return
        self._aborts.append(request_id)  # the engine drops it at the next step (a no-op if it has)
        stream.fail(error)
