"""Verifying drafts: what the sampler sees at each draft position, and how many drafts are accepted.

A row with k drafts gets logits at k + 1 positions. Position j is sampled exactly as the plain path would
sample the token after drafts[:j]: penalties over the tokens so far, min_tokens by the output length so
far, a seeded draw from (seed, output position). The sampler reads those from a view of the row as it
would be with drafts[:j] appended (motet/engine/worker/rows.py's `position_views`). Drafts are point masses, so rejection sampling reduces
to: sample the target at each position and accept while the sample equals the draft. The first sample that
differs (or the one after the last draft, the bonus token) is the target's own, so every emitted token is
distributed exactly as without speculation, greedy or not.
"""

from __future__ import annotations


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's samples at their positions."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m
