"""The ingress side of scale-out: the API's serving system when engines run as Ray Serve replicas.

ClusterSystem is a ServingFront (motet/actors/front.py), as the local actors.system.ServingSystem is, so the app,
its auth, tenants, adapters and metrics are the same. Its `model` is the ModelView (motet/engine/model_view.py) of
what the replicas are built from (their ReplicaSettings: the engine configuration and the model's directory), read
from the model's files here without its weights. A submission is hashed into its route
(motet/cluster/prompt_blocks.py) and sent, through the Serve handle and its router (motet/cluster/router.py), to
one replica as one streaming call; the replica's Admitted answers the API, its deltas go onto local reply streams.

Under prefill/decode disaggregation (motet/cluster/disaggregation.py) a request whose prompt is worth it first
goes to a prefill replica, whose answer says how many of its blocks the shared KV tier holds; then, as above, to
a decode replica. A prefill that fails in any way (replica lost, busy, too slow) only costs its time: the decode
replica computes what is missing. A request the prefill replica refuses as bad input gets that answer.

Faults: a replica that dies before a request's first token (in its queue, or while admitting it) costs
nothing: the request is sent again, to another replica. Once tokens have reached the client, the streams
end with a clean error (an SSE error event). No wait is unbounded: admission has a time limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup, TaskStatus

from motet.actors.front import Stats
from motet.actors.messages import Admission, GenerateSpec
from motet.actors.reply import ReplyStream
from motet.actors.serving_errors import EngineFailure, ServerBusy, ServingError, ShuttingDown
from motet.cluster import reports
from motet.cluster.disaggregation import PrefillDone, wants_prefill
from motet.cluster.launch import Cluster, ClusterThread, reclaim_sigterm
from motet.cluster.prompt_blocks import route_hashes
from motet.cluster.replica import Admitted, Refused
from motet.cluster.reports import total_stats
from motet.cluster.routing_policy import RouteRequest
from motet.cluster.shared_adapter_store import SharedAdapterStore
from motet.engine.model_view import ModelView

log = logging.getLogger("motet.ingress")

MAX_ATTEMPTS = 3  # replicas a request may be sent to before it fails
ADMISSION_TIMEOUT_S = 120.0  # no replica admitted it in this time (none is up): 503
PREFILL_TIMEOUT_S = 120.0  # a prefill that takes longer is given up: the decode replica computes the prompt


class ReplicaLost(ServingError):
    """The replica serving (or about to serve) the request died: a 503, the request may be sent again."""

    status = 503
    type = "service_unavailable"


def _replica_lost(e: BaseException) -> bool:
    """The replica died or became unreachable (its request may be sent elsewhere)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(e, RayActorError | ActorUnavailableError)


@dataclass
class _Call:
    """One API request in flight on a replica."""

    specs: list[GenerateSpec]
    route: RouteRequest
    streams: list[ReplyStream]
    attempts: int = 0
    started: bool = False  # a token has reached a reply stream: no second attempt
    response: object = None  # the Serve streaming response
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)

    @property
    def abandoned(self) -> bool:
        return all(s.cancelled or s.closed for s in self.streams)


