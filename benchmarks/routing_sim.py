"""Routing at scale, by simulation: a multi-tenant chat trace replayed against 4 to 256 simulated replicas
under each routing policy.

    python -m benchmarks.routing_sim [--replicas 4 16 64 256] [--duration 1200] [--out DIR]

The trace (benchmarks/routing_trace.py): Zipf adapter popularity, one system prompt per tenant, multi-turn
conversations, Poisson arrivals, the offered load per replica fixed (`--rate-per-replica`). Each replica
(benchmarks/sim_replica.py) has a block-LRU prefix cache, an adapter LRU and the service-time model fitted to
measured step times (benchmarks/routing_fit.py). Policies (benchmarks/routing_policies.py): round robin, least loaded,
prompt-text prefix affinity (Ray's), adapter affinity alone, motet's router (motet/cluster/routing_policy.py, fed
by reports every `--report-period` seconds) and the oracle (the same policy seeing every cache as it is).

Figures, after a warm-up (`--warmup` of the duration): prefix hit rate (prompt tokens found in the cache),
adapter loads per 1,000 requests, load imbalance (the busiest replica's modelled busy time / the mean), and
the modelled time to first token (p50, p99). Writes results.json, summary.md and PNG plots under --out.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.routing_fit import ServiceModel
from benchmarks.routing_policies import POLICIES, costs_for
from benchmarks.routing_trace import TraceConfig, generate
from benchmarks.sim_replica import SimReplica
from motet.cluster.routing_policy import RoutingPolicy
from motet.evals.report import clean, fmt, pct, pyplot, save, table

ROOT = Path(__file__).resolve().parents[1]
CHECK_REPLICAS = 64  # the acceptance figures: motet >= 90% of the oracle's hit rate, imbalance <= 1.25 ...


def load_model(path: Path | None) -> ServiceModel:
    """The fitted service model (benchmarks/routing_fit.py's output), or the defaults."""
    path = path or ROOT / "benchmarks" / "reports" / "routing_fit.json"
    if path.is_file():
        return ServiceModel(**json.loads(path.read_text())["model"])
    return ServiceModel()


def simulate(policy_name: str, conversations, n: int, model: ServiceModel, args) -> dict:
    """Replay the conversations (each turn sent a think time after the previous reply) under one policy."""
    replicas = [SimReplica(model, args.kv_blocks, args.adapter_slots) for _ in range(n)]
    kwargs = {}
    if policy_name in ("motet", "oracle", "adapter_affinity"):
        kwargs["policy"] = RoutingPolicy(
            costs_for(model), args.imbalance_factor, args.imbalance_slack, args.adapter_slack
        )
    policy = POLICIES[policy_name](replicas, seed=args.seed, **kwargs)
    warm_at = args.duration * args.warmup
    pending = [(c[0].arrival, k, 0) for k, c in enumerate(conversations)]  # (when, conversation, turn)
    heapq.heapify(pending)
    finishes: list[tuple[float, int, tuple[int, int]]] = []  # (when, replica, (conversation, turn))
    next_report = args.report_period
    ttfts, hit_tokens, prompt_tokens, loads, counted = [], 0, 0, 0, 0
    work_at_warm = None
    while pending:
        now, k, turn = heapq.heappop(pending)
        req = replace(conversations[k][turn], arrival=now)
        while finishes and finishes[0][0] <= now:
            _, done, key = heapq.heappop(finishes)
            replicas[done].outstanding -= 1
            policy.completed(done, key)
        while policy.reports and next_report <= now:
            for i, r in enumerate(replicas):
                policy.report(i, r.take_changes())
            next_report += args.report_period
        if work_at_warm is None and now >= warm_at:
            work_at_warm = [r.work_s for r in replicas]
        i = policy.choose(req, now)
        served = replicas[i].serve(req, now)
        replicas[i].outstanding += 1
        heapq.heappush(finishes, (served.finish, i, (k, turn)))
        policy.routed(i, req, now)
        if turn + 1 < len(conversations[k]):
            heapq.heappush(pending, (served.finish + conversations[k][turn + 1].think_s, k, turn + 1))
        if now >= warm_at:
            counted += 1
            ttfts.append(served.ttft_s)
            hit_tokens += served.hit_tokens
            prompt_tokens += req.prompt_tokens
            loads += served.adapter_loaded
    work = [r.work_s - w for r, w in zip(replicas, work_at_warm or [0.0] * n, strict=True)]
    ttfts.sort()
    mean_work = statistics.fmean(work) if work else 0.0
    return {
        "requests": counted,
        "prefix_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else None,
        "adapter_loads_per_1000": 1000 * loads / counted if counted else None,
        "load_imbalance": max(work) / mean_work if mean_work else None,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else None,
    }


def run(args) -> dict:
    model = replace(load_model(args.fit), block_size=TraceConfig.block_size)
    cfg = TraceConfig(seed=args.seed)
    results = {"model": asdict(model), "trace": asdict(cfg), "args": vars(args) | {"out": None, "fit": None}}
    results["by_replicas"] = {}
    for n in args.replicas:
        t0 = time.perf_counter()
        conversations = generate(cfg, args.rate_per_replica * n / cfg.mean_turns, args.duration)
        row = {name: simulate(name, conversations, n, model, args) for name in args.policies}
        results["by_replicas"][str(n)] = row
        print(f"{n} replicas: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(markdown_table(row), file=sys.stderr)
    results["checks"] = checks(results["by_replicas"].get(str(CHECK_REPLICAS)))
    return results


def checks(row: dict | None) -> dict | None:
    """The acceptance figures at 64 replicas."""
    if not row or "motet" not in row or "oracle" not in row:
        return None
    m = row["motet"]
    others = [v["adapter_loads_per_1000"] for k, v in row.items() if k not in ("motet", "oracle")]
    return {
        "hit_rate_vs_oracle": m["prefix_hit_rate"] / row["oracle"]["prefix_hit_rate"],
        "load_imbalance": m["load_imbalance"],
        "fewest_adapter_loads": all(m["adapter_loads_per_1000"] < o for o in others),
    }


# -- the report ------------------------------------------------------------------------------------------
def markdown_table(row: dict) -> str:
    rows = [
        [
            POLICIES[name].name,
            pct(r["prefix_hit_rate"]),
            fmt(r["adapter_loads_per_1000"], ".1f"),
            fmt(r["load_imbalance"], ".2f"),
            fmt(r["ttft_p50_s"], ".2f"),
            fmt(r["ttft_p99_s"], ".2f"),
        ]
        for name, r in row.items()
    ]
    header = ["policy", "prefix hit rate", "adapter loads / 1k req", "imbalance", "TTFT p50 s", "TTFT p99 s"]
    return table(header, rows)


def markdown(results: dict) -> str:
    parts = ["# Routing simulation", "", f"`{' '.join(results['argv'])}`", ""]
    c = results.get("checks")
    if c:
        parts += [
            f"At {CHECK_REPLICAS} replicas motet's router reaches **{pct(c['hit_rate_vs_oracle'])}** of the "
            f"oracle's prefix hit rate, with load imbalance **{fmt(c['load_imbalance'], '.2f')}**; fewest "
            f"adapter loads of all policies: **{'yes' if c['fewest_adapter_loads'] else 'no'}**.",
            "",
        ]
    for n, row in results["by_replicas"].items():
        reqs = next(iter(row.values()))["requests"]
        parts += [f"## {n} replicas ({reqs} requests after the warm-up)", "", markdown_table(row), ""]
    m = results["model"]
    parts += [
        "Service model (s): "
        + ", ".join(f"{k} {v}" for k, v in m.items() if k.endswith("_s"))
        + f"; KV blocks per replica {results['args']['kv_blocks']}, adapter slots "
        f"{results['args']['adapter_slots']}, reports every {results['args']['report_period']} s.",
    ]
    return "\n".join(parts) + "\n"


def plots(results: dict, out: Path) -> list[Path]:
    plt = pyplot()
    ns = list(results["by_replicas"])
    names = list(next(iter(results["by_replicas"].values())))
    figures = [
        ("prefix_hit_rate", "prefix hit rate", "hit_rate.png"),
        ("adapter_loads_per_1000", "adapter loads / 1,000 requests", "adapter_loads.png"),
        ("load_imbalance", "load imbalance (max / mean busy time)", "imbalance.png"),
        ("ttft_p99_s", "modelled TTFT p99 (s)", "ttft_p99.png"),
    ]
    paths = []
    for key, label, file in figures:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name in names:
            ys = [results["by_replicas"][n][name][key] for n in ns]
            ax.plot([int(n) for n in ns], ys, marker="o", label=POLICIES[name].name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        if key == "ttft_p99_s":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save(fig, out / file))
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of conversation arrivals")
    p.add_argument("--rate-per-replica", type=float, default=0.25, help="requests per second per replica")
    p.add_argument("--warmup", type=float, default=0.25, help="share of the duration left out of the figures")
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--adapter-slots", type=int, default=8, help="adapters resident per replica")
    p.add_argument("--report-period", type=float, default=1.0, help="seconds between replicas' reports")
    p.add_argument("--imbalance-factor", type=float, default=RoutingPolicy.imbalance_factor)
    p.add_argument("--imbalance-slack", type=float, default=RoutingPolicy.imbalance_slack)
    p.add_argument("--adapter-slack", type=float, default=RoutingPolicy.adapter_slack)
    p.add_argument(
        "--fit", type=Path, default=None, help="benchmarks/routing_fit.py's JSON (default: its report)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = run(args)
    results["argv"] = ["python -m benchmarks.routing_sim", *(argv if argv is not None else sys.argv[1:])]
    out = args.out or ROOT / "reports" / "eval" / f"routing_sim-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(clean(results), indent=1))
    pngs = plots(results, out)
    figures = "\n".join(f"![{p.stem}]({p.name})" for p in pngs)
    (out / "summary.md").write_text(markdown(results) + "\n" + figures + "\n")
    print(markdown(results))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
