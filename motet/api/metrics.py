"""Prometheus metrics, one registry per app (tests run several apps in one process).

motet's own series (`motet_*`), and beside them vLLM's names with vLLM's meaning (`vllm:*`), which routers,
autoscalers and vLLM's Grafana dashboard read (Kubernetes' inference gateway, llm-d, Ray): requests waiting
(in the adapter queues or admitted but not running) and running, KV-cache usage (0..1), the LoRA adapters of
running and of waiting requests (`vllm:lora_requests_info`, an info gauge whose value is the time it was set;
adapters named as clients name them, never by tenant), the TTFT / inter-token / end-to-end latency
histograms; the engine's counters (prompt and generation tokens, preemptions, prefix-cache queries and hits,
in tokens); and per finished request its prompt and generation tokens, its finish reason and its queue /
prefill / decode / inference times. Buckets, labels (`model_name`) and help texts are vLLM's
(vllm/v1/metrics/loggers.py); deploy/grafana/motet.json is the dashboard that reads them. Per tenant, for an
admin: each tenant's virtual token counter, its requests queued, waiting and running, and its position in
the order tenants are served next (motet/engine/core/fairness.py), and its fine-tuning jobs' validations (queued or
refused) and the CPU time they took. Per KV tier past the device cache (`tier`: ram,
disk; motet/engine/core/kv_connector.py): the bytes and blocks it holds and may hold, the prompt tokens and bytes
loaded from it instead of recomputed, the blocks and bytes saved to it, the entries dropped as corrupt, and
the loads' latency. The native CPU step's kernels: the instruction-set tier they run (`motet_cpu_kernels_info`). Adapter memory (`motet_lora_*`): the pool's bound and the bytes and adapters resident in it,
how many adapters fit, the host cache, and the loads, placements, evictions, hits and misses so far.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from motet.actors.front import Stats
from motet.engine.core.kv_connector import LOAD_BUCKETS
from motet.engine.outputs import RequestTimings

# vLLM's buckets for its latency histograms (vllm/v1/metrics/loggers.py)
_VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
              40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0)  # fmt: skip
_VLLM_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
             480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason: request_success's finished_reason
DEFAULT_MAX_MODEL_LEN = 1 << 16  # the token histograms' top bucket when the context length is not known


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for its token-count histograms: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, model_name: str = "", max_model_len: int | None = None):
        r = self.registry = CollectorRegistry()
        self._model_name = model_name  # the `model_name` label of the vLLM series
        self.stats: Stats | None = None  # as of the latest refresh
        self.requests = Counter(
            "motet_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "motet_time_to_first_token_seconds", "time to first token", buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "motet_time_per_output_token_seconds",
            "time per output token after the first",
            buckets=_PER_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            "motet_e2e_request_latency_seconds",
            "request latency, arrival to last token",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter("motet_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("motet_generation_tokens", "generated tokens", registry=r)
        self.queued = Gauge("motet_queue_depth", "requests waiting in the adapter queues", registry=r)
        self.waiting = Gauge("motet_num_requests_waiting", "requests admitted, waiting to run", registry=r)
        self.running = Gauge("motet_num_requests_running", "sequences running in the engine", registry=r)
        self.kv_used = Gauge("motet_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge(
            "motet_kv_blocks_free", "KV cache blocks free (cached prefixes included)", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "motet_prefix_cache_hit_rate", "prompt tokens found in the prefix cache", registry=r
        )
        self.preemptions = Gauge("motet_preemptions", "sequences preempted so far", registry=r)
        self.adapters_pinned = Gauge(
            "motet_lora_adapters_pinned", "adapters held for unfinished requests", registry=r
        )
        # Adapter memory (motet/lora/manager.py): the pool bounded by bytes, the host cache, loads so far.
        self.lora = {
            name: Gauge(f"motet_lora_{name}", text, registry=r)
            for name, text in (
                ("memory_bytes", "bytes of the resident adapters' pool (their bound)"),
                ("resident_bytes", "bytes of the pool the resident adapters take"),
                ("resident_adapters", "adapters resident in the pool"),
                (
                    "capacity_adapters",
                    "adapters of the resident ones' mean size (rank-8 q/v if none) the pool holds",
                ),
                ("host_bytes", "bytes of loaded adapters in the host cache"),
                ("host_adapters", "loaded adapters in the host cache"),
                ("loading_adapters", "adapters being loaded from disk"),
                ("disk_loads", "adapters read from disk so far"),
                ("placements", "adapters copied into the pool so far"),
                ("evictions", "adapters evicted from the pool so far"),
                ("hits", "requests whose adapter was resident when they arrived, so far"),
                ("misses", "requests whose adapter was not resident when they arrived, so far"),
            )
        }
        # Speculative decoding, over the server's life (zero while it is off).
        self.spec_drafted = Gauge("motet_spec_draft_tokens", "draft tokens verified", registry=r)
        self.spec_accepted = Gauge("motet_spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.spec_acceptance = Gauge(
            "motet_spec_acceptance_rate", "accepted share of the verified draft tokens", registry=r
        )
        self.spec_mean_accepted = Gauge(
            "motet_spec_mean_accepted_length",
            "tokens a row gains per verification step (accepted drafts + the target's own token)",
            registry=r,
        )
        self.spec_hit_rate = Gauge(
            "motet_spec_proposer_hit_rate", "rows asked for drafts that got some, by proposer", ["proposer"],
            registry=r,
        )  # fmt: skip
        self.spec_priced_out = Gauge(
            "motet_spec_priced_out_tokens",
            "drafts proposed but not worth verifying in their step",
            registry=r,
        )

        # Fairness between tenants (one series per tenant with requests in the server; none once it is idle).
        self.tenant_virtual_tokens = Gauge(
            "motet_tenant_virtual_tokens",
            "the tenant's virtual token counter: weighted tokens served over its weight (the lowest goes first)",
            ["tenant"],
            registry=r,
        )
        self.tenant_requests = Gauge(
            "motet_tenant_requests", "the tenant's requests by state: queued, waiting, running", ["tenant", "state"],
            registry=r,
        )  # fmt: skip
        self.tenant_position = Gauge(
            "motet_tenant_queue_position", "the tenant's place in the order tenants are served next (0: first)",
            ["tenant"], registry=r,
        )  # fmt: skip
        # What checking fine-tuning jobs' files costs each tenant, queued or refused (motet/api/fine_tuning/routes.py)
        self.fine_tuning_validations = Counter(
            "motet_fine_tuning_validations", "fine-tuning jobs whose files were checked, by outcome: queued, refused",
            ["tenant", "outcome"], registry=r,
        )  # fmt: skip
        self.fine_tuning_validation_cpu = Counter(
            "motet_fine_tuning_validation_cpu_seconds", "the server's CPU time checking the tenant's fine-tuning jobs' "
            "files (counting, tokenizing)", ["tenant"], registry=r,
        )  # fmt: skip

        model = ["model_name"]
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", model, registry=r
        )
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", model, registry=r
        )
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", model, registry=r
        )
        self.cpu_kernels_info = Gauge(
            "motet_cpu_kernels_info",
            "the instruction-set tier of the native CPU step's kernels (1; no series where it does not run)",
            ["isa"],
            registry=r,
        )
        self.vllm_lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            [
                "model_name",
                "max_lora",
                "running_lora_adapters",
                "waiting_lora_adapters",
            ],  # model_name: motet's
            # addition (vLLM's series lacks it; dashboards filter every series by it)
            registry=r,
        )
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model,
            buckets=_VLLM_TTFT,
            registry=r,
        )
        self.vllm_itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            model,
            buckets=_VLLM_ITL,
            registry=r,
        )
        self.vllm_tpot = Histogram(  # vLLM's older name for the same per-token latency
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            model,
            buckets=_VLLM_ITL,
            registry=r,
        )
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            model,
            buckets=_VLLM_E2E,
            registry=r,
        )
        self._vllm_request_series(r, max_model_len or DEFAULT_MAX_MODEL_LEN)
        r.register(EngineCounters(self))
        r.register(KVTierSeries(self))
        self.model_name = model_name

    def _vllm_request_series(self, r: CollectorRegistry, max_model_len: int) -> None:
        """vLLM's per-request series beyond the latencies: what its Grafana dashboard plots."""
        model, tokens = ["model_name"], token_buckets(max_model_len)
        self.vllm_request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            model,
            buckets=_VLLM_ITL,
            registry=r,
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*model, "finished_reason"],
            registry=r,
        )
        self.vllm_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            model,
            buckets=tokens,
            registry=r,
        )
        self.vllm_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            model,
            buckets=tokens,
            registry=r,
        )
        self.vllm_max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            model,
            buckets=tokens,
            registry=r,
        )
        phases = {
            "queue": "Histogram of time spent in WAITING phase for request.",
            "prefill": "Histogram of time spent in PREFILL phase for request.",
            "decode": "Histogram of time spent in DECODE phase for request.",
            "inference": "Histogram of time spent in RUNNING phase for request.",
        }
        self.vllm_phases = {
            phase: Histogram(f"vllm:request_{phase}_time_seconds", doc, model, buckets=_VLLM_E2E, registry=r)
            for phase, doc in phases.items()
        }

    @property
    def model_name(self) -> str:
        return self._model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        """As in vLLM, every series of the model is there from the start (at zero)."""
        self._model_name = name
        if not name:
            return
        for reason in FINISH_REASONS:
            self.vllm_success.labels(name, reason)
        for h in (
            self.vllm_ttft,
            self.vllm_itl,
            self.vllm_tpot,
            self.vllm_e2e,
            self.vllm_request_tpot,
            self.vllm_prompt_tokens,
            self.vllm_generation_tokens,
            self.vllm_max_generation_tokens,
            *self.vllm_phases.values(),
        ):
            h.labels(name)

    def observe_request(
        self,
        ttft: float,
        e2e: float,
        token_gaps: list[tuple[float, int]],
        *,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
        finish_reason: str | None = None,
        timings: RequestTimings | None = None,
    ) -> None:
        """One finished request (one choice) in the vLLM series; `token_gaps` holds (seconds per token,
        tokens) for each output delta after the first; `timings` are the engine's (None: not reported)."""
        name = self.model_name
        self.vllm_ttft.labels(name).observe(ttft)
        self.vllm_e2e.labels(name).observe(e2e)
        for seconds, tokens in token_gaps:
            for _ in range(tokens):
                self.vllm_itl.labels(name).observe(seconds)
                self.vllm_tpot.labels(name).observe(seconds)
        # vLLM: (e2e - TTFT) / (output tokens - 1), zero for a request of at most one token
        tpot = (e2e - ttft) / (generation_tokens - 1) if generation_tokens > 1 else 0.0
        self.vllm_request_tpot.labels(name).observe(tpot)
        self.vllm_prompt_tokens.labels(name).observe(prompt_tokens)
        self.vllm_generation_tokens.labels(name).observe(generation_tokens)
        if finish_reason is not None:
            self.vllm_success.labels(name, finish_reason).inc()
        if timings is not None:
            for phase, seconds in (
                ("queue", timings.queue_s),
                ("prefill", timings.prefill_s),
                ("decode", timings.decode_s),
                ("inference", timings.inference_s),
            ):
                self.vllm_phases[phase].labels(name).observe(seconds)

    def observe_fine_tuning_validation(self, tenant: str, outcome: str, cpu_s: float) -> None:
        """A fine-tuning job's files checked: it was queued or refused, after `cpu_s` of CPU time."""
        self.fine_tuning_validations.labels(tenant, outcome).inc()
        self.fine_tuning_validation_cpu.labels(tenant).inc(cpu_s)

    def observe_abort(self) -> None:
        """One choice its client cut before the engine finished it: vLLM's `abort` finish (no latency or token
        histogram: they describe the requests that finished)."""
        self.vllm_success.labels(self.model_name, "abort").inc()

    def observe_group(self, max_generation_tokens: int) -> None:
        """The choices of one prompt (`n` of them) have all finished: the most tokens one generated."""
        self.vllm_max_generation_tokens.labels(self.model_name).observe(max_generation_tokens)

    def refresh(self, stats: Stats | None, max_loras: int | None = None) -> None:
        """The gauges from the latest stats; `max_loras`: the cap vLLM's lora info names (None: the adapters that
        fit in memory)."""
        if stats is None:
            return
        self.stats = stats
        self.vllm_waiting.labels(self.model_name).set(stats.queued + stats.num_waiting)
        self.vllm_running.labels(self.model_name).set(stats.num_running)
        total = stats.kv_blocks_used + stats.kv_blocks_free
        self.vllm_kv_usage.labels(self.model_name).set(stats.kv_blocks_used / total if total else 0.0)
        running = _client_names(stats.running_adapters)
        waiting = _client_names(stats.waiting_adapters + stats.queued_adapters) - running
        self.vllm_lora_info.clear()  # one series: the current sets (vLLM keeps one per combination seen)
        cap = max_loras if max_loras is not None else getattr(stats.adapters, "capacity", 0)
        self.vllm_lora_info.labels(
            self.model_name, str(cap), ",".join(sorted(running)), ",".join(sorted(waiting))
        ).set(time.time())
        self.cpu_kernels_info.clear()
        if stats.cpu_kernels:
            self.cpu_kernels_info.labels(stats.cpu_kernels).set(1)
        self.queued.set(stats.queued)
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_free.set(stats.kv_blocks_free)
        q = stats.prefix_cache_queries
        self.prefix_hit_rate.set(stats.prefix_cache_hits / q if q else 0.0)
        self.preemptions.set(stats.preemptions)
        self.adapters_pinned.set(stats.adapters_pinned)
        a = stats.adapters
        if a is not None:
            values = {"memory_bytes": a.memory_bytes, "resident_bytes": a.resident_bytes,
                      "resident_adapters": a.resident, "capacity_adapters": a.capacity, "host_bytes": a.host_bytes,
                      "host_adapters": a.host, "loading_adapters": a.loading, "disk_loads": a.disk_loads,
                      "placements": a.placements, "evictions": a.evictions, "hits": a.hits, "misses": a.misses}  # fmt: skip
            for name, value in values.items():
                self.lora[name].set(value)
        spec = stats.speculative
        self.spec_drafted.set(spec.drafted_tokens)
        self.spec_accepted.set(spec.accepted_tokens)
        self.spec_acceptance.set(spec.accepted_tokens / spec.drafted_tokens if spec.drafted_tokens else 0.0)
        rows = spec.verified_rows
        self.spec_mean_accepted.set((spec.accepted_tokens + rows) / rows if rows else 0.0)
        hits_by = (("ngram", spec.ngram_hits), ("grammar", spec.grammar_hits), ("history", spec.history_hits))
        for proposer, hits in hits_by:
            self.spec_hit_rate.labels(proposer).set(hits / spec.proposals if spec.proposals else 0.0)
        self.spec_priced_out.set(spec.priced_out_tokens)
        self._refresh_tenants(getattr(stats, "tenants", ()))

    def _refresh_tenants(self, tenants) -> None:
        for gauge in (self.tenant_virtual_tokens, self.tenant_requests, self.tenant_position):
            gauge.clear()  # tenants that went idle leave the page
        for t in tenants:
            self.tenant_virtual_tokens.labels(t.tenant).set(t.virtual_tokens)
            self.tenant_position.labels(t.tenant).set(t.position)
            for state in ("queued", "waiting", "running"):
                self.tenant_requests.labels(t.tenant, state).set(getattr(t, state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsCollector(Collector):
    """A collector of series read from the figures of the latest refresh (`metrics.stats`)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics


def families(family_type, series, label: str, samples):
    """A metric family of `family_type` a (name, help, field) of `series`, labelled by `label`: a sample a (label
    value, figures) of `samples`, the figures' field (0 where the figures are None)."""
    for metric, help_, field in series:
        family = family_type(metric, help_, labels=[label])
        for value, figures in samples:
            family.add_metric([value], getattr(figures, field) if figures is not None else 0)
        yield family


class EngineCounters(StatsCollector):
    """vLLM's engine counters, from the engine's own cumulative figures (summed over the replicas) as of the
    latest refresh: a collector, since the engine counts and this only reports."""

    SERIES = (  # name (exposed with _total), help, Stats field
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
        ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            "prefix_cache_queries",
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            "prefix_cache_hits",
        ),
    )

    def collect(self):
        name = self.metrics.model_name
        yield from families(
            CounterMetricFamily, self.SERIES, "model_name", [(name, self.metrics.stats)] if name else []
        )


class KVTierSeries(StatsCollector):
    """The KV tiers' figures (motet/engine/kv_connector.KVTierStats), labelled by tier, as of the latest
    refresh; no series when no tier is on."""

    GAUGES = (  # name, help, KVTierStats field
        ("motet_kv_tier_bytes", "bytes of KV blocks the tier holds", "bytes"),
        ("motet_kv_tier_blocks", "KV blocks the tier holds", "blocks"),
        ("motet_kv_tier_capacity_bytes", "the tier's bound, in bytes", "capacity_bytes"),
    )
    COUNTERS = (  # name (exposed with _total), help, KVTierStats field
        (
            "motet_kv_tier_hit_tokens",
            "prompt tokens loaded from the tier instead of recomputed",
            "hit_tokens",
        ),
        ("motet_kv_tier_loaded_bytes", "bytes of KV loaded from the tier", "loaded_bytes"),
        ("motet_kv_tier_saved_blocks", "KV blocks saved to the tier", "saved_blocks"),
        ("motet_kv_tier_saved_bytes", "bytes of KV saved to the tier", "saved_bytes"),
        (
            "motet_kv_tier_dropped_entries",
            "entries found corrupt, truncated or written for another model, deleted (their tokens recomputed)",
            "dropped_entries",
        ),
    )

    def collect(self):
        tiers = getattr(self.metrics.stats, "kv_tiers", ())
        if not tiers:
            return
        samples = [(t.tier, t) for t in tiers]
        yield from families(GaugeMetricFamily, self.GAUGES, "tier", samples)
        yield from families(CounterMetricFamily, self.COUNTERS, "tier", samples)
        family = HistogramMetricFamily(
            "motet_kv_tier_load_seconds",
            "a request's load of KV blocks, by the slowest tier it read",
            labels=["tier"],
        )
        for t in tiers:
            buckets = [(f"{le:g}", n) for le, n in zip(LOAD_BUCKETS, t.load_seconds_buckets, strict=True)]
            family.add_metric([t.tier], [*buckets, ("+Inf", t.loads)], t.load_seconds_sum)
        yield family


def _client_names(engine_names) -> set[str]:
    """Adapters as clients name them (`model`), without the tenant part of uploads' engine names."""
    return {name.rsplit("/", 1)[-1] for name in engine_names}
