"""The adapter queues actor: one bounded queue per adapter (keyed by its AdapterRef; None: the base model).

Requests wait here until the scheduler takes them into the engine; admission control happens here (a
full queue answers QueueFull, which the API turns into 429). Inside a queue, requests are kept per tenant
in order of vLLM's `priority` (lower first), then arrival, and a `Take` pops the first request of the tenant
its policy picks (the engine's `AdmissionGate`, motet/engine/core/policy.py: every tenant with queued work first, then the lowest virtual
token counter), across all adapters' queues: one tenant's backlog in a queue never stands in front of
another tenant's request, and a priority only orders its own tenant's requests.
Adapters are independent queues so the LoRA work can slice time between adapters without touching the
rest.
"""

from __future__ import annotations

import contextlib
from collections import deque

from motet.actors.messages import Cancel, Enqueue, QueuedRequest, Take, Taken, WorkQueued
from motet.actors.runtime import Actor, ActorStopped
from motet.actors.serving_errors import QueueFull, ShuttingDown
from motet.engine.core.policy import urgency


def _order(queued: QueuedRequest) -> tuple:
    """A tenant's queued requests in the policy's order for a tenant's own (vLLM's priority, then arrival)."""
    return urgency(queued.request.priority, queued.request.arrival_time)


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
        q = self.by_tenant.setdefault(req.request.tenant, deque())
        i = len(q)
        while i and _order(q[i - 1]) > _order(req):  # usually none: one priority, arrival order
            i -= 1
        q.insert(i, req)
        self.size += 1

    def head(self, tenant: str) -> QueuedRequest | None:
        q = self.by_tenant.get(tenant)
        return q[0] if q else None

    def remove(self, req: QueuedRequest) -> None:
        tenant = req.request.tenant
        q = self.by_tenant[tenant]
        q.remove(req)
        if not q:
            del self.by_tenant[tenant]
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

    def depth_by_tenant(self) -> dict[str, int]:
        depth: dict[str, int] = {}
        for q in self.queues.values():
            for tenant, reqs in q.by_tenant.items():
                depth[tenant] = depth.get(tenant, 0) + len(reqs)
        return depth

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
        adapter = requests[0].request.adapter
        q = self.queues.setdefault(adapter, AdapterQueue(adapter, self.max_queue_len))
        if q.size + len(requests) > q.max_len:
            for r in q.purge_cancelled():
                self.index.pop(r.request.request_id, None)
        if q.size + len(requests) > q.max_len:
            raise QueueFull(
                f"the request queue is full ({q.max_len} waiting for this model); retry later",
                retry_after=self.retry_after,
            )
        for r in requests:
            q.push(r)
            self.index[r.request.request_id] = r
        if self.scheduler is not None:  # never waits
            with contextlib.suppress(ActorStopped):
                self.scheduler.tell_nowait(WorkQueued())

    def _cancel(self, request_ids: list[str]) -> None:
        """Requests whose client went away leave their queue at once (none is left for the scheduler)."""
        for request_id in request_ids:
            req = self.index.pop(request_id, None)
            if req is not None:
                self.queues[req.request.adapter].remove(req)

    def _take(self, message: Take) -> Taken:
        taken: list[QueuedRequest] = []
        while True:
            # Each tenant's first live request across adapter queues (by priority, then arrival).
            heads: dict[str, QueuedRequest] = {}
            for q in self.queues.values():
                for tenant in list(q.by_tenant):
                    while (h := q.head(tenant)) is not None and h.stream.cancelled:
                        q.pop(tenant)
                        self.index.pop(h.request.request_id, None)
                    if h is not None and (tenant not in heads or _order(h) < _order(heads[tenant])):
                        heads[tenant] = h
            prompts = {t: len(h.request.prompt_token_ids) for t, h in heads.items()}
            tenant = message.pick(prompts) if heads else None
            if tenant is None:
                break
            req = heads[tenant]
            self.queues[req.request.adapter].pop(tenant)
            self.index.pop(req.request.request_id, None)
            taken.append(req)
        return Taken(taken, more=self.depth > 0)

    async def on_stop(self) -> None:
        for q in self.queues.values():
            for reqs in q.by_tenant.values():
                for r in reqs:
                    r.stream.fail(ShuttingDown("the server is shutting down"))
        self.queues.clear()
        self.index.clear()
