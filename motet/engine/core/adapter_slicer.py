"""Which adapters may start new sequences: resident ones, within the optional `max_loras` cap, time-sliced as in
LoRAX when adapters wait for room.

An adapter is *active* while it has running sequences (its pool memory is then never evicted, and under
`max_loras` it holds one of the cap's places). A waiting sequence joins when its adapter is active, or when
its adapter is resident (motet/lora/manager.py loads it in the background meanwhile) and, under `max_loras`,
a place is free and its adapter is next in line. Adapters wait for room in two ways: for a place under the
cap, or for pool memory that only running adapters hold (the manager's `blocked`); both queue in the order
they were first refused, so a newcomer never overtakes them. When adapters are left waiting, the active
adapters whose time slice has run out (oldest first, as many as are waiting) stop admitting new sequences;
their running ones drain, the place and the memory free, and the next adapter in line takes them. An adapter
that drained goes to the back of the line. Nobody starves: a waiting adapter's place only improves, and
every slice ends.

The base model (adapter 0) needs no adapter and is always admissible. A plain class with plain inputs; the
scheduler calls `begin_step` then `may_admit` / `admitted` for each waiting sequence it considers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable


class AdapterSlicer:
    def __init__(self, max_loras: int | None, time_slice: int):
        self.max_loras = max_loras  # None: no cap on distinct adapters among the running sequences
        self.time_slice = time_slice  # in steps
        self.step = 0
        self.active_since: dict[int, int] = {}  # active adapter -> step it became active
        self.waiting_since: dict[int, int] = {}  # adapter waiting for room -> step it was first refused
        self.granted: set[int] = set()  # inactive adapters that may start sequences this step
        self.draining: set[int] = set()  # active adapters whose slice ended while others wait
        self.order: list[int] = []  # the waiting adapters not active, in the order they would be admitted

    def begin_step(
        self,
        running: Iterable[int],
        waiting: Iterable[int],
        ready: Callable[[int], bool] = lambda a: True,
        blocked: Collection[int] = (),
    ) -> None:
        """Plan a step from the adapters of the running sequences and of the waiting ones (admission order):
        `ready(a)`: adapter a is resident; `blocked`: adapters not resident for lack of pool memory."""
        self.step += 1
        active = set(running) - {0}
        self.active_since = {a: self.active_since.get(a, self.step) for a in active}
        queued = [a for a in dict.fromkeys(waiting) if a and a not in active]
        self.waiting_since = {a: t for a, t in self.waiting_since.items() if a in queued}
        line = sorted(queued, key=lambda a: self.waiting_since.get(a, self.step))  # stable: queue order
        self.order = line
        free = len(line) if self.max_loras is None else self.max_loras - len(active)
        granted, left = [], []
        for a in line:
            if not ready(a):
                if a in blocked:  # no memory until running adapters drain: it waits as for a place
                    left.append(a)
            elif len(granted) < free:
                granted.append(a)
            else:
                left.append(a)
        self.granted = set(granted)
        for a in left:
            self.waiting_since.setdefault(a, self.step)
        expired = [a for a, t in self.active_since.items() if self.step - t >= self.time_slice]
        expired.sort(key=self.active_since.__getitem__)
        self.draining = set(expired[: len(left)])

    def may_admit(self, adapter_id: int) -> bool:
        if adapter_id == 0:
            return True
        if adapter_id in self.active_since:
            return adapter_id not in self.draining
        return adapter_id in self.granted

    def admitted(self, adapter_id: int) -> None:
        """A sequence of this adapter joined the running batch."""
        if adapter_id and adapter_id not in self.active_since:
            self.active_since[adapter_id] = self.step
            self.waiting_since.pop(adapter_id, None)
