"""The Grafana dashboard shipped in deploy/grafana/motet.json (vLLM's dashboard, adapted) against a live `motet
serve`: every series its PromQL queries select is on /metrics with samples for the served model, and the values
agree with what the clients were told (usage, finish reasons), after a little load that forces a preemption
(a KV cache of 8 blocks) and a prefix-cache hit. The queries are parsed with promql-parser and the scrape with
prometheus_client's text parser. The same checks run behind `--replicas 2`, where the ingress sums the replicas, on
tests/cluster/test_cluster.py's cluster (one Ray cluster for that module's tests and this check).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import ROOT, Server

DASHBOARD = ROOT / "deploy" / "grafana" / "motet.json"
MODEL = "tiny"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": MODEL}  # what Grafana substitutes
# 8 KV blocks of 16 tokens: four concurrent 40-token answers to ~30-token prompts need 20, so some are preempted
SERVER_FLAGS = ("--served-model-name", MODEL, "--threads", "1", "--num-kv-blocks", "8", "--block-size", "16",
                "--max-num-seqs", "4")  # fmt: skip


def dashboard_queries(dashboard: dict) -> list[str]:
    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))  # rows hold panels

    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]


def selected_series(expr: str) -> list[tuple[str, dict[str, str]]]:
    """The series a PromQL query selects: (metric name, its equality matchers)."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    out = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert all(m.op == promql_parser.MatchOp.Equal for m in node.matchers.matchers), expr
            out.append((node.name, {m.name: m.value for m in node.matchers.matchers}))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return out


def scrape(server: Server) -> list:
    return [s for family in text_string_to_metric_families(server.metrics_text()) for s in family.samples]


def value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def settled(server: Server, quiet_s: float = 2.0) -> list:
    """A scrape once nothing runs and the generated tokens have not changed for `quiet_s`: behind --replicas the
    ingress's counters follow the replicas' reports, which lag the requests just answered (polled every 0.5 s)."""
    deadline = time.monotonic() + 60
    last = scrape(server)
    while True:
        time.sleep(quiet_s)
        samples = scrape(server)
        tokens = [value(s, "vllm:generation_tokens_total", model_name=MODEL) for s in (last, samples)]
        if tokens[0] == tokens[1] and not value(samples, "vllm:num_requests_running", model_name=MODEL):
            return samples
        assert time.monotonic() < deadline, "the server's counters never settled"
        last = samples


