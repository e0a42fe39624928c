"""W8A16 / W4A16 GEMM in Triton: ``x @ W^T (+ bias)`` with W in a block format of motet/kernels/quant.py.

The kernel reads the weight as `QuantizedWeight` stores it (int8 [N, K], or Q4_1's nibbles [N, K / 2];
fp16 scales and mins [N, K / 32]; MXFP4's FP4 codes packed as Q4_1's, its E8M0 exponents [N, K / 32]): rows are contiguous along K, which is both what coalesces (a warp reads
whole 128-byte lines of a row) and what the tensor cores' B operand wants (K-contiguous per column), so no
repacked copy is made and the GPU holds the weight once. A program owns BLOCK_M rows of x times BLOCK_N
outputs and walks its share of K, BLOCK_K values a step: it loads the step's bytes as
[BLOCK_N, blocks, bytes per block] (a thread's 16-byte vector lies in one quant block, with one scale and
min), unpacks in registers, dequantizes in fp32 exactly as `QuantizedWeight.dequantize` does (q * scale
(+ min); the integers become floats by the 2^23 trick, not by the slow int-to-float conversion), rounds
once to x's dtype and multiplies on the tensor cores with fp32 accumulation. Q4_1's byte j of a block holds
values j and j + 16, so the low nibbles meet x's first 16 columns of each block and the high nibbles its
last 16: two dots, no interleaving.

Small batches (decode, M <= 16: one 16-row tile) are bound by the weight's bytes, so the grid must cover
the GPU with N tiles alone or, for a narrow layer, split K across programs (Marlin's answer for the same
problem): each split writes an fp32 partial and a second small kernel sums them in split order, adds the
bias and casts. Nothing is atomic, so the result is deterministic; and for M <= 16 the launch does not
depend on M, so a decode row's output does not depend on how many rows share its step. No host sync, and
the only allocations are the output and the partials (from the caching allocator): the launch can be
captured in a CUDA graph.

`quant_linear` is the entry point (CUDA, or CPU under TRITON_INTERPRET=1); `applies` says where the model
uses it (motet/engine/worker/model.py `Linear.forward`; elsewhere the torch reference `QuantizedWeight.linear`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from motet.kernels import triton_support
from motet.kernels.quant import BLOCK, QuantizedWeight

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SMALL_M = 16  # rows in one tile of tl.dot's minimum height: decode batches, bound by the weight's bytes
TARGET_WAVES = 2  # programs per multiprocessor a split-K launch aims at (when the tiles leave SMs idle)
MIN_STEPS_PER_SPLIT = 4  # K steps a split keeps at least, so its pipeline's warm-up stays amortized


def applies(x: torch.Tensor) -> bool:
    """Whether a quantized layer's product on `x` goes through `quant_linear` (CUDA, Triton installed)."""
    return triton_support.AVAILABLE and x.is_cuda


