"""The serving system: the four actors wired together, and the small front the API talks to.

    API --Submit--> ingress --Enqueue--> adapter queues <--Take-- scheduler --Step--> executor (engine.step)
                                                  \\--WorkQueued-->/   |
    API <------------- reply streams (merged deltas) ------------------/

Start-up order: executor (loads the model on its thread), scheduler, adapter queues, ingress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from motet.actors.adapter_queues import AdapterQueuesActor
from motet.actors.executor import ExecutorActor
from motet.actors.ingress_actor import IngressActor
from motet.actors.messages import Abort, Admission, Cancel, GenerateSpec, RemoveLora, Submit
from motet.actors.runtime import ActorStopped, ActorSystem
from motet.actors.scheduler_actor import SchedulerActor
from motet.actors.serving_errors import ShuttingDown
from motet.engine.core.kv_connector import KVTierStats
from motet.engine.speculative.proposer import SpeculativeStats
from motet.lora.manager import AdapterStats


@dataclass(frozen=True)
class TenantStats:
    """A tenant with requests in the server, for an admin's /metrics."""

    tenant: str
    position: int  # in the order tenants are served next (0: first)
    virtual_tokens: float  # its virtual token counter: weighted tokens served, over its weight
    queued: int  # requests in the adapter queues
    waiting: int  # admitted to the engine, not yet running
    running: int


@dataclass
class Stats:
    queued: int
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    steps: int
    adapters_pinned: int  # adapter versions held in host memory for unfinished requests
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    queued_adapters: tuple[str, ...] = ()  # adapters of requests in the adapter queues, not yet admitted
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)
    prompt_tokens: int = 0  # processed so far (EngineStats.prompt_tokens)
    generation_tokens: int = 0
    tenants: tuple[TenantStats, ...] = ()  # in the order they are served next (one replica's engine only)
    kv_tiers: tuple[KVTierStats, ...] = ()  # the KV tiers past the device cache (engine.kv_connector)
    adapter_memory: AdapterStats | None = None  # the adapter pool, the host cache, loads (lora/manager.py)
    cpu_kernels: str = ""  # the native CPU step's instruction-set tier (EngineStats.cpu_kernels)


class ServingSystem:
    def __init__(
        self,
        engine_factory: Callable[[], Any],
        max_queue_len: int = 256,
        max_waiting: int = 16,
        loras: dict[str, Path] | None = None,  # adapters registered at start-up: name -> directory
    ):
        self.executor = ExecutorActor(engine_factory, loras)
        self.scheduler = SchedulerActor(self.executor, max_waiting=max_waiting)
        self.queues = AdapterQueuesActor(max_queue_len)
        self.ingress = IngressActor(self.executor, self.queues)
        self.scheduler.queues, self.queues.scheduler = self.queues, self.scheduler
        self.actors = ActorSystem([self.executor, self.scheduler, self.queues, self.ingress])

    @property
    def engine(self):
        return self.executor.engine

    @property
    def ready(self) -> bool:
        return self.actors.started.is_set() and not self.actors.stopped.is_set()

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        await self.actors.run(task_status=task_status)

    async def stop(self) -> None:
        await self.actors.stop()

    async def submit(self, spec: GenerateSpec) -> Admission:
        """Tokenize, validate and queue a request; raises InvalidRequest, QueueFull or ShuttingDown."""
        return (await self.submit_all([spec]))[0]

    async def submit_all(self, specs: list[GenerateSpec]) -> list[Admission]:
        """Several prompts of one API request: every one is queued, or none is (nothing left behind)."""
        try:
            return await self.ingress.ask(Submit(specs))
        except ActorStopped:
            raise ShuttingDown("the server is shutting down") from None

    def abort(self, request_id: str) -> None:
        """Never blocks: a queued request leaves its queue at once, a running one between steps."""
        with contextlib.suppress(ActorStopped):
            self.queues.tell_nowait(Cancel([request_id]))
        with contextlib.suppress(ActorStopped):
            self.scheduler.tell_nowait(Abort(request_id))

    def remove_lora(self, name: str) -> None:
        """Never blocks: the engine forgets the name between steps; requests already using it finish."""
        with contextlib.suppress(ActorStopped):
            self.scheduler.tell_nowait(RemoveLora(name))

    def stats(self) -> Stats:
        """As of the latest step (the engine's own counters are its thread's)."""
        es = self.executor.stats
        return Stats(
            queued=self.queues.depth,
            waiting=es.num_waiting,
            running=es.num_running,
            kv_blocks_used=es.kv_blocks_used,
            kv_blocks_free=es.kv_blocks_free,
            prefix_cache_queries=es.prefix_cache_queries,
            prefix_cache_hits=es.prefix_cache_hits,
            preemptions=es.preemptions,
            steps=es.steps,
            adapters_pinned=es.adapters_pinned,
            adapter_memory=es.adapters,
            running_adapters=es.running_adapters,
            waiting_adapters=es.waiting_adapters,
            queued_adapters=tuple(
                sorted({a.name for a, n in self.queues.depth_by_adapter().items() if a is not None and n})
            ),
            speculative=es.speculative,
            prompt_tokens=es.prompt_tokens,
            generation_tokens=es.generation_tokens,
            tenants=self._tenant_stats(es.tenants),
            kv_tiers=es.kv_tiers,
            cpu_kernels=es.cpu_kernels,
        )

    def _tenant_stats(self, engine_tenants) -> tuple[TenantStats, ...]:
        """The engine's tenants in its order, then those with requests only in the queues (they enter the
        engine at the next step, their counter lifted to the lowest there)."""
        queued = self.queues.depth_by_tenant()
        floor = min((t.virtual_tokens for t in engine_tenants), default=0.0)
        rows = [(t.tenant, t.virtual_tokens, t.waiting, t.running) for t in engine_tenants]
        known = {t.tenant for t in engine_tenants}
        rows += [(t, floor, 0, 0) for t in sorted(queued) if t not in known]
        return tuple(
            TenantStats(tenant, i, vtc, queued.get(tenant, 0), waiting, running)
            for i, (tenant, vtc, waiting, running) in enumerate(rows)
        )
