"""Scheduler policy: unified token budget, chunked prefill, preemption by recompute, adapter slots."""

import dataclasses

import pytest

from motet.engine.core.adapter_slicer import AdapterSlicer
from motet.engine.core.block_manager import BlockManager
from motet.engine.core.scheduler import Scheduler
from motet.engine.core.sequence import Sequence, SequenceStatus
from motet.engine.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32):
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget)


def run_step(sched, next_token=7):
    """Pretend to run the batch: mark chunks computed and append a token where the step samples."""
    batch = sched.schedule()
    samplers = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
    sched.advance(batch)
    for s in samplers:  # its pending token lands
        s.num_pending -= 1
        s.append_token(next_token)
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s)
    return batch


def test_budget_chunks_long_prompts_and_serves_decodes_first():
    sched = make(budget=16)
    a = Sequence(list(range(40)), SamplingParams(max_tokens=4))
    sched.add(a)
    sizes = []
    while a.num_output_tokens == 0:
        batch = run_step(sched)
        sizes.append(batch.num_new_tokens)
    assert sizes == [[16], [16], [8]]
    b = Sequence(list(range(100, 130)), SamplingParams(max_tokens=4))
    sched.add(b)
    batch = run_step(sched)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]


def test_the_budget_grows_with_the_rows_while_prompts_wait_and_comes_back_once_they_keep_up():
    """While a step leaves prompt tokens waiting, the next holds DECODE_SHARE tokens for each running row (between
    the base and the most); once the prompts keep up it is the base again (motet/engine/core/step_budget.py)."""
    from motet.engine.core.step_budget import DECODE_SHARE

    sched = Scheduler(BlockManager(512, 4), 8, 16, max_step_tokens=64)
    decoding = [Sequence([i, i + 1], SamplingParams(max_tokens=50)) for i in range(6)]
    for s in decoding:
        sched.add(s)
    assert [sum(run_step(sched).num_new_tokens) for _ in range(2)] == [12, 6]  # their prompts fit the base
    assert sched.budget.tokens == 16
    wave = [Sequence(list(range(i, i + 100)), SamplingParams(max_tokens=4)) for i in range(2)]
    for s in wave:
        sched.add(s)
    first = run_step(sched)  # the base: six decode rows and ten of the first prompt's tokens, the rest left
    assert sum(first.num_new_tokens) == 16 and sched.budget.tokens == DECODE_SHARE * 7 == 56
    steps = []  # (the step's budget, the rows running into it, its tokens) until the wave is prefilled
    while any(s.num_uncomputed > 1 for s in wave):
        budget, rows = sched.budget.tokens, len(sched.running)
        steps.append((budget, rows, sum(run_step(sched).num_new_tokens)))
    assert all(budget == min(64, DECODE_SHARE * rows) for budget, rows, _ in steps)
    assert all(tokens == budget for budget, _, tokens in steps[:-1]) and steps[-1][2] <= steps[-1][0]
    assert steps[0][0] == 56 and steps[-1][0] == 64  # seven rows, then eight (the most)
    assert sched.budget.tokens == 16  # the wave is in: the base again
    assert sum(run_step(sched).num_new_tokens) == 8  # decode rows only


def test_the_budget_stays_the_base_for_few_rows_and_beside_a_latency_bound_tenant():
    from motet.engine.core.step_budget import StepBudget

    budget = StepBudget(256, 1024)
    budget.after_step(running=20, prompts_waiting=True, capped=False)
    assert budget.tokens == 256  # 8 x 20 < 256
    budget.after_step(running=64, prompts_waiting=True, capped=False)
    assert budget.tokens == 512
    budget.after_step(running=64, prompts_waiting=True, capped=True)  # a light tenant's request runs
    assert budget.tokens == 256
    budget.after_step(running=200, prompts_waiting=True, capped=False)
    assert budget.tokens == 1024
    budget.after_step(running=200, prompts_waiting=False, capped=False)
    assert budget.tokens == 256


def test_an_explicit_step_budget_is_every_steps_bound():
    """`max_num_batched_tokens` given is vLLM's: no step grows past it; left to the default, a CPU step grows
    from 256 to CPU_MAX_STEP_TOKENS while prompts wait."""
    from motet.engine.config import CPU_MAX_STEP_TOKENS, CPU_STEP_TOKENS, EngineConfig

    given = EngineConfig(model="m", max_num_batched_tokens=512)
    assert given.step_tokens == given.max_step_tokens == 512
    cpu = EngineConfig(model="m", device="cpu")
    assert (cpu.step_tokens, cpu.max_step_tokens) == (CPU_STEP_TOKENS, CPU_MAX_STEP_TOKENS)
    sched = make(budget=16)  # (no max_step_tokens: fixed)
    for i in range(4):
        sched.add(Sequence(list(range(i, i + 40)), SamplingParams(max_tokens=4)))
    assert [sum(run_step(sched).num_new_tokens) for _ in range(3)] == [16, 16, 16]


def test_held_rows_wait_a_step_and_leave_their_tokens_to_the_others():
    """An overlapped engine schedules ahead of a step whose token ends some rows: those rows are held (nothing of
    theirs is scheduled, their pending token untouched) and their decode slot goes to the prompt chunk."""
    sched = make(budget=8)
    a, b = (Sequence([1, 2, 3], SamplingParams(max_tokens=4)) for _ in range(2))
    sched.add(a), sched.add(b)
    run_step(sched)
    c = Sequence(list(range(20)), SamplingParams(max_tokens=4))
    sched.add(c)
    batch = sched.schedule(hold=[a])
    assert batch.seqs == [b, c] and batch.num_new_tokens == [1, 7]
    assert a.num_pending == 0 and a.num_uncomputed == 1  # still wanted once not held


