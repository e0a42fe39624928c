"""The cores' granting policy (motet/training/compute_share.py) on plain inputs: serving's steps and the slices it
grants, as seconds, against the share's own arithmetic (T / (S + T) = share); the idle engine's turns; tenants in
turn by the time they held the cores; why a worker waits, from two samples of its compute."""

from __future__ import annotations

from collections import Counter

import pytest

from motet.training.compute_share import MAX_SLICES, SLICE_S, ComputeSample, TrainingShare, waiting_reason


def run_busy(policy: TrainingShare, steps: list[float], chunks: int = 1) -> tuple[float, float, Counter]:
    """Serving busy for these steps (each told in `chunks` parts, as the lease accounts the time), each followed by
    the slice the policy grants (its holder holds it): serving's seconds, training's, and each worker's."""
    served = trained = 0.0
    each: Counter = Counter()
    for step in steps:
        for _ in range(chunks):
            policy.served(step / chunks)
        served += step
        if length := policy.slice():
            holder = policy.holder()
            policy.held(holder, length, busy=True)
            trained += length
            each[holder] += length
    return served, trained, each


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("step", [0.01, 0.03, 0.06, 0.5])
@pytest.mark.parametrize("chunks", [1, 3])
def test_training_gets_its_share_of_a_busy_servings_clock(share, step, chunks):
    """(The lease tells serving's time in parts: before a step, the step, before a slice.)"""
    policy = TrainingShare(share)
    policy.join("w", "alice")
    served, trained, _ = run_busy(policy, [step] * 2000, chunks)
    longest = MAX_SLICES * SLICE_S
    if (
        share / (1 - share) * step <= longest
    ):  # within one slice of the share's arithmetic: T / (S + T) = share
        assert trained == pytest.approx(share / (1 - share) * served, abs=longest)
        assert trained / (served + trained) == pytest.approx(share, abs=0.01)
    else:  # a step whose share is more than the longest slice: the longest after each
        assert trained == pytest.approx(longest * 2000)


def test_a_long_step_is_answered_by_a_longer_slice_up_to_a_bound():
    policy = TrainingShare(0.25)
    policy.join("w", "alice")
    policy.served(0.3)  # a long prefill: training's part of its 0.3 s is 0.1 s
    assert policy.slice() == pytest.approx(0.1)
    policy.held("w", 0.1, busy=True)
    policy.served(
        3.0
    )  # a huge one: the slice is bounded (serving's next step waits for it), the rest not owed
    assert policy.slice() == pytest.approx(MAX_SLICES * SLICE_S)
    policy.held("w", MAX_SLICES * SLICE_S, busy=True)
    assert policy.slice() == 0


def test_a_short_step_waits_for_the_shortest_slice():
    policy = TrainingShare(0.25)
    policy.join("w", "alice")
    policy.served(0.01)
    assert (
        policy.slice() == SLICE_S
    )  # owed a little: a whole slice, then nothing until serving's time catches up
    policy.held("w", SLICE_S, busy=True)
    for _ in range(21):  # 0.22 s of serving in all: 0.0733 s owed, less than the slice already given
        policy.served(0.01)
        assert policy.slice() == 0
    policy.served(0.01)  # 0.23 s: 0.0767 s owed, more
    assert policy.slice() == SLICE_S


def test_no_share_and_no_worker_grant_nothing_and_time_without_a_worker_is_not_owed_back():
    assert TrainingShare(0.0).slice() == 0
    none = TrainingShare(0.0)
    none.join("w", "alice")
    run_busy(none, [0.05] * 100)
    assert none.slice() == 0 and none.trained_s == 0
    policy = TrainingShare(0.25)
    run_busy(policy, [0.05] * 1000)  # 50 s of serving with no worker there
    assert policy.slice() == 0
    policy.join("w", "alice")
    policy.served(0.05)
    length = policy.slice()
    assert length == pytest.approx(MAX_SLICES * SLICE_S)  # the longest slice, never the 12.5 s owed before
    policy.held("w", length, busy=True)
    assert policy.slice() == 0


