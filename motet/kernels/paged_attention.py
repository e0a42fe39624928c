"""Paged attention over a flattened batch of sequences (no padding), with a block-paged KV cache.

Layout (shared by the model, the block manager and these kernels):

- ``q``: ``[T, num_heads, head_dim]``; the new tokens of all sequences, concatenated. Sequence ``b`` owns
  rows ``query_start_loc[b]:query_start_loc[b + 1]`` (its ``q_len`` new tokens, possibly 0).
- ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of
  sequence ``b`` lives at block ``block_tables[b, p // block_size]``, offset ``p % block_size``.
- ``seq_lens[b]``: context length *including* the new tokens; the new tokens sit at positions
  ``seq_len - q_len .. seq_len - 1`` and their K/V are already in the cache (``write_kv_cache`` first).
- Causal: the query at position ``p`` attends to keys ``0..p`` (``p - window + 1..p`` in a sliding-window
  layer, whose blocks before that may hold newer tokens and are never read). GQA: query head ``h`` reads kv
  head ``h // (num_heads // num_kv_heads)``.

Each implementation takes ``(q, kv_cache, ctx, options)``: the layer's caches, the step's ``PagedContext``
(the tables, query starts and lengths above) and the layer's ``AttentionOptions``
(motet/kernels/attention_args.py).
``paged_attention_reference`` (motet/kernels/paged_attention_cpu.py) defines the meaning and is also the CPU
production path; ``paged_attention_triton`` is the GPU kernel (motet/kernels/cpu_native.py's ``attention`` the
native CPU one); ``paged_attention`` picks by device.
"""

from __future__ import annotations

import torch

from motet.kernels.attention_args import AttentionOptions, KVCache, PagedContext
from motet.kernels.paged_attention_cpu import paged_attention_reference
from motet.kernels.triton_support import tl, triton

_NO_WINDOW = 1 << 30  # the kernel's window when the layer has none: longer than any context


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V: token ``t`` goes to flat slot ``slot_mapping[t]`` (``block * block_size +
    offset``); negative slots are skipped (e.g. padding rows, or tokens whose KV is already cached).

    On CUDA a Triton kernel skips them on the device: no host sync, so a step's layers launch without
    waiting and the write can be captured in a CUDA graph. On CPU the torch path filters them."""
    if k.is_cuda and triton is not None:
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # .view (not .reshape/.flatten): the write must land in the cache itself, so it must be a view.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_flat[slots] = k.to(k_cache.dtype)
    v_flat[slots] = v.to(v_cache.dtype)


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``write_kv_cache`` as one Triton launch (CUDA, or CPU under ``TRITON_INTERPRET=1``): one program per
    (token, kv head); a negative slot returns at once. No device sync; ``k``/``v`` may be strided views
    (slices of the fused qkv projection)."""
    if triton is None:
        raise RuntimeError("write_kv_cache_triton needs triton")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"bad shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        k.stride(2), v.stride(2), k_cache.stride(3), v_cache.stride(3),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor, kv_cache: KVCache, ctx: PagedContext, options: AttentionOptions
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (`ctx`) with a layer's
    `options` (motet/kernels/attention_args.py); returns ``[T, H, D]`` in ``q``'s dtype."""
    attend = paged_attention_triton if q.is_cuda else paged_attention_reference
    return attend(q, kv_cache, ctx, options)


def paged_attention_triton(
    q: torch.Tensor, kv_cache: KVCache, ctx: PagedContext, options: AttentionOptions
) -> torch.Tensor:
    """Triton kernel launch (CUDA, or CPU under ``TRITON_INTERPRET=1``). No device sync.

    Grid: (query blocks, kv heads). A program owns up to ``BLOCK_Q`` consecutive new tokens of one
    sequence times the ``group`` query heads sharing one kv head (``BLOCK_M = BLOCK_Q * group`` rows,
    padded to a power of two >= 16 for ``tl.dot``), so each K/V tile is loaded once per group, and walks
    the sequence's KV in tiles of ``TILE_N`` positions (any block size) with an online softmax.
    Rows past ``query_start_loc[-1]`` are left unwritten.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs triton")
    k_cache, v_cache = kv_cache
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    group = num_heads // num_kv_heads
    num_seqs = ctx.seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_tables = ctx.block_tables
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()

    # only a tuning hint (the loop bounds are read on the device): without one, a guess without a device sync
    max_query_len = ctx.max_query_len
    if max_query_len is None:
        max_query_len = 1 if num_tokens <= num_seqs else num_tokens
    # Decode: one token per sequence, so only `group` rows are real; keep the tile at the tl.dot minimum.
    # Prefill: more query rows per program amortize each K/V tile over more work.
    min_m = 16 if max_query_len == 1 else 64
    block_m = max(min_m, triton.next_power_of_2(group))
    block_q = block_m // group
    # Sequence b's query blocks start at query_start_loc[b] // block_q + b (see _find_seq), so this bounds
    # the total without reading query_start_loc on the host.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # Triton runs on CPU tensors only under TRITON_INTERPRET=1, whose tl.dot on bf16 multiplies the raw
    # uint16 bits (triton 3.9): there the kernel upcasts dot operands to fp32 (same rounding of p).
    interpreted = not q.is_cuda
    sinks = options.sinks
    _paged_attention_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        ctx.query_start_loc,
        ctx.seq_lens,
        options.scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        num_seqs,
        options.window or _NO_WINDOW,
        sinks.float().contiguous() if sinks is not None else q,  # (not read without sinks)
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=32,  # independent of the block size: positions look up their block one by one
        SOFTCAP=options.softcap or 0.0,
        HAS_SINKS=sinks is not None,
        # fp32 inputs get true fp32 dots (tl.dot defaults to tf32 on NVIDIA); bf16/fp16 use the default.
        PRECISION="ieee" if q.dtype == torch.float32 or interpreted else None,
        DOT_FP32=interpreted,
    )
    return out


if triton is not None:

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