@dataclass(frozen=True)
class TileConfig:
    """A launch: tile sizes (block_k in weight values, a multiple of 32; all powers of two), how many
    programs share K (`split_k`: each a contiguous run of K steps), and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        sizes = (self.block_m, self.block_n, self.block_k // BLOCK)
        if (
            self.block_k % BLOCK
            or any(s < 1 or s & (s - 1) for s in sizes)
            or min(self.block_m, self.block_n) < 16
        ):
            raise ValueError(f"{self}: block_m, block_n >= 16 and block_k / {BLOCK} must be powers of two")
        if self.split_k < 1:
            raise ValueError(f"{self}: split_k must be at least 1")


def choose_config(M: int, N: int, K: int, bits: int, multiprocessors: int, x_bytes: int = 2) -> TileConfig:
    """The launch for an [M, K] x [N, K]^T product, the weight in `bits` per value, x in `x_bytes` each.

    M <= 16: one row tile, 128 weight bytes of a row per step (a full cache line), 64 outputs a program;
    where that leaves multiprocessors without a program, split-K until the launch has about TARGET_WAVES
    programs per multiprocessor (or each split MIN_STEPS_PER_SPLIT steps): every split's fp32 partials
    cost M * N * 8 bytes of traffic, so a wide layer is not split. Nothing here depends on M within that
    range. Larger M (prefill) is
    compute-bound: larger tiles reuse each dequantized weight tile over more rows, and K is split only
    where the tiles would leave more than half the multiprocessors idle. fp32 x takes half the K step
    (its tiles are twice the registers and shared memory). The sizes were checked to compile for sm_80
    and sm_90 without spilling registers and within their shared memory."""
    if M <= SMALL_M:
        block_m, block_n, block_k, warps, stages = SMALL_M, 64, 128 * 8 // bits, 4, 4
    elif M <= 64:
        block_m, block_n, block_k, warps, stages = (32 if M <= 32 else 64), 64, 128, 4, 3
    else:
        block_m, block_n, block_k, warps, stages = (64 if M <= 128 else 128), 128, 64, 8, 3
    if x_bytes > 2:
        block_k, stages = max(block_k // 2, BLOCK), min(stages, 3)
    tiles = triton_support.cdiv(M, block_m) * triton_support.cdiv(N, block_n)
    steps = triton_support.cdiv(K, block_k)
    split = 1
    # bandwidth-bound: split where the tiles leave a multiprocessor without work, up to TARGET_WAVES
    # programs each (bytes in flight); compute-bound: only where they leave half of them idle
    idle, target = (
        (multiprocessors, TARGET_WAVES * multiprocessors) if M <= 64 else (multiprocessors // 2,) * 2
    )
    if tiles < idle:
        split = max(1, min(triton_support.cdiv(target, tiles), steps // MIN_STEPS_PER_SPLIT))
    split = triton_support.cdiv(steps, triton_support.cdiv(steps, split))  # no empty split
    return TileConfig(block_m, block_n, block_k, split, warps, stages)


def default_config(x: torch.Tensor, qweight: QuantizedWeight) -> TileConfig:
    """The launch `quant_linear` makes for x [M, K] on this weight and x's device."""
    N, K = qweight.shape
    return choose_config(x.shape[0], N, K, qweight.format.bits, _multiprocessors(x.device), x.element_size())


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (a property query, no sync); under the interpreter a small stand-in."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def quant_linear(
    x: torch.Tensor,
    qweight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for x [..., K] in fp16/bf16/fp32 and W [N, K] quantized (int8 or int4), in x's
    dtype, accumulated in fp32: F.linear of x and the dequantized weight rounded to x's dtype. x itself is
    used as it is (the CPU product, `QuantizedWeight.linear`, rounds it to int8 blocks first). `config`
    overrides the launch (benchmarks and tests)."""
    if not triton_support.AVAILABLE:
        raise RuntimeError("quant_linear needs triton")
    N, K = qweight.shape
    if x.shape[-1] != K or x.dtype not in DTYPES:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a {N}x{K} weight (fp16/bf16/fp32 x)")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit a {N}x{K} weight")
    if qweight.data.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"x is on {x.device}, the weight on {qweight.data.device}: one device for all")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.reshape(*lead, N)
    int4 = qweight.format.bits == 4  # (Q4_1's nibbles, or MXFP4's codes: both two values a byte alike)
    mxfp4 = qweight.format.codebook is not None
    cfg = config or default_config(x2, qweight)
    steps = triton_support.cdiv(K, cfg.block_k)
    steps_per_split = triton_support.cdiv(steps, cfg.split_k)
    split = triton_support.cdiv(steps, steps_per_split)
    # fp32 partials [split, M, N] when K is shared; else the kernel writes `out` itself
    dest = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out.unsqueeze(0)
    data, scales = qweight.data.view(torch.uint8), qweight.scales  # int8 too: the kernel reads bytes
    mins = qweight.mins if qweight.mins is not None else scales  # unused without mins: any tensor will do
    grid = (triton_support.cdiv(M, cfg.block_m) * triton_support.cdiv(N, cfg.block_n), split)
    interpreted = not x.is_cuda
    _jit()._quant_gemm_kernel[grid](
        x2, data, scales, mins, bias if bias is not None else scales, dest,
        M, N, K, steps_per_split,
        *x2.stride(), *data.stride(), *scales.stride(), *mins.stride(), *dest.stride(),
        INT4=int4,
        MXFP4=mxfp4,
        HAS_BIAS=bias is not None and split == 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCKS_PER_STEP=cfg.block_k // BLOCK,
        # fp32 x gets true fp32 dots (tl.dot defaults to tf32 on NVIDIA), as F.linear does
        PRECISION="ieee" if interpreted or x.dtype == torch.float32 else None,
        # Under TRITON_INTERPRET=1 tl.dot on 16-bit floats multiplies raw bits (triton 3.9): fp32 there,
        # from the same rounded values
        DOT_FP32=interpreted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_n = 256
        _jit()._split_sum_kernel[(M, triton_support.cdiv(N, reduce_n))](
            dest, bias if bias is not None else dest, out, N, split,
            *dest.stride(), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK_N=reduce_n, INTERPRETED=interpreted,
        )  # fmt: skip
    return out.reshape(*lead, N)


def _jit():
    """This module's Triton kernels (motet/kernels/jit/triton_quant.py), imported at their first launch."""
    return triton_support.kernels(__name__)
