"""Prefill/decode disaggregation vs colocated serving at the same total threads: a mix of long prompts (short
outputs) and long decodes (short prompts) against `motet serve` on a local Ray cluster, once colocated
(`--replicas 2 --threads T`; `--colocated-replicas N`) and once disaggregated (`--prefill-replicas 1
--decode-replicas 1 --threads T`).

    python -m benchmarks.pd [--threads 1] [--decodes 6] [--prefills 6] [--prompt-words 900]
                            [--decode-tokens 96] [--ttft-slo 8] [--tpot-slo 0.15] [--out DIR]

The long decodes all start at once; the long prompts arrive while they decode, one every --prefill-gap
seconds. Per class: TTFT and TPOT p50/p99 (TPOT: a request's time per output token after its first), the
inter-token gaps' p99, and goodput as DistServe defines it (requests per second that met both the TTFT and the
TPOT target) over the whole mix. The figure the issue asks for: the long decodes' TPOT p99, colocated over
disaggregated (>= 1.5 wanted). Streamed /v1/completions, greedy, fixed output lengths (ignore_eos); the same
requests in both runs, after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import write_report
from motet.evals.report import table
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import (
    completion_body,
    machine,
    make_prompts,
    one_request,
    stats,
    summarize,
)

MODEL = "bench"


async def workload(url: str, args) -> dict:
    """Run the mix once: {"decode": records, "prefill": records, "duration_s": ...}."""
    decode_prompts = make_prompts(args.decodes, 30, seed=1)
    long_prompts = make_prompts(args.prefills, args.prompt_words, seed=2)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        warm = [completion_body(MODEL, p, 4) for p in make_prompts(4, args.prompt_words // 4, seed=9)]
        await asyncio.gather(*(one_request(client, "/v1/completions", b) for b in warm))

        async def long_prompt(i: int, prompt: str):
            await asyncio.sleep(args.prefill_delay + i * args.prefill_gap)
            return await one_request(
                client, "/v1/completions", completion_body(MODEL, prompt, args.prefill_tokens)
            )

        t0 = time.perf_counter()
        decodes = [
            one_request(client, "/v1/completions", completion_body(MODEL, p, args.decode_tokens))
            for p in decode_prompts
        ]
        prefills = [long_prompt(i, p) for i, p in enumerate(long_prompts)]
        records = await asyncio.gather(*decodes, *prefills)
        duration = time.perf_counter() - t0
    return {"decode": records[: len(decodes)], "prefill": records[len(decodes) :], "duration_s": duration}


def run_mode(name: str, server_args: list[str], args) -> dict:
    log = Path(args.out) / f"{name}.log"
    server = ManagedServer(
        ["--served-model-name", MODEL, "--threads", str(args.threads), *server_args],
        model=args.model,
        log_path=log,
        start_timeout=1200,
    ).start()
    try:
        result = asyncio.run(workload(server.url, args))
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop(120)
    everything = result["decode"] + result["prefill"]
    return {
        "server_args": server_args,
        "duration_s": result["duration_s"],
        "all": summarize(everything, result["duration_s"], len(everything), args.ttft_slo, args.tpot_slo),
        "decode": summarize(
            result["decode"], result["duration_s"], len(result["decode"]), args.ttft_slo, args.tpot_slo
        ),
        "prefill": summarize(
            result["prefill"], result["duration_s"], len(result["prefill"]), args.ttft_slo, args.tpot_slo
        ),
        "decode_itl_s": stats([x for r in result["decode"] if r.ok for x in r.itls]),
        "pd_metrics": [
            line for line in metrics.splitlines() if line.startswith(("motet_pd_", "motet_kv_tier_hit"))
        ],
    }


def summary_md(report: dict) -> str:
    cfg = report["config"]
    rows = []
    for mode in ("colocated", "disaggregated"):
        m = report[mode]
        for cls in ("decode", "prefill", "all"):
            s = m[cls]
            itl = f"{1e3 * m['decode_itl_s']['p99']:.0f}" if cls == "decode" else ""
            rows.append([
                mode, cls, f"{s['completed']}/{s['requests']}", f"{s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f}",
                f"{1e3 * s['tpot_s']['p50']:.0f} / {1e3 * s['tpot_s']['p99']:.0f}", itl, f"{s['goodput']:.3f}",
            ])  # fmt: skip
    header = [
        "mode",
        "class",
        "done",
        "TTFT p50 / p99 (s)",
        "TPOT p50 / p99 (ms)",
        "ITL p99 (ms)",
        "goodput (req/s)",
    ]
    lines = [
        f"# Prefill/decode disaggregation vs colocated ({cfg['threads']} thread(s) per replica, "
        f"{cfg['colocated_replicas']} colocated replicas against 1 prefill + 1 decode; {report['machine']})",
        "",
        f"{cfg['decodes']} long decodes ({cfg['decode_tokens']} tokens from ~30-word prompts) start at once; "
        f"{cfg['prefills']} long prompts (~{cfg['prompt_words']} words, {cfg['prefill_tokens']} tokens out) arrive "
        f"while they decode, one every {cfg['prefill_gap']} s. Targets: TTFT <= {cfg['ttft_slo']} s, TPOT <= "
        f"{cfg['tpot_slo']} s.",
        "",
        table(header, rows, "l" * len(header)),
        "",
        f"Long decodes' TPOT p99, colocated / disaggregated: **{report['tpot_p99_ratio']:.2f}x** (>= 1.5 wanted).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the server's --model (default: motet's default model)")
    ap.add_argument("--threads", type=int, default=1, help="per replica")
    ap.add_argument(
        "--colocated-replicas",
        type=int,
        default=2,
        help="replicas of the colocated run (2: the disaggregated run's prefill + decode replica; fewer only "
        "for a run that checks the benchmark, not the comparison)",
    )
    ap.add_argument("--decodes", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--prefills", type=int, default=6)
    ap.add_argument("--prompt-words", type=int, default=900)
    ap.add_argument("--prefill-tokens", type=int, default=4)
    ap.add_argument("--prefill-delay", type=float, default=1.0, help="seconds before the first long prompt")
    ap.add_argument("--prefill-gap", type=float, default=1.0, help="seconds between long prompts")
    ap.add_argument("--ttft-slo", type=float, default=8.0)
    ap.add_argument("--tpot-slo", type=float, default=0.15)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.out = args.out or f"benchmarks/reports/pd/{time.strftime('%Y%m%d-%H%M%S')}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    common = ["--max-num-seqs", str(args.max_num_seqs), "--max-ongoing-requests", str(4 * args.max_num_seqs)]
    with tempfile.TemporaryDirectory(prefix="motet-pd-bench-") as tmp:
        colocated = run_mode("colocated", [*common, "--replicas", str(args.colocated_replicas)], args)
        pd = ["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-shared-dir", f"{tmp}/kv-shared"]
        disaggregated = run_mode("disaggregated", [*common, *pd], args)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine(),
        "colocated": colocated,
        "disaggregated": disaggregated,
        "tpot_p99_ratio": colocated["decode"]["tpot_s"]["p99"] / disaggregated["decode"]["tpot_s"]["p99"],
    }
    write_report(Path(args.out), report, summary_md(report))


if __name__ == "__main__":
    main()
