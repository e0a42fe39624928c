"""Latency isolation to the last token: how many tokens a step may carry while a latency-bound request runs.

Every row of a step waits for the whole step, so a light tenant's 16-token answer decodes at the pace of a step
that also carries another tenant's 64 rows and their prompt chunks. Fairness at admission (fairness.py) gets the
light request into the step at once; this module keeps the step small enough while it is there.

- `StepCost` learns a step's time from the steps just run: seconds ~ fixed + per_token x tokens (on a CPU a
  step is compute-bound past a floor of reading the weights once; on a GPU the line is flat until the batch
  fills the device), fitted by exponentially weighted least squares so it follows the load.
- `LatencyGuard` says, each step, which tenants are latency-bound and how many tokens the other rows may add.
  A tenant is judged by the work it brings, not by how many requests it sends: an interactive tenant is
  latency-bound when its requests all fit its fair share of the sequence slots (a light tenant, not a backlogged
  one) and its work is at most a quarter of another running interactive tenant's (per weight: the burst's last
  requests still yield to one light request; two tenants of like demand do not size each other's steps). Its
  work (`TenantWork`) is the tokens its requests still need computed (a prompt's every token, one a step for a
  decoding request) averaged over about the last 10 steps: a tenant sending long prompts back to back is the
  heavy one, however few they are. A tenant latency-bound in the last `LINGER_S` with no interactive request
  here now stays so (a conversation's next turn should not wait behind one huge step); one with requests here
  is judged by them.
  Batch work (a `background` sequence: the Batch API's lines, `service_tier: "flex"`, a tenant of the batch
  class) is left out of that judgement, so it never makes a tenant light or heavy: it is never latency-bound
  and yields to every interactive row. While interactive rows run (or ran in the last `LINGER_S`) it fills what
  is spare and no more: a step may take at most `BACKGROUND_SLACK` times what the interactive rows alone would
  (batch work promises a 24-hour window; an interactive token that comes later does not).
  A step's rows come in tiers (`LatencyCap.tier`): the latency-bound tenants' rows at the full budget, then the
  other interactive rows within the tokens that keep the step within `tpot_target_s` (the tenants bringing more
  yield rows: they keep their slots and KV, and go on at the next step), then batch work within what is spare.
  When nobody is light and no batch work runs beside interactive work the step is the full budget: throughput
  is unchanged.
  Yielding never means starving: every tenant with interactive work makes progress. In a capped step the
  least-served of the tenants whose rows yield (the lowest virtual token counter, VTC's rule) gets at least
  `floor` tokens (a 32nd of the budget) whatever the cap leaves, so a light tenant's many streams cannot hold
  another tenant's prompt back until they stop; as it is served its counter rises and the next one has its turn.
  While that tenant runs fewer sequences than its share (one long prompt beside another tenant's many streams,
  not a burst beside a light request), the floor holds in time, not in steps: tokens whose own time equals a step
  of the latency-bound rows alone (`StepCost.tokens_as_long_as`), about half of the step, however slow steps are
  (beside other busy processes a step's fixed part grows most, and so many tokens a step would stretch the prompt
  over ever slower steps: 179 s against 8.8 s alone). A tenant over its share gets the 32nd.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from motet.engine.core.fairness import Tenant, VirtualTokenCounter

# A light tenant asks for at most a quarter of what the heaviest other tenant does (per weight).
LIGHT_RATIO = 4
# Beside interactive rows, batch rows may make a step at most this much slower than those rows alone.
BACKGROUND_SLACK = 1.1
# The least-served yielding tenant's tokens in every capped step: at least the budget over this (8 of 256 on CPU).
FLOOR_DIVISOR = 32
LINGER_S = 1.0  # a light tenant stays latency-bound this long after its last request left the engine
_DECAY = 0.97  # weight of the steps before the latest in the fit (about the last 30 steps count)
_MIN_STEPS = 8  # steps seen before the model sizes anything
_RECENT_STEPS = 64  # the intervals whose mean is the time between a running request's tokens
_MAX_STEP_S = 30.0  # a longer interval is not a step's time (the engine sat idle, a debugger stopped it)
_WORK_DECAY = 0.9  # weight of the steps before the latest in a tenant's work (about the last 10 steps count)
_FORGOTTEN = 1e-3  # a tenant with no work here whose average fell below this is forgotten


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

    def tokens_as_long_as(self, tokens: int) -> int:
        """The tokens whose own time (per token, without the step's fixed part) is that of a step of `tokens`: added
        to such a step, they take half of it (0 before the fit)."""
        line = self.line()
        if line is None:
            return 0
        fixed, per_token = line
        return math.ceil(fixed / per_token) + tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The most tokens a step may carry to take at most `seconds` (at least 1); None: not known yet."""
        line = self.line()
        if line is None:
            return None
        fixed, per_token = line
        return max(1, math.floor((seconds - fixed) / per_token))


class TokenPace:
    """The time between a running request's tokens as the engine goes now: the mean of the last intervals from one
    step's landing to the next while the engine had work throughout (so the loop's own time between steps counts,
    and an idle engine's waiting does not). A mean, not a median: the intervals come in two kinds (a step alone,
    and a step that waited for the server's other threads), and a request's time is their sum. For estimates of
    when a running request ends (motet/api/rate_limits.py), not for sizing steps (`StepCost`)."""

    def __init__(self, size: int = _RECENT_STEPS):
        self._recent: deque[float] = deque(maxlen=size)
        self._last: float | None = None  # the latest landing, when work was left after it

    def landed(self, now: float, work_left: bool) -> None:
        """A step's tokens landed at `now`; `work_left`: the engine has requests still (its next step follows)."""
        if self._last is not None and now - self._last < _MAX_STEP_S:
            self._recent.append(now - self._last)
        self._last = now if work_left else None

    def seconds(self) -> float | None:
        """None before two steps in a row."""
        return sum(self._recent) / len(self._recent) if self._recent else None


# A step's tiers of rows, in the order they take the step's tokens.
BOUND, INTERACTIVE, BACKGROUND = 0, 1, 2


def tier(seq, bound: frozenset = frozenset()) -> int:
    """A row's tier: its tenant latency-bound (and the row interactive), interactive, or batch work."""
    if seq.background:
        return BACKGROUND
    return BOUND if seq.tenant in bound else INTERACTIVE


def work(seq) -> int:
    """The tokens a sequence asks of the steps now: what it still needs computed (a prompt's every token), at
    least the one a running request decodes each step."""
    return max(1, seq.num_uncomputed)


class TenantWork:
    """Each interactive tenant's work per weight, averaged over the last steps (about 1 / (1 - decay) of them):
    a prompt weighs at once, and two tenants of like demand stay alike while one's prompts finish before the
    other's. A newcomer starts from nothing, a tenant between two requests keeps what it brought."""

    def __init__(self, decay: float = _WORK_DECAY):
        self.decay = decay
        self.load: dict[Tenant, float] = {}

    def observe(self, seqs: Iterable, weight) -> None:
        """One step's interactive sequences (once per step)."""
        now: Counter = Counter()
        for s in seqs:
            now[s.tenant] += work(s) / weight(s.tenant)
        d = self.decay
        for t in set(self.load) | set(now):
            self.load[t] = d * self.load.get(t, 0.0) + (1 - d) * now[t]
            if t not in now and self.load[t] < _FORGOTTEN:
                del self.load[t]


@dataclass(frozen=True)
class LatencyCap:
    """One step's sizing: the latency-bound tenants (their interactive rows go first, at the full budget), and
    the most tokens the step may hold when another interactive row (`tokens`) or a batch row (`background`) is
    added, counting every row before it; and the tokens the least-served tenant whose interactive rows yield gets
    whatever the cap leaves: `floor`, or `half_step` (tokens worth as long as the latency-bound rows' own step)
    while it runs fewer sequences than its share."""

    tenants: frozenset
    tokens: int
    background: int
    floor: int = 1
    half_step: int = 1

    def tier(self, seq) -> int:
        return tier(seq, self.tenants)

    def limits(self, budget: int) -> tuple[int, int, int]:
        """Each tier's most tokens in the step (by tier index)."""
        return budget, min(budget, self.tokens), min(budget, self.background)


class LatencyGuard:
    def __init__(self, tpot_target_s: float | None, max_num_seqs: int, fairness: VirtualTokenCounter):
        self.target = tpot_target_s if tpot_target_s and tpot_target_s > 0 else None
        self.max_num_seqs = max_num_seqs
        self.fairness = fairness
        self.cost = StepCost()
        self.work = TenantWork()
        self._light_until: dict[Tenant, float] = {}
        self._interactive_until = -math.inf  # interactive work was here until then (batch work yields to it)

    def observe(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def light_tenants(self, running: Iterable, waiting: Iterable) -> set:
        """The interactive tenants whose requests here all fit their fair share of the sequence slots and whose
        work (`TenantWork`, as of the latest step) is at most a quarter of another running interactive tenant's.
        Batch work is not looked at."""
        requests = Counter(s.tenant for s in (*running, *waiting) if not s.background)
        if len(requests) < 2:
            return set()
        weight, load = self.fairness.weight, self.work.load
        running_tenants = {s.tenant for s in running if not s.background}
        total = sum(weight(t) for t in requests)
        light = set()
        for t, n in requests.items():
            fair = self.max_num_seqs * weight(t) / total
            heaviest = max((load.get(o, 0.0) for o in running_tenants if o != t), default=0.0)
            if n <= fair and load.get(t, 0.0) * LIGHT_RATIO <= heaviest:
                light.add(t)
        return light

    def cap(self, running, waiting, now: float, budget: int) -> LatencyCap | None:
        """This step's sizing, or None: the full budget for everyone."""
        if self.target is None:
            return None
        running, waiting = list(running), list(waiting)
        interactive = [s for s in (*running, *waiting) if not s.background]
        self.work.observe(interactive, self.fairness.weight)
        here = {s.tenant for s in interactive}  # with interactive work here
        if here:
            self._interactive_until = now + LINGER_S
        light = self.light_tenants(running, waiting)
        for t in light:
            self._light_until[t] = now + LINGER_S
        for t in [t for t, until in self._light_until.items() if until <= now]:
            del self._light_until[t]
        # A tenant with interactive work here is judged by it; the linger keeps the step small for one without.
        bound = frozenset(light | {t for t in self._light_until if t not in here})
        tiers = Counter(tier(s, bound) for s in running)
        within_target = self.cost.tokens_within(self.target)
        if within_target is None:
            return None
        tokens = within_target if bound else budget
        background = budget
        if tiers[BOUND] or tiers[INTERACTIVE]:  # batch work takes what is spare beside them
            alone = self.cost.seconds(
                tiers[BOUND] + tiers[INTERACTIVE]
            )  # (their decode tokens; a prompt adds)
            background = self.cost.tokens_within(min(self.target, BACKGROUND_SLACK * alone))
        elif now < self._interactive_until:  # an interactive turn may come at any moment
            background = within_target
        background = min(background, tokens)
        if not (tiers[INTERACTIVE] and tokens < budget or tiers[BACKGROUND] and background < budget):
            return None  # no row is held back
        floor = max(1, budget // FLOOR_DIVISOR)
        bound_tokens = sum(work(s) for s in running if tier(s, bound) == BOUND)
        return LatencyCap(
            bound, tokens, background, floor, max(floor, self.cost.tokens_as_long_as(bound_tokens))
        )
