"""The Triton kernels of motet/kernels/triton_quant.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


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
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + b[None, :] * stride_sk, mask=sb_mask, other=0.0)
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
    tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty, DOT_FP32), mask=m_ok[:, None] & n_ok[None, :])


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
