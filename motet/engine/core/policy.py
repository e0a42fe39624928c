"""The scheduling policy, in one place (vLLM's `SchedulingPolicy` and request queue): every order a request meets
on its way to a step, and who gives way.

- A tenant's own requests: `urgency` (vLLM's `priority`, lower first, then arrival). The serving layer's adapter
  queues (motet/actors/adapter_queues.py) and the engine's waiting and running lists order them by it; priority
  trades the places its tenant's requests hold and never moves another tenant's (`tenant_places`).
- Between tenants, into the engine: `AdmissionGate` (the queues -> the engine's waiting list: every tenant with
  queued work first, then the lowest virtual token counter), built from the engine's `tenant_states()`.
- Between tenants, in each step (`StepOrder`, from `SchedulingPolicy.step`): which waiting sequence is admitted
  first (a tenant under its share of the running sequences, then the lowest counter: motet/engine/core/fairness.py),
  which running sequence a newcomer under its share displaces (the least urgent, newest one of the tenant most over
  its share), which running rows go first and how many tokens each may take (the latency tiers and the floor:
  motet/engine/core/latency.py), and which row is preempted when KV blocks run out (the last in that order).

The engine's `Scheduler` (scheduler.py) is the loop over the token budget, the KV blocks and the adapter slots that
asks these questions; nothing else decides an order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping

from motet.engine.core.fairness import (
    DEFAULT_WEIGHT,
    Tenant,
    TenantShares,
    TenantState,
    VirtualTokenCounter,
)
from motet.engine.core.latency import INTERACTIVE, LatencyCap, LatencyGuard, tier


def urgency(priority: int, arrival) -> tuple:
    """A tenant's own requests, lower first: vLLM's priority, then arrival (the queues' and the engine's order)."""
    return (priority, arrival)


def _urgency(s) -> tuple:
    return (*urgency(s.order.priority, s.order.arrival), s.seq_id)


def _place(s) -> tuple[int, int]:
    return s.order.place or (s.order.arrival, s.seq_id)


def tenant_places(seqs) -> dict[int, tuple[int, int]]:
    """Each sequence's place in an order between tenants (seq_id -> (arrival, seq_id)): the places its tenant's
    sequences hold (by arrival, or as traded before), given out by urgency, so priority reorders a tenant's
    sequences among its own places and never moves another tenant's."""
    if all(s.order.priority == 0 and s.order.place in (None, (s.order.arrival, s.seq_id)) for s in seqs):
        # nothing traded: each holds its own place
        return {s.seq_id: (s.order.arrival, s.seq_id) for s in seqs}
    by_tenant: dict = defaultdict(list)
    for s in seqs:
        by_tenant[s.tenant].append(s)
    places = {}
    for group in by_tenant.values():
        for s, place in zip(sorted(group, key=_urgency), sorted(map(_place, group)), strict=True):
            places[s.seq_id] = place
    return places


class SchedulingPolicy:
    """The engine's policy: the tenants' counters (VTC), the latency guard that sizes steps, and each step's order."""

    def __init__(
        self,
        max_num_seqs: int,
        fairness: VirtualTokenCounter | None = None,
        tpot_target_s: float | None = None,
    ):
        self.max_num_seqs = max_num_seqs
        self.fairness = fairness or VirtualTokenCounter()
        self.latency = LatencyGuard(tpot_target_s, max_num_seqs, self.fairness)
        self.num_capped_steps = 0  # steps sized down for a latency-bound request

    def step(self, running: list, waiting, budget: int, uncomputed: Callable[[object], int]) -> StepOrder:
        """This step's order over the engine's running and waiting sequences (the scheduler's own lists, which it
        changes as it goes); `uncomputed(seq)`: the tokens a row needs this step (0 while it is held)."""
        return StepOrder(self, running, waiting, budget, uncomputed)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step's tokens and time, for sizing the next ones."""
        self.latency.observe(tokens, seconds)

    def tenant_states(self, running, waiting) -> tuple[TenantState, ...]:
        """Each tenant with sequences here, in the order their next waiting sequence would be admitted."""
        shares = TenantShares(self.fairness, (s.tenant for s in running), (s.tenant for s in waiting))
        queued = Counter(s.tenant for s in waiting)
        tenants = sorted(set(shares.running) | set(queued), key=lambda t: (shares.admission_key(t), str(t)))
        return tuple(
            TenantState(t, self.fairness.weight(t), self.fairness.counter(t), shares.running[t], queued[t])
            for t in tenants
        )


