"""Prefill/decode disaggregation at scale, by simulation: colocated replicas against prefill and decode pools of
the same total size, step by step, on the service-time model fitted to this machine's measured steps
(benchmarks/routing_fit.py; benchmarks/reports/routing_fit.json), at 2 to 256 replicas.

    python -m benchmarks.pd_sim [--replicas 2 64 256] [--ratios 3:1 2:1 1:1 1:2 1:3] [--goodput-at 2 64]
                                [--duration 600] [--out DIR]

The trace: Poisson arrivals, a mix of long prompts (--long-prompt tokens, --long-output out) and long decodes
(--decode-prompt tokens, --decode-output out), --long-share of them long prompts. A replica's step is the
engine's: one token per running row, then waiting prompts' chunks first come first served within the step
budget (--step-tokens, the engine's CPU default), its time `overhead + token x tokens + row x rows + attention x
pairs`. Colocated: a request goes to the replica with the least work queued (rows + queued prompt tokens / step
budget) and is prefilled and decoded there. Disaggregated (P:D): to the prefill replica with the fewest queued
prompt tokens; when its prefill ends, its full blocks are loaded by the decode replica with the fewest rows from
the shared KV tier (--block-load-s each: a background load, the request waits for it), which computes the last
partial block and decodes. Same requests in every run.

Figures, after a warm-up: per class, TTFT and TPOT p50/p99; SLO attainment (both the TTFT and the TPOT target met);
and goodput as DistServe defines it: the highest request rate per replica at which >= --attainment of requests
meet both targets (a bisection over the rate, each point a full simulation).
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks import nearest_rank, write_report
from benchmarks.routing_fit import ServiceModel
from benchmarks.routing_sim import load_model
from motet.cluster.disaggregation import MIN_PREFILL_BLOCKS
from motet.cluster.routing_policy import RoutingCosts
from motet.engine.config import CPU_STEP_TOKENS
from motet.evals.report import table
from motet.settings_flags import SettingsFlags


@dataclass
class Req:
    arrival: float
    prompt: int
    output: int
    kind: str  # "long_prompt" | "long_decode"
    computed: int = 0  # prompt tokens computed (or loaded) where it is now
    first: float | None = None  # its first token's time
    last: float | None = None
    emitted: int = 0


class Replica:
    def __init__(self, model: ServiceModel, role: str):
        self.model, self.role = model, role  # role: "colocated" | "prefill" | "decode"
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy = False
        self.batch: list[tuple[Req, int]] = []
        self.incoming = 0  # requests handed here and still loading their blocks

    def queued_tokens(self) -> int:
        return sum(r.prompt - r.computed for r in self.waiting)

    def rows(self) -> int:
        return len(self.running) + len(self.waiting) + self.incoming

    def compose(self) -> float | None:
        """The next step's batch; its duration, or None when there is nothing to run."""
        m = self.model
        batch = [(r, 1) for r in self.running]
        budget = m.max_num_batched_tokens - len(batch)
        pairs = sum(r.prompt + r.emitted for r in self.running)
        for r in self.waiting:
            if budget <= 0 or len(batch) >= m.max_num_seqs:
                break
            n = min(budget, r.prompt - r.computed)
            batch.append((r, n))
            budget -= n
            pairs += n * (r.computed + (n + 1) / 2)
        if not batch:
            return None
        self.batch = batch
        return m.step_s(sum(n for _, n in batch), len(batch), pairs)


@dataclass
class Config:
    long_prompt: int = 1000
    long_output: int = 16
    decode_prompt: int = 200
    decode_output: int = 256
    long_share: float = 0.3
    block_load_s: float = RoutingCosts.block_load_s
    ttft_slo: float = 30.0
    tpot_slo: float = 0.25


CONFIG_FLAGS = SettingsFlags()  # the flags that set a Config field


def trace(cfg: Config, rate: float, duration: float, seed: int) -> list[Req]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return out
        if rng.random() < cfg.long_share:
            out.append(Req(t, int(cfg.long_prompt * rng.uniform(0.75, 1.25)), cfg.long_output, "long_prompt"))
        else:
            out.append(
                Req(t, int(cfg.decode_prompt * rng.uniform(0.5, 1.5)), cfg.decode_output, "long_decode")
            )


