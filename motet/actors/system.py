"""The serving system: the four actors wired together behind the front the API talks to (ServingFront,
motet/actors/front.py).

    API --Submit--> ingress --Enqueue--> adapter queues <--Take-- scheduler --Step--> executor (engine.step)
                                                  \\--WorkQueued-->/   |
    API <------------- reply streams (merged deltas) ------------------/

Start-up order: executor (loads the model on its thread), scheduler, adapter queues, ingress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from motet.actors.adapter_queues import AdapterQueuesActor
from motet.actors.executor import ExecutorActor
from motet.actors.front import Stats, TenantStats
from motet.actors.ingress_actor import IngressActor
from motet.actors.messages import Abort, Admission, Cancel, GenerateSpec, RemoveLora, Submit
from motet.actors.runtime import ActorStopped, ActorSystem
from motet.actors.scheduler_actor import SchedulerActor
from motet.actors.serving_errors import ShuttingDown
from motet.actors.training_lease import TrainingLease
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import EngineStats, LLMEngine
from motet.engine.model_view import ModelView


class ServingSystem:
    """The local ServingFront: the actors and one engine in this process."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        max_queue_len: int = 256,
        max_waiting: int = 16,
        loras: dict[str, Path] | None = None,  # adapters registered at start-up: name -> directory
        cache_period_s: float | None = None,  # how often its stats tell what the caches hold (a replica's)
        lease: TrainingLease | None = None,  # fine-tuning workers the engine lends the cores to between steps
    ):
        self.executor = ExecutorActor(engine_factory, loras, cache_period_s, lease=lease)
        self.scheduler = SchedulerActor(self.executor, max_waiting=max_waiting)
        self.queues = AdapterQueuesActor(max_queue_len)
        self.ingress = IngressActor(self.executor, self.queues)
        self.scheduler.queues, self.queues.scheduler = self.queues, self.scheduler
        self.actors = ActorSystem([self.executor, self.scheduler, self.queues, self.ingress])

    @classmethod
    def of_config(cls, config: EngineConfig, **kwargs) -> ServingSystem:
        """A serving system around one engine of `config` (built on the engine's thread as it starts)."""
        return cls(lambda: LLMEngine(config), **kwargs)

    @property
    def model(self) -> ModelView:
        """The served model as the API sees it (built once the engine has loaded)."""
        return self.executor.model

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

    async def shared_prefix(self, block_hashes: tuple[int, ...]) -> int:
        """How many of the leading blocks the shared KV tier holds once the engine's KV connector has written
        what finished requests left it (a prefill replica's answer); 0 without one. On a worker thread: that
        half of the connector is thread-safe, and the engine's steps go on meanwhile."""
        return await anyio.to_thread.run_sync(self.executor.engine.kv_connector.shared_prefix, block_hashes)

    def stats(self) -> Stats:
        """As of the latest step (the engine's own counters are its thread's)."""
        es = self.executor.stats
        engine = {f.name: getattr(es, f.name) for f in fields(EngineStats)}
        queued = {a.name for a, n in self.queues.depth_by_adapter().items() if a is not None and n}
        return Stats(
            **{**engine, "tenants": self._tenant_stats(es.tenants)},
            queued=self.queues.depth,
            queued_adapters=tuple(sorted(queued)),
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
