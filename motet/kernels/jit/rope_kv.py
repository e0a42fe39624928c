"""The Triton kernels of motet/kernels/rope_kv.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotated_heads(
    x_ptr, stride_h, stride_d, num_heads, w_ptr, eps, cos, sin,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """A token's heads [HEADS_PAD, HALF_PAD] x 2 halves, RMS-normalised by `w` and rounded to their dtype
    first (HAS_NORM), rotated in fp32: (first halves, second halves, the mask of real values)."""
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    ok = (h[:, None] < num_heads) & (i[None, :] < HALF)
    ptrs = x_ptr + h[:, None] * stride_h + i[None, :] * stride_d
    x1 = tl.load(ptrs, mask=ok, other=0.0)
    x2 = tl.load(ptrs + HALF * stride_d, mask=ok, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
        x2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, ok


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_cos, stride_sin, stride_pos, stride_slot, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Program (t, 0): token t's query heads; (t, 1): its kv heads."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0)[None, :]
    if tl.program_id(1) == 0:  # the query heads: rotated in place
        src = q_ptr + t * stride_qt
        o1, o2, ok = _rotated_heads(
            src, stride_qh, stride_qd, NUM_HEADS, qw_ptr, eps, cos, sin, HALF, HALF_PAD, HEADS_PAD, HAS_NORM,
        )  # fmt: skip
        dst = src + h[:, None] * stride_qh + i[None, :] * stride_qd
        tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF * stride_qd, o2.to(q_ptr.dtype.element_ty), mask=ok)
    else:  # the kv heads: rotated k and v into the cache, unless the slot is negative
        slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
        if slot >= 0:
            o1, o2, ok = _rotated_heads(
                k_ptr + t * stride_kt, stride_kh, stride_kd, NUM_KV_HEADS, kw_ptr, eps, cos, sin,
                HALF, HALF_PAD, HEADS_PAD, HAS_NORM,
            )  # fmt: skip
            block = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            # rounded to k's dtype first (the torch path's rotated k), then to the cache's
            k_dtype = k_cache_ptr.dtype.element_ty
            o1 = o1.to(k_ptr.dtype.element_ty).to(k_dtype)
            o2 = o2.to(k_ptr.dtype.element_ty).to(k_dtype)
            k_dst = k_cache_ptr + block * stride_kcb + off * stride_kcs
            k_dst += h[:, None] * stride_kch + i[None, :] * stride_kcd
            tl.store(k_dst, o1, mask=ok)
            tl.store(k_dst + HALF * stride_kcd, o2, mask=ok)
            v_src = v_ptr + t * stride_vt + h[:, None] * stride_vh + i[None, :] * stride_vd
            v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcs
            v_dst += h[:, None] * stride_vch + i[None, :] * stride_vcd
            v_dtype = v_cache_ptr.dtype.element_ty
            v1 = tl.load(v_src, mask=ok)
            v2 = tl.load(v_src + HALF * stride_vd, mask=ok)
            tl.store(v_dst, v1.to(v_dtype), mask=ok)
            tl.store(v_dst + HALF * stride_vcd, v2.to(v_dtype), mask=ok)
