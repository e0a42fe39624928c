"""Scheduler policy: unified token budget, chunked prefill, preemption by recompute."""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32):
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget)


def run_step(sched, next_token=7):
    """Pretend to run the batch: mark chunks computed and append a token where the step samples."""
    batch = sched.schedule()
    samplers = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
    sched.advance(batch)
    for s in samplers:
        s.append_token(next_token)
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s, "length")
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
    sched = make(num_blocks=2, block_size=4)
    try:
        sched.add(Sequence(list(range(20))))
    except ValueError as e:
        assert "KV blocks" in str(e)
    else:
        raise AssertionError("expected ValueError")
