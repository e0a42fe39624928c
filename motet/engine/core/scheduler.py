"""The scheduler: vLLM-V1-style unified token budget, preemption by recompute, in the policy's order.

There are no prefill and decode phases. Every sequence has tokens whose KV is computed and tokens it
still needs computed; each step hands out at most its budget of the latter (`max_num_batched_tokens`, growing
with the running rows up to `max_step_tokens` while prompts wait: motet/engine/core/step_budget.py), running
sequences first (a decode needs one token, an unfinished prompt a chunk), then waiting ones. Chunked prefill and
prefix-cache hits fall out of this. When the KV pool runs dry a running sequence is preempted: its blocks are freed
and it is recomputed later from its prompt and output so far.
Every order is the scheduling policy's (motet/engine/core/policy.py: tenants' shares and virtual token counters,
latency tiers, priority, who is displaced or preempted); this module is the loop over the budget, the KV blocks
and the adapter slots that follows it.
A waiting sequence is admitted once its adapter is resident in the pool (`adapters.ready`; the engine loads
it meanwhile), running sequences hold at most `max_loras` distinct adapters where that cap is set, and
adapters waiting for room are time-sliced (see `AdapterSlicer`); a step's batch is ordered by adapter so that
each adapter's tokens form one contiguous segment for the LoRA kernels.
With KV tiers (motet/engine/core/kv_connector.py), a waiting sequence whose prefix the tiers hold past the device
cache's hit waits, keeping its place, while its blocks are loaded in the background; it is admitted after.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from motet.engine.core.adapter_slicer import AdapterSlicer
from motet.engine.core.block_manager import BlockManager
from motet.engine.core.fairness import TenantState, VirtualTokenCounter
from motet.engine.core.kv_connector import KVConnector, NoKVTiers
from motet.engine.core.plan_mirror import PlanMirror, reaches_end
from motet.engine.core.policy import SchedulingPolicy, StepOrder, remove_seq
from motet.engine.core.sequence import Sequence, SequenceStatus
from motet.engine.core.step_budget import StepBudget
from motet.engine.core.step_plan import SampledRef, StepPlan, new_step


@dataclass
class ScheduledBatch:
    """A step as the engine keeps it: the rows it runs (`seqs`, the scheduler's own) and each one's tokens in it, and
    its plan as values (`plan()`, motet/engine/core/step_plan.py), the runner's only view of it."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # The plan, taken when the batch is scheduled (`freeze`): each row as it was then (an overlapped engine
    # advances the rows as it launches the step, while the forward thread still runs it). None: a batch built by
    # hand, planned from nothing held when first read.
    step: StepPlan | None = None
    scheduled_at: float | None = None  # time.monotonic() when the engine scheduled it (a step's time starts)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def freeze(
        self,
        mirror: PlanMirror | None = None,
        running_ids: Collection[int] = (),
        holds_stop: Collection[str] = (),
    ) -> ScheduledBatch:
        """Take the plan (the scheduler does, as it returns the batch, against its record of what the runner
        holds; without one, from nothing held): each sampling row gets the SampledRef its token will be found by;
        `holds_stop`: the requests whose grammar holds back their stop tokens."""
        held = (
            mirror is not None
        )  # (a plan from nothing held has no number: the runner applies it whenever read)
        mirror = mirror if held else PlanMirror()
        rows, step = [], new_step()
        for i, (seq, n) in enumerate(zip(self.seqs, self.num_new_tokens, strict=True)):
            samples = reaches_end(seq, n)
            ref = SampledRef(step, i) if samples else None
            rows.append(mirror.row(seq, n, samples, ref, seq.request_id in holds_stop))
        departed = mirror.departures(set(running_ids), bool(self.seqs))
        self.step = StepPlan(tuple(rows), departed, mirror.plan_id() if held and self.seqs else None)
        return self

    def plan(self) -> StepPlan:
        """The step's plan (a batch built by hand: planned now, from nothing held, as its rows are)."""
        if self.step is None:
            self.freeze()
        return self.step

    def subset(self, rows) -> ScheduledBatch:
        """The batch's rows `rows`, in order (to re-run part of a step: the same plan, not applied again)."""
        return ScheduledBatch(
            [self.seqs[i] for i in rows],
            [self.num_new_tokens[i] for i in rows],
            step=self.plan().subset(rows),
        )

    def sampling_rows(self) -> list[int]:
        """The rows i for which `samples(i)`."""
        return self.plan().sampling_rows()

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches its last token, so that this step samples its next one (and
        verifies the drafts scheduled after it)."""
        return self.plan()[i].samples


class AdapterResidency(Protocol):
    """What the scheduler asks of the adapters (motet/lora/manager.py's AdapterManager)."""

    blocked: Collection[int]  # adapters not resident for lack of pool memory

    def ready(self, uid: int) -> bool: ...  # resident: a request of it may run


class _AllResident:
    blocked: Collection[int] = ()

    def ready(self, uid: int) -> bool:
        return True


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int | None = None,
        lora_time_slice: int = 32,
        fairness: VirtualTokenCounter | None = None,
        kv_connector: KVConnector | NoKVTiers | None = None,
        adapters: AdapterResidency | None = None,
        tpot_target_s: float | None = None,
        max_step_tokens: int | None = None,
    ):
        self.bm = block_manager
        self.mirror = (
            PlanMirror()
        )  # what the runner holds of each running row: each plan carries what changed
        self.kv = kv_connector or NoKVTiers()
        self.adapters = adapters or _AllResident()
        self.max_num_seqs = max_num_seqs
        self.budget = StepBudget(max_num_batched_tokens, max_step_tokens)  # this step's tokens
        # a sequence's chunk per step: sliding-window layers keep a window plus one chunk (engine/core/kv_window.py)
        self.max_chunk = block_manager.window.max_chunk if block_manager.window is not None else None
        self.slicer = AdapterSlicer(max_loras, lora_time_slice)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.policy = SchedulingPolicy(max_num_seqs, fairness, tpot_target_s)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (motet/engine/request_checks.py has made sure it fits the KV pool)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, hold: Collection[Sequence] = (), holds_stop: Collection[str] = ()) -> ScheduledBatch:
        """The next step's rows. `hold`: running rows that wait this step whatever they need (an overlapped engine
        schedules ahead of a step whose token is their last); `holds_stop`: the requests whose grammar holds back
        their stop tokens (their plans say so). Every order and who gives way is the policy's (`StepOrder`); this
        loop hands out the budget, the KV blocks and the adapter slots in that order."""
        self.kv.poll()
        held = {s.seq_id for s in hold}

        def uncomputed(s: Sequence) -> int:  # what a row needs this step: nothing while held
            return 0 if s.seq_id in held else s.num_uncomputed

        batch = ScheduledBatch()
        budget = self.budget.tokens
        order = self.policy.step(self.running, self.waiting, budget, uncomputed)
        self.slicer.begin_step(
            (s.adapter_id for s in self.running),
            (s.adapter_id for s in sorted(self.waiting, key=order.admission_key)),
            self.adapters.ready,
            self.adapters.blocked,
        )
        # Tenants under their share first: their waiting sequences join the running ones now, in a free slot or
        # in place of another tenant's; they get KV blocks and budget below, ahead of the tenants with more.
        candidates = order.admission_queue(self.waiting)
        while candidates:
            seq = candidates.pop()
            growing = len(self.running) < self.max_num_seqs
            if not order.jumps_queue(seq):
                break  # nor does any other
            if not self.slicer.may_admit(seq.adapter_id):
                continue  # waiting for an adapter slot; it keeps its place in the queue
            if not growing and not order.may_displace(seq):
                continue
            if not self._prefix_ready(seq):
                continue  # its prefix is being loaded; it keeps its place in the queue
            if not growing:
                victim = order.displaced_by(seq)
                self._preempt(victim, order)
                batch.preempted.append(victim)
            self._start(seq, order)  # its other blocks come below, with the running ones'

        # Running sequences in the policy's order, each within the tokens it may take (its tier's, or the floor's).
        # Every decode row keeps its one token ahead of any prompt chunk of its tier, so a long prompt never stalls
        # the decoding ones. The rows the tokens do not reach wait a step.
        order.sort_running(time.monotonic())
        decodes_left = Counter(order.tier(s) for s in self.running if uncomputed(s) == 1)
        used = 0  # tokens in the step so far
        i = 0
        while i < len(self.running) and used < budget:
            seq = self.running[i]
            group = order.tier(seq)
            owed = order.owed(seq)
            left = order.tokens_left(seq, used)
            if left <= 0:  # its tier's tokens are spent: it and the later rows (tiers after) wait a step
                break
            remaining = uncomputed(seq)
            if remaining == 0:  # held, or its next token is on the way
                i += 1
                continue
            if seq.cache.switch is not None and seq.num_computed_tokens >= seq.cache.switch[0]:
                self._long_rope_restart(self.running.pop(i), order)  # then recomputed as a prompt
                if remaining == 1:
                    decodes_left[group] -= 1
                batch.preempted.append(seq)
                continue
            if remaining == 1:
                decodes_left[group] -= 1
                room = max(1, left - decodes_left[group])  # its drafts do not take the later rows' tokens
            else:  # the floor's tokens are owed whatever the tier's other decode rows would take
                room = max(left - decodes_left[group], min(owed, left))
                if room <= 0:  # no room for a prompt chunk beside the decode rows: next step
                    i += 1
                    continue
            n = min(remaining, room, self.max_chunk or room)
            if seq.cache.switch is not None:  # no draft reaches past LongRoPE's original context
                n += self._fit_drafts(seq, n, min(room, seq.cache.switch[0] - seq.num_computed_tokens))
            else:
                n += self._fit_drafts(seq, n, room)
            while not self.bm.allocate_slots(seq, n):
                if seq.draft_token_ids:  # drafts are optional: drop them before preempting anyone
                    n -= len(seq.draft_token_ids)
                    seq.draft_token_ids = []
                    continue
                victim = order.kv_victim()
                if victim is not seq and uncomputed(victim) == 1:
                    decodes_left[order.tier(victim)] -= 1  # its token is no longer held for it
                self._preempt(victim, order)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                used += n
                order.took(seq, n)
                i += 1
                continue
            break

        # Then the other waiting sequences in the free slots, in the policy's order; none when something had to
        # be preempted (it would just thrash), nor those preempted in this step.
        candidates = order.admission_queue(
            s for s in self.waiting if not any(s is p for p in batch.preempted)
        )
        while candidates and used < budget and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = candidates.pop()
            left = order.limits[order.tier(seq)] - used
            if left <= 0 or not self.slicer.may_admit(seq.adapter_id) or not self._prefix_ready(seq):
                continue
            n = min(seq.num_uncomputed, left, self.max_chunk or left)
            if not self.bm.allocate_slots(seq, n):
                self.bm.free_seq(seq)  # give back prefix hits; they stay cached
                break
            self._start(seq, order)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            used += n
        self.budget.after_step(
            len(self.running), self._prompts_left(batch, uncomputed), order.cap is not None
        )
        for seq in self.waiting:  # a waiting sequence holds no blocks across steps, once loaded neither (they
            # stay in the device cache, to be matched again)
            if seq.block_table and not self.kv.is_loading(seq):
                self.bm.free_seq(seq)
        if any(s.adapter_id for s in batch.seqs):  # one contiguous segment per adapter (stable sort)
            rows = sorted(range(len(batch)), key=lambda i: batch.seqs[i].adapter_id)
            batch.seqs = [batch.seqs[i] for i in rows]
            batch.num_new_tokens = [batch.num_new_tokens[i] for i in rows]
        return batch.freeze(self.mirror, [s.seq_id for s in self.running], holds_stop)

    def _prompts_left(self, batch: ScheduledBatch, uncomputed) -> bool:
        """Whether the step left prompt tokens that a larger budget would have computed: a running row's chunk
        cut short, or a waiting sequence with a free slot to start in. Not where KV blocks ran out (a sequence was
        preempted): a larger step would only preempt more."""
        if batch.preempted:
            return False
        scheduled = {s.seq_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
        if any((left := uncomputed(s)) > 1 and scheduled.get(s.seq_id, 0) < left for s in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _prefix_ready(self, seq: Sequence) -> bool:
        """Attach a waiting sequence's cached prefix: the device cache's blocks now, and the KV tiers' after they
        are loaded in the background. False while its load is under way."""
        if self.kv.is_loading(seq):
            return False
        if not seq.block_table:
            self.bm.match_prefix(seq)
            if self.kv.start_load(seq):
                return False
        return True

    def _start(self, seq: Sequence, order: StepOrder) -> None:
        """A waiting sequence joins the running ones."""
        remove_seq(self.waiting, seq)
        self.slicer.admitted(seq.adapter_id)
        order.started(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def tenant_states(self) -> tuple[TenantState, ...]:
        """Each tenant with sequences here, in the order their next waiting sequence would be admitted."""
        return self.policy.tenant_states(self.running, self.waiting)

    @staticmethod
    def _fit_drafts(seq: Sequence, n: int, budget: int) -> int:
        """Keep the drafts that fit the budget behind a decode row's one token; they count like any token."""
        if seq.draft_token_ids and n == seq.num_uncomputed == 1:
            seq.draft_token_ids = seq.draft_token_ids[: budget - n]
        else:
            seq.draft_token_ids = []
        return len(seq.draft_token_ids)

    def _preempt(self, seq: Sequence, order: StepOrder) -> None:
        """Back to the front of the waiting queue (taken out of `running` by the caller)."""
        order.stopped(seq)
        seq.draft_token_ids = []
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _long_rope_restart(self, seq: Sequence, order: StepOrder) -> None:
        """A LongRoPE sequence that grew past the original context: recomputed whole with the long factors (as
        transformers' Phi-3 drops its cache there), preempted and under the prefix salt of its long form (the
        blocks it had hold its short-factor keys)."""
        self._preempt(seq, order)
        self.bm.forget(seq)  # its block hashes, chained from the old salt
        seq.cache.switch_to_long()

    def advance(self, batch: ScheduledBatch) -> None:
        """Mark the batch's chunks computed as it is scheduled, each sampling row's token pending until its step
        lands (`Sequence.num_pending`, as vLLM's output placeholders): an overlapped engine may then schedule the
        next step before this one's tokens reach the host. Their KV is written before any later step reads it (the
        device runs steps in order)."""
        cache_full_blocks = self.bm.cache_full_blocks
        for seq, row in zip(batch.seqs, batch.plan(), strict=True):
            seq.num_computed_tokens += row.num_new_tokens - len(row.drafts)  # drafts count once accepted
            if row.samples:
                seq.num_pending += 1
                seq.pending = row.sampled_as
            cache_full_blocks(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the accepted drafts' KV is the sequence's (they are its tokens now); the
        rejected ones' slots are given back, and blocks they alone used return to the pool."""
        seq.draft_token_ids = []
        seq.num_computed_tokens += num_accepted
        self.bm.truncate(seq)
        self.bm.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """Finish a sequence (it stopped, or was aborted) and return its blocks to the pool."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.draft_token_ids = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        self.bm.forget(seq)
