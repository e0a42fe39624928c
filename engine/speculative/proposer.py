"""Which drafts each decode row carries into a step: proposers, per-row lookahead, and when to back off.

Proposers need no second model: the grammar's forced tokens where the row's grammar forces a string, else
prompt lookup over the row's prompt and output (ngram.py). The number of drafts per row adapts to what the
row's drafts have been accepted at, and a row whose drafts keep missing rests a few steps. When the step
has many decode rows it is compute-bound, verifying costs as much as it saves, and no row drafts
(`SpeculativeConfig.max_batch`, measured by evals/spec_bench.py --measure-threshold).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.sequence import Sequence
from engine.speculative.grammar_drafts import activation_index, check_drafts, forced_tokens
from engine.speculative.ngram import NgramIndex

_RATE_DECAY = 0.7  # weight of the past in a row's acceptance rate
_REST_BELOW = 0.15  # a row whose acceptance rate falls under this stops drafting for a while
_REST_STEPS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 4  # most drafts per row and step
    max_batch: int = 8  # no drafts in a step with more decode rows than this
    min_n: int = 2  # prompt lookup matches suffixes of min_n..max_n tokens
    max_n: int = 4


@dataclass
class SpeculativeStats:
    """Plain counters for /metrics and benchmarks."""

    proposals: int = 0  # rows the proposers were asked for drafts
    ngram_hits: int = 0  # of those, rows that got prompt-lookup drafts
    grammar_hits: int = 0  # rows that got the grammar's forced tokens
    verified_rows: int = 0  # rows that verified at least one draft
    drafted_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of those, accepted
    backoff_steps: int = 0  # steps with too many decode rows to draft


class DraftState:
    """A row's proposer state: its n-gram index and its adaptive lookahead."""

    def __init__(self, config: SpeculativeConfig):
        self.index = NgramIndex(config.min_n, config.max_n)
        self.max_k = config.num_tokens
        self.k = config.num_tokens
        self.rate = 1.0
        self.rest = 0

    def lookahead(self) -> int:
        if self.rest:
            self.rest -= 1
            return 0
        return self.k

    def observe(self, drafted: int, accepted: int) -> None:
        # All accepted: look further next time; else just past what was accepted.
        self.k = min(self.k + 1, self.max_k) if accepted == drafted else max(1, accepted + 1)
        self.rate = _RATE_DECAY * self.rate + (1 - _RATE_DECAY) * accepted / drafted
        if self.rate < _REST_BELOW:
            self.rest, self.rate, self.k = _REST_STEPS, 2 * _REST_BELOW, 1


class Speculator:
    def __init__(self, config: SpeculativeConfig, encode: Callable[[str], list[int]], max_model_len: int):
        self.config = config
        self.encode = encode  # text -> token ids, for the grammar's forced strings
        self.max_model_len = max_model_len
        self.stats = SpeculativeStats()

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set the drafts of every running decode row (and clear the others')."""
        rows = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if len(rows) > self.config.max_batch:
            self.stats.backoff_steps += 1
            rows = []
        for seq in running:
            seq.draft_token_ids = []
        for seq in rows:
            if seq.params.speculative:
                seq.draft_token_ids = self._drafts(seq)

    def _drafts(self, seq: Sequence) -> list[int]:
        state = seq.draft_state
        if state is None:
            state = seq.draft_state = DraftState(self.config)
        # No draft past the request's last token or the context: they could never be kept.
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
        k = min(state.lookahead(), room)
        if k <= 0:
            return []
        self.stats.proposals += 1
        g = seq.guided
        drafts = forced_tokens(g, self.encode, k) if g is not None else []
        if drafts:
            self.stats.grammar_hits += 1
        else:
            drafts = state.index.propose(seq.token_ids, k)
            self.stats.ngram_hits += bool(drafts)
        if g is not None and drafts:
            drafts = check_drafts(g, drafts, activation_index(g, seq.detok, drafts))
        return drafts

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A row verified `drafted` drafts and kept `accepted` of them."""
        if drafted:
            self.stats.verified_rows += 1
            self.stats.drafted_tokens += drafted
            self.stats.accepted_tokens += accepted
            if seq.draft_state is not None:
                seq.draft_state.observe(drafted, accepted)
