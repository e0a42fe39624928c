"""Serving load test: latency, throughput and goodput vs concurrency, and vs adapter popularity.

Streamed chat requests (prompts of ~--prompt-words words, --max-tokens output tokens with EOS ignored,
greedy) arrive as a Poisson process at --request-rate per second (inf: all at once) with at most C in
flight. Per level: TTFT, TPOT (per output token after the first), inter-token latency, end-to-end
percentiles, request and output-token throughput, and goodput: requests per second that met both
--ttft-slo and --tpot-slo (DistServe's measure), with the share that did.

Two sweeps:
- concurrency: each of --levels, on the base model (--limit requests per level; default 2 x level, >= 8);
- adapters (at --concurrency): random LoRA adapters of the base model are uploaded over the HTTP API
  (POST /v1/adapters) and requests pick them by Punica's popularity patterns: `distinct` (one adapter
  per request), `uniform` (over --adapters), `skewed` (Zipf, exponent --zipf-alpha, over --adapters) and
  `identical` (all one adapter), beside the base model without adapters. They are deleted afterwards.
--json-share F sends that share of the requests with a `response_format` json_schema (those end when
the JSON does, so they are shorter). The adapters' shapes come from the base model's config: --model-path
(default: the --model of the server motet eval started, else the model the run names) must be that checkpoint.
A run whose requests all failed, or any of whose requests were answered 404, exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import tempfile
import time
import uuid
from pathlib import Path

from motet.evals import report
from motet.evals.context import EvalContext
from motet.evals.serving_bench import machine, make_prompts, run_level, summarize

NAME = "serving"
NEEDS_SERVER = True
PATTERNS = ("distinct", "uniform", "skewed", "identical")
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
    },
    "required": ["topic", "keywords", "sentiment"],
    "additionalProperties": False,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving options")
    g.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrency levels to sweep")
    g.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    g.add_argument("--prompt-words", type=int, default=64)
    g.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    g.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT target in seconds (goodput)")
    g.add_argument("--tpot-slo", type=float, default=0.2, help="TPOT target in seconds per token (goodput)")
    g.add_argument("--json-share", type=float, default=0.0, help="share of requests with a JSON schema")
    g.add_argument(
        "--patterns",
        nargs="*",
        choices=PATTERNS,
        default=list(PATTERNS),
        help="adapter patterns (none: skip)",
    )
    g.add_argument(
        "--adapters", type=int, default=8, help="adapters the uniform and skewed patterns draw from"
    )
    g.add_argument("--adapter-rank", type=int, default=8)
    g.add_argument("--zipf-alpha", type=float, default=1.5, help="skew of the skewed pattern")
    g.add_argument("--model-path", default=None, help="the base model's checkpoint, for the adapters' shapes")
    g.add_argument("--seed", type=int, default=0)


# -- requests -------------------------------------------------------------------------------------------
def build_requests(ctx: EvalContext, n: int, models: list[str], seed: int) -> list[tuple[str, dict]]:
    """n streamed chat requests; request i names models[i] (the base model or an adapter)."""
    args = ctx.args
    rng = random.Random(seed)
    out = []
    for prompt, model in zip(make_prompts(n, args.prompt_words, seed), models, strict=True):
        body = {
            "model": model,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if rng.random() < args.json_share:
            body["messages"] = [{"role": "user", "content": f"Describe this text as JSON: {prompt}"}]
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "doc", "schema": JSON_SCHEMA},
            }
        else:
            body["messages"] = [{"role": "user", "content": f"Continue this text: {prompt}"}]
            body["ignore_eos"] = True
        out.append(("/chat/completions", body))
    return out


def pattern_models(pattern: str, n: int, names: list[str], alpha: float, pool: int, seed: int) -> list[str]:
    """Which adapter each of n requests uses under a Punica popularity pattern."""
    rng = random.Random(seed)
    if pattern == "distinct":
        return names[:n]
    if pattern == "identical":
        return [names[0]] * n
    if pattern == "uniform":
        return [names[rng.randrange(pool)] for _ in range(n)]
    weights = [1 / (k + 1) ** alpha for k in range(pool)]  # skewed: Zipf over the pool
    return rng.choices(names[:pool], weights=weights, k=n)


def level(ctx: EvalContext, requests: list[tuple[str, dict]], concurrency: int, desc: str) -> dict:
    args = ctx.args
    bar = ctx.progress(len(requests), desc)
    try:
        records, duration = asyncio.run(
            run_level(
                ctx.base_url,
                requests,
                concurrency,
                args.request_rate,
                args.seed,
                ctx.headers(),
                on_done=lambda _: bar.update(1),
            )
        )
    finally:
        bar.close()
    return summarize(records, duration, concurrency, args.ttft_slo, args.tpot_slo)


# -- adapters -------------------------------------------------------------------------------------------
class Adapters:
    """Random LoRA adapters uploaded over the HTTP API for the run, deleted on exit."""

    def __init__(self, ctx: EvalContext, count: int):
        self.ctx, self.count, self.names = ctx, count, []

    def base_config(self):
        from motet.engine.weights.model_store import resolve_model
        from motet.models.config import ModelConfig

        name = self.ctx.args.model_path or self.ctx.model_path or self.ctx.model
        try:
            return ModelConfig.from_dir(resolve_model(name, progress=False))
        except Exception as e:
            raise ValueError(
                f"cannot build adapters for model {name!r} ({e}); pass --model-path with its checkpoint dir"
            ) from None

    def __enter__(self) -> list[str]:
        import httpx

        from motet.evals.lora_reference import write_random_adapter

        base, rank = self.base_config(), self.ctx.args.adapter_rank
        run_id = uuid.uuid4().hex[:8]
        bar = self.ctx.progress(self.count, "uploading adapters")
        with (
            tempfile.TemporaryDirectory() as tmp,
            httpx.Client(headers=self.ctx.headers(), timeout=600) as http,
        ):
            for i in range(self.count):
                path = write_random_adapter(Path(tmp) / f"a{i}", base, rank, seed=self.ctx.args.seed + i)
                name = f"eval-{run_id}-{i}"
                files = [("files", (f.name, f.read_bytes())) for f in sorted(path.iterdir())]
                r = http.post(f"{self.ctx.base_url}/adapters", data={"name": name}, files=files)
                if r.status_code != 200:
                    self.__exit__()
                    raise ValueError(f"uploading adapter {name} failed: HTTP {r.status_code} {r.text[:300]}")
                self.names.append(name)
                bar.update(1)
        bar.close()
        return list(self.names)

    def __exit__(self, *exc) -> None:
        import httpx

        with httpx.Client(headers=self.ctx.headers(), timeout=60) as http:
            for name in self.names:
                with contextlib.suppress(httpx.HTTPError):
                    http.delete(f"{self.ctx.base_url}/adapters/{name}")
        self.names = []


# -- the run --------------------------------------------------------------------------------------------
def run(ctx: EvalContext) -> dict:
    args = ctx.args
    if not 0 <= args.json_share <= 1:
        raise ValueError("--json-share must be in [0, 1]")
    t0 = time.perf_counter()
    warm = build_requests(ctx, 2, [ctx.model] * 2, seed=-1)
    asyncio.run(run_level(ctx.base_url, warm, 2, headers=ctx.headers()))

    levels = []
    for c in args.levels:
        n = ctx.limit or max(8, 2 * c)
        levels.append(level(ctx, build_requests(ctx, n, [ctx.model] * n, args.seed + c), c, f"{c} clients"))

    patterns = []
    if args.patterns:
        c = ctx.concurrency
        n = ctx.limit or max(8, 2 * c)
        pool = min(args.adapters, n)
        with Adapters(ctx, max(n if "distinct" in args.patterns else 0, pool)) as names:
            # One token per adapter first, so the patterns measure batching rather than first loads.
            warm = [
                (path, {**body, "max_tokens": 1}) for path, body in build_requests(ctx, len(names), names, -1)
            ]
            asyncio.run(run_level(ctx.base_url, warm, c, headers=ctx.headers()))
            for i, pattern in enumerate(["base", *args.patterns]):
                models = (
                    [ctx.model] * n
                    if pattern == "base"
                    else pattern_models(pattern, n, names, args.zipf_alpha, pool, args.seed)
                )
                # fresh prompts per pattern: no prefix-cache hits carried over from the previous one
                requests = build_requests(ctx, n, models, args.seed + 1000 * (i + 1))
                row = level(ctx, requests, c, f"adapters: {pattern}")
                row["pattern"] = pattern
                row["distinct_adapters"] = 0 if pattern == "base" else len(set(models))
                patterns.append(row)

    return {
        "config": {
            "model": ctx.model,
            "base_url": ctx.base_url,
            "levels": args.levels,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words,
            "request_rate": args.request_rate,
            "ttft_slo_s": args.ttft_slo,
            "tpot_slo_s": args.tpot_slo,
            "json_share": args.json_share,
            "adapter_concurrency": ctx.concurrency,
            "adapter_pool": args.adapters,
            "adapter_rank": args.adapter_rank,
            "zipf_alpha": args.zipf_alpha,
            "seed": args.seed,
            "machine": machine(),
            "seconds": time.perf_counter() - t0,
        },
        "levels": levels,
        "patterns": patterns,
    }


def failure(results: dict) -> str | None:
    """Why the run does not measure what was asked: every request failed, or some were answered 404 (the model,
    an adapter or the route is not on that server: a setting to fix, not a load the server refused)."""
    rows = results["levels"] + results["patterns"]
    errors = sorted({e for r in rows for e in r["errors"]})
    if rows and not any(r["completed"] for r in rows):
        return f"all {sum(r['requests'] for r in rows)} requests failed, e.g. {errors[0] if errors else '?'}"
    if missing := [e for e in errors if e.startswith("HTTP 404")]:
        return f"requests were answered 404 (not on that server), e.g. {missing[0]}"
    return None


# -- reporting ------------------------------------------------------------------------------------------
def _pair(stat: dict, spec: str, scale: float = 1.0) -> str:
    return f"{report.fmt(stat.get('p50'), spec, scale)} / {report.fmt(stat.get('p99'), spec, scale)}"


# (header, cell) of the tables' columns, shared by both sweeps
COLUMNS = {
    "clients": lambda r: str(r["concurrency"]),
    "pattern": lambda r: r["pattern"],
    "distinct adapters": lambda r: str(r["distinct_adapters"]),
    "done/sent": lambda r: f"{r['completed']}/{r['requests']}",
    "req/s": lambda r: report.fmt(r["request_throughput"]),
    "out tok/s": lambda r: report.fmt(r["output_token_throughput"], ".1f"),
    "goodput req/s": lambda r: report.fmt(r["goodput"]),
    "met SLO": lambda r: report.pct(r["slo_attainment"], 0),
    "TTFT p50 / p99 (s)": lambda r: _pair(r["ttft_s"], ".2f"),
    "TPOT p50 / p99 (ms)": lambda r: _pair(r["tpot_s"], ".0f", 1e3),
    "ITL p50 / p99 (ms)": lambda r: _pair(r["itl_s"], ".0f", 1e3),
    "E2E p50 / p99 (s)": lambda r: _pair(r["e2e_s"], ".2f"),
}
LEVEL_COLUMNS = ["clients", "done/sent", "req/s", "out tok/s", "goodput req/s", "met SLO",
                 "TTFT p50 / p99 (s)", "TPOT p50 / p99 (ms)", "ITL p50 / p99 (ms)",
                 "E2E p50 / p99 (s)"]  # fmt: skip
PATTERN_COLUMNS = ["pattern", "distinct adapters", "done/sent", "out tok/s", "goodput req/s", "met SLO",
                   "TTFT p50 / p99 (s)", "TPOT p50 / p99 (ms)"]  # fmt: skip


def _table(runs: dict[str, dict], key: str, columns: list[str]) -> str:
    """One row per result of every server (a leading server column when comparing)."""
    server = ["server"] if len(runs) > 1 else []
    rows = [
        [*([label] if server else []), *(COLUMNS[c](r) for c in columns)]
        for label, res in runs.items()
        for r in res[key]
    ]
    align = "l" * len(server) + ("l" if columns[0] == "pattern" else "r") + "r" * (len(columns) - 1)
    return report.table([*server, *columns], rows, align)


def compare_markdown(runs: dict[str, dict]) -> str:
    cfg = next(iter(runs.values()))["config"]
    parts = [
        f"Model `{cfg['model']}`; {cfg['max_tokens']} output tokens per request (EOS ignored), prompts of "
        f"~{cfg['prompt_words']} words, {_arrivals(cfg['request_rate'])}, "
        f"{report.pct(cfg['json_share'], 0)} of requests with a JSON schema. Goodput: requests/s with "
        f"TTFT <= {cfg['ttft_slo_s']} s and TPOT <= {1e3 * cfg['tpot_slo_s']:.0f} ms. {cfg['machine']}.",
        "",
        "## vs concurrency (base model)",
        "",
        _table(runs, "levels", LEVEL_COLUMNS),
    ]
    if any(res["patterns"] for res in runs.values()):
        parts += [
            "",
            f"## vs adapter popularity ({cfg['adapter_concurrency']} clients, rank-{cfg['adapter_rank']} "
            f"random adapters; uniform and skewed draw from {cfg['adapter_pool']}, skewed is Zipf "
            f"{cfg['zipf_alpha']})",
            "",
            _table(runs, "patterns", PATTERN_COLUMNS),
        ]
    errors = {e for res in runs.values() for r in res["levels"] + res["patterns"] for e in r["errors"]}
    if errors:
        parts += ["", "Errors seen: " + "; ".join(f"`{e[:160]}`" for e in sorted(errors)[:5])]
    return "\n".join(parts)


def _concurrency_axes(*axes) -> None:
    """Concurrency on a log-2 x axis, a light grid and a legend."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def compare_plots(runs: dict[str, dict], out_dir: Path) -> list[Path]:
    plt = report.pyplot()
    paths = []
    tag = lambda label, what: f"{label} {what}".strip() if len(runs) > 1 else what

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, res in runs.items():
        xs = [r["concurrency"] for r in res["levels"]]
        a.plot(
            xs, [r["output_token_throughput"] for r in res["levels"]], "o-", label=tag(label, "output tok/s")
        )
        b.plot(xs, [r["request_throughput"] for r in res["levels"]], "o-", label=tag(label, "throughput"))
        b.plot(xs, [r["goodput"] for r in res["levels"]], "s--", label=tag(label, "goodput"))
    a.set(xlabel="concurrent clients", ylabel="output tokens/s", title="Token throughput vs concurrency")
    b.set(xlabel="concurrent clients", ylabel="requests/s", title="Throughput and goodput vs concurrency")
    _concurrency_axes(a, b)
    paths.append(report.save(fig, out_dir / "serving_throughput.png"))

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, res in runs.items():
        xs = [r["concurrency"] for r in res["levels"]]
        for q, style in (("p50", "o-"), ("p99", "s--")):
            a.plot(xs, [r["ttft_s"][q] for r in res["levels"]], style, label=tag(label, f"TTFT {q}"))
            b.plot(
                xs, [_scale(r["tpot_s"][q], 1e3) for r in res["levels"]], style, label=tag(label, f"TPOT {q}")
            )
    a.set(xlabel="concurrent clients", ylabel="seconds", title="Time to first token")
    b.set(xlabel="concurrent clients", ylabel="ms per output token", title="Time per output token")
    _concurrency_axes(a, b)
    paths.append(report.save(fig, out_dir / "serving_latency.png"))

    if any(res["patterns"] for res in runs.values()):
        first = next(res for res in runs.values() if res["patterns"])
        groups = [f"{r['pattern']}\n({r['distinct_adapters']} adapters)" for r in first["patterns"]]
        order = [r["pattern"] for r in first["patterns"]]
        series = {
            tag(label, "output tok/s"): [
                next((r["output_token_throughput"] for r in res["patterns"] if r["pattern"] == p), None)
                for p in order
            ]
            for label, res in runs.items()
        }
        fig, ax = plt.subplots(figsize=(8, 4.5))
        report.grouped_bars(
            ax,
            groups,
            series,
            "output tokens/s",
            f"Throughput vs adapter pattern ({first['config']['adapter_concurrency']} clients)",
            value_fmt=".1f",
        )
        paths.append(report.save(fig, out_dir / "serving_adapters.png"))
    return paths


def _arrivals(rate: float | None) -> str:
    """The request rate as configured (JSON holds an infinite rate as null)."""
    return "all requests at once" if rate is None or math.isinf(rate) else f"Poisson arrivals at {rate}/s"


def _scale(x: float | None, k: float) -> float | None:
    return None if x is None else x * k


def summary(results: dict) -> str:
    lines = []
    for r in results["levels"]:
        lines.append(
            f"{r['concurrency']:3d} clients: {report.fmt(r['output_token_throughput'], '.1f')} tok/s, "
            f"goodput {report.fmt(r['goodput'])} req/s ({report.pct(r['slo_attainment'], 0)} met SLO), "
            f"TTFT p50 {report.fmt(r['ttft_s']['p50'])} s, "
            f"TPOT p50 {report.fmt(r['tpot_s']['p50'], '.0f', 1e3)} ms"
        )
    if results["patterns"]:
        rates = [
            f"{r['pattern']} {report.fmt(r['output_token_throughput'], '.1f')}" for r in results["patterns"]
        ]
        lines.append("adapters (tok/s): " + ", ".join(rates))
    return "\n".join(lines)
