"""A step's plan as values: what the scheduler hands the runner for each row it schedules (`RowPlan`), and the
scheduler's record of what the runner holds of each running row (`PlanMirror`), so that each plan carries only
what changed (vLLM V1's SchedulerOutput against its runner's persistent batch).

The runner keeps its own copy of each running row (motet/engine/worker/rows.py: its tokens known on the host, its
block table and window ring) and updates it from the plans, in order: the inputs, the sampler and the grammar
masks read the plan and that copy, never a live `Sequence` (which the scheduling thread goes on changing while a
launched step computes). Not yet values throughout: a grammar row's plan carries the sequence's live constraint and
detokenizer (`guided`, `detok`), which the masks read before the step launches, and `PendingToken` cells that the
forward thread fills. A plan's changes are absolute (the copy keeps its first `tokens_from` tokens, then the
new ones): applying a plan twice (a step re-run in parts) leaves the copy as once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from motet.engine.core.sequence import PendingToken, Sequence
from motet.engine.detokenizer import IncrementalDetokenizer
from motet.engine.guided import GuidedDecoding
from motet.engine.sampling_params import SamplingParams


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
    params: SamplingParams
    num_prompt_tokens: int
    num_output_tokens: int  # on the host (a pending token not counted)
    # The grammar rows: its constraint and detokenizer (the engine's; the masks read them before the step
    # launches, while the scheduling thread waits), None without a grammar
    guided: GuidedDecoding | None
    detok: IncrementalDetokenizer | None
    grammar_holds_stop: bool  # whether its grammar holds back the stop tokens (a bounded reasoning open)
    num_prompt_logprobs_done: int  # prompt logprobs it has reported (a recompute skips them)
    # Where its sampled token goes (the forward thread fills it), and where its pending input token is
    pending: PendingToken | None
    fed_by: PendingToken | None


@dataclass(slots=True)
class _Held:
    """What the runner holds of one row: its tokens' count, and its block table and ring as of the last plan (the
    lists themselves: the block manager replaces a list it shortens, so a list still the same one only grew)."""

    num_tokens: int
    table: list[int]
    table_len: int
    window: list[int]
    window_len: int


class PlanMirror:
    """The scheduler's record of what the runner holds of each row, making each plan's changes; rows that left the
    running set (finished, aborted, preempted) are named in the next plan with rows (`departed`), for the runner to
    drop."""

    def __init__(self):
        self._held: dict[int, _Held] = {}
        self._departed: list[int] = []
        self._plans = itertools.count(1)

    def plan_id(self) -> int:
        """The next plan's number (increasing: the runner applies each plan once, in order)."""
        return next(self._plans)

    def row(
        self, seq: Sequence, n: int, samples: bool, pending: PendingToken | None, fed_by: PendingToken | None
    ) -> RowPlan:
        held = self._held.get(seq.seq_id)
        tokens, table, window = seq.token_ids, seq.block_table, seq.window_blocks
        if held is None:
            held = self._held[seq.seq_id] = _Held(0, table, 0, window, 0)
        tokens_from = held.num_tokens
        table_from = held.table_len if held.table is table else 0
        window_from = held.window_len if held.window is window else 0
        held.num_tokens, held.table, held.table_len = len(tokens), table, len(table)
        held.window, held.window_len = window, len(window)
        guided = seq.guided
        return RowPlan(
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            start=seq.num_computed_tokens,
            num_new_tokens=n,
            samples=samples,
            tokens_from=tokens_from,
            new_tokens=tuple(tokens[tokens_from:]),
            table_from=table_from,
            new_blocks=tuple(table[table_from:]),
            window_from=window_from,
            new_window=tuple(window[window_from:]),
            drafts=tuple(seq.draft_token_ids),
            long_rope=seq.long_rope,
            params=seq.params,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            guided=guided,
            detok=seq.detok if guided is not None else None,
            grammar_holds_stop=guided is not None and guided.holds_stop,
            num_prompt_logprobs_done=len(seq.prompt_logprobs),
            pending=pending,
            fed_by=fed_by,
        )

    def departures(self, running_ids: set[int], with_rows: bool) -> tuple[int, ...]:
        """The rows held that are not running any more (forgotten here), to be named in a plan; a plan without rows
        (never run) passes its departures on to the next one."""
        for seq_id in [s for s in self._held if s not in running_ids]:
            del self._held[seq_id]
            self._departed.append(seq_id)
        if not with_rows:
            return ()
        departed, self._departed = tuple(self._departed), []
        return departed


def reaches_end(seq: Sequence, n: int) -> bool:
    """Whether a chunk of `n` tokens (drafts included) from its computed tokens reaches its last token (appended
    or pending): the step samples its next token."""
    return seq.num_computed_tokens + n - len(seq.draft_token_ids) == seq.num_tokens + seq.num_pending
