"""Fairness across tenants: Virtual Token Counters (Sheng et al., "Fairness in Serving Large Language
Models", OSDI'24).

Each tenant has a counter of the service it received, weighted tokens: input tokens when a request is
admitted, output tokens as they are generated. The next request admitted comes from the backlogged
tenant with the lowest counter. A tenant that was idle does not bank credit: when it becomes active its
counter is lifted to the lowest counter among the active tenants (or, when nobody is active, to the
counter of the tenant that left last), so it competes from where the others are, not from zero.

A plain synchronous class: the scheduler actor calls it; it never sees requests, only tenant names and
token counts.
"""

from __future__ import annotations

from collections.abc import Iterable


class VirtualTokenCounter:
    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        # The paper weights output tokens more: they cost a forward step each, input tokens share one.
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.active: dict[str, int] = {}  # tenant -> requests in the system (queued or running)
        self._last_left = 0.0  # counter of the tenant that went idle last

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` entered the system (queued)."""
        if self.active.get(tenant, 0) == 0:
            floor = min((self.counters[t] for t in self.active), default=self._last_left)
            self.counters[tenant] = max(self.counter(tenant), floor)
        self.active[tenant] = self.active.get(tenant, 0) + 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` left the system (finished, aborted or rejected)."""
        n = self.active.get(tenant, 0) - 1
        if n > 0:
            self.active[tenant] = n
        elif tenant in self.active:
            del self.active[tenant]
            self._last_left = self.counter(tenant)

    def pick(self, candidates: Iterable[str]) -> str | None:
        """The tenant to admit from next: the lowest counter; ties go to the first candidate."""
        best = None
        for t in candidates:
            if best is None or self.counter(t) < self.counter(best):
                best = t
        return best

    def charge(self, tenant: str, input_tokens: int = 0, output_tokens: int = 0) -> None:
        self.counters[tenant] = (
            self.counter(tenant) + self.input_weight * input_tokens + self.output_weight * output_tokens
        )
