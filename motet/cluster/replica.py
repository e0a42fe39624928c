"""One engine replica: a Ray Serve deployment around a ServingSystem (the actors and the engine), as
`motet serve` runs it in one process.

`generate(route, specs)` streams one API request: first Admitted (its prompts' token ids) or Refused (the
ServingError a single-process server would have answered), then (stream index, OutputDelta) as the engine
produces them. A cancelled stream (its client went away) aborts what still runs. `prefill(route, specs)` is a
prefill replica's call under disaggregation (motet/cluster/disaggregation.py): the prompt computed, its blocks
in the shared KV tier, then PrefillDone (or Refused). `record_routing_stats`
is the replica's report to the routers (motet/cluster/reports.py), made of its serving system's stats: what the
engine's caches hold comes in them as a value the engine's thread made (EngineStats.cache), for the replica holds
no engine; with it, now and then, the replica drops the adapters the shared store no longer has
(motet/cluster/shared_adapter_store.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio.to_thread
from ray import serve

from motet.actors.messages import GenerateSpec
from motet.actors.reply import merge_streams
from motet.actors.serving_errors import ServingError, model_not_found
from motet.actors.system import ServingSystem
from motet.cluster.disaggregation import PrefillDone, prefill_spec
from motet.cluster.reports import REPORT_PERIOD_S, ReplicaReport
from motet.cluster.routing_policy import RouteRequest
from motet.cluster.shared_adapter_store import SharedAdapterStore
from motet.engine.config import EngineConfig
from motet.lora.manager import AdapterRef

log = logging.getLogger("motet.replica")

SWEEP_PERIOD_S = 2.0  # how often a replica looks for deleted adapters among those it holds


@dataclass
class ReplicaSettings:
    engine_config: EngineConfig
    loras: dict[str, Path] = field(default_factory=dict)  # shared adapters (--lora), registered at start
    max_queue_len: int = 256
    max_waiting: int = 16
    adapter_store: str | None = None  # an fsspec URL; None: adapters are read where their refs point
    adapter_cache_dir: str | None = None


@dataclass
class Admitted:
    replica: str
    prompts: list[tuple[list[int], str]]  # per spec: its prompt's token ids and rendered text


@dataclass
class Refused:
    error: ServingError


class EngineReplica:
    async def __init__(self, settings: ReplicaSettings):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.system = ServingSystem.of_config(
            settings.engine_config,
            max_queue_len=settings.max_queue_len,
            max_waiting=settings.max_waiting,
            loras=settings.loras,
            cache_period_s=REPORT_PERIOD_S,  # its stats tell what its caches hold, for the report
        )
        self.store = SharedAdapterStore(settings.adapter_store, settings.adapter_cache_dir)
        self.report: ReplicaReport | None = None
        self.swept_at = 0.0
        self.dropped: set[int] = set()  # adapter versions removed after their deletion
        self.running = asyncio.get_running_loop().create_task(self.system.run())
        while not self.system.ready:
            if self.running.done():
                self.running.result()  # the start-up failure (e.g. the model did not load)
                raise RuntimeError("the serving system stopped while starting")
            await asyncio.sleep(0.05)
        log.info("replica %s ready", self.replica_id)

    async def generate(self, route: RouteRequest, specs: list[GenerateSpec]) -> AsyncIterator:
        try:
            specs = [await self._local_adapter(s) for s in specs]
            admissions = await self.system.submit_all(specs)
        except ServingError as e:
            yield Refused(e)
            return
        yield Admitted(self.replica_id, [(a.prompt_token_ids, a.prompt_text) for a in admissions])
        streams = [s for a in admissions for s in a.streams]
        try:
            async for item in merge_streams(streams):
                yield item
        finally:  # finished, or cancelled by the ingress: abort what still runs
            for s in streams:
                if not s.closed:
                    s.cancel()
                    self.system.abort(s.request_id)

    async def prefill(self, route: RouteRequest, specs: list[GenerateSpec]) -> PrefillDone | Refused:
        """Compute the prompt's KV and wait until its full blocks are in the shared tier (the finished request's
        blocks are written through by the KV connector's saver thread: `wait_saved`)."""
        t0 = time.monotonic()
        try:
            spec = await self._local_adapter(prefill_spec(specs[0]))
            (admission,) = await self.system.submit_all([spec])
        except ServingError as e:
            return Refused(e)
        streams = admission.streams
        try:
            async for _, delta in merge_streams(streams):
                if delta.error is not None:
                    return Refused(delta.error)
        finally:  # cancelled by the ingress (its client went away): abort what still runs
            for s in streams:
                if not s.closed:
                    s.cancel()
                    self.system.abort(s.request_id)
        held = await self.system.shared_prefix(route.block_hashes)
        return PrefillDone(self.replica_id, len(admission.prompt_token_ids), held, time.monotonic() - t0)

    async def _local_adapter(self, spec: GenerateSpec) -> GenerateSpec:
        if spec.adapter is None:
            return spec
        try:
            ref = await anyio.to_thread.run_sync(self.store.local, spec.adapter)
        except (FileNotFoundError, OSError):  # deleted from the store since the ingress resolved it
            raise model_not_found(spec.adapter.model) from None
        return dataclasses.replace(spec, adapter=ref)

    # -- Serve's hooks --------------------------------------------------------------------------------
    async def record_routing_stats(self) -> dict:
        stats = self.system.stats()
        # what the engine's caches held as of a recent step, made on its thread (cache_period_s: always there)
        cache = stats.cache
        stats = dataclasses.replace(stats, cache=None)  # (the report carries it once, as blocks and adapters)
        blocks, adapters = cache.blocks, cache.adapters
        last = self.report
        # A report that differs is broadcast to every handle: idle steps alone do not make one.
        same = last is not None and dataclasses.replace(last.stats, steps=stats.steps) == stats
        if not same or (last.blocks, last.adapters) != (blocks, adapters):
            seq = last.seq + 1 if last else 1
            self.report = ReplicaReport(self.replica_id, seq, stats, blocks, adapters, cache.adapter_slots)
        if time.monotonic() - self.swept_at > SWEEP_PERIOD_S:
            self.swept_at = time.monotonic()
            await self._drop_deleted_adapters(cache.referenced)
        return self.report.to_dict()

    async def _drop_deleted_adapters(self, referenced: tuple[AdapterRef, ...]) -> None:
        """Remove the adapters requests named by reference that the shared store no longer has."""
        refs = [r for r in referenced if r.uid not in self.dropped]
        if not refs:
            return
        gone = await anyio.to_thread.run_sync(lambda: [r for r in refs if self.store.deleted(r)])
        for ref in gone:
            log.info("adapter %s was deleted from the store: dropping it", ref.name)
            self.dropped.add(ref.uid)
            self.system.remove_lora(ref.name)
            self.store.forget(ref.name)

    async def check_health(self) -> None:
        if self.running.done():
            raise RuntimeError("the serving system stopped")

    async def __del__(self):
        with anyio.move_on_after(10):
            await self.system.stop()
        self.running.cancel()