def run_load(server: Server, api_key: str) -> list[dict]:
    """Chat (plain, streamed, constrained) and completions requests; what each client was told."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=600)
    told = []

    def chat(content: str, max_tokens: int, **extra) -> None:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, **extra
        )
        u = r.usage
        told.append(dict(prompt=u.prompt_tokens, completion=u.completion_tokens,
                         cached=u.prompt_tokens_details.cached_tokens, finish=r.choices[0].finish_reason))  # fmt: skip

    # a prefix-cache hit: the same prompt twice, one after the other
    for _ in range(2):
        chat("The quick brown fox jumps over the lazy dog", 4, temperature=0)
    # finish reason "stop": the grammar ends the answer
    chat("Is Paris in France?", 8, extra_body={"guided_choice": ["yes", "no"]})
    # streamed, with usage in the last chunk
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to three"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    u = chunks[-1].usage
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    told.append(dict(prompt=u.prompt_tokens, completion=u.completion_tokens, cached=0, finish=finish))
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=5, temperature=0)
    told.append(dict(prompt=r.usage.prompt_tokens, completion=r.usage.completion_tokens, cached=0,
                     finish=r.choices[0].finish_reason))  # fmt: skip
    # four at once, more KV than the cache has: preemptions
    topics = ["Paris is the capital of France", "Berlin is the capital of", "def add(a, b): return", "emoji"]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda t: chat(f"Tell me about {t}", 40, extra_body={"ignore_eos": True}), topics))
    return told


def check_dashboard(server: Server, api_key: str = "none", preempts: bool = True) -> None:
    """Load the server as the tenant of `api_key`, then check the dashboard's series against what its clients were
    told (the changes since a scrape taken before the load: the server may have served other requests before).
    `preempts`: the load preempts a request (a KV cache too small for it), counted in vllm:num_preemptions_total."""
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 30, "the dashboard lost its panels"
    before = settled(server)
    told = run_load(server, api_key)
    n = len(told)
    prompt, completion = sum(t["prompt"] for t in told), sum(t["completion"] for t in told)

    def delta(samples, name: str, **labels) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    deadline = time.monotonic() + 120
    while True:  # behind --replicas the engine's counters follow the replicas' reports (every 0.5 s)
        samples = scrape(server)
        if delta(samples, "vllm:generation_tokens_total", model_name=MODEL) == completion and not value(
            samples, "vllm:num_requests_running", model_name=MODEL
        ):
            break
        assert time.monotonic() < deadline, (
            "the engine's counters never matched the clients' usage",
            delta(samples, "vllm:generation_tokens_total", model_name=MODEL),
            completion,
            value(samples, "vllm:num_requests_running", model_name=MODEL),
            told,
        )
        time.sleep(0.5)

    # every series the dashboard queries exists, with samples for the served model
    names = {s.name for s in samples}
    for expr in queries:
        for name, matchers in selected_series(expr):
            assert name in names, f"{name} (queried by {expr!r}) is not on /metrics"
            found = any(s.name == name and matchers.items() <= s.labels.items() for s in samples)
            assert found, (name, matchers)

    # ... and agrees with what the clients were told
    def changed(name: str, **labels) -> float:
        return delta(samples, name, model_name=MODEL, **labels)

    assert changed("vllm:prompt_tokens_total") == prompt
    assert changed("vllm:generation_tokens_total") == completion
    finishes = Counter(t["finish"] for t in told)
    assert finishes["stop"] >= 1 and finishes["length"] >= 1
    for reason in ("stop", "length", "abort"):
        assert changed("vllm:request_success_total", finished_reason=reason) == finishes[reason], reason
    assert changed("vllm:request_prompt_tokens_count") == n
    assert changed("vllm:request_prompt_tokens_sum") == prompt
    assert changed("vllm:request_generation_tokens_sum") == completion
    assert changed("vllm:request_max_num_generation_tokens_sum") == completion  # one choice per prompt
    assert changed("vllm:num_preemptions_total") >= (1 if preempts else 0)
    cached = sum(t["cached"] for t in told)
    assert cached > 0
    assert changed("vllm:prefix_cache_hits_total") >= cached
    assert changed("vllm:prefix_cache_queries_total") >= prompt
    # vLLM's token buckets: 1, 2, 5, 10, ... up to the context length (the tiny model's 4096)
    les = sorted(
        float(s.labels["le"])
        for s in samples
        if s.name == "vllm:request_prompt_tokens_bucket" and "le" in s.labels
    )
    assert les == sorted(
        {m * 10**e for e in range(4) for m in (1, 2, 5) if m * 10**e <= 4096} | {float("inf")}
    )
    # the phases: one observation per request; inference = prefill + decode; all within the e2e latency
    phases = {
        p: changed(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode", "inference")
    }
    for p in phases:
        assert changed(f"vllm:request_{p}_time_seconds_count") == n
    assert phases["inference"] == pytest.approx(phases["prefill"] + phases["decode"], abs=1e-6)
    assert changed("vllm:e2e_request_latency_seconds_sum") >= phases["queue"] + phases["inference"]
    assert changed("vllm:time_to_first_token_seconds_count") == n
    assert 0 <= value(samples, "vllm:kv_cache_usage_perc", model_name=MODEL) <= 1


def test_engine_counts_as_vllm_does(tiny_model_dir):
    """The engine's counters and timings, offline: a prompt counts once even when its request is preempted and
    recomputed, every committed output token counts, and each finished request carries its phases."""
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from motet.engine.outputs import RequestOutputs
    from motet.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=8, block_size=16, max_num_seqs=4,
                                    num_threads=1))  # fmt: skip
    prompts = [
        engine.tokenizer.encode(f"Tell me about {t} and more") for t in ("Paris", "Berlin", "add", "fox")
    ]
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    finals, answers = [], RequestOutputs()
    while engine.has_unfinished():
        finals += [out for out in answers.step(engine) if out.finished]
    stats = engine.stats()
    assert stats.preemptions >= 1  # 4 x (prompt + 40) tokens do not fit in 8 blocks of 16
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    assert stats.generation_tokens == sum(len(out.token_ids) for out in finals) == 4 * 40
    for out in finals:
        t = out.timings
        assert min(t.queue_s, t.prefill_s, t.decode_s) >= 0
        assert t.inference_s == t.prefill_s + t.decode_s


def test_dashboard_queries_parse():
    """Every query of the dashboard is valid PromQL, and selects vLLM's series by the served model."""
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    selected = [s for q in queries for s in selected_series(q)]
    vllm = [(name, m) for name, m in selected if name.startswith("vllm:")]
    assert vllm and all(m == {"model_name": MODEL} for _, m in vllm)
    families = {name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for name, _ in vllm}
    for family in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                   "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                   "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                   "vllm:request_max_num_generation_tokens", "vllm:num_preemptions_total",
                   "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert family in families


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    srv = Server(tmp, "--model", str(tiny_model_dir), "--data-dir", str(tmp / "data"), *SERVER_FLAGS)
    yield srv
    srv.stop()


def test_dashboard_series_on_a_live_server(server):
    check_dashboard(server)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Prometheus (Debian's prometheus package)"
)
def test_prometheus_evaluates_every_query_to_data(server, tmp_path):
    """A real Prometheus scrapes the live server under load and evaluates each of the dashboard's queries, as
    Grafana would: every one returns a finite value."""
    from motet.evals.server import free_port

    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: motet\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 (closed below)
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        deadline = time.monotonic() + 120
        while True:  # the first scrapes, then load between them
            try:
                up = httpx.get(api, params={"query": "up"}, timeout=10).json()["data"]["result"]
            except (httpx.TransportError, ValueError, KeyError):  # not listening yet, or not ready (503 text)
                up = []
            if up and up[0]["value"][1] == "1":
                break
            assert prom.poll() is None and time.monotonic() < deadline, (
                tmp_path / "prometheus.log"
            ).read_text()
            time.sleep(0.5)
        run_load(server)
        pending = [q.replace("$__rate_interval", "1m").replace("$model_name", MODEL) for q in
                   dashboard_queries(json.loads(DASHBOARD.read_text()))]  # fmt: skip
        while pending:  # each query returns data once Prometheus has scraped the load twice
            answers = {q: httpx.get(api, params={"query": q}, timeout=10).json() for q in pending}
            for q, a in answers.items():
                assert a["status"] == "success", (q, a)
            pending = [
                q for q, a in answers.items()
                if not a["data"]["result"] or any(math.isnan(float(r["value"][1])) for r in a["data"]["result"])
            ]  # fmt: skip
            assert time.monotonic() < deadline + 120, f"no data for {pending}"
            time.sleep(1)
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