class ClusterSystem:
    """The ServingFront behind --replicas: engine replicas on Ray Serve, this process their ingress."""

    def __init__(self, cluster: Cluster, store: SharedAdapterStore):
        self.cluster, self.store = cluster, store
        self.config = (
            cluster.replica_settings.engine_config
        )  # the replicas' (its model resolved to a directory)
        self._model: ModelView | None = None
        self.handle = None
        self.prefill_handle = None  # the prefill pool's, under disaggregation
        self.pd = PDCounters()
        self.calls: dict[str, _Call] = {}  # request id -> its call
        self._tg: TaskGroup | None = None
        self._stopped = anyio.Event()

    @property
    def model(self) -> ModelView:
        """The replicas' model as the API sees it (read once Ray is up, before the first request)."""
        if self._model is None:
            raise RuntimeError("the model is read when the cluster has started")
        return self._model

    @property
    def ready(self) -> bool:
        return self.handle is not None and not self._stopped.is_set()

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        owner = ClusterThread(self.cluster)
        owner.start()
        try:
            await anyio.to_thread.run_sync(owner.connected.wait, abandon_on_cancel=True)
            reclaim_sigterm()  # on the event loop's thread: the main one when serving
            await anyio.to_thread.run_sync(owner.started.wait, abandon_on_cancel=True)
            if owner.error is not None:
                raise owner.error
            config = self.config
            self._model = await anyio.to_thread.run_sync(ModelView.from_files, config, Path(config.model))
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self.prefill_handle = self.cluster.prefill_handle
                self.handle = owner.handle
                task_status.started()
                await self._stopped.wait()
                tg.cancel_scope.cancel()
        finally:
            self.handle = self.prefill_handle = None
            owner.finish()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(owner.join)

    async def stop(self) -> None:
        self._stopped.set()

    # -- requests -------------------------------------------------------------------------------------
    async def submit(self, spec: GenerateSpec) -> Admission:
        return (await self.submit_all([spec]))[0]

    async def submit_all(self, specs: list[GenerateSpec]) -> list[Admission]:
        """Route and admit every spec of one API request on one replica (all or none, as there)."""
        if not self.ready or self._tg is None:
            raise ShuttingDown("the server is shutting down")
        spec = specs[0]
        tok, config = self.model.tokenizer, self.config
        hashes = await anyio.to_thread.run_sync(
            route_hashes, tok, spec, config.block_size, config.shared_prefix_cache
        )
        for s in specs:
            if s.adapter is not None:
                await anyio.to_thread.run_sync(self.store.publish, s.adapter)
        adapter = spec.adapter.uid if spec.adapter is not None else 0
        streams = [ReplyStream(rid) for s in specs for rid in s.request_ids]
        call = _Call(specs, RouteRequest(hashes, adapter), streams)
        if self.prefill_handle is not None and wants_prefill(specs, hashes):
            await self._prefill(call)
        try:
            admitted = await self._admit(call)
        except BaseException:  # refused, or the client went away meanwhile: nothing may run on
            if call.response is not None:
                call.response.cancel()
            raise
        for s in streams:
            self.calls[s.request_id] = call
        self._tg.start_soon(self._relay, call)
        admissions, i = [], 0
        for s, (prompt_ids, text) in zip(specs, admitted.prompts, strict=True):
            admissions.append(Admission(prompt_ids, streams[i : i + len(s.request_ids)], text))
            i += len(s.request_ids)
        return admissions

    async def _prefill(self, call: _Call) -> None:
        """The prompt's KV computed on a prefill replica and put in the shared tier; the call's route then says
        how many of its blocks are there. Any failure but a refusal of the request itself leaves the prompt to
        the decode replica."""
        rid = call.streams[0].request_id
        response = self.prefill_handle.prefill.remote(call.route, call.specs)
        try:
            with anyio.fail_after(PREFILL_TIMEOUT_S):
                done = await response
        except BaseException as e:
            response.cancel()
            if not isinstance(e, Exception):  # cancelled: the client went away
                raise
            # A lost prefill replica is not retried: the decode replica computing the prompt costs less than
            # waiting for another prefill replica (or this one's replacement).
            log.warning("the prefill of %s failed (%r): the decode replica computes it", rid, e)
            self.pd.fallbacks += 1
            return
        if isinstance(done, Refused):
            if 400 <= done.error.status < 500 and done.error.status != 429:
                raise done.error  # the request's own fault: the decode replica would say the same
            log.warning("the prefill of %s was refused (%s): the decode replica computes it", rid, done.error)
            self.pd.fallbacks += 1
            return
        self.pd.record(done)
        call.route = dataclasses.replace(call.route, shared_blocks=done.shared_blocks)

    async def _admit(self, call: _Call) -> Admitted:
        """Send the call to a replica and wait for its admission; again elsewhere if that replica is lost."""
        while True:
            call.attempts += 1
            call.response = self.handle.options(stream=True).generate.remote(call.route, call.specs)
            try:
                with anyio.fail_after(ADMISSION_TIMEOUT_S):
                    first = await call.response.__anext__()
            except TimeoutError:
                call.response.cancel()
                raise ServerBusy(
                    f"no engine replica took the request within {ADMISSION_TIMEOUT_S:.0f} s"
                ) from None
            except Exception as e:
                if not _replica_lost(e):
                    log.error("request %s failed on its way to a replica: %r", call.streams[0].request_id, e)
                    raise EngineFailure("the request could not reach an engine replica") from None
                if call.attempts >= MAX_ATTEMPTS:
                    log.warning("request %s lost %d replicas", call.streams[0].request_id, call.attempts)
                    raise ReplicaLost(
                        f"{call.attempts} engine replicas were lost before taking the request; try again"
                    ) from None
                log.warning(
                    "a replica was lost before admitting %s; sending it again", call.streams[0].request_id
                )
                continue
            if isinstance(first, Refused):
                if isinstance(first.error, ShuttingDown) and call.attempts < MAX_ATTEMPTS:
                    continue  # that replica is draining: another one takes it
                raise first.error
            call.route = dataclasses.replace(call.route, avoid=call.route.avoid | {first.replica})
            return first

    async def _relay(self, call: _Call) -> None:
        """The replica's deltas onto the reply streams; on a lost replica, again elsewhere if no token was
        out yet, else a clean error."""
        try:
            with call.scope:
                while True:
                    try:
                        async for i, delta in call.response:
                            call.started = call.started or bool(delta.token_ids or delta.text)
                            call.streams[i].put(delta)
                        break
                    except Exception as e:
                        retry = _replica_lost(e) and not call.started and not call.abandoned
                        if not retry or call.attempts >= MAX_ATTEMPTS:
                            raise
                        log.warning(
                            "replica lost before %s started; sending it again", call.streams[0].request_id
                        )
                        await self._admit(call)
        except Exception as e:
            if not isinstance(e, ServingError):
                log.warning("request %s lost its replica: %r", call.streams[0].request_id, e)
                stopped = "the engine replica serving this request stopped; try again"
                e = ReplicaLost(stopped) if _replica_lost(e) else EngineFailure(stopped)
            for s in call.streams:
                s.fail(e)
        finally:
            with contextlib.suppress(Exception):
                call.response.cancel()
            for s in call.streams:
                if not s.closed:
                    s.fail(EngineFailure("the engine replica ended the request without finishing it"))
                self.calls.pop(s.request_id, None)

    def abort(self, request_id: str) -> None:
        """Never blocks: once every stream of its call is cancelled or done, the replica's call is cancelled."""
        call = self.calls.get(request_id)
        if call is not None and call.abandoned:
            call.scope.cancel()

    def remove_lora(self, name: str) -> None:
        """Never blocks: the store forgets the adapter; replicas drop it when they see it gone."""
        if self._tg is not None and self.store.url:
            self._tg.start_soon(anyio.to_thread.run_sync, self.store.unpublish, name)

    def stats(self) -> Stats:
        """The replicas' stats summed, as of their latest reports."""
        return total_stats(reports.LATEST.values()) or Stats()

    def replica_metrics(self):
        from motet.cluster.replica_metrics import ReplicaMetrics

        return ReplicaMetrics(reports.LATEST, self.pd if self.cluster.settings.prefill_replicas else None)


@dataclass
class PDCounters:
    """Prefill/decode disaggregation at this ingress (for /metrics)."""

    prefills: int = 0  # prefills done on a prefill replica
    fallbacks: int = 0  # prefills that failed or were refused: the decode replica computed the prompt
    handed_blocks: int = 0  # KV blocks the prefills left in the shared tier for the decode replicas
    prefill_seconds: float = 0.0  # on the prefill replicas, admission to the blocks being in the shared tier

    def record(self, done: PrefillDone) -> None:
        self.prefills += 1
        self.handed_blocks += done.shared_blocks
        self.prefill_seconds += done.seconds
