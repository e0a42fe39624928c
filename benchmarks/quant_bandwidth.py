"""Batch-1 decode against the memory bandwidth ceiling, per weight format: how close a step comes to reading
its weights at the speed the machine reads memory.

    python -m benchmarks.quant_bandwidth [--formats bf16 int8 int4 gguf] [--threads 2] [--tokens 128]
                                         [--repeats 3] [--out DIR]

The ceiling: the machine's read bandwidth, measured here with --threads threads as the best of (a) torch
summing a 1 GiB fp32 tensor and (b) the native GEMV streaming a 1 GiB bf16 weight at one row (each the best
of 5 passes). The bytes a token reads: every packed weight the step streams (the decoder's projections and
the lm_head, in their format) plus the KV cache read at the mean context; not the embedding row. For each
format the offline engine (speculation off: one token per step) decodes --tokens tokens of one greedy
request after a 64-token prompt, --repeats times; the median time per token gives the achieved bandwidth
(bytes / time) and its fraction of the ceiling. Each format's step time is compared to bf16's in the same
run. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks import write_report
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_store import resolve_model
from motet.evals.serving_bench import machine
from motet.kernels import cpu_native

GIB = 1 << 30
QUANTIZATION = {"bf16": None, "int8": "int8", "int4": "int4", "gguf": "gguf"}


def read_bandwidth(threads: int, nbytes: int = GIB) -> dict[str, float]:
    """Bytes per second: torch's sum over `nbytes` (1 GiB) of fp32, and the native GEMV over a bf16 weight of as
    many bytes."""
    torch.set_num_threads(threads)
    a = torch.ones(nbytes // 4)

    def best(fn, nbytes: int) -> float:
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times)

    out = {"torch_sum": best(a.sum, nbytes)}
    del a
    K = 2048
    w = torch.ones(nbytes // 2 // K, K, dtype=torch.bfloat16)
    packed = cpu_native.pack(w)
    del w
    x = torch.ones(1, K)
    out["native_gemv"] = best(lambda: cpu_native.gemm(x, packed, packed.shape[0] * cpu_native.PANEL), nbytes)
    return out


def step_bytes(llm: LLM, context: int) -> int:
    """The bytes one decode step streams: packed weights (projections, lm_head) and the KV cache read."""
    native = llm.engine.runner.native
    cfg = llm.engine.model_config
    weights = native.arena._used  # every packed weight, each read once a step
    kv_elem = llm.engine.runner.kv_caches[0][0].element_size()
    kv = 2 * cfg.num_hidden_layers * context * cfg.num_key_value_heads * cfg.head_dim * kv_elem
    return weights + kv


def decode(fmt: str, args, model: str) -> dict:
    llm = LLM(model, dtype="bfloat16", quantization=QUANTIZATION[fmt], num_threads=args.threads,
              max_num_seqs=1, speculative="off")  # fmt: skip
    prompt = list(range(100, 164))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
    per_token = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - t0
        per_token.append(elapsed / len(out.token_ids))
    nbytes = step_bytes(llm, len(prompt) + args.tokens // 2)
    ms = 1e3 * statistics.median(per_token)
    return {"format": fmt, "ms_per_token": ms, "ms_range": [1e3 * min(per_token), 1e3 * max(per_token)],
            "bytes_per_token": nbytes, "achieved_gbs": nbytes / ms / 1e6}  # fmt: skip


def summary_md(report: dict) -> str:
    ceiling = report["ceiling_gbs"]
    bf16 = next((r for r in report["rows"] if r["format"] == "bf16"), None)
    lines = [
        f"# Batch-1 decode vs the read-bandwidth ceiling ({report['threads']} threads, {report['machine']})",
        "",
        f"Ceiling: {ceiling:.1f} GB/s (torch sum {report['bandwidth_gbs']['torch_sum']:.1f}, native GEMV "
        f"{report['bandwidth_gbs']['native_gemv']:.1f}).",
        "",
        "| format | MB read per token | ms per token (min-max) | achieved GB/s | of the ceiling | vs bf16 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        speed = f"{bf16['ms_per_token'] / r['ms_per_token']:.2f}x" if bf16 else "-"
        lines.append(
            f"| {r['format']} | {r['bytes_per_token'] / 1e6:.1f} | {r['ms_per_token']:.2f} "
            f"({r['ms_range'][0]:.2f}-{r['ms_range'][1]:.2f}) | {r['achieved_gbs']:.1f} | "
            f"{100 * r['achieved_gbs'] / ceiling:.0f}% | {speed} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", nargs="+", default=list(QUANTIZATION), choices=list(QUANTIZATION))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ceiling-mib",
        type=int,
        default=GIB >> 20,
        help="MiB read by each ceiling measurement (far above the caches; a smaller one: a smoke run)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = str(resolve_model(args.model))
    bandwidth = read_bandwidth(args.threads, args.ceiling_mib << 20)
    rows = []
    for fmt in args.formats:
        rows.append(decode(fmt, args, model))
        print(f"{fmt}: {rows[-1]['ms_per_token']:.2f} ms/token", flush=True)
    report = {"threads": args.threads, "machine": machine(), "tokens": args.tokens,
              "bandwidth_gbs": {k: v / 1e9 for k, v in bandwidth.items()},
              "ceiling_gbs": max(bandwidth.values()) / 1e9, "rows": rows}  # fmt: skip
    out = Path(args.out or f"benchmarks/reports/quant_bandwidth/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
