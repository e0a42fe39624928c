"""The served FLOP rate: the work a server hands its clients (their prompt and output tokens times the model's
FLOPs) per second, against this machine's GEMM peak measured in the same run.

    python -m benchmarks.served_flops [--model M] [--dtype bfloat16] [--clients 8 32 64] [--rounds 2]
                                      [--max-tokens 64] [--prompt-words 64] [--threads 2]
                                      [--url URL --served-model NAME] [--out DIR]

The peak, measured first on a quiet machine: the model's own projection shapes (q, k, v, o, gate, up, down,
lm_head) at --peak-rows rows, each shape's fastest GEMM of torch's linear in bfloat16 and float32 and motet's
native GEMM (this CPU's instruction-set tier) on packed bf16 and fp32 weights; the peak is the forward's
projections at those speeds (their FLOPs over the sum of their times, as benchmarks/step_profile.py takes it).
Beside it the roofline no kernel passes: the CPU's fp32 FMA peak on --threads threads (benchmarks/cpu_gemm.py's
`fma_peak`), where a C++ compiler builds it.
Then per level C, R x C streamed chat requests (R: --rounds), C at once, greedy, --max-tokens each with EOS
ignored, against `motet serve` (started here) or any OpenAI-compatible server at --url (vLLM's CPU backend,
llama.cpp's server: the same count of work, their own usage). Each answered request's work is counted from its
usage alone (`served_flops`): P prompt and C output tokens run P + C - 1 tokens through the decoder's
projections (2 FLOPs per weight), C logit rows through the lm_head, and each token at position t attends t + 1
earlier positions (a sliding window's layers at most the window) at 4 x heads x head_dim FLOPs each. A prefix
served from the cache counts as served work: the client got it. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks import chat_body, cpu_info, cpu_line, write_report
from benchmarks.cpu_gemm import fma_peak
from benchmarks.step_profile import fastest_gflops, linear_gflops, linear_shapes
from motet.evals.serving_bench import make_prompts, run_level, summarize


def attended(tokens: int, window: int | None) -> int:
    """Key positions the first `tokens` positions of a sequence attend in one layer (causal; at most `window`
    each)."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def served_flops(cfg, prompt_tokens: int, completion_tokens: int) -> int:
    """FLOPs of one request's served work (see the module's doc): its tokens through the decoder's projections,
    its logit rows through the lm_head, and attention's two products over the positions each token attends."""
    shapes = linear_shapes(cfg)
    if shapes is None:
        raise ValueError(
            f"{cfg.architecture}: a sparse (MoE) model's tokens read only some experts: not counted"
        )
    tokens = prompt_tokens + max(0, completion_tokens - 1)
    decoder = sum(2 * k * n * count for k, n, count in shapes.values())
    lm_head = 2 * shapes["lm_head"][0] * shapes["lm_head"][1]
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim  # (q . k and p . v, per head)
    windowed = set(cfg.window_layers)
    keys = sum(
        attended(tokens, cfg.sliding_window if i in windowed else None) for i in range(cfg.num_hidden_layers)
    )
    return tokens * decoder + completion_tokens * lm_head + per_key * keys


def measure_peak(cfg, rows: int, threads: int, seconds: float) -> dict:
    """The GEMM peak at `rows` rows on the model's projection shapes (see the module's doc): per shape, each
    kernel's GFLOPS; `decoder`, the forward's projections each at its fastest kernel; `lm_head`, the logits'."""
    from motet.kernels import cpu_native

    torch.set_num_threads(threads)
    shapes, per_shape = linear_shapes(cfg), {}
    for name, (k, n, _) in shapes.items():
        measured = {f"torch {str(dt).removeprefix('torch.')}": linear_gflops(rows, k, n, dt, seconds)
                    for dt in (torch.bfloat16, torch.float32)}  # fmt: skip
        x, out, w = torch.randn(rows, k), torch.empty(rows, n), torch.randn(n, k)
        for dt in (torch.bfloat16, torch.float32):  # (the native GEMM reads x in fp32, its weights in either)
            call = partial(cpu_native.gemm, x, cpu_native.pack(w.to(dt)), n, out=out)
            measured[f"motet {cpu_native.isa()} {str(dt).removeprefix('torch.')}"] = fastest_gflops(
                call, 2 * rows * k * n, seconds
            )
        per_shape[name] = measured
    best = {name: max(m.values()) for name, m in per_shape.items()}
    flops = {name: 2 * k * n * count for name, (k, n, count) in shapes.items()}
    decoder = sum(flops.values()) / sum(f / best[name] for name, f in flops.items() if f)
    fma = fma_peak(threads, seconds)
    return {"rows": rows, "shapes": per_shape, "decoder": decoder, "lm_head": best["lm_head"], "fma": fma}


