"""The Triton grouped-expert kernel (motet/kernels/triton_moe.py) against the torch path the model takes off
CUDA (motet/engine/worker/model.py `grouped_experts`: one gate/up and one down `F.linear` per expert with rows) on
one CUDA device, with the fraction of the device's copy bandwidth each reaches. Writes results.json and summary.md into --out.

    python -m benchmarks.moe_gpu_bench --out OUT [--shape 8x4096x14336] [--top-k 2] [--tokens 1,8,32,64]

A shape ExHxI: E experts of hidden size H and intermediate size I (8x4096x14336: Mixtral-8x7B's; bf16 random
weights). Each case routes `tokens` tokens to top-k experts at random, so rows = tokens x top_k. Times are
CUDA-event means over 50 calls after warm-up (the kernel's tile table needs one host sync, so no graph);
the bytes a call must move are the touched experts' weights (3 H I x 2 bytes each) plus the rows in and out.
`--device cpu` runs it on the CPU under Triton's interpreter (TRITON_INTERPRET=1), timed by the host's clock: a
smoke run at a tiny --shape (tests/benchmarks/), not a measurement.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks import write_report
from benchmarks.gpu_common import copy_bandwidth
from motet.engine.worker.model import grouped_experts
from motet.kernels import triton_moe


def mean_us(fn, device: torch.device, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    if device.type != "cuda":  # --device cpu (a smoke run: Triton's interpreter): the host's clock
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return 1e6 * (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8x4096x14336")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument(
        "--out", type=Path, default=Path("benchmarks/reports/moe_gpu") / time.strftime("%Y-%m-%d")
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: Triton's interpreter (TRITON_INTERPRET=1) at a tiny --shape, a smoke run")  # fmt: skip
    ap.add_argument("--calls", type=int, default=50, help="timed calls per case")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    device = torch.device(args.device)
    E, H, inter = (int(v) for v in args.shape.lower().split("x"))
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(E, 2 * inter, H, device=device, dtype=torch.bfloat16, generator=g) * 0.02
    down = torch.randn(E, H, inter, device=device, dtype=torch.bfloat16, generator=g) * 0.02
    bandwidth = copy_bandwidth(device)
    rows_out = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        ids = torch.stack(
            [torch.randperm(E, device=device, generator=g)[: args.top_k] for _ in range(tokens)]
        )
        expert_ids = ids.flatten()
        rows = torch.randn(expert_ids.numel(), H, device=device, dtype=torch.bfloat16, generator=g)
        got = triton_moe.grouped_experts(rows, expert_ids, gate_up, down)
        want = grouped_experts(rows, expert_ids, gate_up, down)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        touched = len(set(expert_ids.tolist()))
        nbytes = touched * 3 * H * inter * 2 + 2 * 2 * rows.numel()
        kernel_call = partial(triton_moe.grouped_experts, rows, expert_ids, gate_up, down)
        t_kernel = mean_us(kernel_call, device, args.calls)
        t_torch = mean_us(partial(grouped_experts, rows, expert_ids, gate_up, down), device, args.calls)
        rows_out.append(
            {
                "tokens": tokens,
                "rows": rows.shape[0],
                "experts_touched": touched,
                "kernel_us": t_kernel,
                "torch_us": t_torch,
                "speedup": t_torch / t_kernel,
                "kernel_bandwidth_fraction": nbytes / (t_kernel * 1e-6) / bandwidth,
                "torch_bandwidth_fraction": nbytes / (t_torch * 1e-6) / bandwidth,
                "max_relative_error": err,
            }
        )
        print(rows_out[-1], flush=True)
    lines = [
        f"# Grouped experts on {torch.cuda.get_device_name() if device.type == 'cuda' else 'the CPU (Triton interpreted)'}: "
        f"{args.shape}, top-{args.top_k}, bf16",
        "",
        f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s",
        "",
        "| tokens | rows | experts | kernel us | torch us | speedup | kernel BW | torch BW | max rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows_out:
        lines.append(
            f"| {r['tokens']} | {r['rows']} | {r['experts_touched']} | {r['kernel_us']:.1f} | {r['torch_us']:.1f} | "
            f"{r['speedup']:.2f} | {r['kernel_bandwidth_fraction']:.0%} | {r['torch_bandwidth_fraction']:.0%} | "
            f"{r['max_relative_error']:.1e} |"
        )
    report = {"args": vars(args) | {"out": str(args.out)}, "copy_bandwidth": bandwidth, "results": rows_out}
    write_report(args.out, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
