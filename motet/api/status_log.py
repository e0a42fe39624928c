"""What `motet serve` tells its operator while it runs: while it loads, where no start-up line came for 5 s, which
phase it is in (motet/engine/weights/load_progress.py's heartbeat: importing the engine's libraries is as silent as
it is long on a busy machine); one line when it turns ready (what it serves and with which limits), then every
`interval_s` seconds a line of throughput and load as vLLM logs it, at info while there is activity and at debug when
idle (vLLM's rule: an idle server stays quiet).

`tick()` is called by the server's loop (motet/api/draining.py, about ten times a second); it only reads the
serving system's stats, which the executor refreshes after every step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motet.engine.weights.load_progress import Heartbeat

if TYPE_CHECKING:  # (`motet serve`'s parser reads DEFAULT_INTERVAL_S before the API's modules are imported)
    from motet.actors.front import Stats
    from motet.api.state import ServerState
    from motet.engine.model_view import ModelView

log = logging.getLogger("motet.server")

DEFAULT_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL
REPORT_WAIT_S = 10.0  # replicas report their KV pools shortly after they are up: wait this long for them


@dataclass
class _Mark:
    """The counters at the previous stats line."""

    at: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    active: bool = False


def ready_line(state: ServerState, url: str, stats: Stats) -> str:
    """The facts an operator checks first: the model, where and how it runs, its KV capacity and limits,
    and the adapters."""
    system, model = state.system, state.system.model
    kv_blocks = stats.kv_blocks_used + stats.kv_blocks_free
    kv = f"{kv_blocks * model.block_size} tokens ({kv_blocks} blocks of {model.block_size})"
    replicas = getattr(getattr(system, "cluster", None), "settings", None)
    where = f"device {model.device}, threads {model.num_threads}"
    if replicas is not None:
        where = (
            f"{replicas.replicas} replicas, each on device {model.device} with threads {model.num_threads}"
        )
        kv += " in all"
    name = state.model_name
    if str(model.model_dir) != name:
        name += f" ({model.model_dir})"
    shared = sorted(state.adapters.shared) if state.adapters is not None else []
    adapters = f"adapters: {', '.join(shared) if shared else 'none shared'} (+ tenants' uploads; {memory_line(model)})"
    return (
        f"ready on {url}: model {name}, dtype {model.dtype}, {where}, "
        f"KV cache {kv}, max {model.max_num_seqs} sequences, context {model.max_model_len} tokens, {adapters}"
    )


def memory_line(model: ModelView) -> str:
    """How many adapters the pool holds: its bytes, the count of rank-8 q/v and rank-16 all-module adapters that
    fit, the caps."""
    caps = f"rank <= {model.max_lora_rank}" + (
        f", at most {model.max_loras} running at once" if model.max_loras is not None else ""
    )
    pool = model.adapter_capacity
    if pool is None:  # behind --replicas: each replica has its own pool
        return caps
    return (
        f"{pool.pool_bytes / 2**30:.2f} GiB of adapter memory holds {pool.small} rank-8 "
        f"q_proj/v_proj adapters or {pool.large} rank-16 ones on every module; {caps}"
    )


class StatusLog:
    """`state`: None while the server's state is being built (`motet serve` sets it once it is)."""

    def __init__(
        self, state: ServerState | None, url: str, interval_s: float = DEFAULT_INTERVAL_S, stats: bool = True
    ):
        self.state, self.url = state, url
        self.loading = Heartbeat(logger=log)
        self.interval_s = interval_s
        self.log_stats = stats
        self.ready_at: float | None = None  # when the system was first seen ready
        self.announced = False
        self.mark: _Mark | None = None

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        state = self.state
        if state is None or (state.fatal is None and not state.system.ready):
            self.loading.tick(now)  # (the start-up's own lines keep it quiet)
            return
        if state.fatal is not None:
            return
        if self.announced and not (self.log_stats and now - self.mark.at >= self.interval_s):
            return
        stats = state.system.stats()
        if not self.announced:
            self.ready_at = self.ready_at or now
            if stats.kv_blocks_used + stats.kv_blocks_free == 0 and now - self.ready_at < REPORT_WAIT_S:
                return  # behind --replicas, before the first reports
            log.info("%s", ready_line(state, self.url, stats))
            self.announced = True
            self.mark = _Mark(now, stats.prompt_tokens, stats.generation_tokens,
                              stats.prefix_cache_queries, stats.prefix_cache_hits)  # fmt: skip
            return
        self._log_stats(stats, now)

    def _log_stats(self, stats: Stats, now: float) -> None:
        m, seconds = self.mark, now - self.mark.at
        prompt = (stats.prompt_tokens - m.prompt_tokens) / seconds
        generation = (stats.generation_tokens - m.generation_tokens) / seconds
        queries = stats.prefix_cache_queries - m.prefix_queries
        hits = stats.prefix_cache_hits - m.prefix_hits
        kv_total = stats.kv_blocks_used + stats.kv_blocks_free
        active = bool(prompt or generation or stats.num_running or stats.num_waiting or stats.queued)
        # vLLM's rule: an idle server logs at debug, except the first idle line after activity
        level = logging.INFO if active or m.active else logging.DEBUG
        log.log(
            level,
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt,
            generation,
            stats.num_running,
            stats.num_waiting + stats.queued,
            100 * stats.kv_blocks_used / kv_total if kv_total else 0.0,
            100 * hits / queries if queries else 0.0,
        )
        self.mark = _Mark(now, stats.prompt_tokens, stats.generation_tokens,
                          stats.prefix_cache_queries, stats.prefix_cache_hits, active)  # fmt: skip
