"""The scheduler actor: drives the engine step by step and moves work in and out of it.

Each iteration, strictly between steps (the executor thread reads the sequences while a batch runs):
apply aborts, admit requests from the adapter queues while the engine has room (the tenant is chosen
by the fairness policy, engine/fairness.py), then schedule a batch, have the executor run it, process
the result and put each request's delta on its reply stream (never blocking: slow readers get merged
deltas). Policy lives in the engine; this actor only moves requests, batches and deltas.

LoRA adapters are registered with the engine here, lazily: the first time a request for one is admitted
(`engine.add_lora` in a worker thread: it reads and validates the files; the executor is idle meanwhile,
as the scheduler is the only one that runs steps). Deletions arrive as RemoveLora messages.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import anyio.to_thread

from actors.errors import EngineFailure, InvalidRequest, ModelNotFound, ServingError, ShuttingDown
from actors.messages import Abort, Execute, LoraRef, QueuedRequest, RemoveLora, Take, WorkQueued
from actors.reply import Delta, ReplyStream
from actors.runtime import Actor, ActorStopped
from engine.fairness import VirtualTokenCounter
from lora.adapter import AdapterError

log = logging.getLogger("motet.scheduler")


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(
        self,
        executor: Actor,
        fairness: VirtualTokenCounter | None = None,
        max_waiting: int = 16,
        loras: dict[str, Path] | None = None,
    ):
        super().__init__()
        self.executor = executor
        self.queues: Actor | None = None  # set by the system
        self.fairness = fairness or VirtualTokenCounter()
        self.max_waiting = max_waiting  # requests admitted but not yet running; the rest wait in the queues
        self.engine = None
        self.live: dict[str, tuple[ReplyStream, str]] = {}  # request id -> (reply stream, tenant)
        self.faulty: set[str] = set()  # test-only fault injection
        self.steps = 0
        self.preload = dict(loras or {})  # registered at start-up: a bad one fails the start
        self.loras: dict[str, tuple[int, int]] = {}  # engine name -> (version, engine id)
        self._aborts: list[str] = []
        self._removals: list[str] = []
        self._maybe_queued = False
        self._closed = False

    async def on_start(self) -> None:
        self.engine = self.executor.engine
        for name, path in self.preload.items():
            self.loras[name] = (0, await anyio.to_thread.run_sync(self.engine.add_lora, name, path))

    # -- the mailbox (never awaited while work is pending) --------------------------------------------------
    def _on_message(self, message) -> None:
        if isinstance(message, Abort):
            self._aborts.append(message.request_id)
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
            self._apply_control()
            if self._closed:
                break
            await self._admit()
            if not self.engine.scheduler.has_work():
                await self._wait_message()  # idle: sleep until a request or abort arrives
                continue
            batch = self.engine.scheduler.schedule()
            if not batch:  # nothing fits right now (e.g. blocks pinned): let the world move on
                await self._wait_message(timeout=0.005)
                continue
            await self._step(batch)

    async def on_stop(self) -> None:
        # Also after a crash: no reader is left waiting for a delta that will never come.
        for stream, _ in self.live.values():
            stream.fail(ShuttingDown("the server shut down before the request finished"))
        self.live.clear()

    def _apply_control(self) -> None:
        """Aborts and adapter removals, between steps."""
        for request_id in self._aborts:
            entry = self.live.pop(request_id, None)
            if entry is not None:  # not yet admitted: its cancelled stream is dropped at admission
                self.engine.abort(request_id)
                self.faulty.discard(request_id)
                self.fairness.leave(entry[1])
        self._aborts.clear()
        for name in self._removals:
            if self.loras.pop(name, None) is not None:
                self.engine.remove_lora(name)  # requests already using it finish with it
        self._removals.clear()

    async def _admit(self) -> None:
        """Move requests from the adapter queues into the engine while it has room, fairest tenant first.

        Cancelled requests taken from a queue are dropped and more are taken at once: however many
        sit there, the engine never idles while a live request is queued."""
        while self._maybe_queued and self.queues is not None:
            sched, max_seqs = self.engine.scheduler, self.engine.config.max_num_seqs
            room = min(
                max_seqs - len(sched.running) - len(sched.waiting), self.max_waiting - len(sched.waiting)
            )
            if room <= 0:
                return
            try:
                taken: list[QueuedRequest] = await self.queues.ask(Take(room, self.fairness.pick))
            except ActorStopped:
                taken = []
            if len(taken) < room:
                self._maybe_queued = False  # a later WorkQueued sets it again
            for req in taken:
                await self._admit_one(req)

    async def _admit_one(self, req: QueuedRequest) -> None:
        try:
            adapter_id = 0 if req.stream.cancelled else await self._adapter_id(req.adapter)
            if req.stream.cancelled:  # also after the await: the client may have left meanwhile
                self.fairness.leave(req.tenant)
                return
            self.engine.add_request(
                req.prompt_token_ids, req.params, req.request_id, adapter_id, grammar=req.grammar
            )
        except (ValueError, ServingError) as e:
            req.stream.fail(e if isinstance(e, ServingError) else InvalidRequest(str(e)))
            self.fairness.leave(req.tenant)
            return
        self.live[req.request_id] = (req.stream, req.tenant)
        self.fairness.charge(req.tenant, input_tokens=len(req.prompt_token_ids))
        if req.fault:
            self.faulty.add(req.request_id)

    async def _adapter_id(self, ref: LoraRef | None) -> int:
        """The engine id of a request's adapter (0: the base model), registering it on first use."""
        if not ref:
            return 0
        have = self.loras.get(ref.name)
        if have is None or have[0] < ref.version:
            try:
                adapter_id = await anyio.to_thread.run_sync(self.engine.add_lora, ref.name, ref.path)
            except AdapterError:
                if not ref.path.is_dir():  # deleted while the request waited in its queue
                    raise ModelNotFound(
                        f"the model {ref.model!r} does not exist", param="model", code="model_not_found"
                    ) from None
                log.exception("adapter %s no longer loads from %s", ref.name, ref.path)
                raise EngineFailure(f"the adapter {ref.model!r} could not be loaded") from None
            have = self.loras[ref.name] = (ref.version, adapter_id)
        return have[1]

    async def _step(self, batch) -> None:
        self.steps += 1
        try:
            executed = await self.executor.ask(Execute(batch, frozenset(self.faulty)))
        except Exception as e:  # the executor itself is gone or broken: fail this batch, keep serving
            log.exception("executor failed on a batch of %d", len(batch))
            for seq in batch.seqs:
                self._fail(seq.request_id, EngineFailure(f"executor error: {e}"))
            return
        try:
            outputs = self.engine.process(executed.batch, executed.result) if executed.batch.seqs else []
        except Exception:
            log.exception("processing a step failed")
            for seq in executed.batch.seqs:
                self._fail(seq.request_id, EngineFailure("internal error while processing the step"))
            outputs = []
        for seq, err in executed.failed:
            self._fail(seq.request_id, EngineFailure(f"the model failed on this request: {err}"))
        self._emit(outputs)

    def _emit(self, outputs) -> None:
        for out in outputs:
            entry = self.live.get(out.request_id)
            if entry is None:
                continue
            stream, tenant = entry
            if out.error is not None:
                self._fail(out.request_id, EngineFailure("internal error while processing this request"))
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
                )
            )
            self.fairness.charge(tenant, output_tokens=n)
            if out.finished:
                del self.live[out.request_id]
                self.faulty.discard(out.request_id)
                self.fairness.leave(tenant)

    def _fail(self, request_id: str, error: ServingError) -> None:
        entry = self.live.pop(request_id, None)
        if entry is None:
            return
        self.engine.abort(request_id)
        self.faulty.discard(request_id)
        self.fairness.leave(entry[1])
        entry[0].fail(error)
