"""Fairness between tenants (motet/engine/core/fairness.py and the engine's scheduler): pure policy, no threads.

The scheduler is driven as the engine drives it (schedule, pretend the forward pass ran, append a token),
with the engine's charging of output tokens, so the counts below are the tokens each tenant was served.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motet.engine.core.block_manager import BlockManager
from motet.engine.core.fairness import (
    TenantShares,
    TenantState,
    VirtualTokenCounter,
    check_tenant_weights,
)
from motet.engine.core.policy import AdmissionGate
from motet.engine.core.scheduler import Scheduler
from motet.engine.core.sequence import QueueOrder, Sequence, SequenceStatus
from motet.engine.sampling_params import SamplingParams
from motet.flag_types import json_file


# -- the counters ------------------------------------------------------------------------------------------
def test_pick_lowest_counter_ties_to_first():
    vtc = VirtualTokenCounter()
    vtc.set_active("abc")
    vtc.charge("a", input_tokens=10)
    vtc.charge("b", output_tokens=1)  # 2 with the default weights
    assert vtc.pick(["a", "b", "c"]) == "c"
    vtc.charge("c", input_tokens=5)
    assert vtc.pick(["a", "b", "c"]) == "b"
    assert vtc.pick([]) is None


def test_token_weights_and_tenant_weights():
    vtc = VirtualTokenCounter(input_weight=1, output_weight=3)
    vtc.charge("a", input_tokens=4, output_tokens=2)
    assert vtc.counter("a") == 10
    vtc = VirtualTokenCounter({"gold": 2.0, "bronze": 0.5})
    for t in ("gold", "bronze", "plain"):
        vtc.charge(t, input_tokens=10)
    assert (vtc.counter("gold"), vtc.counter("plain"), vtc.counter("bronze")) == (5, 10, 20)


def test_new_tenant_is_lifted_to_min_active():
    vtc = VirtualTokenCounter()
    vtc.set_active(["a", "b"])
    vtc.charge("a", input_tokens=100)
    vtc.charge("b", input_tokens=40)
    vtc.set_active(["a", "b", "c"])  # c is new: no credit banked for the time it was away
    assert vtc.counter("c") == 40
    assert vtc.counter("a") == 100  # already active: unchanged


def test_idle_tenant_banks_no_credit():
    vtc = VirtualTokenCounter()
    vtc.set_active(["a", "b"])
    vtc.charge("a", input_tokens=10)
    vtc.charge("b", input_tokens=500)
    vtc.set_active(["b"])  # a goes idle at 10 while b keeps receiving service
    vtc.charge("b", output_tokens=100)
    vtc.set_active(["a", "b"])
    assert vtc.counter("a") == vtc.counter("b") == 700


def test_when_nobody_is_active_newcomer_starts_at_last_leaver():
    vtc = VirtualTokenCounter()
    vtc.set_active(["a"])
    vtc.charge("a", input_tokens=1000)
    vtc.set_active([])
    vtc.set_active(["b"])
    assert vtc.counter("b") == 1000
    vtc.set_active(["a", "b"])  # equal footing now
    assert vtc.counter("a") == 1000


def test_tenant_weights_are_validated():
    assert check_tenant_weights({"a": 2, "b": 0.25}) == {"a": 2.0, "b": 0.25}
    for bad in ({"a": 0}, {"a": -1}, {"a": math.inf}, {"a": math.nan}, {"a": "2"}, {"a": True}, {"a": None}):
        with pytest.raises(ValueError, match="'a' must be a positive finite number"):
            check_tenant_weights(bad)
    with pytest.raises(ValueError, match="JSON object"):
        check_tenant_weights([["a", 1]])
    with pytest.raises(ValueError, match="non-empty strings"):
        check_tenant_weights({"": 1})


def test_tenant_weights_file(tmp_path):
    """`--tenant-weights FILE` is read by its flag type (motet/flag_types.py `json_file`) and checked here."""
    read = json_file(check_tenant_weights)
    good = tmp_path / "w.json"
    good.write_text(json.dumps({"eval-suite": 1, "interactive": 4}))
    assert read(str(good)) == {"eval-suite": 1.0, "interactive": 4.0}
    cases = {
        '{"a": NaN}': "NaN is not a JSON number",
        '{"a": Infinity}': "Infinity is not a JSON number",
        '{"a": 1e999}': "positive finite",  # json reads it as inf
        '{"a": -2}': "positive finite",
        '{"a": 1': "not valid JSON",
        '["a"]': "JSON object",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(argparse.ArgumentTypeError, match=message) as e:
            read(str(bad))
        assert str(bad) in str(e.value)
    with pytest.raises(argparse.ArgumentTypeError, match="cannot open"):
        read(str(tmp_path / "missing.json"))


def test_serve_refuses_bad_tenant_weights_at_start(tmp_path, capsys):
    from motet.api.cli import main

    bad = tmp_path / "weights.json"
    bad.write_text('{"tenant-a": 0}')
    assert main(["serve", "--tenant-weights", str(bad), "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "--tenant-weights" in err and "'tenant-a' must be a positive finite number, got 0" in err


# -- shares and the admission gate -------------------------------------------------------------------------
def test_shares_follow_weights_and_swaps_never_undo_each_other():
    vtc = VirtualTokenCounter({"a": 2})
    shares = TenantShares(vtc, ["a"] * 5 + ["b"], ["b", "c"])  # 6 running; weights a 2, b 1, c 1
    assert shares.share("a") == 3 and shares.share("b") == 1.5
    assert shares.over("a") and not shares.over("b")
    assert shares.under("c") and not shares.under("b")
    assert shares.may_displace("c") and shares.most_over("c") == "a" and not shares.may_displace("b")
    shares.stopped("a")
    shares.started("c")
    shares.stopped("a")
    shares.started("c")  # a 3, b 1, c 2
    assert not shares.may_displace("a") and not shares.may_displace("c")  # at rest


def test_gate_lets_every_tenant_in_whatever_another_has_queued():
    # The engine's waiting room is full of a's requests; b and c have nothing waiting there.
    engine = [TenantState("a", 1.0, 500.0, running=4, waiting=16), TenantState("b", 1.0, 900.0, 1, 0)]
    gate = AdmissionGate(engine, room=0, spare=8)
    order = []
    while (t := gate.pick({"a": 10, "b": 10, "c": 10})) is not None:
        order.append(t)
    assert sorted(order) == ["b", "c"]  # one each, and none of a's (no room left)
    gate = AdmissionGate(engine, room=0, spare=1)  # the spare room is bounded too
    assert [gate.pick({"b": 10, "c": 10}), gate.pick({"b": 10, "c": 10})] == ["c", None]


def test_gate_fills_room_lowest_counter_first():
    engine = [TenantState("a", 1.0, 100.0, 0, 1), TenantState("b", 2.0, 105.0, 0, 1)]
    gate = AdmissionGate(engine, room=4, spare=4)
    # b weighs 2: each of its 20-token prompts costs it 10, each of a's costs a 20.
    picks = [gate.pick({"a": 20, "b": 20}) for _ in range(5)]
    assert picks == ["a", "b", "b", "a", None]


# -- the engine's scheduler ----------------------------------------------------------------------------------
def make(num_blocks=256, block_size=4, max_seqs=8, budget=64, weights=None):
    return Scheduler(
        BlockManager(num_blocks, block_size), max_seqs, budget, fairness=VirtualTokenCounter(weights or {})
    )


_arrivals = iter(range(10**9))


def seq(tenant, prompt_len=6, max_tokens=16):
    first = 1000 * (ord(tenant[0]) - ord("a"))  # tenants' prompts share no prefix
    return Sequence(
        list(range(first, first + prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        order=QueueOrder(next(_arrivals)),
        tenant=tenant,
    )


def run_step(sched, served: Counter | None = None):
    """One engine step: schedule, mark the chunks computed, append a token where the step samples, charge it
    to its tenant and finish at max_tokens (as LLMEngine.commit does)."""
    batch = sched.schedule()
    samplers = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
    sched.advance(batch)
    for s in samplers:  # its pending token lands
        s.num_pending -= 1
        s.append_token(7)
        sched.policy.fairness.charge(s.tenant, output_tokens=1)
        if served is not None:
            served[s.tenant] += 1
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s)
    return batch


def test_light_tenant_is_admitted_at_the_next_step_under_a_backlog():
    sched = make(max_seqs=4)
    backlog = [seq("a", max_tokens=100) for _ in range(20)]
    for s in backlog:
        sched.add(s)
    for _ in range(3):
        run_step(sched)
    assert [s.tenant for s in sched.running] == ["a"] * 4 and len(sched.waiting) == 16
    light = seq("b", max_tokens=4)
    sched.add(light)
    batch = run_step(sched)
    assert light in batch.seqs and light.status is SequenceStatus.RUNNING
    (victim,) = batch.preempted
    assert victim.tenant == "a" and victim is max(backlog[:4], key=lambda s: s.order.arrival)  # a's newest
    while not light.is_finished:
        run_step(sched)
    assert sched.num_preemptions == 1  # a's sequence was not preempted again, nor b's
    run_step(sched)
    assert [s.tenant for s in sched.running] == ["a"] * 4  # a has the whole engine again


def test_light_tenant_gets_kv_blocks_from_the_tenant_holding_them():
    # 24 blocks of 4 tokens: a's long sequences hold them all.
    sched = make(num_blocks=24, max_seqs=16, budget=256)
    for _ in range(10):
        sched.add(seq("a", prompt_len=20, max_tokens=200))
    for _ in range(8):
        run_step(sched)
    assert sched.bm.num_free_blocks < 2 and sched.waiting
    light = seq("b", prompt_len=12, max_tokens=4)
    sched.add(light)
    batch = run_step(sched)
    assert light in batch.seqs
    assert batch.preempted and {s.tenant for s in batch.preempted} == {"a"}
    for _ in range(3):
        batch = run_step(sched)
        assert all(s.tenant == "a" for s in batch.preempted)  # out of blocks again: a pays, not b
    assert light.is_finished


def test_light_tenant_prefills_ahead_of_the_backlogs_prompt_chunks():
    sched = make(max_seqs=8, budget=64)
    decoding = [seq("a", prompt_len=8, max_tokens=100) for _ in range(3)]
    for s in decoding:
        sched.add(s)
    run_step(sched)
    long_prompt = seq("a", prompt_len=400, max_tokens=4)
    sched.add(long_prompt)
    run_step(sched)  # a's long prompt takes the budget left beside a's decode rows, chunk by chunk
    light = seq("b", prompt_len=20, max_tokens=4)
    sched.add(light)
    batch = run_step(sched)
    assert batch.num_new_tokens[batch.seqs.index(light)] == 20 and light.num_output_tokens == 1
    assert batch.num_new_tokens[batch.seqs.index(long_prompt)] == 64 - 20 - 3  # a's chunk got the rest
    assert all(s in batch.seqs for s in decoding) and not batch.preempted


def test_decode_rows_keep_their_token_beside_a_long_prompt():
    sched = make(max_seqs=8, budget=8)
    decoding = [seq("a", prompt_len=4, max_tokens=50) for _ in range(6)]
    for s in decoding:
        sched.add(s)
    while not all(s.num_output_tokens for s in decoding):
        run_step(sched)
    long_prompt = seq("b", prompt_len=100, max_tokens=4)  # b's rows go first: b is under its share
    sched.add(long_prompt)
    for _ in range(3):
        batch = run_step(sched)
        assert all(s in batch.seqs for s in decoding)
        assert batch.num_new_tokens[batch.seqs.index(long_prompt)] == 2 and batch.num_tokens == 8


def _backlogged(weights, steps=600, max_seqs=6, first=None):
    """Two tenants that always have requests waiting; `first` floods alone for a while before the other
    comes. Output tokens served to each after a warm-up, and the preemptions after it."""
    sched = make(max_seqs=max_seqs, budget=256, num_blocks=512, weights=weights)
    served = Counter()
    for step in range(steps):
        for t in ("a", "b"):
            if (first is None or t == first or step >= 50) and sum(s.tenant == t for s in sched.waiting) < 4:
                sched.add(seq(t, max_tokens=8 + step % 5))
        run_step(sched, served if step >= 100 else None)
        if step == 100:
            preemptions = sched.num_preemptions
    return served, sched.num_preemptions - preemptions


def test_backlogged_tenants_with_weights_2_to_1_get_tokens_2_to_1():
    served, _ = _backlogged({"a": 2})
    assert served["a"] / served["b"] == pytest.approx(2, rel=0.1), served


def test_backlogged_equal_tenants_get_equal_tokens_and_do_not_thrash():
    served, preemptions = _backlogged({}, first="a")  # a holds every slot when b arrives
    assert served["a"] / served["b"] == pytest.approx(1, rel=0.1), served
    assert preemptions == 0  # once shared, nobody displaces anybody


def test_one_tenant_alone_is_scheduled_as_before():
    """No tenants (the offline engine): arrival order, the newest preempted first."""
    sched = make(num_blocks=6, max_seqs=8, budget=64)
    seqs = [Sequence(list(range(i, i + 6)), SamplingParams(max_tokens=8)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:3]  # 2 blocks each: the first three fit
    steps = 0
    while sched.has_work():
        run_step(sched)
        steps += 1
        assert steps < 500
    assert all(s.num_output_tokens == 8 for s in seqs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 30)),
        min_size=1,
        max_size=30,
    ),
    st.integers(10, 40),
    st.integers(1, 6),
    st.integers(4, 64),
    st.dictionaries(st.sampled_from("abc"), st.sampled_from([0.5, 1.0, 3.0])),
)
def test_any_mix_of_tenants_completes_and_returns_every_block(
    requests, num_blocks, max_seqs, budget, weights
):
    """(tenant, prompt tokens, output tokens, arrival step): every request finishes with what it asked for,
    within bounds, and the pool is whole again; no step runs more than max_num_seqs or the budget."""
    sched = make(num_blocks=num_blocks, block_size=4, max_seqs=max_seqs, budget=budget, weights=weights)
    pending = sorted(requests, key=lambda r: r[3])
    seqs = []
    for step in range(3000):
        while pending and pending[0][3] <= step:
            tenant, prompt_len, max_tokens, _ = pending.pop(0)
            if prompt_len + max_tokens > num_blocks * 4:  # the engine refuses it before the scheduler
                continue
            seqs.append(seq(tenant, prompt_len=prompt_len, max_tokens=max_tokens))
            sched.add(seqs[-1])
        if not pending and not sched.has_work():
            break
        batch = run_step(sched)
        assert len(sched.running) <= max_seqs and batch.num_tokens <= budget
    assert not sched.has_work(), "livelock"
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.bm.num_free_blocks == num_blocks


@settings(max_examples=60, deadline=None)
@given(
    running=st.lists(st.sampled_from("abc"), max_size=8),
    waiting=st.lists(st.tuples(st.sampled_from("abcd"), st.integers(-1, 1)), min_size=1, max_size=30),
    weights=st.fixed_dictionaries({"a": st.sampled_from([0.5, 1.0, 3.0]), "c": st.sampled_from([1.0, 2.0])}),
    max_seqs=st.integers(1, 12),
)
def test_admission_queue_hands_out_the_lowest_admission_key_as_the_shares_change(
    running, waiting, weights, max_seqs
):
    """The scheduler's admission order (StepOrder.admission_queue) is a brute-force min of admission_key over the
    candidates left, taken again after each admission changes the shares."""
    from motet.engine.core.policy import SchedulingPolicy

    policy = SchedulingPolicy(max_seqs, fairness=VirtualTokenCounter(weights))
    run = [seq(t) for t in running][:max_seqs]
    wait = []
    for t, priority in waiting:
        s = seq(t)
        s.order.priority = priority
        wait.append(s)
    order = policy.step(run, wait, 64, lambda s: 1)
    queue, left = order.admission_queue(wait), list(wait)
    while left:
        expected = min(left, key=order.admission_key)
        assert queue.pop() is expected
        left.remove(expected)
        run.append(expected)  # it starts: the shares (and whether a slot is free) change for the next one
        order.started(expected)
    assert not queue
