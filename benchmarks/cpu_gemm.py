"""The native GEMM per instruction-set tier against torch's F.linear, on one model's projection shapes.

    python -m benchmarks.cpu_gemm [--rows 1 8 32 64 256] [--tiers avx512bf16 avx2] [--threads 2]
                                  [--quantized int8 int4] [--seconds 0.3] [--out DIR]

Shapes (SmolLM2-135M's: hidden 576, intermediate 1536, 9 q heads and 3 kv heads of 64): qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536, lm_head 49152x576. Each cell is GFLOPS (2 M N K / the best time of repeated
calls over --seconds): the native GEMM on bf16 and fp32 weights in every tier this CPU runs (`MOTET_CPU_ISA`'s
tiers; with --quantized, on those formats' packed weights too), torch's F.linear with bf16 x and weights (oneDNN's
bf16 kernels where the CPU has them) and with fp32 ones. Beside them the roofline they share: the CPU's fp32 FMA
peak on --threads threads (`fma_peak`: independent FMA chains with no memory traffic, built with the system C++
compiler for this CPU), so a cell's share of what the cores can do at all is one division. Prints a table per
row count; with --out writes results.json and summary.md there. Another process on the machine skews it: repeat
and keep the best.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from motet.kernels import cpu_isa, cpu_native
from motet.kernels.quant import FORMATS

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def best_time(fn, seconds: float) -> float:
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        best = min(best, t)
        if t0 + t > end:
            return best


# Twelve independent chains of fp32 FMAs per thread in the widest vectors this CPU has (twelve registers: no
# spills), nothing read from memory: the FMA units' rate.
FMA_SOURCE = r"""
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#ifdef __AVX512F__
constexpr int L = 16;
#else
constexpr int L = 8;
#endif
typedef float vec __attribute__((vector_size(4 * L)));
int main(int argc, char** argv) {
    const long iters = atol(argv[1]);
    double flops = 0, seconds = 0;
#pragma omp parallel reduction(+ : flops) reduction(max : seconds)
    {
        vec a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, b, c;
        for (int j = 0; j < L; ++j) {
            a0[j] = a1[j] = a2[j] = a3[j] = a4[j] = a5[j] = 1.0f + 1e-7f * j;
            a6[j] = a7[j] = a8[j] = a9[j] = a10[j] = a11[j] = 1.0f - 1e-7f * j;
            b[j] = 0.9999999f;
            c[j] = 1e-7f;
        }
        const double t0 = omp_get_wtime();
        for (long n = 0; n < iters; ++n) {
            a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c; a4 = a4 * b + c; a5 = a5 * b + c;
            a6 = a6 * b + c; a7 = a7 * b + c; a8 = a8 * b + c; a9 = a9 * b + c; a10 = a10 * b + c; a11 = a11 * b + c;
        }
        seconds = omp_get_wtime() - t0;
        const vec s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
        flops = 2.0 * L * 12 * iters + (s[0] == 12345.f);  // (the chains' result used)
    }
    printf("%f\n", flops / seconds / 1e9);
}
"""


def fma_peak(threads: int, seconds: float) -> float | None:
    """GFLOPS of fp32 FMAs on `threads` threads (FMA_SOURCE), or None where no C++ compiler builds it."""
    compiler = cpu_native.compiler()  # (the one the kernels are built with)
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma.cpp", Path(tmp) / "fma"
        src.write_text(FMA_SOURCE)
        flags = ["-O2", "-march=native", "-ffp-contract=fast", "-fopenmp"]
        if subprocess.run([compiler, *flags, str(src), "-o", str(exe)], capture_output=True).returncode:
            return None
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

        def run(iters: int) -> float:
            out = subprocess.run([str(exe), str(iters)], capture_output=True, text=True, env=env, check=True)
            return float(out.stdout)

        iters = 10_000_000
        while True:  # until one run takes --seconds; then the best of three such (a shared VM's cores vary)
            t0 = time.perf_counter()
            first = run(iters)
            if time.perf_counter() - t0 >= seconds or iters >= 10**10:
                return max(first, run(iters), run(iters))
            iters *= 4


def use_tier(name: str) -> None:
    """Run `name`'s kernels from here on (as MOTET_CPU_ISA would at start-up)."""
    os.environ[cpu_isa.ENV] = name
    cpu_isa.selected.cache_clear()
    assert cpu_native.isa() == name


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--tiers", nargs="+", default=[t.name for t in cpu_isa.TIERS if t.name != "scalar"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quantized", nargs="*", default=[], choices=["int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tiers = [t for t in args.tiers if not cpu_isa.missing(cpu_isa.BY_NAME[t])]
    g = torch.Generator().manual_seed(0)
    weights = {s: torch.randn(SHAPES[s], generator=g).mul_(0.05) for s in args.shapes}
    results: dict[str, dict[str, dict[str, float]]] = {}  # shape -> column -> rows -> GFLOPS
    for s, w32 in weights.items():
        N, K = w32.shape
        wb = w32.bfloat16()
        packed = cpu_native.pack(wb)
        packed32 = cpu_native.pack(w32)
        quantized = {f: cpu_native.pack_quantized(FORMATS[f].quantize(w32)) for f in args.quantized}
        cols: dict[str, dict[str, float]] = {}
        for M in args.rows:
            flops = 2 * M * N * K / 1e9
            x = torch.randn(M, K, generator=g)
            xb = x.bfloat16()
            cols.setdefault("torch bf16", {})[M] = flops / best_time(partial(F.linear, xb, wb), args.seconds)
            cols.setdefault("torch fp32", {})[M] = flops / best_time(partial(F.linear, x, w32), args.seconds)
            out = torch.empty(M, N)
            for t in tiers:
                use_tier(t)
                cols.setdefault(f"{t} bf16", {})[M] = flops / best_time(
                    partial(cpu_native.gemm, x, packed, N, out=out), args.seconds
                )
                cols.setdefault(f"{t} fp32", {})[M] = flops / best_time(
                    partial(cpu_native.gemm, x, packed32, N, out=out), args.seconds
                )
                for f, q in quantized.items():
                    cols.setdefault(f"{t} {f}", {})[M] = flops / best_time(
                        partial(cpu_native.gemm, x, q, N, out=out, quantized=f), args.seconds
                    )
        results[s] = cols
        print(f"\n{s} {N}x{K} (GFLOPS)")
        print(f"{'':>18}" + "".join(f"{M:>9}" for M in args.rows))
        for name, by_rows in cols.items():
            print(f"{name:>18}" + "".join(f"{by_rows[M]:>9.1f}" for M in args.rows))
    peak = fma_peak(args.threads, args.seconds)
    print(
        f"\nfp32 FMA peak, {args.threads} threads: "
        + (f"{peak:.1f} GFLOPS" if peak else "n/a (no C++ compiler)")
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({**results, "fma_peak_gflops": peak}, indent=1))
        lines = [
            f"The fp32 FMA peak on {args.threads} threads (no memory traffic): "
            + (f"{peak:.1f} GFLOPS." if peak else "n/a (no C++ compiler)."),
            "",
        ]
        for s, cols in results.items():
            lines += [
                f"### {s} {SHAPES[s][0]}x{SHAPES[s][1]} (GFLOPS)",
                "",
                "| | " + " | ".join(f"M={M}" for M in args.rows) + " |",
            ]
            lines.append("|---|" + "---:|" * len(args.rows))
            lines += [
                f"| {n} | " + " | ".join(f"{v[M]:.1f}" for M in args.rows) + " |" for n, v in cols.items()
            ]
            lines.append("")
        (args.out / "summary.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
