"""The Triton kernels of motet/kernels/paged_attention.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block ``q_block_idx``: the last ``b`` with
    ``query_start_loc[b] // BLOCK_Q + b <= q_block_idx`` (strictly increasing in ``b``)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    window,
    sinks_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SOFTCAP: tl.constexpr,  # 0.0: none
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # spare program (the grid is an upper bound) or q_len == 0
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    # Row m is token (m // GROUP) of this block, query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok  # absolute position; every row (even padding) sees key 0, so no NaN rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys needed by this block: up to its last real query's position, from its first query's window (no
    # other block is read: a sliding-window layer's cache reuses them)
    kv_len = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    kv_first = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf in the rescale
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the head's sink starts the running softmax: its max, and exp(0) = 1 in the sum
        m_i = tl.load(sinks_ptr + head, mask=offs_m < BLOCK_Q * GROUP, other=0.0) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_first // TILE_N * TILE_N, kv_len, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = (offs_n < kv_len) & (offs_n >= kv_first)
        # Per-position block lookup: tiles may span several (small) blocks or part of a big one.
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        if SOFTCAP > 0:  # cap * tanh(s / cap) in natural-log units (tanh from exp: 1 - 2 / (e^2x + 1))
            x = s * (1.0 / (1.4426950408889634 * SOFTCAP))
            s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * 1.4426950408889634)
        seen = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        p = p.to(v.dtype)  # probabilities in the cache dtype for the second dot, as flash attention does
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    # (a padding row past a window may see no key: 1, not 0, keeps it from dividing by zero; not stored)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(
        o_ptrs + offs_d[None, :] * stride_od,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_kd, stride_vd, stride_kcd, stride_vcd,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM_PAD)
    ok = d < HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=ok)
    k_dst = k_cache_ptr + block * stride_kcb + off * stride_kcs + h * stride_kch + d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcs + h * stride_vch + d * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)
