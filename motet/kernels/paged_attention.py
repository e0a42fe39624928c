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

from motet.kernels import triton_support
from motet.kernels.attention_args import AttentionOptions, KVCache, PagedContext
from motet.kernels.paged_attention_cpu import paged_attention_reference

_NO_WINDOW = 1 << 30  # the kernel's window when the layer has none: longer than any context


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' K/V: token ``t`` goes to flat slot ``slot_mapping[t]`` (``block * block_size +
    offset``); negative slots are skipped (e.g. padding rows, or tokens whose KV is already cached).

    On CUDA a Triton kernel skips them on the device: no host sync, so a step's layers launch without
    waiting and the write can be captured in a CUDA graph. On CPU the torch path filters them."""
    if k.is_cuda and triton_support.AVAILABLE:
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
    if not triton_support.AVAILABLE:
        raise RuntimeError("write_kv_cache_triton needs triton")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"bad shapes: k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    _jit()._write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        k.stride(2), v.stride(2), k_cache.stride(3), v_cache.stride(3),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=triton_support.next_power_of_2(head_dim),
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
    if not triton_support.AVAILABLE:
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
    block_m = max(min_m, triton_support.next_power_of_2(group))
    block_q = block_m // group
    # Sequence b's query blocks start at query_start_loc[b] // block_q + b (see jit/paged_attention.py _find_seq), so this bounds
    # the total without reading query_start_loc on the host.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    # Triton runs on CPU tensors only under TRITON_INTERPRET=1, whose tl.dot on bf16 multiplies the raw
    # uint16 bits (triton 3.9): there the kernel upcasts dot operands to fp32 (same rounding of p).
    interpreted = not q.is_cuda
    sinks = options.sinks
    _jit()._paged_attention_kernel[grid](
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
        HEAD_DIM_PAD=max(16, triton_support.next_power_of_2(head_dim)),
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


def _jit():
    """This module's Triton kernels (motet/kernels/jit/paged_attention.py), imported at their first launch."""
    return triton_support.kernels(__name__)
