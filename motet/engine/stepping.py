"""How the engine takes its steps: two strategies around its one schedule -> execute -> commit.

`SequentialSteps` runs the three stages one after the other on the caller's thread. `OverlappedSteps`
(EngineConfig.overlap_output; on CUDA by default) runs each step's forward pass on a thread of its own,
`motet-forward`, given the step as values only (`LLMEngine.forward_call`: the plan, the LoRA segments, the grammar
mask, the inputs, all made on the engine's thread; a failure comes back as a value and is bisected on the engine's
thread as the step lands), and owns what overlapping needs: the step in flight, the rows aborted while it runs, the steps launched and not
landed, and the rule for scheduling ahead. Each `step()` lands step N's tokens (`commit_tokens`), schedules and
launches N+1, then makes N's outputs (`commit_text`) while N+1 computes. Where no row of N needs its token on
the host but as N+1's input (`LLMEngine.needs_token_on_host`), and no part of the engine works from landed
steps only, N+1 is scheduled and launched before N lands, as vLLM's async scheduling does
(EngineConfig.async_scheduling): the forward thread feeds each row its pending token. The outputs are the
sequential order's either way.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch

from motet.engine.core.scheduler import ScheduledBatch
from motet.engine.core.sequence import Sequence


class Stages(Protocol):
    """What a strategy runs: the engine's stages (motet/engine/llm_engine.py's LLMEngine)."""

    config: Any
    runner: Any
    speculator: Any
    kv_connector: Any
    max_model_len: int

    def schedule(self) -> ScheduledBatch: ...  # (refused while a step is in flight)

    def schedule_next(self) -> ScheduledBatch: ...

    def execute(self, batch: ScheduledBatch, on_launch=None, lazy: bool = False) -> Any: ...

    def forward_call(self, batch: ScheduledBatch, inputs=None, after_landing: bool = False) -> Any: ...

    def needs_token_on_host(self, seq: Sequence) -> bool: ...

    def start_mask(self, mask) -> None: ...

    def bisect(self, batch: ScheduledBatch, error: Exception) -> Any: ...

    def commit(self, batch: ScheduledBatch, result) -> list: ...

    def commit_tokens(self, batch: ScheduledBatch, result) -> Any: ...

    def commit_text(self, landed) -> list: ...

    def drop(self, seq: Sequence) -> None: ...


class SequentialSteps:
    """schedule -> execute -> commit, in order, on the caller's thread."""

    in_flight = False
    num_steps_ahead = 0
    unlanded: tuple[ScheduledBatch, ...] = ()  # (no step outlives its `step()`)

    def __init__(self, engine: Stages):
        self.engine = engine

    def step(self) -> list:
        engine = self.engine
        batch = engine.schedule()
        return engine.commit(batch, engine.execute(batch)) if batch else []

    def flush(self) -> list:
        return []

    def wait_forward(self) -> None:
        pass  # (no step outlives its `step()`)

    def release(self, seq: Sequence) -> None:
        """An aborted row's blocks and adapter, given back now."""
        self.engine.drop(seq)

    def close(self) -> None:
        pass