def test_serving_idle_starts_the_share_afresh():
    policy = TrainingShare(0.25)
    policy.join("w", "alice")
    policy.served(0.3)
    policy.idle()
    assert policy.slice() == 0 and policy.served_s == policy.trained_s == 0
    policy.held(
        "w", 60.0, busy=False
    )  # the idle engine's time is the worker's, not counted against the share
    policy.served(0.03)
    assert policy.slice() == SLICE_S


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0, -0.1])
def test_the_share_is_a_fraction_below_one(share):
    if 0 <= share < 1:
        TrainingShare(share)
    else:
        with pytest.raises(ValueError, match="share"):
            TrainingShare(share)


def test_tenants_take_turns_by_time_not_by_jobs():
    """A tenant with three jobs gets the time a tenant with one gets; its jobs share its time evenly."""
    policy = TrainingShare(0.25)
    for worker in ("a1", "a2", "a3"):
        policy.join(worker, "alice")
    policy.join("b1", "bob")
    _, trained, each = run_busy(policy, [0.03] * 4000)
    alice = each["a1"] + each["a2"] + each["a3"]
    assert alice == pytest.approx(each["b1"], abs=SLICE_S)
    for worker in ("a1", "a2", "a3"):
        assert each[worker] == pytest.approx(alice / 3, abs=SLICE_S)
    assert policy.fraction("b1", busy=True) == 0.25 / 2 and policy.fraction("a1", busy=True) == 0.25 / 2 / 3
    assert policy.fraction("b1", busy=False) == 1 / 2 and policy.fraction("nobody", busy=False) == 0


def test_the_idle_engine_gives_several_workers_turns():
    policy = TrainingShare(0.25)
    policy.join("a", "alice")
    policy.join("b", "bob")
    turns = []
    for _ in range(6):
        holder = policy.holder()
        turns.append(holder)
        policy.held(holder, policy.turn_s, busy=False)
    assert turns == ["a", "b"] * 3


def test_a_tenant_that_joins_late_is_not_owed_the_time_before():
    policy = TrainingShare(0.25)
    policy.join("a", "alice")
    policy.held("a", 100.0, busy=False)
    policy.join("b", "bob")  # level with alice: they alternate from here, bob is not given 100 s first
    turns = []
    for _ in range(4):
        holder = policy.holder()
        turns.append(holder)
        policy.held(holder, 1.0, busy=False)
    assert sorted(Counter(turns).values()) == [2, 2]
    policy.leave("a")
    policy.leave("a")  # (twice: nothing)
    assert policy.holder() == "b" and len(policy) == 1
    policy.leave("b")
    assert policy.holder() is None and policy.slice() == 0


def sample(at, held, busy, ran=None, queued=None):
    return ComputeSample(at, held, busy, ran, queued)


@pytest.mark.parametrize(
    ("first", "last", "reason"),
    [
        (sample(0, 0, 0, 0, 0), sample(5, 5, 0, 9.5, 0.1), None),  # held the cores, its threads ran
        (sample(0, 0, 0), sample(5, 1.25, 5), "serving"),  # serving busy, a quarter of the time
        (sample(0, 0, 0), sample(5, 2.5, 1), "jobs"),  # serving idle, another worker's turns
        (sample(0, 0, 0), sample(5, 3, 2), "serving"),  # serving busy the 2 s it waited (idle the 3 others)
        (
            sample(0, 0, 0, 0, 0),
            sample(5, 5, 0, 6, 4),
            "machine",
        ),  # held, but its threads waited for the CPUs
        (sample(0, 0, 0), sample(5, 5, 0), None),  # (no CPU figures: held is all it knows)
        (sample(5, 5, 0), sample(5, 5, 0), None),  # (no time passed)
    ],
)
def test_why_a_worker_waits(first, last, reason):
    assert waiting_reason(first, last) == reason
