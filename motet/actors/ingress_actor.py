"""The ingress actor: each submission prepared (motet/actors/input_processor.py) in worker threads, then admitted.

Each submission is handled in its own task so one long prompt does not hold up the others; its preparation
(chat template and tokens, adapter files, bad words: a few threads at a time; grammar compilations: their own
few) runs in worker threads so the event loop never does it. The actor holds no engine: only the
InputProcessor, built once at start-up from the executor's engine, which is thread-safe (its docstring says
what each thread may touch). A request that passes becomes one queued request per choice; the adapter queues
admit all of them or none (429), also across the prompts of one multi-prompt completion.
"""

from __future__ import annotations

import logging
import time

import anyio
import anyio.to_thread

from motet.actors.input_processor import InputProcessor
from motet.actors.messages import Admission, Enqueue, QueuedRequest, Submit
from motet.actors.reply import ReplyStream
from motet.actors.runtime import Actor
from motet.engine.request import EngineRequest

log = logging.getLogger("motet.ingress")

VOCABULARY_QUIET_S = 0.5  # the system idle this long (nothing prepared, queued or in the engine) before the
# grammar backends' vocabulary is built: seconds of one core, which would slow the steps serving requests
IDLE_POLL_S = 0.05


class IngressActor(Actor):
    name = "ingress"

    def __init__(self, executor: Actor, queues: Actor, tokenizer_threads: int = 2):
        super().__init__()
        self.executor = executor
        self.queues = queues
        self.limiter = anyio.CapacityLimiter(tokenizer_threads)
        self.grammar_limiter = anyio.CapacityLimiter(4)  # threads waiting on grammar compilations
        self.inputs: InputProcessor | None = None
        self.preparing = 0  # submissions being prepared now

    async def on_start(self) -> None:
        # The executor has started: its engine is loaded, and no step runs yet.
        self.inputs = InputProcessor.of(self.executor.engine, self.executor.model)

    def idle(self) -> bool:
        """Nothing being prepared, queued, or in the engine (as of its latest step)."""
        stats = self.executor.stats
        engine_busy = stats is not None and (stats.num_running or stats.num_waiting)
        return not (self.preparing or self.queues.depth or engine_busy)

    async def _build_vocabulary(self) -> None:
        """The grammar backends' view of the vocabulary, built in a worker thread once the server serves and has
        been idle for VOCABULARY_QUIET_S: seconds of a core on a large vocabulary, which the start does not
        wait for, nor do the first requests (their steps would share the cores with it); a request with a
        grammar seldom does (it builds it, or waits for this build, where it comes first). A failure is
        logged; such a request meets it again."""
        quiet_since = None
        while quiet_since is None or anyio.current_time() - quiet_since < VOCABULARY_QUIET_S:
            if not self.idle():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = anyio.current_time()
            await anyio.sleep(IDLE_POLL_S)
        try:
            await anyio.to_thread.run_sync(self.inputs.vocabulary, limiter=self.grammar_limiter)
        except Exception:
            log.exception("the grammar backends' vocabulary could not be built")

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:  # on close, waits for the submissions in flight
            tg.start_soon(self._build_vocabulary)
            async for envelope in self._recv:
                tg.start_soon(self.deliver, envelope)

    async def handle(self, message: Submit) -> list[Admission]:
        self.preparing += 1
        try:
            return await self._admit(message)
        finally:
            self.preparing -= 1

    async def _admit(self, message: Submit) -> list[Admission]:
        inputs = self.inputs
        admissions, requests = [], []
        for spec in message.specs:
            phases = []
            if spec.adapter is not None:
                t0 = time.perf_counter()
                read = await anyio.to_thread.run_sync(inputs.load_adapter, spec, limiter=self.limiter)
                phases.append(("adapter_load", t0, time.perf_counter(), {"motet.adapter.cached": not read}))
            bad_words, (prompt_ids, text) = await anyio.to_thread.run_sync(
                lambda s=spec: (inputs.bad_words(s), inputs.prompt(s)), limiter=self.limiter
            )
            params = inputs.final_params(spec, prompt_ids, bad_words)
            arrival = time.monotonic()
            t0 = time.perf_counter()
            grammar = await anyio.to_thread.run_sync(inputs.grammar, spec, limiter=self.grammar_limiter)
            if grammar is not None:
                phases.append(("grammar_compile", t0, time.perf_counter(), {}))
            # The request's one record per choice, final from here to the engine (motet/engine/request.py).
            queued = [
                QueuedRequest(
                    EngineRequest(
                        request_id,
                        prompt_ids,
                        p,
                        spec.adapter,
                        grammar,
                        spec.tenant,
                        spec.priority,
                        spec.background,
                        arrival,
                    ),
                    ReplyStream(request_id),
                )
                for request_id, p in zip(spec.request_ids, params, strict=True)
            ]
            requests += queued
            admissions.append(Admission(prompt_ids, [r.stream for r in queued], text, phases))
        # One Enqueue for every prompt of the submission: all are queued, or none (429).
        await self.queues.ask(Enqueue(requests))
        return admissions
