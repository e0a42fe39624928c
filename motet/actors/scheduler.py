"""The scheduler actor: moves work into the engine and results out of it, one step at a time.

Each iteration: take the mailbox (aborts, adapter removals, news of queued work), take requests from the
adapter queues while the engine has room (the tenant is chosen by the fairness policy, motet/engine/fairness.py),
send all of it to the executor as one `Step`, and put each request's delta on its reply stream (never
blocking: slow readers get merged deltas). It never waits while admitted or queued work exists. Policy
lives in the engine; this actor only moves requests and deltas, and it never touches the engine itself.
"""

from __future__ import annotations

import logging

import anyio

from motet.actors.errors import EngineFailure, ServingError, ShuttingDown
from motet.actors.messages import Abort, QueuedRequest, RemoveLora, Step, StepDone, Take, WorkQueued
from motet.actors.reply import Delta, ReplyStream
from motet.actors.runtime import Actor, ActorStopped
from motet.engine.fairness import VirtualTokenCounter

log = logging.getLogger("motet.scheduler")


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, executor: Actor, fairness: VirtualTokenCounter | None = None, max_waiting: int = 16):
        super().__init__()
        self.executor = executor
        self.queues: Actor | None = None  # set by the system
        self.fairness = fairness or VirtualTokenCounter()
        self.max_waiting = max_waiting  # requests admitted but not yet running; the rest wait in the queues
        self.live: dict[str, tuple[ReplyStream, str]] = {}  # request id -> (reply stream, tenant)
        self.steps = 0
        self._aborts: list[str] = []
        self._removals: list[str] = []
        self._maybe_queued = False
        self._closed = False

    # -- the mailbox (never awaited while work is pending) --------------------------------------------------
    def _on_message(self, message) -> None:
        if isinstance(message, Abort):
            entry = self.live.pop(message.request_id, None)
            if entry is not None:  # not yet admitted: its cancelled stream is dropped at admission
                self._aborts.append(message.request_id)
                self.fairness.leave(entry[1])
        elif isinstance(message, RemoveLora):
            self._removals.append(message.name)
        elif isinstance(message, WorkQueued):
            for tenant in message.arrived:
                self.fairness.arrive(tenant)
            for tenant in message.dropped:
                self.fairness.leave(tenant)
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
                await self._wait_message()  # idle: sleep until a request or abort arrives
                continue
            done = await self._step(step)
            if done is not None and not done.ran and not done.outputs and not self._mailbox_pending():
                await self._wait_message(timeout=0.005)  # nothing fits right now (blocks pinned)

    def _mailbox_pending(self) -> bool:
        return self._recv.statistics().current_buffer_used > 0

    async def on_stop(self) -> None:
        # Also after a crash: no reader is left waiting for a delta that will never come.
        for stream, _ in self.live.values():
            stream.fail(ShuttingDown("the server shut down before the request finished"))
        self.live.clear()

    async def _admit(self) -> list[QueuedRequest]:
        """Take requests from the adapter queues while the engine has room, fairest tenant first.

        Cancelled requests taken from a queue are dropped and more are taken at once: however many
        sit there, the engine never idles while a live request is queued."""
        admitted: list[QueuedRequest] = []
        stats = self.executor.stats
        while self._maybe_queued and self.queues is not None:
            room = min(stats.free_seq_slots, self.max_waiting - stats.num_waiting) - len(admitted)
            if room <= 0:
                break
            try:
                taken: list[QueuedRequest] = await self.queues.ask(Take(room, self.fairness.pick))
            except ActorStopped:
                taken = []
            if len(taken) < room:
                self._maybe_queued = False  # a later WorkQueued sets it again
            for req in taken:
                if req.stream.cancelled:
                    self.fairness.leave(req.tenant)
                    continue
                admitted.append(req)
                self.live[req.request_id] = (req.stream, req.tenant)
                self.fairness.charge(req.tenant, input_tokens=len(req.prompt_token_ids))
        return admitted

    async def _step(self, step: Step) -> StepDone | None:
        self.steps += 1
        try:
            done: StepDone = await self.executor.ask(step)
        except Exception as e:  # the engine broke outside any one request: none of its requests can go on
            log.exception("the engine step failed")
            for request_id in list(self.live):
                self._fail(request_id, EngineFailure(f"internal error in the engine step: {e}"))
            return None
        for request_id, error in done.refused:
            self._fail(request_id, error if isinstance(error, ServingError) else EngineFailure(str(error)))
        self._emit(done.outputs)
        return done

    def _emit(self, outputs) -> None:
        for out in outputs:
            entry = self.live.get(out.request_id)
            if entry is None:
                continue
            stream, tenant = entry
            if out.error is not None:  # it failed alone in the step: the engine has already dropped it
                self.live.pop(out.request_id)
                self.fairness.leave(tenant)
                stream.fail(EngineFailure(f"the model failed on this request: {out.error}"))
                continue
            n = out.num_new_tokens
            first = stream.num_puts == 0  # prompt logprobs are complete by the first token
            stream.put(
                Delta(
                    text=out.delta,
                    token_ids=list(out.token_ids[-n:]) if n else [],
                    logprobs=list(out.logprobs[-n:]) if n and out.logprobs else [],
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    prompt_logprobs=list(out.prompt_logprobs)
                    if first and out.prompt_logprobs is not None
                    else None,
                    num_cached_tokens=out.num_cached_tokens,
                    timings=out.timings,
                )
            )
            self.fairness.charge(tenant, output_tokens=n)
            if out.finished:
                del self.live[out.request_id]
                self.fairness.leave(tenant)

    def _fail(self, request_id: str, error: ServingError) -> None:
        entry = self.live.pop(request_id, None)
        if entry is None:
            return
        self._aborts.append(request_id)  # the engine drops it at the next step (a no-op if it has)
        self.fairness.leave(entry[1])
        entry[0].fail(error)
