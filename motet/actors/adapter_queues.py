"""The adapter queues actor: one bounded queue per adapter (keyed by its AdapterRef; None: the base model).

Requests wait here until the scheduler has room for them; admission control happens here (a full
queue answers QueueFull, which the API turns into 429). Inside a queue, requests are kept per tenant in
arrival order, so the scheduler's fairness policy can take the oldest request of the tenant it picks.
Adapters are independent queues so the LoRA work can slice time between adapters without touching the
rest.
"""

from __future__ import annotations

import contextlib
from collections import deque

from motet.actors.errors import QueueFull, ShuttingDown
from motet.actors.messages import Cancel, Enqueue, QueuedRequest, Take, WorkQueued
from motet.actors.runtime import Actor, ActorStopped


class AdapterQueue:
    def __init__(self, adapter, max_len: int):
        self.adapter = adapter
        self.max_len = max_len
        self.by_tenant: dict[str, deque[QueuedRequest]] = {}
        self.size = 0

    def purge_cancelled(self) -> list[QueuedRequest]:
        gone = []
        for tenant, q in list(self.by_tenant.items()):
            keep = deque(r for r in q if not r.stream.cancelled)
            gone += [r for r in q if r.stream.cancelled]
            if keep:
                self.by_tenant[tenant] = keep
            else:
                del self.by_tenant[tenant]
        self.size -= len(gone)
        return gone

    def push(self, req: QueuedRequest) -> None:
        self.by_tenant.setdefault(req.tenant, deque()).append(req)
        self.size += 1

    def head(self, tenant: str) -> QueuedRequest | None:
        q = self.by_tenant.get(tenant)
        return q[0] if q else None

    def remove(self, req: QueuedRequest) -> None:
        q = self.by_tenant[req.tenant]
        q.remove(req)
        if not q:
            del self.by_tenant[req.tenant]
        self.size -= 1

    def pop(self, tenant: str) -> QueuedRequest:
        q = self.by_tenant[tenant]
        req = q.popleft()
        if not q:
            del self.by_tenant[tenant]
        self.size -= 1
        return req


class AdapterQueuesActor(Actor):
    name = "adapter-queues"

    def __init__(self, max_queue_len: int, retry_after: float = 1.0):
        super().__init__()
        self.max_queue_len = max_queue_len
        self.retry_after = retry_after
        self.queues: dict[object, AdapterQueue] = {}
        self.index: dict[str, QueuedRequest] = {}  # request id -> its queued entry
        self.scheduler: Actor | None = None  # told WorkQueued; set by the system

    @property
    def depth(self) -> int:
        return sum(q.size for q in self.queues.values())

    def depth_by_adapter(self) -> dict:
        return {a: q.size for a, q in self.queues.items()}

    async def handle(self, message):
        if isinstance(message, Enqueue):
            return self._enqueue(message.requests)
        if isinstance(message, Take):
            return self._take(message)
        if isinstance(message, Cancel):
            return self._cancel(message.request_ids)
        raise TypeError(f"adapter queues cannot handle {type(message).__name__}")

    def _enqueue(self, requests: list[QueuedRequest]) -> None:
        if not requests:
            return
        adapter = requests[0].adapter
        q = self.queues.setdefault(adapter, AdapterQueue(adapter, self.max_queue_len))
        if q.size + len(requests) > q.max_len:
            dropped = q.purge_cancelled()
            for r in dropped:
                self.index.pop(r.request_id, None)
            self._notify(dropped=dropped)
        if q.size + len(requests) > q.max_len:
            raise QueueFull(
                f"the request queue is full ({q.max_len} waiting for this model); retry later",
                retry_after=self.retry_after,
            )
        for r in requests:
            q.push(r)
            self.index[r.request_id] = r
        self._notify(arrived=requests)

    def _cancel(self, request_ids: list[str]) -> None:
        """Requests whose client went away leave their queue at once (none is left for the scheduler)."""
        gone = []
        for request_id in request_ids:
            req = self.index.pop(request_id, None)
            if req is not None:
                self.queues[req.adapter].remove(req)
                gone.append(req)
        self._notify(dropped=gone)

    def _notify(self, arrived=(), dropped=()) -> None:
        """Tell the scheduler (its fairness counters, and that there is work): never waits."""
        if (arrived or dropped) and self.scheduler is not None:
            with contextlib.suppress(ActorStopped):
                self.scheduler.tell_nowait(
                    WorkQueued([r.tenant for r in arrived], [r.tenant for r in dropped])
                )

    def _take(self, message: Take) -> list[QueuedRequest]:
        taken: list[QueuedRequest] = []
        while len(taken) < message.max_requests:
            # Each tenant's oldest request across adapter queues.
            heads: dict[str, QueuedRequest] = {}
            for q in self.queues.values():
                for tenant in q.by_tenant:
                    h = q.head(tenant)
                    if tenant not in heads or h.arrival < heads[tenant].arrival:
                        heads[tenant] = h
            tenant = message.pick(list(heads)) if heads else None
            if tenant is None:
                break
            req = heads[tenant]
            self.queues[req.adapter].pop(tenant)
            self.index.pop(req.request_id, None)
            taken.append(req)
        return taken

    async def on_stop(self) -> None:
        for q in self.queues.values():
            for reqs in q.by_tenant.values():
                for r in reqs:
                    r.stream.fail(ShuttingDown("the server is shutting down"))
        self.queues.clear()
        self.index.clear()
