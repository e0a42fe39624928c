"""A step's plan as values: what the scheduler hands the runner for each row it schedules (`RowPlan`), each plan
carrying only what changed against the scheduler's record of what the runner holds (motet/engine/core/plan_mirror.py
`PlanMirror`; vLLM V1's SchedulerOutput against its runner's persistent batch). A leaf: it imports nothing of the
engine's core, so the worker reads plans without reaching the scheduler's rows.

The runner keeps its own copy of each running row (motet/engine/worker/rows.py: its tokens known on the host, its
block table and window ring) and updates it from the plans, in order: the inputs and the sampler read the plan and
that copy, never a live `Sequence` (which the scheduling thread goes on changing while a launched step computes). A
row's pending input token is named by value (`SampledRef`: the step that samples it and the row's index there),
which the runner finds among the tokens it keeps (motet/engine/worker/step_inputs.py `SampledTokens`); a grammar
row's constraint is the engine's structured outputs' (motet/engine/structured_output.py), which mask the step's
logits. A plan's changes are absolute (the copy keeps its first `tokens_from` tokens, then the
new ones): applying a plan twice (a step re-run in parts) leaves the copy as once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from motet.engine.sampling_params import SamplingParams

_steps = itertools.count(1)


@dataclass(frozen=True, slots=True)
class SampledRef:
    """Where a step leaves one row's sampled token: the step's number (`new_step`) and the row's index in it. The
    runner keeps recent steps' sampled tokens by it (motet/engine/worker/step_inputs.py `SampledTokens`), so that a
    later step may take a token as its input before it reaches the host."""

    step: int
    row: int


def new_step() -> int:
    """A number for a step being planned, unique in the process (a part of a step re-run keeps its step's)."""
    return next(_steps)


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One scheduled row of a step, as it was when the step was scheduled."""

    seq_id: int
    request_id: str | None
    start: int  # its first position in the step (its computed tokens)
    num_new_tokens: int  # its tokens in the step, drafts included
    samples: bool  # whether the step samples its next token (its chunk reaches its last token)
    # Its tokens known on the host (prompt and output): the runner's copy keeps its first `tokens_from`, then these
    tokens_from: int
    new_tokens: tuple[int, ...]
    # Its block table and sliding-window ring, likewise
    table_from: int
    new_blocks: tuple[int, ...]
    window_from: int
    new_window: tuple[int, ...]
    drafts: tuple[int, ...]  # the drafts the step verifies after its last token
    long_rope: bool  # whether its tokens turn by LongRoPE's long factors
    # In the row's first plan only (None after: the runner keeps them from there, motet/engine/worker/rows.py)
    params: SamplingParams | None
    num_prompt_tokens: int | None
    num_output_tokens: int  # on the host (a pending token not counted)
    # Its tokens sampled by launched steps and not on the host (0, or 1 where the step was scheduled before the one
    # before it landed: its input, found by `fed_by`); the sampler counts it (penalties, min_tokens, a seed's draw)
    num_pending: int
    # whether its grammar holds back the stop tokens (a bounded reasoning open; the grammar itself is the engine's
    # structured outputs', motet/engine/structured_output.py, which mask the step's logits)
    grammar_holds_stop: bool
    num_prompt_logprobs_done: int  # prompt logprobs it has reported (a recompute skips them)
    # Where its sampled token will be (None: the step samples none for it), and where its pending input token is
    sampled_as: SampledRef | None
    fed_by: SampledRef | None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A step as the worker sees it, and all it sees: its rows' plans in order (it is a sequence of them), the rows
    that left the running set since the plan before (the runner forgets them) and the plan's number (the runner
    applies each plan once, in order; a part of a step re-run carries its step's). `plan_id` None: a plan from
    nothing held (a batch built by hand), applied whenever read."""

    rows: tuple[RowPlan, ...] = ()
    departed: tuple[int, ...] = ()
    plan_id: int | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> RowPlan:
        return self.rows[i]

    def __iter__(self):
        return iter(self.rows)

    def subset(self, indices) -> StepPlan:
        """The rows at `indices`, in order: the same plan (its number, its departures), to re-run part of a step."""
        return StepPlan(tuple(self.rows[i] for i in indices), self.departed, self.plan_id)

    def sampling_rows(self) -> list[int]:
        """The rows i that sample their next token in this step."""
        return [i for i, r in enumerate(self.rows) if r.samples]
