"""GPU time of the SGMV and paged-attention kernels without the host's launch cost: N launches captured in
one CUDA graph, replayed and timed with CUDA events (benchmarks/gpu_bench.py times a Python loop of launches,
which at these sizes measures the launch path). Writes kernel_graph_bench.{json,md} into --out.

    PYTHONPATH=. python scripts/gpu/kernel_graph_bench.py --out OUT
"""

# ruff: noqa: B023  (each timed lambda runs before the loop moves on)
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.gpu_common import graph_us

HBM = 3.35e12  # H100 SXM's specified HBM3 bandwidth, bytes/s
CALLS, REPLAYS = 20, 10  # launches captured in one graph, replays of it timed


def sgmv_rows() -> list[dict]:
    from benchmarks.gpu_bench import sgmv_calls, sgmv_case

    rows = []
    for tokens in (1, 8, 64, 256):
        for rank in (8, 16, 64):
            for n in sorted({min(a, tokens) for a in (1, 8, 64)}):
                c = sgmv_case(tokens, rank, n)
                shrink, expand, _ = sgmv_calls(c)
                shrink()
                t_s, t_e = graph_us([shrink] * CALLS, REPLAYS), graph_us([expand] * CALLS, REPLAYS)
                b_s, b_e = c["bytes_shrink"], c["bytes_expand"]
                rows.append({"tokens": tokens, "rank": rank, "adapters": n, "shrink_us": t_s, "expand_us": t_e,
                             "shrink_roofline": b_s / (t_s * 1e-6) / HBM, "expand_roofline": b_e / (t_e * 1e-6) / HBM,
                             "both_roofline": (b_s + b_e) / ((t_s + t_e) * 1e-6) / HBM})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def attention_rows() -> list[dict]:
    from motet.kernels import paged_attention as pa
    from motet.kernels.attention_args import AttentionOptions, PagedContext

    rows, dev, dt = [], "cuda", torch.bfloat16
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    for batch in (1, 8, 64, 256):
        for ctx in (512, 2048):
            nb = batch * ctx // block
            k = torch.randn(nb, block, kv_heads, head_dim, device=dev, dtype=dt)
            v = torch.randn_like(k)
            tables = torch.arange(nb, device=dev, dtype=torch.int32).view(batch, -1)
            q = torch.randn(batch, heads, head_dim, device=dev, dtype=dt)
            qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
            lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
            paged, options = PagedContext(tables, qsl, lens, max_query_len=1), AttentionOptions(0.125)
            attend = lambda: pa.paged_attention_triton(q, (k, v), paged, options)
            t = graph_us([attend] * CALLS, REPLAYS)
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
            rows.append({"batch": batch, "context": ctx, "us": t, "roofline": kv_bytes / (t * 1e-6) / HBM})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    report = {
        "device": torch.cuda.get_device_name(),
        "sgmv": sgmv_rows(),
        "paged_attention": attention_rows(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_graph_bench.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Kernel GPU time from CUDA-graph replay on {report['device']} (bf16; roofline {HBM / 1e12} TB/s)", "",
             "| tokens | rank | adapters | shrink us | expand us | shrink / expand / both roofline |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["sgmv"]:
        lines.append(f"| {r['tokens']} | {r['rank']} | {r['adapters']} | {r['shrink_us']:.2f} | {r['expand_us']:.2f} | "
                     f"{r['shrink_roofline']:.1%} / {r['expand_roofline']:.1%} / {r['both_roofline']:.1%} |")  # fmt: skip
    lines += ["", "| batch | context | paged attention us | roofline (KV bytes) |", "|---:|---:|---:|---:|"]
    for r in report["paged_attention"]:
        lines.append(f"| {r['batch']} | {r['context']} | {r['us']:.2f} | {r['roofline']:.1%} |")
    (args.out / "kernel_graph_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