def run_levels(url: str, model: str, cfg, args) -> list[dict]:
    """Per level: the summary of its requests and their served work over the level's wall time."""
    rows = []
    for c in args.clients:
        texts = make_prompts(args.rounds * c, args.prompt_words, c)
        reqs = [("/chat/completions", chat_body(model, t, args.max_tokens)) for t in texts]
        records, duration = asyncio.run(run_level(url, reqs, c))
        res = summarize(records, duration, c)
        work = sum(served_flops(cfg, r.prompt_tokens, r.output_tokens) for r in records if r.ok)
        prompt = sum(r.prompt_tokens for r in records if r.ok)
        rows.append({"clients": c, "completed": res["completed"], "requests": res["requests"],
                     "errors": res["errors"], "duration_s": duration, "prompt_tokens": prompt,
                     "output_tokens_per_s": res["output_token_throughput"], "served_gflops": work / duration / 1e9,
                     "ttft_p50_s": res["ttft_s"]["p50"], "ttft_p99_s": res["ttft_s"]["p99"]})  # fmt: skip
        print(f"{c:3d} clients: {rows[-1]['served_gflops']:.1f} served GFLOPS, "
              f"{res['output_token_throughput']:.1f} output tok/s, {res['completed']}/{res['requests']} answered",
              flush=True)  # fmt: skip
    return rows


def summary_md(report: dict) -> str:
    peak = report["peak"]
    lines = [
        "# Served FLOP rate",
        "",
        f"Model `{report['model']}`, {report['server']}, {report['threads']} threads; {report['max_tokens']} output "
        f"tokens per request (greedy, EOS ignored), prompts of ~{report['prompt_words']} words, {report['rounds']} "
        "rounds of C requests per level, C at once.",
        "",
        f"CPU: {cpu_line(report['cpu'])}.",
        "",
        f"GEMM peak at {peak['rows']} rows on the model's projections (each at its fastest of torch's linear in "
        f"bf16 / fp32 and motet's native GEMM): forward {peak['decoder']:.1f} GFLOPS, lm_head {peak['lm_head']:.1f}. "
        + (f"The fp32 FMA peak: {fma:.1f} GFLOPS." if (fma := peak.get("fma")) else "The FMA peak: n/a."),
        "",
        "| clients | answered | output tok/s | served GFLOPS | of the forward's peak | of the FMA peak | "
        "TTFT p50 / p99 s |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["levels"]:
        of_fma = f"{100 * r['served_gflops'] / fma:.0f}%" if fma else "n/a"
        lines.append(f"| {r['clients']} | {r['completed']}/{r['requests']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['served_gflops']:.1f} | {100 * r['served_gflops'] / peak['decoder']:.0f}% | {of_fma} | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="the checkpoint whose shapes count the work (default: motet's)"
    )
    ap.add_argument("--dtype", default="auto", help="as `motet serve --dtype` (a server started here)")
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-rows", type=int, default=256)
    ap.add_argument("--peak-seconds", type=float, default=0.3)
    ap.add_argument(
        "--url", default=None, help="a running OpenAI-compatible server's /v1 root (default: start motet)"
    )
    ap.add_argument("--served-model", default=None, help="the model name its requests carry (with --url)")
    ap.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="more `motet serve` arguments"
    )
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> None:
    from motet.engine.weights.model_config import load_model_config
    from motet.engine.weights.model_store import resolve_model
    from motet.evals.server import ManagedServer

    args = build_parser().parse_args(argv)
    model_dir = Path(resolve_model(args.model))
    cfg = load_model_config(model_dir)
    peak = measure_peak(cfg, args.peak_rows, args.threads, args.peak_seconds)
    print(f"peak at {args.peak_rows} rows: {peak['decoder']:.1f} GFLOPS on the forward's shapes", flush=True)
    report = {"model": model_dir.name, "threads": args.threads, "max_tokens": args.max_tokens,
              "prompt_words": args.prompt_words, "rounds": args.rounds, "cpu": cpu_info(), "peak": peak}  # fmt: skip
    if args.url:
        report["server"] = f"the server at {args.url}"
        report["levels"] = run_levels(args.url, args.served_model or model_dir.name, cfg, args)
    else:
        server_args = ["--dtype", args.dtype, "--threads", str(args.threads), "--max-num-seqs",
                       str(max(args.clients)), *args.server_args]  # fmt: skip
        report["server"] = f"motet serve {' '.join(server_args)}"
        with ManagedServer(server_args, model=str(model_dir)) as server:
            report["levels"] = run_levels(server.base_url, model_dir.name, cfg, args)
    out = Path(args.out or f"reports/served_flops/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
