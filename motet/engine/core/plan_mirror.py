"""The scheduler's record of what the runner holds of each running row (`PlanMirror`), making each row's plan
(motet/engine/core/step_plan.py `RowPlan`) carry only what changed since the row's previous one."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from motet.engine.core.sequence import Sequence
from motet.engine.core.step_plan import RowPlan, SampledRef


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
        self, seq: Sequence, n: int, samples: bool, sampled_as: SampledRef | None, holds_stop: bool = False
    ) -> RowPlan:
        held = self._held.get(seq.seq_id)
        tokens, table, window = seq.token_ids, seq.block_table, seq.window_blocks
        first = held is None  # (the runner has nothing of it: it gets its params)
        if first:
            held = self._held[seq.seq_id] = _Held(0, table, 0, window, 0)
        tokens_from = held.num_tokens
        table_from = held.table_len if held.table is table else 0
        window_from = held.window_len if held.window is window else 0
        held.num_tokens, held.table, held.table_len = len(tokens), table, len(table)
        held.window, held.window_len = window, len(window)
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
            long_rope=seq.cache.long_rope,
            params=seq.params if first else None,
            num_prompt_tokens=seq.num_prompt_tokens if first else None,
            num_output_tokens=seq.num_output_tokens,
            num_pending=seq.num_pending,
            grammar_holds_stop=holds_stop,
            num_prompt_logprobs_done=len(seq.prompt_logprobs),
            sampled_as=sampled_as,
            fed_by=seq.pending,
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
