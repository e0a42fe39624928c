"""The runner's own copy of each running row (vLLM's persistent batch): its tokens known on the host, its block
table and its sliding-window ring, kept between steps and updated from each step's plan
(motet/engine/core/step_plan.py), which carries only what changed. The step's inputs, the sampler's views
(`SampleView`) and the prompt logprobs read these and the plan's values, never a live `Sequence`.

Plans are applied in order, once each, on the thread that launches the steps (`ModelRunner.take_plan`, as the
engine hands a step over); the rows a recent plan ran are kept by its number, and a part of the step re-run after a
failure reads them as they are by then (only grown: rows' tokens and blocks are never taken back while a step is in
flight)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from motet.engine.core.step_plan import RowPlan, StepPlan
from motet.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class Row:
    """One running row as the runner holds it: what its first plan gave once (its params, its prompt's length) and
    what each plan changes."""

    params: SamplingParams | None = None
    num_prompt_tokens: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt and output, as far as known on the host
    table: list[int] = field(default_factory=list)  # its KV blocks
    window: list[int] = field(default_factory=list)  # its sliding-window layers' ring


class RunnerRows:
    """The rows the runner holds, by sequence id, and the rows each recent plan ran (the latest `keep`)."""

    def __init__(self, keep: int = 8):
        self._rows: dict[int, Row] = {}
        self._applied = 0  # the latest plan applied
        self._taken: OrderedDict[int, dict[int, Row]] = OrderedDict()  # a plan's rows, by its number
        self._keep = keep

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, plan: StepPlan) -> list[Row]:
        """The plan's rows, in its order, the plan applied first unless it was (as the step launches, on the
        launching thread, plans in order); a part of the step re-run later gets the rows the step ran. A plan from
        nothing held (a batch built by hand) is applied whenever read."""
        taken = self._taken.get(plan.plan_id) if plan.plan_id is not None else None
        if taken is None:
            if plan.plan_id is None or plan.plan_id > self._applied:
                for seq_id in plan.departed:
                    self._rows.pop(seq_id, None)
                for p in plan:
                    row = self._rows.get(p.seq_id)
                    if row is None:
                        row = self._rows[p.seq_id] = Row()
                    if p.params is not None:  # (its first plan)
                        row.params, row.num_prompt_tokens = p.params, p.num_prompt_tokens
                    _splice(row.tokens, p.tokens_from, p.new_tokens, p.seq_id)
                    _splice(row.table, p.table_from, p.new_blocks, p.seq_id)
                    _splice(row.window, p.window_from, p.new_window, p.seq_id)
            taken = {p.seq_id: self._rows[p.seq_id] for p in plan}
            if plan.plan_id is not None:
                self._applied = max(self._applied, plan.plan_id)
                self._taken[plan.plan_id] = taken
                while len(self._taken) > self._keep:
                    self._taken.popitem(last=False)
        return [taken[p.seq_id] for p in plan]


def _splice(held: list[int], keep: int, new: tuple[int, ...], seq_id: int) -> None:
    """`held` keeps its first `keep` values, then `new`."""
    if len(held) < keep:  # (a plan built against more than the runner holds: plans applied out of order)
        raise RuntimeError(f"the runner holds {len(held)} values of row {seq_id}, its plan keeps {keep}")
    del held[keep:]
    held.extend(new)


# A token sampled by a launched step and not on the host when the step was planned (an overlapped engine schedules
# a step before the one before lands, motet/engine/stepping.py): in a view's `token_ids` it stands in its place, and
# the view's `pending` says where it is on the device.
PENDING = -1


class SampleView:
    """What the sampler reads of one sampled position (a row's next token, or a draft's position after it): its
    request, its params, its output's length, its tokens (prompt and output, with the drafts before the position;
    read from the runner's copy only where the params ask: penalties, bad words), and whether its grammar holds
    the stop tokens back.

    A row planned before its previous step landed has that step's token pending: its `token_ids` hold `PENDING` in
    its place and `pending` is (the step's sampled tokens on the device, the row's index there)
    (motet/engine/worker/step_inputs.py `SampledTokens`), which the sampler reads on the device (penalties, bad
    words); its output's length counts it, as the step before landing would have (min_tokens, a seed's draw)."""

    __slots__ = (
        "request_id",
        "params",
        "num_prompt_tokens",
        "num_output_tokens",
        "grammar_holds_stop",
        "pending",
        "_row",
        "_known",
        "_num_pending",
        "_drafts",
    )

    def __init__(self, plan: RowPlan, row: Row, num_drafts: int, sampled=None):
        self.request_id = plan.request_id
        self.params = row.params
        self.num_prompt_tokens = row.num_prompt_tokens
        self._known = (
            row.num_prompt_tokens + plan.num_output_tokens
        )  # its tokens on the host as it was planned
        self._num_pending = plan.num_pending
        self.pending = sampled.where(plan.fed_by) if plan.num_pending and sampled is not None else None
        self.num_output_tokens = plan.num_output_tokens + plan.num_pending + num_drafts
        # (the drafts never change whether the grammar holds the stop tokens: none crosses a bounded reasoning's
        # forced end, motet/engine/speculative/proposer.py)
        self.grammar_holds_stop = plan.grammar_holds_stop
        self._row, self._drafts = row, plan.drafts[:num_drafts]

    @property
    def token_ids(self) -> list[int]:
        # (the runner's copy only grows while a step is in flight: its first tokens are the plan's)
        return self._row.tokens[: self._known] + [PENDING] * self._num_pending + list(self._drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def position_views(plan: RowPlan, row: Row, sampled=None) -> list[SampleView]:
    """The sampler's views of a sampling row's positions: its next token, then each of its drafts' (the drafts
    before it appended); `sampled`: the recent steps' sampled tokens (`SampledTokens`), where a pending token is."""
    return [SampleView(plan, row, j, sampled) for j in range(len(plan.drafts) + 1)]
