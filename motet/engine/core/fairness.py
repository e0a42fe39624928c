"""Fairness across tenants: weighted Virtual Token Counters (Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24) and each tenant's share of the running sequences.

Each tenant has a counter of the service it received: weighted tokens (input tokens when its request first
runs, output tokens as they are generated) divided by the tenant's weight (`--tenant-weights`, 1 unless
set), so a tenant of weight 2 is charged half as much per token and gets twice the tokens of a busy server.
A tenant that was idle does not bank credit: when it becomes active its counter is lifted to the lowest
counter among the tenants that stayed active (or, when nobody was, to the counter of the tenants that left
last), so it competes from where the others are, not from zero.

The counters and shares are read by the scheduling policy (motet/engine/core/policy.py: who is admitted, displaced
and served first, into the engine and in each step) and by `/metrics`, through the snapshot the engine reports
after each step (`TenantState`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

DEFAULT_WEIGHT = 1.0
Tenant = Hashable  # a tenant's name; None for requests without one (the offline engine)


def check_tenant_weights(weights: object, source: str = "tenant weights") -> dict[str, float]:
    """`{"tenant": weight}` with every weight a positive finite number; ValueError naming what to fix."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"{source}: must be a JSON object mapping each tenant to a positive number")
    checked = {}
    for tenant, weight in weights.items():
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{source}: tenant names must be non-empty strings, got {tenant!r}")
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"{source}: the weight of {tenant!r} must be a positive finite number, got {weight!r}"
            )
        checked[tenant] = float(weight)
    return checked


class VirtualTokenCounter:
    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
    ):
        self.weights = check_tenant_weights(weights or {})
        # The paper weights output tokens more: they cost a forward step each, input tokens share one.
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[Tenant, float] = {}
        self.active: set[Tenant] = set()  # tenants with requests in the engine
        self._last_left = 0.0  # counter of the tenants that went idle last

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, DEFAULT_WEIGHT)

    def counter(self, tenant: Tenant) -> float:
        return self.counters.get(tenant, 0.0)

    def set_active(self, tenants: Iterable[Tenant]) -> None:
        """The tenants with requests now (once per step). Newcomers are lifted; leavers keep their counter."""
        now = set(tenants)
        stayed = self.active & now
        floor = min((self.counter(t) for t in stayed), default=self._last_left)
        for t in now - self.active:
            self.counters[t] = max(self.counter(t), floor)
        left = self.active - now
        if left:
            self._last_left = max(self.counter(t) for t in left)
        self.active = now
        if now:  # an idle tenant at or below the floor would be lifted to it anyway: forget it
            floor = min(self.counter(t) for t in now)
            for t in [t for t, c in self.counters.items() if t not in now and c <= floor]:
                del self.counters[t]

    def cost(self, tenant: Tenant, input_tokens: int = 0, output_tokens: int = 0) -> float:
        return (self.input_weight * input_tokens + self.output_weight * output_tokens) / self.weight(tenant)

    def charge(self, tenant: Tenant, input_tokens: int = 0, output_tokens: int = 0) -> None:
        self.counters[tenant] = self.counter(tenant) + self.cost(tenant, input_tokens, output_tokens)

    def pick(self, candidates: Iterable[Tenant]) -> Tenant | None:
        """The tenant to serve next: the lowest counter; ties go to the first candidate."""
        best = None
        for t in candidates:
            if best is None or self.counter(t) < self.counter(best):
                best = t
        return best


class TenantShares:
    """One step's view of how the running sequences are split between the active tenants.

    A tenant's share is the running sequences times its weight over the active tenants' weights (active:
    with a sequence waiting or running). A tenant is *under* its share when one more sequence would still
    be within it, *over* when one fewer would still be at least it; a waiting sequence of a tenant under its
    share may take the place of a running one of a tenant over its share. Both bounds hold after such a swap,
    so swaps never undo each other (no thrash), and a tenant that wants less than its share leaves the rest
    to the others.
    """

    def __init__(self, vtc: VirtualTokenCounter, running: Iterable[Tenant], waiting: Iterable[Tenant]):
        self.vtc = vtc
        self.running: Counter[Tenant] = Counter(running)
        active = set(self.running) | set(waiting)
        self.total_weight = sum(vtc.weight(t) for t in active)

    @property
    def num_running(self) -> int:
        return self.running.total()

    def share(self, tenant: Tenant, num_running: int | None = None) -> float:
        n = self.num_running if num_running is None else num_running
        return n * self.vtc.weight(tenant) / self.total_weight if self.total_weight else 0.0

    def under(self, tenant: Tenant, growing: bool = False) -> bool:
        """Whether one more running sequence keeps `tenant` within its share, in place of another one's or
        (`growing`) in a free slot, which grows everyone's share too; and another tenant runs more per weight
        (a tenant alone is never under its share)."""
        if self.running[tenant] + 1 > self.share(tenant, self.num_running + growing):
            return False
        return any(self.load(t) > self.load(tenant) for t in self._others(tenant))

    def over(self, tenant: Tenant) -> bool:
        return self.running[tenant] >= 1 and self.running[tenant] - 1 >= self.share(tenant)

    def load(self, tenant: Tenant) -> float:
        """Running sequences per unit of weight: the highest is the most over its share."""
        return self.running[tenant] / self.vtc.weight(tenant)

    def _others(self, tenant: Tenant) -> list[Tenant]:
        return [t for t, n in self.running.items() if n and t != tenant]

    def most_over(self, other_than: Tenant) -> Tenant:
        """The running tenant other than `other_than` most over its share (ties: the highest counter);
        ValueError when there is none."""
        return max(self._others(other_than), key=lambda t: (self.load(t), self.vtc.counter(t)))

    def may_displace(self, tenant: Tenant) -> bool:
        """Whether a waiting sequence of `tenant` may take the place of a running one of `most_over(tenant)`."""
        return self.under(tenant) and self.over(self.most_over(tenant))

    def admission_key(self, tenant: Tenant, growing: bool = False) -> tuple:
        """Waiting order between tenants: under its share first (then a free slot never goes to a tenant that
        another could displace next step), then the lowest counter."""
        return (not self.under(tenant, growing), self.vtc.counter(tenant))

    def started(self, tenant: Tenant) -> None:
        self.running[tenant] += 1

    def stopped(self, tenant: Tenant) -> None:
        self.running[tenant] -= 1


@dataclass(frozen=True)
class TenantState:
    """A tenant's place in the engine after a step (for admission from the queues, and /metrics)."""

    tenant: Tenant
    weight: float
    virtual_tokens: float
    running: int
    waiting: int
