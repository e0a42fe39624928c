"""Structured output, as vLLM's `StructuredOutputManager`: each request's grammar state (`GuidedDecoding`,
motet/engine/guided.py) by request id, and each step's token bitmask over the constrained rows' sampled positions,
filled on a side thread while the forward pass runs (the grammar backends release the GIL). The runner only
applies the mask to the logits before sampling (motet/engine/worker/model_runner.py); unconstrained rows are never
touched, and a step without constrained rows gets `NO_MASK`, which does nothing.

A step scheduled before the step before it lands (an overlapped engine's, motet/engine/stepping.py) gets its mask
made as it launches and filled once that step's tokens land and advance the grammars (`mask(..., after_landing=True)`,
then `start`), while its forward pass runs; its sampler waits for it, as vLLM's async scheduling computes a step's
bitmask after the step before it and hands it to the sampler apart from the forward pass. So the grammar a step's
mask reads is always the one its tokens so far left. Such a step's rows are those whose grammar constrains every
token (`waits_for_token`): a reasoning format's phases move with the output's text, and their rows' steps wait."""

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
    """One step's bitmask over its sampled positions, filled on the masks' thread: from the moment it is made, or
    for a step scheduled before the step before it landed (`StructuredOutputs.mask(..., after_landing=True)`),
    once that step's tokens advanced the grammars (`start`); the sampler waits for it (`apply`)."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int], stats: GrammarStats, fill, thread):
        self.bitmask, self.rows, self.stats = bitmask, rows, stats
        self.filling: Future = Future()
        # its rows' grammars, still to fill: plain [(guided, row)], drafted [(guided, drafts, first, row)], tagged
        # [(guided, row)], each with its request's id; the grammars by request id
        self._fill, self._thread = fill, thread

    def start(self, grammars: dict[str, GuidedDecoding] | None = None) -> None:
        """Fill the bitmask on the masks' thread from the grammars as they are now (once). `grammars`: the requests'
        grammars now, where some may have ended since the mask was made (a request finished or aborted by the
        step before: its row's token is dropped): the rows of those are left unmasked."""
        if self._fill is None:
            return
        (plain, drafted, tagged), self._fill = self._fill, None
        if grammars is not None:
            live = lambda rid, g: grammars.get(rid) is g and not g.terminated  # noqa: E731
            plain, drafted, tagged = ([x for x in xs if live(*x[:2])] for xs in (plain, drafted, tagged))
        plain = [(g.matcher, row) for _, g, row in plain]
        drafted = [x[1:] for x in drafted]
        tagged = [x[1:] for x in tagged]

        def fill() -> None:
            try:
                self.filling.set_result(_timed_fill(self.bitmask, plain, drafted, tagged))
            except BaseException as e:  # (the sampler raises it: the step fails, and is bisected)
                self.filling.set_exception(e)

        self._thread.submit(fill)

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

    def waits_for_token(self, request_id: str | None) -> bool:
        """Whether the request's next mask depends on more than its grammar advanced by its pending token, so that
        its next step waits for the token to land: a grammar not yet constraining every token (a reasoning
        format's opening, reasoning or forced closing: the phase moves with the output's text, and with it the
        mask's kind and whether the stop tokens are held). A constraining grammar's mask of a step scheduled before
        the step before lands is filled once it lands (`mask(..., after_landing=True)`)."""
        guided = self.grammars.get(request_id) if self.grammars else None
        return guided is not None and not guided.active

    def mask(self, plan: StepPlan, after_landing: bool = False) -> GrammarMask | _NoMask:
        """The step's mask (NO_MASK where no row is constrained), its filling started unless `after_landing`: the
        step was scheduled before the step before it landed, whose tokens the grammars have yet to accept (its
        constrained rows' grammars constrain every token: `waits_for_token`); the engine starts it then
        (`GrammarMask.start`). Its sampled positions are each sampling row's next token and its drafts', in the
        plan's order."""
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
                drafted.append((row.request_id, guided, drafts, first, start))
            elif guided.active:
                masked.append(start)
                plain.append((row.request_id, guided, start))
            elif guided.tag_masked:
                masked.append(start)
                tagged.append((row.request_id, guided, start))
        if not masked:
            return NO_MASK
        bitmask = allocate_bitmask(num_positions, self.vocab_size)
        mask = GrammarMask(bitmask, masked, self.stats, (plain, drafted, tagged), self._thread)
        if not after_landing:
            mask.start()
        return mask

    def start(self, mask: GrammarMask | _NoMask) -> None:
        """Start filling a mask made `after_landing`, now that the step before landed: from the grammars as its
        tokens left them, but those of requests that ended meanwhile."""
        if isinstance(mask, GrammarMask):
            mask.start(self.grammars)
