"""Scheduling policy: vLLM-V1-style unified token budget, preemption by recompute.

There are no prefill and decode phases. Every sequence has tokens whose KV is computed and tokens it
still needs computed; each step hands out at most `max_num_batched_tokens` of the latter, running
sequences first (a decode needs one token, an unfinished prompt a chunk), then waiting ones. Chunked
prefill and prefix-cache hits fall out of this. When the KV pool runs dry the newest running sequence is
preempted: its blocks are freed and it is recomputed later from its prompt and output so far.
Running sequences hold at most `max_loras` distinct adapters (see `AdapterSlicer`), and a step's batch
is ordered by adapter so that each adapter's tokens form one contiguous segment for the LoRA kernels.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from motet.engine.adapter_slicer import AdapterSlicer
from motet.engine.block_manager import BlockManager
from motet.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def subset(self, rows) -> ScheduledBatch:
        """The batch's rows `rows`, in order (to re-run part of a step)."""
        return ScheduledBatch([self.seqs[i] for i in rows], [self.num_new_tokens[i] for i in rows])

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches its last token, so that this step samples its next one (and
        verifies the drafts scheduled after it)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] - len(seq.draft_token_ids) == seq.num_tokens


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 8,
        lora_time_slice: int = 32,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slicer = AdapterSlicer(max_loras, lora_time_slice)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (motet/engine/request_checks.py has made sure it fits the KV pool)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            n += self._fit_drafts(seq, n, budget)
            while not self.bm.allocate_slots(seq, n):
                if seq.draft_token_ids:  # drafts are optional: drop them before preempting anyone
                    n -= len(seq.draft_token_ids)
                    seq.draft_token_ids = []
                    continue
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break

        # New work only when nothing had to be preempted: otherwise it would just thrash.
        self.slicer.begin_step((s.adapter_id for s in self.running), (s.adapter_id for s in self.waiting))
        skipped: list[Sequence] = []  # waiting for an adapter slot; they keep their place in the queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if not self.slicer.may_admit(seq.adapter_id):
                skipped.append(self.waiting.popleft())
                continue
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate_slots(seq, n):
                self.bm.free_seq(seq)  # give back prefix hits; they stay cached
                break
            self.waiting.popleft()
            self.slicer.admitted(seq.adapter_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if any(s.adapter_id for s in batch.seqs):  # one contiguous segment per adapter (stable sort)
            order = sorted(range(len(batch)), key=lambda i: batch.seqs[i].adapter_id)
            batch.seqs = [batch.seqs[i] for i in order]
            batch.num_new_tokens = [batch.num_new_tokens[i] for i in order]
        return batch

    @staticmethod
    def _fit_drafts(seq: Sequence, n: int, budget: int) -> int:
        """Keep the drafts that fit the budget behind a decode row's one token; they count like any token."""
        if seq.draft_token_ids and n == seq.num_tokens - seq.num_computed_tokens == 1:
            seq.draft_token_ids = seq.draft_token_ids[: budget - n]
        else:
            seq.draft_token_ids = []
        return len(seq.draft_token_ids)

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_token_ids = []
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, batch: ScheduledBatch) -> None:
        """Mark the batch's chunks computed (call after the forward pass, before appending tokens)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # drafts count once accepted
            self.bm.cache_full_blocks(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the accepted drafts' KV is the sequence's (they are its tokens now); the
        rejected ones' slots are given back, and blocks they alone used return to the pool."""
        seq.draft_token_ids = []
        seq.num_computed_tokens += num_accepted
        self.bm.truncate(seq)
        self.bm.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish a sequence (stop, length, abort) and return its blocks to the pool."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.draft_token_ids = []
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        self.bm.forget(seq)