class StepOrder:
    """One step's answers: the waiting sequences' order and who may displace whom, the running rows' order and
    tokens. Built once per step, before any sequence moves; told of each move (`started`, `stopped`, `took`)."""

    def __init__(self, policy: SchedulingPolicy, running: list, waiting, budget: int, uncomputed):
        self.policy = policy
        self.running = running  # the scheduler's own list: `growing` reads its length as it changes
        fair = policy.fairness
        fair.set_active(s.tenant for s in (*running, *waiting))
        self.shares = TenantShares(fair, (s.tenant for s in running), (s.tenant for s in waiting))
        self.waiting_places = tenant_places(waiting)
        for s in waiting:  # the places traded stay traded: a later place stays the later one's
            s.order.place = self.waiting_places[s.seq_id]
        self.waiting = waiting
        self.budget = budget
        self.uncomputed = uncomputed
        # The step's sizing, once the newcomers under their share have joined the running ones (`sort_running`).
        self.cap: LatencyCap | None = None
        self.limits = (budget,) * 3
        self.floor_tenant = None
        self.floor_left = 0

    def tier(self, seq) -> int:
        return self.cap.tier(seq) if self.cap is not None else tier(seq)

    # -- the waiting ------------------------------------------------------------------------------------------------
    def _growing(self) -> bool:
        return len(self.running) < self.policy.max_num_seqs  # a free slot: a newcomer displaces nobody

    def admission_key(self, seq) -> tuple:
        return (
            *self.shares.admission_key(seq.tenant, self._growing()),
            *self.waiting_places.get(seq.seq_id, _place(seq)),
        )

    def admission_queue(self, candidates: Iterable) -> AdmissionQueue:
        """`candidates` in the order they are admitted (`admission_key`'s), asked one at a time as sequences start."""
        return AdmissionQueue(self, candidates)

    def jumps_queue(self, seq) -> bool:
        """Whether `seq`'s tenant is under its share: it joins the running ones ahead of the others' rows, in a free
        slot or (`may_displace`) in place of another tenant's."""
        return self.shares.under(seq.tenant, self._growing())

    def may_displace(self, seq) -> bool:
        return self.shares.may_displace(seq.tenant)

    def displaced_by(self, seq):
        """Take the running sequence `seq` takes the place of out of the running ones: the least urgent, newest one
        of the tenant most over its share."""
        tenant = self.shares.most_over(seq.tenant)
        victim = max((s for s in self.running if s.tenant == tenant), key=_urgency)
        remove_seq(self.running, victim)
        return victim

    def started(self, seq) -> None:
        """A waiting sequence joined the running ones (its prompt is charged once, when it first runs)."""
        if seq.num_preemptions == 0:
            self.policy.fairness.charge(seq.tenant, input_tokens=seq.num_prompt_tokens)
        self.shares.started(seq.tenant)

    def stopped(self, seq) -> None:
        """A running sequence went back to waiting."""
        self.shares.stopped(seq.tenant)

    # -- the running ------------------------------------------------------------------------------------------------
    def sort_running(self, now: float) -> None:
        """Size the step (motet/engine/core/latency.py: the tiers' tokens, the floor) as the running rows are now,
        and sort them: in their latency tiers (the latency-bound tenants' at the full budget, then the other
        interactive ones, then batch work), in each the floor's tenant first, then the least-served tenants' (their
        prefill chunks get the budget first); last, the least urgent, newest sequence of the tenant most over its
        share: the first to be preempted."""
        self.cap = self.policy.latency.cap(self.running, self.waiting, now, self.budget)
        if self.cap is not None:
            self.policy.num_capped_steps += 1
            self.limits = self.cap.limits(self.budget)
            # Yielding is not starving: the least-served tenant whose interactive rows the cap holds back (VTC's
            # lowest counter) goes first in its tier and gets at least the cap's floor of tokens, whatever the cap
            # leaves; half the step's time while it runs fewer sequences than its share.
            yielding = (s.tenant for s in self.running if self.tier(s) == INTERACTIVE and self.uncomputed(s))
            self.floor_tenant = self.policy.fairness.pick(dict.fromkeys(yielding))
            if self.floor_tenant is not None:
                under_share = self.shares.under(self.floor_tenant)
                self.floor_left = self.cap.half_step if under_share else self.cap.floor
        places = tenant_places(self.running)
        fair, shares = self.policy.fairness, self.shares
        key = {
            t: (t != self.floor_tenant, shares.load(t), fair.counter(t))
            for t in {s.tenant for s in self.running}
        }
        self.running.sort(key=lambda s: (self.tier(s), *key[s.tenant], *places[s.seq_id]))

    def owed(self, seq) -> int:
        """The floor's tokens still owed to `seq` in this step (0: none)."""
        return self.floor_left if seq.tenant == self.floor_tenant and self.tier(seq) == INTERACTIVE else 0

    def tokens_left(self, seq, used: int) -> int:
        """The most tokens `seq` may take with `used` already in the step: its tier's limit, or what the floor owes."""
        return max(self.limits[self.tier(seq)] - used, min(self.owed(seq), self.budget - used))

    def took(self, seq, n: int) -> None:
        if self.owed(seq):
            self.floor_left = max(0, self.floor_left - n)

    def kv_victim(self):
        """Take the row preempted when KV blocks run out out of the running ones: the last in their order."""
        return self.running.pop()


