"""Verifying drafts: what the sampler sees at each draft position, and how many drafts are accepted.

A row with k drafts gets logits at k + 1 positions. Position j is sampled exactly as the plain path would
sample the token after drafts[:j]: penalties over the tokens so far, min_tokens by the output length so
far, a seeded draw from (seed, output position). The sampler reads those from a `DraftView`, the
sequence as it would be with drafts[:j] appended. Drafts are point masses, so rejection sampling reduces
to: sample the target at each position and accept while the sample equals the draft. The first sample that
differs (or the one after the last draft, the bonus token) is the target's own, so every emitted token is
distributed exactly as without speculation, greedy or not.
"""

from __future__ import annotations

from motet.engine.core.sequence import Sequence
from motet.engine.sampling_params import SamplingParams


class DraftView:
    """A sequence with some drafts appended, as the sampler reads it (params and token counts)."""

    __slots__ = ("params", "token_ids", "num_prompt_tokens", "guided")

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.params: SamplingParams = seq.params
        # The grammar's state before the drafts: the sampler reads only whether a bounded reasoning holds the
        # stop tokens, which the drafts never change (none crosses its forced end: proposer.py; one that ends it
        # leads to the call's grammar, which allows no stop token for many tokens yet).
        self.guided = seq.guided
        self.token_ids = seq.token_ids + drafts
        self.num_prompt_tokens = seq.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def position_views(seq: Sequence) -> list:
    """What the sampler sees at each of the row's verified positions: the sequence, then with drafts."""
    drafts = seq.draft_token_ids
    return [seq] + [DraftView(seq, drafts[:j]) for j in range(1, len(drafts) + 1)]


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's samples at their positions."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m
