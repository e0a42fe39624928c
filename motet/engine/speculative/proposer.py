"""Which drafts each decode row carries into a step: proposers, and a cost model that prices every draft.

Proposers need no second model: the grammar's forced tokens where the row's grammar forces a string,
prompt lookup over the row's prompt and output (ngram.py), and an n-gram model of the recent outputs of
the row's scope, its tenant, adapter and kind of grammar (history.py). Each row keeps, per proposer, an
estimate p of the chance that a draft is accepted given the earlier ones were, so its j-th draft adds p^j
expected tokens; the history estimates each draft's chance from its counts. A row takes the candidate with
the most expected tokens. A step costs about `overhead + tokens` token-times (measured:
benchmarks/spec_threshold.py fits the step time of B rows with k drafts as a line in B(k + 1)); a draft is worth
verifying while its expected tokens exceed the step's tokens out per token-time so far. So a row's drafts
follow its acceptance, and with many decode rows (the step compute-bound, each extra token as dear as a
whole row's) only drafts that are nearly sure survive: speculation backs off by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from motet.engine.core.sequence import Sequence
from motet.engine.guided import GuidedDecoding
from motet.engine.speculative.grammar_drafts import GrammarWalk, activation_index, check_drafts, forced_text
from motet.engine.speculative.history import DraftScope, OutputHistory
from motet.engine.speculative.ngram import NgramIndex

_DECAY = 0.8  # weight of the past in a row's acceptance estimate
# (accepted, tried) before any verification, per source: the grammar's forced tokens, and prompt lookup by
# the length of the suffix it matched (one token is a weak cue, four a strong one).
_PRIOR = {
    "grammar": (3.0, 4.0),
    "ngram1": (1.0, 3.0),
    "ngram2": (1.0, 2.0),
    "ngram3": (1.0, 2.0),
    "ngram4": (2.0, 3.0),
}
_MAX_P = 0.95  # no draft is ever sure


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 8  # most drafts per row and step
    # A step's fixed cost in token-times (its time at zero tokens over the time per token): measured.
    overhead_tokens: float = 10.0
    min_n: int = 1  # prompt lookup matches suffixes of min_n..max_n tokens (the longest it finds)
    max_n: int = 4


@dataclass
class SpeculativeStats:
    """Plain counters for /metrics and benchmarks."""

    proposals: int = 0  # rows the proposers were asked for drafts
    ngram_hits: int = 0  # of those, rows that got prompt-lookup drafts
    grammar_hits: int = 0  # rows that got the grammar's forced tokens
    history_hits: int = 0  # rows whose drafts came from the scope's recent outputs
    verified_rows: int = 0  # rows that verified at least one draft
    drafted_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of those, accepted
    priced_out_tokens: int = 0  # drafts proposed but not worth their cost in their step


class Estimate:
    """A decayed count of drafts accepted out of drafts tried (a draft tried only after the earlier were
    accepted), starting from a prior."""

    def __init__(self, proposer: str):
        self.accepted, self.tried = _PRIOR[proposer]

    @property
    def p(self) -> float:
        return min(_MAX_P, self.accepted / self.tried)

    def observe(self, drafted: int, accepted: int) -> None:
        self.accepted = _DECAY * self.accepted + accepted
        self.tried = _DECAY * self.tried + accepted + (accepted < drafted)


class DraftState:
    """A row's proposer state: its n-gram index, its acceptance estimates, and its latest drafts' source."""

    def __init__(self, config: SpeculativeConfig):
        assert config.max_n <= 4, "an acceptance prior per suffix length up to 4"
        self.index = NgramIndex(config.min_n, config.max_n)
        self.estimates = {name: Estimate(name) for name in _PRIOR}
        self.source = "ngram2"

    def observe(self, drafted: int, accepted: int) -> None:
        if self.source in self.estimates:  # the history's chances come from its counts instead
            self.estimates[self.source].observe(drafted, accepted)


class NoSpeculation:
    """Speculation off: no drafts proposed, no history recorded, its stats zeros."""

    needs_landed_steps = False

    def __init__(self):
        self.stats = SpeculativeStats()

    def propose(self, running: Iterable[Sequence]) -> None:
        pass

    def admit(self, seq_id: int, scope: DraftScope) -> None:
        pass

    def record(self, seq: Sequence) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


class Speculator:
    needs_landed_steps = True  # (drafts are proposed from the landed tokens)

    def __init__(
        self,
        config: SpeculativeConfig,
        encode: Callable[[str], list[int]],
        max_model_len: int,
        grammar_of: Callable[[str], GuidedDecoding | None] = lambda request_id: None,
    ):
        self.config = config
        self.encode = encode  # text -> token ids, for the grammar's forced strings
        self.max_model_len = max_model_len
        self.grammar_of = grammar_of  # a request's grammar (the structured outputs'), for grammar drafts
        self.stats = SpeculativeStats()
        self.history = OutputHistory(config.max_n)
        # Each request's, by seq_id: whose recent outputs it may draft from (its tenant, cache_salt, adapter and kind
        # of grammar), and its drafts' state once it drafts
        self.scopes: dict[int, DraftScope] = {}
        self.states: dict[int, DraftState] = {}

    def admit(self, seq_id: int, scope: DraftScope) -> None:
        """A new request drafts from its scope's history, and its output joins it as it finishes."""
        self.scopes[seq_id] = scope

    def forget(self, seq: Sequence) -> None:
        """A request ended without finishing (aborted): its scope and drafts' state go."""
        self.scopes.pop(seq.seq_id, None)
        self.states.pop(seq.seq_id, None)

    def record(self, seq: Sequence) -> None:
        """A request finished: its output joins its scope's history (unless it opted out)."""
        self.states.pop(seq.seq_id, None)
        scope = self.scopes.pop(seq.seq_id, None)
        if seq.params.speculative and scope is not None:
            lead_in = seq.prompt_token_ids[-self.config.max_n :]
            self.history.record(scope, lead_in, seq.output_token_ids)

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set the drafts of every running decode row worth its cost (and clear the others')."""
        running = list(running)
        for seq in running:
            seq.draft_token_ids = []
        rows = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        offers = []  # (expected tokens, row, its drafts so far): every draft position of every row
        for seq in rows:
            if seq.params.speculative:
                drafts, gains = self._drafts(seq, len(rows))
                offers += [(gains[j], -j, seq, drafts[: j + 1]) for j in range(len(drafts))]
        # Best first (a row's later drafts are worth less than its earlier ones, so prefixes are taken).
        offers.sort(key=lambda o: o[:2], reverse=True)
        out, cost = len(rows), len(rows) + self.config.overhead_tokens
        for i, (gain, _, seq, drafts) in enumerate(offers):
            if gain * cost <= out:  # this draft would lower the step's tokens per token-time
                self.stats.priced_out_tokens += len(offers) - i
                break
            seq.draft_token_ids = drafts
            out, cost = out + gain, cost + 1

    def _drafts(self, seq: Sequence, num_rows: int) -> tuple[list[int], list[float]]:
        """The row's best candidate drafts, and for each the chance that it and those before it are kept
        (in a step of `num_rows` decode rows, where drafts less likely than that cannot pay)."""
        state = self.states.get(seq.seq_id)
        if state is None:
            state = self.states[seq.seq_id] = DraftState(self.config)
        # No draft past the request's last token or the context: they could never be kept.
        room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
        k = min(self.config.num_tokens, room)
        g = self.grammar_of(seq.request_id)
        if g is not None and g.reasoning_room is not None:  # no draft reaches a forced end of reasoning, nor
            k = min(k, g.reasoning_room - 1)  # does the token sampled after the drafts (guided.py)
        if k <= 0 or (g is not None and g.tag_masked):  # a tag's tokens decide the next ones: no drafts
            return [], []
        self.stats.proposals += 1
        text = forced_text(g) if g is not None else ""
        forced = self.encode(text)[:k] if text else []
        p_forced = state.estimates["grammar"].p
        forced_gains = [p_forced ** (j + 1) for j in range(len(forced))]
        # Candidates (source, drafts, gains): the forced tokens continued by prompt lookup (a key, then
        # the value copied from the prompt); and the history walked under the grammar, which spells a
        # forced string in the model's own tokenization (jump-forward's may not be) and runs on.
        candidates = []
        copied = state.index.propose(seq.token_ids, k - len(forced), forced)
        if forced or copied:
            source = "grammar" if forced else f"ngram{state.index.matched}"
            p = state.estimates[source].p
            gains = forced_gains + [p ** (len(forced) + j + 1) for j in range(len(copied))]
            candidates.append((source, forced + copied, gains, False))
        scope = self.scopes.get(seq.seq_id)
        if scope is not None and len(self.history):
            walk = GrammarWalk(g) if g is not None and g.active else None
            floor = num_rows / (num_rows + self.config.overhead_tokens)  # as propose() prices a draft
            tail = seq.token_ids[-self.config.max_n :]
            past, chances = self.history.propose(scope, tail, k, walk, floor)
            if walk is not None:
                walk.release()
            if past:
                candidates.append(("history", past, chances, walk is not None))
        if not candidates:
            return [], []
        source, drafts, gains, checked = max(candidates, key=lambda c: sum(c[2]))
        state.source = source
        self.stats.grammar_hits += source == "grammar"
        self.stats.ngram_hits += source.startswith("ngram") or (source == "grammar" and bool(copied))
        self.stats.history_hits += source == "history"
        if g is not None and not checked:
            drafts = check_drafts(g, drafts, activation_index(g, drafts))
        return drafts, gains[: len(drafts)]

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A row verified `drafted` drafts and kept `accepted` of them."""
        if drafted:
            self.stats.verified_rows += 1
            self.stats.drafted_tokens += drafted
            self.stats.accepted_tokens += accepted
            state = self.states.get(seq.seq_id)
            if state is not None:
                state.observe(drafted, accepted)