def simulate(requests: list[Req], model: ServiceModel, cfg: Config, n: int, prefill: int) -> list[Req]:
    """Run the trace on n replicas, `prefill` of them a prefill pool (0: colocated); the requests, done."""
    reqs = [replace(r) for r in requests]
    if prefill:
        pool = [Replica(model, "prefill") for _ in range(prefill)]
        decoders = [Replica(model, "decode") for _ in range(n - prefill)]
    else:
        pool = decoders = [Replica(model, "colocated") for _ in range(n)]
    events: list = []  # (time, seq, kind, replica, request)
    seq = 0

    def push(t, kind, rep, req=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, rep, req))

    def kick(rep: Replica, now: float) -> None:
        if not rep.busy:
            d = rep.compose()
            if d is not None:
                rep.busy = True
                push(now + d, "step", rep)

    for r in reqs:
        push(r.arrival, "arrive", None, r)
    bs = model.block_size
    while events:
        now, _, kind, rep, req = heapq.heappop(events)
        if kind == "arrive":
            if prefill and req.prompt // bs >= MIN_PREFILL_BLOCKS:
                rep = min(pool, key=Replica.queued_tokens)
            elif prefill:  # too short to gain from the prefill pool (disaggregation.py)
                rep = min(decoders, key=Replica.rows)
            else:
                rep = min(
                    pool, key=lambda x: len(x.running) + x.queued_tokens() / model.max_num_batched_tokens
                )
            rep.waiting.append(req)
            kick(rep, now)
        elif kind == "loaded":  # its blocks are on the decode replica: the rest of the prompt and the decode
            rep.incoming -= 1
            rep.waiting.append(req)
            kick(rep, now)
        else:  # a step ends
            rep.busy = False
            for r, k in rep.batch:
                if r.computed < r.prompt:  # a prefill chunk
                    r.computed += k
                    if r.computed < r.prompt:
                        continue
                    rep.waiting.remove(r)
                    if rep.role == "prefill":  # handed over: the decode replica loads its full blocks
                        dest = min(decoders, key=Replica.rows)
                        r.computed = min((r.prompt // bs) * bs, r.prompt - 1)
                        dest.incoming += 1
                        push(now + (r.prompt // bs) * cfg.block_load_s, "loaded", dest, r)
                        continue
                    r.first, r.emitted = now, 1
                    if r.emitted < r.output:
                        rep.running.append(r)
                    else:
                        r.last = now
                else:
                    r.emitted += 1
                    if r.emitted >= r.output:
                        r.last = now
                        rep.running.remove(r)
            kick(rep, now)
    return reqs


def figures(reqs: list[Req], cfg: Config, warm: float) -> dict:
    done = [r for r in reqs if r.arrival >= warm and r.last is not None]

    def tpot(r: Req) -> float:
        return (r.last - r.first) / (r.output - 1) if r.output > 1 else 0.0

    def ok(r: Req) -> bool:
        return r.first - r.arrival <= cfg.ttft_slo and tpot(r) <= cfg.tpot_slo

    out = {"requests": len(done), "attainment": sum(map(ok, done)) / len(done) if done else None}
    for kind in ("long_prompt", "long_decode"):
        rs = [r for r in done if r.kind == kind]
        ttft, tp = [r.first - r.arrival for r in rs], [tpot(r) for r in rs]
        out[kind] = {
            "ttft_p50_s": nearest_rank(ttft, 0.5),
            "ttft_p99_s": nearest_rank(ttft, 0.99),
            "tpot_p50_s": nearest_rank(tp, 0.5),
            "tpot_p99_s": nearest_rank(tp, 0.99),
        }
    return out


def goodput(model, cfg, n: int, prefill: int, args) -> float:
    """DistServe's goodput: the highest rate per replica with attainment >= args.attainment (bisection)."""
    lo, hi = 0.0, args.max_rate
    for _ in range(args.bisections):
        mid = (lo + hi) / 2
        reqs = simulate(trace(cfg, mid * n, args.goodput_duration, args.seed), model, cfg, n, prefill)
        att = figures(reqs, cfg, args.goodput_duration * args.warmup)["attainment"]
        if att is not None and att >= args.attainment:
            lo = mid
        else:
            hi = mid
    return lo


def run(args) -> dict:
    model = replace(load_model(None), max_num_batched_tokens=args.step_tokens, max_num_seqs=args.max_num_seqs)
    cfg = Config(**CONFIG_FLAGS.values(args))
    results = {"model": asdict(model), "config": asdict(cfg), "by_replicas": {}}
    for n in args.replicas:
        t0 = time.perf_counter()
        requests = trace(cfg, args.rate_per_replica * n, args.duration, args.seed)
        modes = {"colocated": 0}
        for ratio in args.ratios:
            p, d = map(int, ratio.split(":"))
            k = min(n - 1, max(1, round(n * p / (p + d))))
            if k not in modes.values():
                modes[f"pd {k}+{n - k}"] = k
        row = {}
        for name, prefill in modes.items():
            reqs = simulate(requests, model, cfg, n, prefill)
            row[name] = figures(reqs, cfg, args.duration * args.warmup)
            if n in args.goodput_at:
                row[name]["goodput_per_replica"] = goodput(model, cfg, n, prefill, args)
        results["by_replicas"][str(n)] = row
        print(f"{n} replicas: {time.perf_counter() - t0:.0f} s")
    return results


def summary_md(results: dict, args) -> str:
    cfg = results["config"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    rows = []
    for n, row in results["by_replicas"].items():
        base = row["colocated"]["long_decode"]["tpot_p99_s"]
        for mode, r in row.items():
            d, p = r["long_decode"], r["long_prompt"]
            ratio = base / d["tpot_p99_s"] if base and d["tpot_p99_s"] else None
            rows.append([
                n, mode, f"{f(d['tpot_p50_s'] and 1e3 * d['tpot_p50_s'], '.0f')} / "
                f"{f(d['tpot_p99_s'] and 1e3 * d['tpot_p99_s'], '.0f')}", f(d["ttft_p99_s"], ".2f"),
                f"{f(p['ttft_p50_s'], '.2f')} / {f(p['ttft_p99_s'], '.2f')}", f(r["attainment"], ".0%"),
                f(r.get("goodput_per_replica"), ".3f"), f"{f(ratio, '.2f')}x",
            ])  # fmt: skip
    header = ["replicas", "mode", "long decodes TPOT p50 / p99 (ms)", "long decodes TTFT p99 (s)",
              "long prompts TTFT p50 / p99 (s)", "attainment", "goodput (req/s/replica)", "TPOT p99 colocated / this"]  # fmt: skip
    lines = [
        "# Prefill/decode disaggregation at scale, by simulation",
        "",
        f"The service model fitted to this machine's steps (one thread per replica), a step budget of "
        f"{args.step_tokens} tokens; {args.rate_per_replica} requests/s per replica, {cfg['long_share']:.0%} long "
        f"prompts ({cfg['long_prompt']} tokens, {cfg['long_output']} out), the rest long decodes "
        f"({cfg['decode_prompt']} tokens, {cfg['decode_output']} out); a block loaded from the shared tier in "
        f"{1e3 * cfg['block_load_s']:.0f} ms. Targets: TTFT <= {cfg['ttft_slo']} s, TPOT <= {cfg['tpot_slo']} s.",
        "",
        table(header, rows, "l" * len(header)),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flag = CONFIG_FLAGS.adder(ap, Config)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 64, 256])
    ap.add_argument(
        "--ratios", nargs="+", default=["3:1", "2:1", "1:1", "1:2", "1:3"], help="prefill:decode pool sizes"
    )
    ap.add_argument("--rate-per-replica", type=float, default=0.05, help="requests per second per replica")
    ap.add_argument("--duration", type=float, default=600.0, help="simulated seconds")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the duration not counted")
    flag("--long-prompt", type=int)
    flag("--long-output", type=int)
    flag("--decode-prompt", type=int)
    flag("--decode-output", type=int)
    flag("--long-share", type=float)
    flag("--block-load-s", type=float)
    flag("--ttft-slo", type=float)
    flag("--tpot-slo", type=float)
    ap.add_argument("--step-tokens", type=int, default=CPU_STEP_TOKENS)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--goodput-at", type=int, nargs="*", default=[2, 64], help="replica counts whose goodput is bisected"
    )
    ap.add_argument("--goodput-duration", type=float, default=300.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--max-rate", type=float, default=0.3, help="the bisection's upper rate per replica")
    ap.add_argument("--bisections", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = run(args)
    results["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    out = Path(args.out or f"benchmarks/reports/pd_sim/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, results, summary_md(results, args))


if __name__ == "__main__":
    main()
