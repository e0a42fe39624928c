"""Drafts from a scope's recent outputs (motet/engine/speculative/history.py) against a brute-force n-gram count
over the outputs the history should still hold; scopes never mix and memory stays bounded (per tenant:
tests/engine/test_tenant_isolation.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from motet.engine.speculative.history import DraftScope, OutputHistory

MAX_N = 4


def scope(tenant="t", adapter=0) -> DraftScope:
    return DraftScope(tenant, None, adapter, None, False)


S = scope()


def brute_force_walk(outputs: list[list[int]], context: list[int], k: int, allowed=None, floor=0.05):
    """The walk as the docstring states it, by scanning every kept output at every step: after the longest
    suffix of the context (up to MAX_N tokens) that occurs followed by a token, the most frequent such
    token (ties: the larger id) that `allowed` admits, with chance count / (admitted count + 1)."""
    drafts, chances, chance = [], [], 1.0
    context = list(context[-MAX_N:])
    while len(drafts) < k:
        follow = Counter()
        for n in range(min(MAX_N, len(context)), 0, -1):
            suffix = context[-n:]
            follow = Counter(
                out[i + n] for out in outputs for i in range(len(out) - n) if out[i : i + n] == suffix
            )
            if follow:
                break
        total = sum(follow.values())
        ranked = sorted(((c, t) for t, c in follow.items()), reverse=True)
        pick = None
        for c, t in ranked:
            if allowed is None or allowed(t):
                pick = (c, t)
                break
            total -= c
        if pick is None:
            break
        chance *= pick[0] / (total + 1)
        if chance < floor:
            break
        drafts.append(pick[1])
        chances.append(chance)
        context = (context + [pick[1]])[-MAX_N:]
    return drafts, chances


class Forbid:
    """A constraint that rules out some tokens (and, like a grammar, remembers what it took)."""

    def __init__(self, banned):
        self.banned, self.taken = set(banned), []

    def try_take(self, token):
        if token in self.banned:
            return False
        self.taken.append(token)
        return True


def random_outputs(rng: random.Random, n: int) -> list[list[int]]:
    # A few shared phrases with varying fillers, like JSON keys around differing values.
    phrases = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    outs = []
    for _ in range(n):
        out = []
        for p in phrases:
            out += p + [rng.randint(10, 14) for _ in range(rng.randint(1, 3))]
        outs.append(out)
    return outs


@pytest.mark.parametrize("seed", range(6))
def test_walk_matches_a_brute_force_count(seed):
    rng = random.Random(seed)
    history = OutputHistory(MAX_N, tokens_per_scope=10_000, tokens_per_tenant=10_000)
    lead_in = [99, 98]
    kept = []
    for out in random_outputs(rng, 8):
        history.record(S, lead_in, out)
        kept.append(lead_in + out)
        for _ in range(5):
            ref = rng.choice(kept)
            cut = rng.randint(1, len(ref))
            context = ref[:cut]
            got = history.propose(S, context, 6, min_chance=0.05)
            want = brute_force_walk(kept, context, 6)
            assert got[0] == want[0], (context, got, want)
            assert got[1] == pytest.approx(want[1])


def test_a_constraint_picks_the_most_frequent_token_it_allows():
    rng = random.Random(7)
    history = OutputHistory(MAX_N)
    outs = random_outputs(rng, 6)
    for out in outs:
        history.record(S, [], out)
    for banned in ([10], [10, 11], [2, 5, 12]):
        for context in ([1, 2, 3], [4, 5], [3]):
            walk = Forbid(banned)
            got = history.propose(S, context, 5, walk, min_chance=0.01)
            want = brute_force_walk(outs, context, 5, lambda t, b=set(banned): t not in b, floor=0.01)
            assert got[0] == want[0]
            assert got[1] == pytest.approx(want[1])
            assert walk.taken[: len(got[0])] == got[0]  # what was drafted was taken, in order


def test_old_outputs_leave_the_counts_when_the_scope_is_full():
    rng = random.Random(3)
    history = OutputHistory(MAX_N, tokens_per_scope=60)
    recorded = []
    for out in random_outputs(rng, 12):
        history.record(S, [], out)
        recorded.append(out)
    kept, size = [], 0
    for out in reversed(recorded):  # the newest outputs that fit, as the history keeps them
        if size + len(out) > 60 and kept:
            break
        kept.insert(0, out)
        size += len(out)
    for context in ([1, 2, 3], [4, 5], [9], [6, 7], [12]):
        got = history.propose(S, context, 6)
        assert got[0] == brute_force_walk(kept, context, 6)[0]


def test_scopes_never_mix_and_are_bounded():
    history = OutputHistory(MAX_N, scopes_per_tenant=3)
    history.record(scope("tenant-a", 0), [], [1, 2, 3, 4])
    assert history.propose(scope("tenant-b", 0), [1, 2], 4) == ([], [])
    assert history.propose(scope("tenant-a", 1), [1, 2], 4) == ([], [])  # another adapter
    assert history.propose(scope("tenant-a", 0), [1, 2], 4)[0] == [3, 4]
    for i in range(5):
        history.record(scope("tenant-a", 10 + i), [], [7, 8])
    assert len(history) == 3  # the tenant's least recently used scopes were dropped
    assert history.propose(scope("tenant-a", 0), [1, 2], 4) == ([], [])


def test_a_token_budget_over_a_tenants_scopes():
    history = OutputHistory(MAX_N, tokens_per_scope=100, tokens_per_tenant=250)
    for i in range(10):
        history.record(scope("t", i), [], list(range(60)))
    assert history.num_tokens <= 250 and len(history) == 4  # the newest scopes, 60 tokens each
    assert history.propose(scope("t", 9), [5, 6], 2)[0] == [7, 8]
    assert history.propose(scope("t", 5), [5, 6], 2) == ([], [])
