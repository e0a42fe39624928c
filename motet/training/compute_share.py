"""Who computes between two serving steps: the serving engine's share of the machine's cores with fine-tuning jobs'
workers. Plain code: the engine's thread asks it (motet/actors/training_lease.py applies its answers with signals);
the runner (motet/api/fine_tuning/runner.py) reads a job's outlook from it.

One worker at a time holds the cores, and never while serving steps:

- while serving is busy (requests in the engine), training is owed `share` of the wall clock: with S the seconds
  serving was busy without training and T the seconds a worker held the cores meanwhile, a slice of `slice_s` is
  granted between two steps while T < share / (1 - share) * S, of what is owed (at least `slice_s`, at most
  MAX_SLICES of them: after a long step, a longer slice), so that T / (S + T) tends to `share`; what is owed
  beyond the longest slice when one is asked for is not owed any more (serving's seconds while no worker could
  take them are not owed back; a step so long that its share would stall serving more is given the longest);
- while serving is idle a worker holds the cores for as long as it stays idle (turns of `turn_s` where several
  workers wait), and the next step takes them back;
- the holder is the worker of the tenant that has held the cores the least, and among that tenant's workers the one
  that has held them the least: a tenant with three jobs gets the time a tenant with one gets. A tenant (or a worker)
  that joins starts level with the least-served one present, never owed the time before it joined.

`waiting_reason` reads two samples of a worker's compute (motet/actors/training_lease.py's) and says why it waits,
if it does.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

# A slice while serving is busy: long enough that switching costs little of it (a SIGSTOP and a SIGCONT, a warm
# cache lost), short enough that a streamed reply barely stalls: a decode step of the default model takes 10-60 ms
# on a CPU, so a slice holds up the next token by about one to a few steps' time.
SLICE_S = 0.075
MAX_SLICES = (
    4  # the longest slice, in SLICE_S: after a long step (a long prompt's prefill), training's part of it
)
# While serving is idle, several workers take turns of this long (one alone holds the cores until serving needs
# them).
TURN_S = 1.0
# A worker that held the cores less than this share of a while waits for the lease; one whose threads ran less than
# this share of the time they were runnable waits for the machine's CPUs (other programs use them).
HELD_WAITING = 0.8
RAN_WAITING = 0.7


class TrainingShare:
    """The policy: `share` of the wall clock while serving is busy (0 <= share < 1), all of it while idle."""

    def __init__(self, share: float, slice_s: float = SLICE_S, turn_s: float = TURN_S):
        if not 0 <= share < 1:
            raise ValueError(f"the fine-tuning share must be at least 0 and below 1, not {share}")
        self.share, self.slice_s, self.turn_s = share, slice_s, turn_s
        self.served_s = 0.0  # S: serving busy, no worker holding the cores (since serving was last idle)
        self.trained_s = 0.0  # T: a worker held the cores while serving was busy (since then)
        self._tenants: dict[str, dict[Hashable, float]] = {}  # tenant -> its workers -> seconds each held
        self._tenant_s: dict[str, float] = {}  # tenant -> seconds its workers held (while it has any)
        self._tenant_of: dict[Hashable, str] = {}

    # -- the workers -------------------------------------------------------------------------------------------
    def join(self, worker: Hashable, tenant: str) -> None:
        """A worker waits for the cores (level with the least-served present: owed nothing from before)."""
        if worker in self._tenant_of:
            return
        if tenant not in self._tenants:
            self._tenant_s[tenant] = min(self._tenant_s.values(), default=0.0)
            self._tenants[tenant] = {}
        mine = self._tenants[tenant]
        mine[worker] = min(mine.values(), default=0.0)
        self._tenant_of[worker] = tenant

    def leave(self, worker: Hashable) -> None:
        tenant = self._tenant_of.pop(worker, None)
        if tenant is None:
            return
        del self._tenants[tenant][worker]
        if not self._tenants[tenant]:
            del self._tenants[tenant], self._tenant_s[tenant]

    def __len__(self) -> int:
        return len(self._tenant_of)

    def holder(self) -> Hashable | None:
        """Who holds the cores next: the least-served tenant's least-served worker (ties: the first that joined)."""
        if not self._tenants:
            return None
        tenant = min(self._tenants, key=self._tenant_s.__getitem__)
        mine = self._tenants[tenant]
        return min(mine, key=mine.__getitem__)

    def fraction(self, worker: Hashable, busy: bool) -> float:
        """The share of the machine's time `worker` can expect now: the training share while serving is busy (all
        of it while idle), split evenly between the tenants with workers, then between the tenant's workers."""
        tenant = self._tenant_of.get(worker)
        if tenant is None:
            return 0.0
        whole = self.share if busy else 1.0
        return whole / len(self._tenants) / len(self._tenants[tenant])

    # -- the clock -------------------------------------------------------------------------------------------
    def held(self, worker: Hashable, seconds: float, busy: bool) -> None:
        """`worker` held the cores for `seconds` (while serving was busy: they count against the share)."""
        tenant = self._tenant_of.get(worker)
        if tenant is not None:
            self._tenants[tenant][worker] += seconds
            self._tenant_s[tenant] += seconds
        if busy:
            self.trained_s += seconds

    def served(self, seconds: float) -> None:
        """Serving was busy for `seconds` with no worker holding the cores."""
        self.served_s += seconds

    def idle(self) -> None:
        """Serving has nothing left to run: the share starts afresh when it is busy again."""
        self.served_s = self.trained_s = 0.0

    def slice(self) -> float:
        """How long a worker should hold the cores before serving's next step (0: not now). What is owed beyond the
        longest slice is not owed any more (serving's time while no worker could take it, or a step so long that
        its share would stall serving more than a slice)."""
        longest = MAX_SLICES * self.slice_s
        if (owed := self._owed()) > longest:
            self.trained_s += owed - longest
            owed = longest
        if not self._tenants or owed <= 0:
            return 0.0
        return max(owed, self.slice_s)

    def _owed(self) -> float:
        return self._ratio * self.served_s - self.trained_s

    @property
    def _ratio(self) -> float:
        return self.share / (1 - self.share)


@dataclass(frozen=True)
class ComputeSample:
    """A worker's compute up to `at` (seconds, cumulative since it joined): how long it held the cores, how long
    serving was busy, and how long its threads ran on a CPU and waited for one while runnable (summed over its
    threads; None where the system does not say)."""

    at: float
    held_s: float
    busy_s: float
    ran_s: float | None = None
    queued_s: float | None = None


def waiting_reason(first: ComputeSample, last: ComputeSample) -> str | None:
    """Why the worker mostly waited for compute between two samples ("serving": serving was busy for most of the
    time it waited, "jobs": other fine-tuning workers took their turns, "machine": other programs held the CPUs its
    threads were ready to run on), or None: it computed."""
    span = last.at - first.at
    if span <= 0:
        return None
    held = last.held_s - first.held_s
    # serving's if its steps took half the time it waited at least, else the other workers' turns
    if held / span < HELD_WAITING:
        return "serving" if last.busy_s - first.busy_s >= 0.5 * (span - held) else "jobs"
    if last.ran_s is None or first.ran_s is None or last.queued_s is None or first.queued_s is None:
        return None
    ran, queued = last.ran_s - first.ran_s, last.queued_s - first.queued_s
    if ran + queued > 0 and ran / (ran + queued) < RAN_WAITING:
        return "machine"
    return None
