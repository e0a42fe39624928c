"""Latency isolation to the last token: how many tokens a step may carry while a latency-bound request runs.

Every row of a step waits for the whole step, so a light tenant's 16-token answer decodes at the pace of a step
that also carries another tenant's 64 rows and their prompt chunks. Fairness at admission (fairness.py) gets the
light request into the step at once; this module keeps the step small enough while it is there.

- `StepCost` learns a step's time from the steps just run: seconds ~ fixed + per_token x tokens (on a CPU a
  step is compute-bound past a floor of reading the weights once; on a GPU the line is flat until the batch
  fills the device), fitted by exponentially weighted least squares so it follows the load.
- `LatencyGuard` says, each step, which tenants are latency-bound and how many tokens the other rows may add:
  a tenant is latency-bound when it asks for no more than its fair share of the sequence slots (all its
  requests fit its share: a light tenant, not a backlogged one) and for at most a quarter of what another
  running tenant asks for (per weight: the burst's last requests still yield to one light request; two
  tenants of like demand do not size each other's steps), or when it ran such
  requests in the last `LINGER_S` (a conversation's next turn should not wait behind one huge step). Batch
  work (a `background` sequence: the Batch API's lines, `service_tier: "flex"`, a tenant of the batch class)
  is never latency-bound, and every interactive tenant is latency-bound beside it: batch work yields, and when
  only batch work would yield it fills what is spare and no more: a step may take at most `BACKGROUND_SLACK`
  times what the interactive rows alone would (batch work promises a 24-hour window; an interactive token that
  comes later does not).
  While anyone is latency-bound the scheduler serves those rows first and gives the rest of the rows only the
  tokens that keep the step within `tpot_target_s`: the tenants over their share yield rows (they keep their
  slots and KV, and go on at the next step). When nobody is light the step is the full budget: throughput is
  unchanged.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from motet.engine.fairness import Tenant, VirtualTokenCounter

# A light tenant asks for at most a quarter of what the heaviest other tenant does (per weight).
LIGHT_RATIO = 4
# Beside interactive rows, batch rows may make a step at most this much slower than those rows alone.
BACKGROUND_SLACK = 1.1
LINGER_S = 1.0  # a light tenant stays latency-bound this long after its last request left the engine
_DECAY = 0.97  # weight of the steps before the latest in the fit (about the last 30 steps count)
_MIN_STEPS = 8  # steps seen before the model sizes anything
_MAX_STEP_S = 30.0  # a longer interval is not a step's time (the engine sat idle, a debugger stopped it)


class StepCost:
    """A step's seconds against its tokens: `fixed + per_token * tokens`, from the steps seen."""

    def __init__(self, decay: float = _DECAY):
        self.decay = decay
        self.steps = 0
        # Weighted sums of 1, x, x^2, y, xy (x: tokens, y: seconds).
        self._s0 = self._sx = self._sxx = self._sy = self._sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not (0.0 < seconds < _MAX_STEP_S):
            return
        d = self.decay
        self._s0 = d * self._s0 + 1.0
        self._sx = d * self._sx + tokens
        self._sxx = d * self._sxx + tokens * tokens
        self._sy = d * self._sy + seconds
        self._sxy = d * self._sxy + tokens * seconds
        self.steps += 1

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before enough steps. Steps of one size only, or a fit
        that says a token costs nothing or the floor is negative: the time is taken as proportional."""
        if self.steps < _MIN_STEPS or self._sx <= 0:
            return None
        var = self._s0 * self._sxx - self._sx * self._sx
        if var > 1e-9 * self._s0 * self._sxx:
            slope = (self._s0 * self._sxy - self._sx * self._sy) / var
            fixed = (self._sy - slope * self._sx) / self._s0
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self._sy / self._sx

    def seconds(self, tokens: int) -> float | None:
        """A step's expected seconds with `tokens` tokens; None: not known yet."""
        line = self.line()
        return None if line is None else line[0] + line[1] * tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may carry to take at most `seconds` (at least 1); None: not known yet."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return max(1, math.floor((seconds - fixed) / per_token))


@dataclass(frozen=True)
class LatencyCap:
    """One step's sizing: the latency-bound tenants (their interactive rows go first, at the full budget) and
    the tokens every other row may add up to (`tokens`, counting the latency-bound rows' own)."""

    tenants: frozenset
    tokens: int

    def bound(self, seq) -> bool:
        return not seq.background and seq.tenant in self.tenants


class LatencyGuard:
    def __init__(self, tpot_target_s: float | None, max_num_seqs: int, fairness: VirtualTokenCounter):
        self.target = tpot_target_s if tpot_target_s and tpot_target_s > 0 else None
        self.max_num_seqs = max_num_seqs
        self.fairness = fairness
        self.cost = StepCost()
        self._light_until: dict[Tenant, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def light_tenants(self, running: Iterable, waiting: Iterable) -> set:
        """The interactive tenants whose requests in the engine all fit their fair share of the sequence slots,
        while some other tenant (or batch work) runs."""
        running, waiting = list(running), list(waiting)
        demand = Counter(s.tenant for s in (*running, *waiting) if not s.background)
        running_tenants = {s.tenant for s in running}
        background = any(s.background for s in running)
        if background:  # batch work yields to every interactive tenant
            return set(demand)
        if len(demand) < 2 or not running_tenants:
            return set()
        weight = self.fairness.weight
        total = sum(weight(t) for t in demand)
        load = {t: n / weight(t) for t, n in demand.items()}
        light = set()
        for t, n in demand.items():
            fair = self.max_num_seqs * weight(t) / total
            heaviest = max((load[o] for o in running_tenants if o != t and o in load), default=0.0)
            if n <= fair and load[t] * LIGHT_RATIO <= heaviest:
                light.add(t)
        return light

    def cap(self, running, waiting, now: float, budget: int) -> LatencyCap | None:
        """This step's sizing, or None: the full budget for everyone."""
        if self.target is None:
            return None
        running, waiting = list(running), list(waiting)
        light = self.light_tenants(running, waiting)
        for t in light:
            self._light_until[t] = now + LINGER_S
        for t in [t for t, until in self._light_until.items() if until <= now]:
            del self._light_until[t]
        if not self._light_until:
            return None
        tenants = frozenset(self._light_until)
        yielding = [s for s in running if not (s.tenant in tenants and not s.background)]
        if not yielding:
            return None  # only latency-bound rows run: nobody to yield
        target = self.target
        interactive = len(running) - len(yielding)
        if interactive and all(
            s.background for s in yielding
        ):  # only batch work yields: it takes what is spare
            alone = self.cost.seconds(interactive)  # (their decode tokens: a prompt chunk adds to it)
            if alone is not None:
                target = min(target, BACKGROUND_SLACK * alone)
        tokens = self.cost.tokens_within(target)
        if tokens is None or tokens >= budget:
            return None
        return LatencyCap(tenants, tokens)