def test_max_num_seqs_is_respected():
    sched = make(max_seqs=2, budget=1000)
    for _ in range(5):
        sched.add(Sequence([1, 2, 3], SamplingParams(max_tokens=2)))
    batch = sched.schedule()
    assert len(batch) == 2 and len(sched.waiting) == 3


def test_preemption_frees_blocks_and_everything_completes():
    sched = make(num_blocks=6, block_size=4, max_seqs=8, budget=64)
    seqs = [Sequence(list(range(i, i + 6)), SamplingParams(max_tokens=8)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        run_step(sched)
        steps += 1
        assert steps < 500
    assert sched.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 8 for s in seqs)
    assert sched.bm.num_free_blocks == 6


def test_prompt_larger_than_pool_is_refused():
    """Checked once, before a request reaches the scheduler (ingress and engine share these limits)."""
    from motet.engine.request_checks import RequestError, RequestLimits

    limits = RequestLimits(vocab_size=100, max_model_len=64, max_kv_tokens=8)
    limits.check_prompt(list(range(7)))
    with pytest.raises(RequestError, match="more than this server's KV cache holds") as e:
        limits.check_prompt(list(range(8)))
    assert e.value.code == "context_length_exceeded"


# -- adapter slots and time slicing --------------------------------------------------------------------------


def test_slicer_grants_free_slots_in_line_and_drains_expired_adapters():
    s = AdapterSlicer(max_loras=2, time_slice=3)
    s.begin_step(running=[], waiting=[1, 0, 2, 3, 1])
    assert [s.may_admit(a) for a in (0, 1, 2, 3)] == [True, True, True, False]
    s.admitted(1)
    s.admitted(2)
    s.begin_step(running=[1, 2], waiting=[3, 4])  # 3 was refused first: it is first in line
    assert s.may_admit(1) and s.may_admit(2) and not s.may_admit(3)
    s.begin_step(running=[1, 2], waiting=[4, 3])
    s.begin_step(running=[1, 2], waiting=[4, 3])  # adapters 1 and 2 have had their 3 steps
    assert s.draining == {1, 2}  # two adapters wait: both expired slices end
    assert not s.may_admit(1) and not s.may_admit(2) and s.may_admit(0)
    s.begin_step(running=[2], waiting=[1, 4, 3])  # 1 drained; it goes to the back of the line
    assert s.may_admit(3) and not s.may_admit(4) and not s.may_admit(1)
    s.admitted(3)
    s.begin_step(running=[2, 3], waiting=[1, 4])
    assert s.draining == {2}  # 3's slice has just begun


def test_slicer_admits_resident_adapters_and_drains_running_ones_for_memory():
    """No cap: an adapter's requests start once it is resident (`ready`); one the pool has no room for while
    running adapters hold it (`blocked`) waits as for a place, and expired slices drain to make room."""
    s = AdapterSlicer(max_loras=None, time_slice=2)
    resident = {1, 2}
    s.begin_step(running=[], waiting=[1, 2, 3], ready=resident.__contains__)
    assert s.may_admit(1) and s.may_admit(2) and not s.may_admit(3)  # 3 is loading: nothing drains
    s.admitted(1)
    s.admitted(2)
    s.begin_step(running=[1, 2], waiting=[3], ready=resident.__contains__)
    s.begin_step(running=[1, 2], waiting=[3], ready=resident.__contains__)
    assert s.draining == set()  # loading is not waiting for room
    s.begin_step(running=[1, 2], waiting=[3], ready=resident.__contains__, blocked={3})
    assert s.draining == {1}  # one adapter waits for memory: the oldest expired slice ends
    resident = {2, 3}  # 1 drained and left the pool; 3 took its memory
    s.begin_step(running=[2], waiting=[3, 1], ready=resident.__contains__)
    assert s.may_admit(3) and not s.may_admit(1)


def test_batches_hold_at_most_max_loras_adapters_in_contiguous_segments():
    sched = make(num_blocks=256, max_seqs=16, budget=64)
    sched.slicer.max_loras = 2
    seqs = [Sequence([i, i + 1, i + 2], SamplingParams(max_tokens=5), adapter_id=i % 5) for i in range(20)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        batch = run_step(sched)
        adapters = [s.adapter_id for s in batch.seqs]
        assert len(set(adapters) - {0}) <= 2 and adapters == sorted(adapters)
        steps += 1
        assert steps < 200
    assert all(s.num_output_tokens == 5 for s in seqs)


def test_a_waiting_adapter_never_starves():
    # Adapters 1 and 2 hold both slots and keep getting new requests every step; adapter 3 waits.
    sched = make(num_blocks=1024, max_seqs=64, budget=256)
    sched.slicer.max_loras, sched.slicer.time_slice = 2, 4
    lonely = Sequence([7, 8, 9], SamplingParams(max_tokens=3), adapter_id=3)
    for step in range(200):
        for a in (1, 2):
            sched.add(Sequence([a, step], SamplingParams(max_tokens=6), adapter_id=a))
        if step == 1:
            sched.add(lonely)
        run_step(sched)
        if lonely.is_finished:
            break
    assert lonely.is_finished and step < 30


def test_a_sequence_holds_the_schedulers_state_only():
    """Issue 60: a `Sequence` is the scheduler's record, at most 22 fields; its grammar is the structured outputs'
    and its text the output commit's, so no field holds either."""
    fields = dataclasses.fields(Sequence)
    assert len(fields) <= 22, [f.name for f in fields]
    held = " ".join(str(f.type) for f in fields)
    for owned_elsewhere in ("GuidedDecoding", "IncrementalDetokenizer", "TextState", "PendingToken"):
        assert owned_elsewhere not in held
