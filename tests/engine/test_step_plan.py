"""The step's plan as values and the runner's own rows (vLLM's persistent batch): through chunked prefill,
prefix-cache hits, preemption and recompute, rejected drafts' blocks given back and requests finishing, the
runner's copy of every scheduled row equals the scheduler's sequence as it was scheduled, each plan carries only
what changed, and rows that left are forgotten on both sides."""

import random

from motet.engine.core.block_manager import BlockManager
from motet.engine.core.scheduler import Scheduler
from motet.engine.core.sequence import Sequence
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.rows import RunnerRows


def test_the_runner_rows_follow_the_scheduled_sequences_from_what_each_plan_changes():
    rng = random.Random(0)
    sched = Scheduler(
        BlockManager(14, 4, enable_prefix_caching=True), max_num_seqs=4, max_num_batched_tokens=12
    )
    rows = RunnerRows()
    shared = [rng.randrange(100) for _ in range(8)]  # two blocks: prefix-cache hits for the later ones
    seqs = [
        Sequence(
            shared + [rng.randrange(100) for _ in range(rng.randrange(1, 12))], SamplingParams(max_tokens=9)
        )
        for _ in range(7)
    ]
    for s in seqs[:4]:
        sched.add(s)
    later = seqs[4:]
    steps = sent = decode_rows = 0
    planned = {}  # each row's tokens as of its last plan
    while sched.has_work() or later:
        if later and steps % 3 == 2:
            sched.add(later.pop())
        for s in sched.running:  # a draft now and then: its blocks come back when it is rejected
            s.draft_token_ids = [rng.randrange(100)] if rng.random() < 0.3 else []
        batch = sched.schedule()
        expected = [(list(s.token_ids), list(s.block_table), s.num_computed_tokens) for s in batch.seqs]
        sched.advance(batch)
        held = rows.update(batch.plan())
        for row, plan, (tokens, table, start) in zip(held, batch.plan(), expected, strict=True):
            assert (row.tokens, row.table, plan.start) == (tokens, table, start)
            # only what changed since its last plan: nothing of its history again
            assert plan.tokens_from == planned.get(plan.seq_id, 0)
            planned[plan.seq_id] = len(tokens)
            sent += len(plan.new_tokens)
            decode_rows += plan.tokens_from > 0
        for s in batch.preempted:  # its blocks are gone: it comes back whole
            planned.pop(s.seq_id, None)
        if batch.seqs:  # the rows that left the running ones (finished, preempted) are forgotten
            assert len(rows) <= len(sched.running)
        for i, s in enumerate(batch.seqs):
            if not batch.samples(i):
                continue
            s.num_pending -= 1
            accepted = s.draft_token_ids[: rng.randrange(len(s.draft_token_ids) + 1)]
            for t in [*accepted, rng.randrange(100)]:
                s.append_token(t)
            if s.draft_token_ids:
                sched.accept_drafts(s, len(accepted))
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s)
                planned.pop(s.seq_id)
        steps += 1
        assert steps < 400
    assert sched.num_preemptions > 0 and decode_rows > 20
    # every token went over once, and again only for a row that came back after preemption
    assert sent < sum(s.num_tokens for s in seqs) * 2
