"""Prometheus metrics, one registry per app (tests run several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actors.system import Stats

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
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

    def refresh(self, stats: Stats | None) -> None:
        if stats is None:
            return
        self.queued.set(stats.queued)
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_free.set(stats.kv_blocks_free)
        q = stats.prefix_cache_queries
        self.prefix_hit_rate.set(stats.prefix_cache_hits / q if q else 0.0)
        self.preemptions.set(stats.preemptions)
        self.adapters_pinned.set(stats.adapters_pinned)
        spec = stats.speculative
        self.spec_drafted.set(spec.drafted_tokens)
        self.spec_accepted.set(spec.accepted_tokens)
        self.spec_acceptance.set(spec.accepted_tokens / spec.drafted_tokens if spec.drafted_tokens else 0.0)
        rows = spec.verified_rows
        self.spec_mean_accepted.set((spec.accepted_tokens + rows) / rows if rows else 0.0)
        for proposer, hits in (("ngram", spec.ngram_hits), ("grammar", spec.grammar_hits)):
            self.spec_hit_rate.labels(proposer).set(hits / spec.proposals if spec.proposals else 0.0)
        self.spec_priced_out.set(spec.priced_out_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
