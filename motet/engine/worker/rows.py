"""The runner's own copy of each running row (vLLM's persistent batch): its tokens known on the host, its block
table and its sliding-window ring, kept between steps and updated from each step's plan
(motet/engine/core/step_plan.py), which carries only what changed. The step's inputs, the sampler's views
(`SampleView`) and the prompt logprobs read these and the plan's values, never a live `Sequence`.

Plans are applied in order, once each, on the thread that launches the steps (`ModelRunner.take_plan`, as the
engine hands a step over); the batch keeps its rows' copies, and a part of the step re-run after a failure reads
them as they are by then (only grown: rows' tokens and blocks are never taken back while a step is in flight)."""

from __future__ import annotations

from dataclasses import dataclass, field

from motet.engine.core.scheduler import ScheduledBatch
from motet.engine.core.step_plan import RowPlan


@dataclass(slots=True)
class Row:
    """One running row as the runner holds it."""

    tokens: list[int] = field(default_factory=list)  # prompt and output, as far as known on the host
    table: list[int] = field(default_factory=list)  # its KV blocks
    window: list[int] = field(default_factory=list)  # its sliding-window layers' ring


class RunnerRows:
    """The rows the runner holds, by sequence id."""

    def __init__(self):
        self._rows: dict[int, Row] = {}
        self._applied = 0  # the latest plan applied

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, batch: ScheduledBatch) -> list[Row]:
        """The batch's rows, in its order, its plan applied first unless it was (as the step launches, on the
        launching thread, plans in order). The batch keeps them: a part of the step re-run later reads them
        there. A batch built by hand carries a plan from nothing held, applied whenever read."""
        if batch.runner_rows is not None:
            return batch.runner_rows
        plan = batch.plan()
        if batch.plan_id is None or batch.plan_id > self._applied:
            for seq_id in batch.departed:
                self._rows.pop(seq_id, None)
            for p in plan:
                row = self._rows.get(p.seq_id)
                if row is None:
                    row = self._rows[p.seq_id] = Row()
                _splice(row.tokens, p.tokens_from, p.new_tokens, p.seq_id)
                _splice(row.table, p.table_from, p.new_blocks, p.seq_id)
                _splice(row.window, p.window_from, p.new_window, p.seq_id)
            if batch.plan_id is not None:
                self._applied = batch.plan_id
        batch.runner_rows = [self._rows[p.seq_id] for p in plan]
        return batch.runner_rows


def _splice(held: list[int], keep: int, new: tuple[int, ...], seq_id: int) -> None:
    """`held` keeps its first `keep` values, then `new`."""
    if len(held) < keep:  # (a plan built against more than the runner holds: plans applied out of order)
        raise RuntimeError(f"the runner holds {len(held)} values of row {seq_id}, its plan keeps {keep}")
    del held[keep:]
    held.extend(new)


class SampleView:
    """What the sampler reads of one sampled position (a row's next token, or a draft's position after it): its
    request, its params, its output's length, its tokens (prompt and output, with the drafts before the position;
    read from the runner's copy only where the params ask: penalties, bad words), and whether its grammar holds
    the stop tokens back."""

    __slots__ = (
        "request_id",
        "params",
        "num_prompt_tokens",
        "num_output_tokens",
        "grammar_holds_stop",
        "_row",
        "_drafts",
    )

    def __init__(self, plan: RowPlan, row: Row, num_drafts: int):
        self.request_id = plan.request_id
        self.params = plan.params
        self.num_prompt_tokens = plan.num_prompt_tokens
        self.num_output_tokens = plan.num_output_tokens + num_drafts
        # (the drafts never change whether the grammar holds the stop tokens: none crosses a bounded reasoning's
        # forced end, motet/engine/speculative/proposer.py)
        self.grammar_holds_stop = plan.grammar_holds_stop
        self._row, self._drafts = row, plan.drafts[:num_drafts]

    @property
    def token_ids(self) -> list[int]:
        # (the runner's copy only grows while a step is in flight: its first tokens are the plan's)
        known = self.num_prompt_tokens + self.num_output_tokens - len(self._drafts)
        return self._row.tokens[:known] + list(self._drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def position_views(plan: RowPlan, row: Row) -> list[SampleView]:
    """The sampler's views of a sampling row's positions: its next token, then each of its drafts' (the drafts
    before it appended)."""
    return [SampleView(plan, row, j) for j in range(len(plan.drafts) + 1)]
