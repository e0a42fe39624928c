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

from motet.kernels.quant import BLOCK, QuantizedWeight
from motet.kernels.triton_support import tl, triton

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SMALL_M = 16  # rows in one tile of tl.dot's minimum height: decode batches, bound by the weight's bytes
TARGET_WAVES = 2  # programs per multiprocessor a split-K launch aims at (when the tiles leave SMs idle)
MIN_STEPS_PER_SPLIT = 4  # K steps a split keeps at least, so its pipeline's warm-up stays amortized


def applies(x: torch.Tensor) -> bool:
    """Whether a quantized layer's product on `x` goes through `quant_linear` (CUDA, Triton installed)."""
    return triton is not None and x.is_cuda


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
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    steps = triton.cdiv(K, block_k)
    split = 1
    # bandwidth-bound: split where the tiles leave a multiprocessor without work, up to TARGET_WAVES
    # programs each (bytes in flight); compute-bound: only where they leave half of them idle
    idle, target = (
        (multiprocessors, TARGET_WAVES * multiprocessors) if M <= 64 else (multiprocessors // 2,) * 2
    )
    if tiles < idle:
        split = max(1, min(triton.cdiv(target, tiles), steps // MIN_STEPS_PER_SPLIT))
    split = triton.cdiv(steps, triton.cdiv(steps, split))  # no empty split
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
    if triton is None:
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
    steps = triton.cdiv(K, cfg.block_k)
    steps_per_split = triton.cdiv(steps, cfg.split_k)
    split = triton.cdiv(steps, steps_per_split)
    # fp32 partials [split, M, N] when K is shared; else the kernel writes `out` itself
    dest = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out.unsqueeze(0)
    data, scales = qweight.data.view(torch.uint8), qweight.scales  # int8 too: the kernel reads bytes
    mins = qweight.mins if qweight.mins is not None else scales  # unused without mins: any tensor will do
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split)
    interpreted = not x.is_cuda
    _quant_gemm_kernel[grid](
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
        _split_sum_kernel[(M, triton.cdiv(N, reduce_n))](
            dest, bias if bias is not None else dest, out, N, split,
            *dest.stride(), *out.stride(),
            HAS_BIAS=bias is not None, BLOCK_N=reduce_n, INTERPRETED=interpreted,
        )  # fmt: skip
    return out.reshape(*lead, N)


if triton is not None:

    @triton.jit
    def _int_to_f32(v):
        """int32 values in [0, 2^23) as exact fp32: 2^23's bits with v as the mantissa, minus 2^23 (an OR
        and a subtraction at full rate, where int-to-float conversion runs at a quarter)."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _fp4(code):
        """FP4 E2M1 codes (int32 0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) as their fp32 values:
        m / 2 for exponent 0, else (2 + m) * 2^(e - 2)."""
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        magnitude = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
        return tl.where((code & 8) != 0, -magnitude, magnitude)

    @triton.jit
    def round_to(v, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
        """fp32 `v` rounded to nearest-even in DTYPE. The interpreter (triton 3.9) truncates fp32 to bf16, so
        there the rounding is done on the bits first (a bf16 value is the high half of an fp32 one)."""
        if INTERPRETED and DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr on the left, as triton compares)
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            v = bits.to(tl.float32, bitcast=True)
        return v.to(DTYPE)

    @triton.jit
    def _operand(w, DTYPE: tl.constexpr, DOT_FP32: tl.constexpr):
        """A dequantized fp32 tile rounded to x's dtype (the reference's weight), as the dot takes it."""
        w = round_to(w, DTYPE, DOT_FP32)
        if DOT_FP32:
            w = w.to(tl.float32)
        return w

    @triton.jit
    def _quant_gemm_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        m_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        steps_per_split,
        stride_xm,
        stride_xk,
        stride_qn,
        stride_qk,
        stride_sn,
        stride_sk,
        stride_mn,
        stride_mk,
        stride_os,
        stride_om,
        stride_on,
        INT4: tl.constexpr,
        MXFP4: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCKS_PER_STEP: tl.constexpr,
        PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):
        QB: tl.constexpr = 32  # values per quant block (motet.kernels.quant.BLOCK)
        HALF: tl.constexpr = QB // 2
        BYTES: tl.constexpr = HALF if INT4 else QB  # bytes of one block's values in one row
        COLS: tl.constexpr = BLOCKS_PER_STEP * BYTES  # the dot's depth (int4: two dots, lo and hi nibbles)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = tl.program_id(0) % num_m  # neighbouring programs share a weight tile (prefill: from L2)
        pid_n = tl.program_id(0) // num_m
        split = tl.program_id(1)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        m_ok = offs_m < M
        n_ok = offs_n < N
        blk = tl.arange(0, BLOCKS_PER_STEP)
        byte = tl.arange(0, BYTES)
        # [rows, blocks, values of a block]: one thread's vector is one block, with one scale (and min)
        q_base = q_ptr + offs_n[:, None, None] * stride_qn + byte[None, None, :] * stride_qk
        x_base = x_ptr + offs_m[:, None, None] * stride_xm + byte[None, None, :] * stride_xk
        x_dtype = x_ptr.dtype.element_ty
        num_blocks = K // QB
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        first = split * steps_per_split
        for step in range(first, first + steps_per_split):
            b = step * BLOCKS_PER_STEP + blk  # the step's quant blocks
            b_ok = b < num_blocks
            w_mask = n_ok[:, None, None] & b_ok[None, :, None]
            x_mask = m_ok[:, None, None] & b_ok[None, :, None]
            q = tl.load(q_base + (b * BYTES)[None, :, None] * stride_qk, mask=w_mask, other=0).to(tl.int32)
            sb_mask = n_ok[:, None] & b_ok[None, :]
            scale = tl.load(
                s_ptr + offs_n[:, None] * stride_sn + b[None, :] * stride_sk, mask=sb_mask, other=0.0
            )
            if MXFP4:  # an E8M0 byte: 2^(e - 127), its bits e << 23 (e = 0: 2^-127, a subnormal)
                e8 = scale.to(tl.int32)
                scale = tl.where(e8 == 0, 5.877471754111438e-39, (e8 << 23).to(tl.float32, bitcast=True))
            scale = scale.to(tl.float32)[:, :, None]
            x_cols = (b * QB)[None, :, None] * stride_xk
            if INT4:
                if MXFP4:
                    w_lo = _fp4(q & 0xF) * scale  # values j of each block
                    w_hi = _fp4(q >> 4) * scale  # values j + 16
                else:
                    low = tl.load(
                        m_ptr + offs_n[:, None] * stride_mn + b[None, :] * stride_mk, mask=sb_mask, other=0.0
                    )
                    low = low.to(tl.float32)[:, :, None]
                    w_lo = _int_to_f32(q & 0xF) * scale + low  # values j of each block
                    # values j + 16, left in place as 16 * q (no shift): 16 q * (scale / 16) is q * scale exactly
                    w_hi = _int_to_f32(q & 0xF0) * (scale * 0.0625) + low
                w_lo = _operand(tl.reshape(w_lo, [BLOCK_N, COLS]), x_dtype, DOT_FP32)
                w_hi = _operand(tl.reshape(w_hi, [BLOCK_N, COLS]), x_dtype, DOT_FP32)
                x_lo = tl.load(x_base + x_cols, mask=x_mask, other=0.0)
                x_hi = tl.load(x_base + x_cols + HALF * stride_xk, mask=x_mask, other=0.0)
                x_lo = tl.reshape(x_lo, [BLOCK_M, COLS])
                x_hi = tl.reshape(x_hi, [BLOCK_M, COLS])
                if DOT_FP32:
                    x_lo = x_lo.to(tl.float32)
                    x_hi = x_hi.to(tl.float32)
                acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
                acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
            else:
                # int8 read as bytes u: u ^ 0x80 = q + 128 in 0..255, under 2^23's bits in the same logic op
                w = ((q ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0) * scale
                w = _operand(tl.reshape(w, [BLOCK_N, COLS]), x_dtype, DOT_FP32)
                xt = tl.reshape(tl.load(x_base + x_cols, mask=x_mask, other=0.0), [BLOCK_M, COLS])
                if DOT_FP32:
                    xt = xt.to(tl.float32)
                acc = tl.dot(xt, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(
            out_ptrs, round_to(acc, out_ptr.dtype.element_ty, DOT_FP32), mask=m_ok[:, None] & n_ok[None, :]
        )

    @triton.jit
    def _split_sum_kernel(
        part_ptr,
        bias_ptr,
        out_ptr,
        N,
        num_splits,
        stride_ps,
        stride_pm,
        stride_pn,
        stride_om,
        stride_on,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        """out[m] = sum of the splits' fp32 partials, in split order (+ bias), in out's dtype."""
        m = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        ptrs = part_ptr + m * stride_pm + offs_n * stride_pn
        acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
        for s in range(num_splits):
            acc += tl.load(ptrs + s * stride_ps, mask=n_ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + m * stride_om + offs_n * stride_on,
            round_to(acc, out_ptr.dtype.element_ty, INTERPRETED),
            mask=n_ok,
        )
