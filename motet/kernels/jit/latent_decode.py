"""The Triton kernels of motet/kernels/latent_decode.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _latent_decode_kernel(
    out_ptr, parts_ptr, lse_ptr, ql_ptr, qr_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale_log2, num_heads,
    stride_lt, stride_lh, stride_ld, stride_rt, stride_rh, stride_rd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_cd, stride_bt,
    BLOCK_SIZE: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == row:  # no new token
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    # this split's positions: whole tiles (the last split's may be short, or none)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    h_ok = heads < num_heads
    offs_r = tl.arange(0, RANK_PAD)
    r_ok = offs_r < RANK
    offs_p = tl.arange(0, ROPE_PAD)
    p_ok = offs_p < ROPE
    row64 = row.to(tl.int64)
    ql = tl.load(
        ql_ptr + row64 * stride_lt + heads[:, None] * stride_lh + offs_r[None, :] * stride_ld,
        mask=h_ok[:, None] & r_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, RANK_PAD]
    qr = tl.load(
        qr_ptr + row64 * stride_rt + heads[:, None] * stride_rh + offs_p[None, :] * stride_rd,
        mask=h_ok[:, None] & p_ok[None, :],
        other=0.0,
    )  # [BLOCK_H, ROPE_PAD]
    if DOT_FP32:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: no inf - inf in the rescale
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = offs_n < hi
        # per-position block lookup: a tile may span several (small) blocks or part of a big one
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        base = cache_ptr + block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
        c = tl.load(
            base[:, None] + offs_r[None, :] * stride_cd, mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )  # [TILE_N, RANK_PAD]: the keys' latent part and the values
        kr = tl.load(
            base[None, :] + (RANK + offs_p[:, None]) * stride_cd,
            mask=n_ok[None, :] & p_ok[:, None],
            other=0.0,
        )  # [ROPE_PAD, TILE_N]
        if DOT_FP32:
            c = c.to(tl.float32)
            kr = kr.to(tl.float32)
        s = tl.dot(ql, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(qr, kr, acc=s, input_precision=PRECISION) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(cache_ptr.dtype.element_ty)  # in the cache's dtype for the second dot, as flash attention
        if DOT_FP32:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + row64 * stride_ot + heads[:, None] * stride_oh + offs_r[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=h_ok[:, None] & r_ok[None, :],
        )
    else:  # parts [T, H, NUM_SPLITS, RANK] and lse [T, H, NUM_SPLITS], contiguous; an empty split's lse -inf
        at = (row64 * num_heads + heads) * NUM_SPLITS + split
        tl.store(parts_ptr + at[:, None] * RANK + offs_r[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + at, lse, mask=h_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr, parts_ptr, lse_ptr, query_start_loc_ptr, stride_ot, stride_oh, stride_od,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    """One (sequence, head): its splits' outputs weighted by their share of the softmax's sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    row = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == row:
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < NUM_SPLITS
    offs_r = tl.arange(0, RANK_PAD)
    r_ok = offs_r < RANK
    at = (row.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
    lse = tl.load(lse_ptr + at, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    parts = tl.load(
        parts_ptr + at[:, None] * RANK + offs_r[None, :], mask=s_ok[:, None] & r_ok[None, :], other=0.0
    )
    o = tl.sum(w[:, None] * parts, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_r * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=r_ok,
    )
