"""Which adapters may start new sequences: `max_loras` device slots, time-sliced as in LoRAX.

An adapter is *active* while it has running sequences; it holds a device slot all that time (a step's
batch is a subset of the running sequences, so a step never needs more than `max_loras` slots). A
waiting sequence joins when its adapter is active, or when a slot is free and its adapter is next in
line: adapters waiting for a slot are served in the order they were first refused one, so a newcomer
never overtakes them. When adapters are left waiting, the active adapters whose time slice has run out
(oldest first, as many as are waiting) stop admitting new sequences; their running ones drain, the slot
frees, and the next adapter in line takes it. An adapter that drained goes to the back of the line.
Nobody starves: a waiting adapter's place only improves, and every slice ends.

The base model (adapter 0) needs no slot and is always admissible. A plain class with plain inputs;
the scheduler calls `begin_step` then `may_admit` / `admitted` for each waiting sequence it considers.
"""

from __future__ import annotations

from collections.abc import Iterable


class AdapterSlicer:
    def __init__(self, max_loras: int, time_slice: int):
        self.max_loras = max_loras
        self.time_slice = time_slice  # in steps
        self.step = 0
        self.active_since: dict[int, int] = {}  # active adapter -> step it became active
        self.waiting_since: dict[int, int] = {}  # adapter waiting for a slot -> step it was first refused
        self.granted: set[int] = set()  # inactive adapters that may take a free slot this step
        self.draining: set[int] = set()  # active adapters whose slice ended while others wait

    def begin_step(self, running: Iterable[int], waiting: Iterable[int]) -> None:
        """Plan a step from the adapters of the running sequences and of the waiting ones (queue order)."""
        self.step += 1
        active = set(running) - {0}
        self.active_since = {a: self.active_since.get(a, self.step) for a in active}
        queued = [a for a in dict.fromkeys(waiting) if a and a not in active]
        self.waiting_since = {a: t for a, t in self.waiting_since.items() if a in queued}
        line = sorted(queued, key=lambda a: self.waiting_since.get(a, self.step))  # stable: queue order
        free = self.max_loras - len(active)
        self.granted, left = set(line[:free]), line[free:]
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
