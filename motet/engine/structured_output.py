"""Structured output, as vLLM's `StructuredOutputManager`: each request's grammar state (`GuidedDecoding`,
motet/engine/guided.py) by request id, and each step's token bitmask over the constrained rows' sampled positions,
filled on a side thread while the forward pass runs (the grammar backends release the GIL). The runner only
applies the mask to the logits before sampling (motet/engine/worker/model_runner.py); unconstrained rows are never
touched, and a step without constrained rows gets `NO_MASK`, which does nothing.

A constrained row's step is never scheduled ahead of its previous step's landing (its next token's mask depends on
its text: `Sequence.decided_by_tokens`), so the grammar a step's mask reads is the one its tokens so far left."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from motet.engine.core.step_plan import StepPlan
from motet.engine.guided import GuidedDecoding
from motet.engine.speculative.grammar_drafts import activation_index, fill_draft_bitmask
from motet.grammar.backend import allocate_bitmask, apply_bitmask
from motet.grammar.masking import fill_bitmasks


@dataclass
class GrammarStats:
    """Where structured output's time goes, summed over steps (for benchmarks and /metrics)."""

    steps: int = 0  # steps with at least one constrained row
    rows: int = 0  # constrained rows masked
    fill_s: float = 0.0  # filling bitmasks (on a side thread, overlapping the forward pass)
    wait_s: float = 0.0  # of that, what the step waited for after its forward pass
    apply_s: float = 0.0  # masking the logits
    jump_forward_tokens: int = 0  # tokens appended without sampling (counted by the engine)


def _timed_fill(bitmask: torch.Tensor, items, drafted, tagged) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():  # the bitmask was made in the step's inference mode; this is another thread
        fill_bitmasks(bitmask, items)
        for guided, drafts, first, row in drafted:  # position by position, through the drafts
            fill_draft_bitmask(bitmask, guided, drafts, first, row)
        for (
            guided,
            row,
        ) in tagged:  # a tag's tokens: the opening of <think> (or the grammar's), a forced </think>
            guided.fill_tag_bitmask(bitmask, row)
    return time.perf_counter() - t0


class _NoMask:
    def apply(self, logits: torch.Tensor) -> None:
        pass


NO_MASK = _NoMask()


class GrammarMask:
    """One step's bitmask over its sampled positions, being filled on the masks' thread."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int], filling: Future, stats: GrammarStats):
        self.bitmask, self.rows, self.filling, self.stats = bitmask, rows, filling, stats

    def apply(self, logits: torch.Tensor) -> None:
        stats = self.stats
        t0 = time.perf_counter()
        stats.fill_s += self.filling.result()
        t1 = time.perf_counter()
        apply_bitmask(logits, self.bitmask, self.rows)
        stats.wait_s += t1 - t0
        stats.apply_s += time.perf_counter() - t1
        stats.steps += 1
        stats.rows += len(self.rows)


class StructuredOutputs:
    """The requests' grammars (`add` as a request is taken, `forget` as it ends) and each step's mask (`mask`),
    with the stats."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.stats = GrammarStats()
        self.grammars: dict[str, GuidedDecoding] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="motet-bitmask")

    def add(self, request_id: str, guided: GuidedDecoding) -> None:
        self.grammars[request_id] = guided

    def get(self, request_id: str | None) -> GuidedDecoding | None:
        """The request's grammar; None where it has none (or has ended)."""
        return self.grammars.get(request_id)

    def forget(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)

    def holding_stop(self) -> set[str]:
        """The requests whose grammar holds back their stop tokens now (`GuidedDecoding.holds_stop`): the next
        step's plan tells the sampler."""
        return {rid for rid, g in self.grammars.items() if g.holds_stop} if self.grammars else set()

    def mask(self, plan: StepPlan) -> GrammarMask | _NoMask:
        """The step's mask (NO_MASK where no row is constrained), its filling started: its sampled positions are
        each sampling row's next token and its drafts', in the plan's order."""
        masked, plain, drafted, tagged = [], [], [], []
        num_positions = 0
        for row in plan:
            if not row.samples:
                continue
            start = num_positions
            num_positions += len(row.drafts) + 1
            guided = self.grammars.get(row.request_id) if self.grammars else None
            if guided is None:
                continue
            drafts = list(row.drafts)
            if drafts:
                first = activation_index(guided, drafts)
                masked.extend(range(start + first, start + len(drafts) + 1))
                drafted.append((guided, drafts, first, start))
            elif guided.active:
                masked.append(start)
                plain.append((guided.matcher, start))
            elif guided.tag_masked:
                masked.append(start)
                tagged.append((guided, start))
        if not masked:
            return NO_MASK
        bitmask = allocate_bitmask(num_positions, self.vocab_size)
        filling = self._thread.submit(_timed_fill, bitmask, plain, drafted, tagged)
        return GrammarMask(bitmask, masked, filling, self.stats)