class OverlappedSteps:
    """Step N+1 computes on the forward thread while the caller's thread makes step N's outputs."""

    def __init__(self, engine: Stages, num_threads: int | None):
        self.engine = engine
        # The thread's initializer sets the forward pass's threads (not a reference to the runner: it would keep
        # it alive).
        init = dict(initializer=torch.set_num_threads, initargs=(num_threads,)) if num_threads else {}
        self._thread = ThreadPoolExecutor(1, "motet-forward", **init)
        # Launched, not landed: the step, its result to come, and where it was launched before the step before it
        # landed, that step's (a step whose forward pass raised left its rows' tokens unsampled)
        self._inflight: tuple[ScheduledBatch, Future, Future | None] | None = None
        # The grammar mask of the step launched before the step before it landed: filled once that one lands
        self._mask_after_landing = None
        self._aborted: list[Sequence] = []  # aborted while in flight: released when it lands
        self.unlanded: list[ScheduledBatch] = []  # launched steps not landed: the pool keeps their adapters
        self.num_steps_ahead = 0  # steps launched before the step before them landed
        # Parts of the engine that work from landed steps only (each says so: `needs_landed_steps`) keep the
        # next step waiting for the one before.
        parts = (engine.speculator, engine.kv_connector, engine.runner.broadcast)
        self.ahead = engine.config.async_scheduling and not any(p.needs_landed_steps for p in parts)

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def step(self) -> list:
        """Land the launched step and launch the next (before the landing where `_ahead_holds` allows it),
        then make the landed step's outputs while the next one runs."""
        engine = self.engine
        landing, self._inflight = self._inflight, None
        landed = None
        if landing is not None:
            try:
                self._launch_ahead(*landing)
            finally:  # (whatever happened, the launched step's tokens land, then the next one's mask fills)
                try:
                    landed = self._land(*landing)
                finally:
                    mask, self._mask_after_landing = self._mask_after_landing, None
                    if mask is not None:
                        engine.start_mask(mask)
        if self._inflight is None:
            self._launch(engine.schedule_next())
        return engine.commit_text(landed) if landed is not None else []

    def wait_forward(self) -> None:
        """The launched step's forward pass done (its tokens not landed): nothing of the engine computes until the
        next `step()`."""
        if self._inflight is not None:
            wait([self._inflight[1]])

    def flush(self) -> list:
        """Land the launched step, if any, without launching another: its outputs."""
        if self._inflight is None:
            return []
        landing, self._inflight = self._inflight, None
        return self.engine.commit_text(self._land(*landing))

    def release(self, seq: Sequence) -> None:
        """An aborted row: the launched step may be reading its block table and adapter slot, and its landing
        would advance it: its blocks and adapter are given back once the step lands."""
        if self._inflight is not None:
            self._aborted.append(seq)
        else:
            self.engine.drop(seq)

    def close(self) -> None:
        """The launched step ends."""
        self._thread.shutdown(wait=True)

    def _launch_ahead(self, batch: ScheduledBatch, future: Future, ahead_of: Future | None) -> None:
        """Schedule and launch the step after the launched `batch` now, if nothing in it may depend on a token of
        `batch` but its input; the rows whose pending token is their last (by length) are left out of it. Never
        after a step that will run again (`ahead_of` raised) or whose forward pass raised: its tokens are to come
        from its run on the engine's thread."""
        if _raised(ahead_of) or (future.done() and isinstance(future.result(), Exception)):
            return
        held = self._ahead_holds(batch)
        if held is None:
            return
        # (the held rows' pending token is their last: nothing to schedule after it)
        self._launch(self.engine.schedule_next(hold=held), ahead_of=future)
        self.num_steps_ahead += self._inflight is not None

    def _ahead_holds(self, batch: ScheduledBatch) -> list[Sequence] | None:
        """None where the next step may not be scheduled before `batch` lands; else the rows to leave out of it."""
        if not self.ahead or self._aborted:  # (aborted rows still run, to be dropped as the batch lands)
            return None
        held, max_model_len = [], self.engine.max_model_len
        for i, seq in enumerate(batch.seqs):
            if seq.params.prompt_logprobs is not None:  # (its next chunk starts from the landed ones)
                return None
            if not batch.samples(i) or seq.is_finished:
                continue
            if self.engine.needs_token_on_host(seq):
                return None
            p = seq.params
            if seq.num_output_tokens + seq.num_pending >= p.max_tokens or (
                seq.num_tokens + seq.num_pending >= max_model_len
            ):
                held.append(seq)
        return held

    def _launch(self, batch: ScheduledBatch, ahead_of: Future | None = None) -> None:
        """Run the batch on the forward thread; returns once its inputs are built (the thread reads the rows
        until then, and only the batch's own snapshots after). `ahead_of`: the result of the step before it, which
        has not landed: its grammar mask fills once it has (`step` starts it), while its forward pass runs."""
        if not batch:
            return
        engine = self.engine
        try:  # here, while the forward thread may still run the step before
            inputs = engine.runner.plan_inputs(batch.plan())
        except Exception:  # (the forward thread builds them again; a failure is bisected as the step lands)
            inputs = None
        # values only: the forward thread reads nothing of the engine's
        call = engine.forward_call(batch, inputs, after_landing=ahead_of is not None)
        if ahead_of is not None:
            self._mask_after_landing = call.mask
        launched = threading.Event()
        future = self._thread.submit(call.run, launched.set, True)
        future.add_done_callback(lambda _: launched.set())  # (it may fail before it launches)
        self._inflight = (batch, future, ahead_of)
        self.unlanded.append(batch)
        # The text half waits for the launch: the interpreter's lock would otherwise hold the launch back.
        launched.wait()

    def _land(self, batch: ScheduledBatch, future: Future, ahead_of: Future | None):
        """The launched step's tokens committed, then the rows aborted while it ran released. A step launched
        before a step whose forward pass raised ran without that step's tokens (they were never sampled, or not
        as its run on the engine's thread sampled them): it runs again here, now that they are."""
        try:
            result = future.result()
            if _raised(ahead_of):
                result = self.engine.execute(batch)
            elif isinstance(result, Exception):  # the failing rows found here, on the engine's thread
                result = self.engine.bisect(batch, result)
            return self.engine.commit_tokens(batch, result)
        finally:
            self.unlanded = [b for b in self.unlanded if b is not batch]
            aborted, self._aborted = self._aborted, []
            for seq in aborted:
                self.engine.drop(seq)


def _raised(result: Future | None) -> bool:
    """Whether a landed step's forward pass raised (its result is the exception, bisected as it landed)."""
    return result is not None and isinstance(result.result(), Exception)
