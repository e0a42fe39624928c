"""Prefill against the machine's peak: a load of --prompts prompts of --prompt-tokens tokens each (one output token,
distinct random tokens: no prefix-cache hit) through the offline engine, its prompt tokens/s turned into GFLOPS of the
decoder's projections (2 x their parameters a token), against the same run's torch linear on the model's own shapes
at the step's rows (its token budget), bf16 and fp32, the faster per shape (benchmarks/step_profile.py's peak).

    python -m benchmarks.prefill_peak [--dtype bfloat16] [--prompts 64] [--prompt-tokens 512] [--threads 2]
                                      [--rounds 2] [--out DIR]

The share counts the whole prefill's time (projections, attention, norms, the step's host work, the one logit row
a prompt samples) against the projections' peak alone: what a user's prompt load gets of the machine. Writes
results.json and summary.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks import cpu_info, cpu_line, write_report
from benchmarks.step_profile import flop_counts, measure_peak
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_store import DEFAULT_MODEL, resolve_model


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="timed loads (the best is reported, all are kept)")
    ap.add_argument("--peak-seconds", type=float, default=0.3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    model_dir = resolve_model(args.model or DEFAULT_MODEL)
    llm = LLM(str(model_dir), dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.prompts,
              enable_prefix_caching=False, speculative="off")  # fmt: skip
    cfg, rows = llm.engine.model_config, llm.engine.config.step_tokens
    peak = measure_peak(cfg, [rows], args.threads, args.peak_seconds).get(rows)
    flops = flop_counts(cfg)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts(4, args.prompt_tokens, cfg.vocab_size, seed=99), params)  # warm-up
    runs = []
    for r in range(args.rounds):
        load = prompts(args.prompts, args.prompt_tokens, cfg.vocab_size, seed=r)
        t0 = time.perf_counter()
        llm.generate(load, params)
        seconds = time.perf_counter() - t0
        tokens = args.prompts * args.prompt_tokens
        gflops = flops["decoder"] * tokens / seconds / 1e9 if flops else None
        runs.append({"seconds": seconds, "tokens_per_s": tokens / seconds, "gflops": gflops,
                     "pct_of_peak": 100 * gflops / peak["decoder"] if gflops and peak else None})  # fmt: skip
        print(
            f"round {r}: {tokens} prompt tokens in {seconds:.2f} s, {tokens / seconds:.0f} tok/s, "
            f"{gflops:.0f} GFLOPS" + (f" ({runs[-1]['pct_of_peak']:.0f}% of peak)" if peak else ""),
            flush=True,
        )
    best = max(runs, key=lambda x: x["tokens_per_s"])
    report = {"config": vars(args), "machine": cpu_info(), "step_rows": rows, "peak": peak, "runs": runs,
              "best": best}  # fmt: skip
    shapes = peak["shapes"] if peak else {}
    lines = [
        f"# Prefill against the peak ({args.dtype}, {args.threads} threads)",
        "",
        cpu_line(report["machine"]),
        "",
        f"{args.prompts} prompts of {args.prompt_tokens} tokens, one output token each, no prefix-cache hit; the "
        f"step's {rows} tokens are torch's rows.",
        "",
        "| round | seconds | prompt tok/s | GFLOPS (projections) | share of torch's peak |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {i} | {x['seconds']:.2f} | {x['tokens_per_s']:.0f} | {x['gflops']:.0f} | "
            f"{x['pct_of_peak'] or float('nan'):.0f}% |"
            for i, x in enumerate(runs)
        ),  # fmt: skip
        "",
        f"torch's linear at {rows} rows (GFLOPS bf16 / fp32): "
        + ", ".join(f"{n} {g['bfloat16']:.0f} / {g['float32']:.0f}" for n, g in shapes.items())
        + (f"; the forward's shapes at the faster of each: {peak['decoder']:.0f}" if peak else ""),
    ]
    out = Path(args.out) if args.out else Path("benchmarks/reports/prefill_peak") / time.strftime("%Y-%m-%d")
    write_report(out, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