class AdmissionGate:
    """Which tenant's queued request enters the engine next (the serving layer's adapter queues -> the
    engine's waiting list), from the engine's state after its latest step (`SchedulingPolicy.tenant_states`).

    A tenant with nothing waiting in the engine may send one request beyond the common room (up to `spare`
    of them in all), so every tenant with queued work is in the engine's waiting list at the next step,
    where the step's order ranks it by its share and counter; further requests fill the common `room` (the
    serving layer's `max_waiting` and the free sequence slots), lowest counter first. Each request taken is
    charged to a copy of the counters, so one admission round interleaves tenants as the engine will.
    """

    def __init__(self, tenants: Iterable[TenantState], room: int, spare: int, input_weight: float = 1.0):
        tenants = list(tenants)
        self.counters = {t.tenant: t.virtual_tokens for t in tenants}
        self.weights = {t.tenant: t.weight for t in tenants}
        self.waiting = Counter({t.tenant: t.waiting for t in tenants})
        self.floor = min(self.counters.values(), default=0.0)  # where a newcomer will be lifted to
        self.room = room
        self.spare = max(room, spare)
        self.input_weight = input_weight

    def pick(self, candidates: Mapping[Tenant, int]) -> Tenant | None:
        """`candidates`: each tenant with queued work -> its next request's prompt tokens. None: take no
        more now."""
        allowed = [t for t in candidates if self.room > 0 or (self.waiting[t] == 0 and self.spare > 0)]
        if not allowed:
            return None
        tenant = min(allowed, key=lambda t: self.counters.get(t, self.floor))  # ties: the first
        self.waiting[tenant] += 1
        self.room -= 1
        self.spare -= 1
        cost = self.input_weight * candidates[tenant] / self.weights.get(tenant, DEFAULT_WEIGHT)
        self.counters[tenant] = self.counters.get(tenant, self.floor) + cost
        return tenant


class AdmissionQueue:
    """Waiting sequences handed out in `StepOrder.admission_key`'s order, as it is when each is asked for: a tenant's
    part of the key changes as sequences start and stop, their places do not (fixed for the step). So each
    tenant's sequences are sorted by place once, and each `pop` compares the tenants' first ones: with thousands
    waiting, a key per sequence per admission was most of a step's time."""

    def __init__(self, order: StepOrder, candidates: Iterable):
        self.order = order
        by_tenant: dict = defaultdict(list)
        for s in candidates:
            by_tenant[s.tenant].append(s)
        self.queues = {t: sorted(group, key=self._place, reverse=True) for t, group in by_tenant.items()}
        self.size = sum(map(len, self.queues.values()))

    def _place(self, seq) -> tuple:
        place = self.order.waiting_places.get(seq.seq_id)
        return _place(seq) if place is None else place

    def __len__(self) -> int:
        return self.size

    def pop(self):
        """The sequence admitted next, taken out of the queue (IndexError when it is empty)."""
        if not self.size:
            raise IndexError("pop from an empty AdmissionQueue")
        growing, shares = self.order._growing(), self.order.shares
        tenant = min(
            (t for t, queue in self.queues.items() if queue),
            key=lambda t: (*shares.admission_key(t, growing), *self._place(self.queues[t][-1])),
        )
        self.size -= 1
        return self.queues[tenant].pop()


def remove_seq(seqs, seq) -> None:
    """Remove `seq` itself (not an equal sequence) from a list or deque."""
    for j, s in enumerate(seqs):
        if s is seq:
            del seqs[j]
            return
