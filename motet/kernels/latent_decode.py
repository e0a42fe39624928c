"""DeepSeek's absorbed MLA decode over the paged latent cache: each sequence's one new token, its heads' queries
already in the latent space, attend over the sequence's cached latent rows as one shared key / value head.

Layout (motet/kernels/paged_attention.py's, with one "kv head" of the latent row's width):

- ``q_latent``: ``[T, H, rank]`` (each head's q_nope W_UK), ``q_rope``: ``[T, H, rope]`` (its rotated part);
  strided views are fine (the last dimension contiguous or not).
- ``cache``: ``[num_blocks, block_size, 1, rank + rope]``: a token's normed c_kv, then its rotated key; token
  position ``p`` of sequence ``b`` at block ``block_tables[b, p // block_size]``, offset ``p % block_size``.
- ``ctx``: the step's ``PagedContext``; sequence ``b`` brings one new token (row ``query_start_loc[b]``; a
  sequence with none is skipped), whose latent row is already written, and attends to positions
  ``0 .. seq_lens[b] - 1``.
- Scores: ``scale * (q_latent . c_kv + q_rope . k_rope)``; output ``[T, H, rank]`` (the softmax's sum of c_kv,
  before W_UV), in q's dtype; rows no sequence owns are zeros.

``latent_decode_reference`` defines the meaning (the paged attention's torch reference over the latent rows as
keys and values) and serves CPUs; ``latent_decode_triton`` is the GPU kernel; ``latent_decode`` picks by device.
"""

from __future__ import annotations

import torch

from motet.kernels import triton_support
from motet.kernels.attention_args import AttentionOptions, PagedContext
from motet.kernels.paged_attention_cpu import paged_attention_reference

BLOCK_H = 16  # heads a program owns (tl.dot's least M): each cached tile is read once for them
TILE_N = 32  # positions a loop step reads
# Splits of each sequence's context (flash decoding) when few sequences leave the GPU's multiprocessors idle: a
# launch aims at this many programs (an H100 has 132 multiprocessors), each split walking this many tiles at least
TARGET_PROGRAMS = 128
MAX_SPLITS = 16
MIN_SPLIT_TILES = 4


def launch_options(fp32: bool) -> dict:
    """Warps, pipeline stages and registers of a launch: at DeepSeek's rank of 512 a program's fp32 accumulator is
    16 x 512, which 8 warps hold in registers; fp32 inputs (tests, not serving) go unpipelined, so that their tiles
    do not spill; and ptxas may use up to 255 registers a thread (left to itself it caps sm_90's build at 128 and
    spills). tests/kernels/test_latent_decode.py builds each for sm_80 / sm_90."""
    return dict(num_warps=8, num_stages=1 if fp32 else 3, maxnreg=255)


def applies(x: torch.Tensor) -> bool:
    """Whether the absorbed decode on `x` goes through the Triton kernel (CUDA, Triton installed)."""
    return triton_support.AVAILABLE and x.is_cuda


def latent_decode(
    q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, ctx: PagedContext, scale: float
) -> torch.Tensor:
    """The absorbed decode (the layout above): the Triton kernel on CUDA, the torch reference elsewhere."""
    attend = latent_decode_triton if applies(q_latent) else latent_decode_reference
    return attend(q_latent, q_rope, cache, ctx, scale)


def latent_decode_reference(
    q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, ctx: PagedContext, scale: float
) -> torch.Tensor:
    """The paged attention's reference with one kv head of the latent row's width, its values the rows too: the
    output's c_kv part. [T, H, rank] in q's dtype."""
    rank = q_latent.shape[-1]
    query = torch.cat([q_latent, q_rope], dim=-1).to(cache.dtype)
    out = paged_attention_reference(query, (cache, cache), ctx, AttentionOptions(scale))[..., :rank]
    return out.to(q_latent.dtype)


def num_splits(num_seqs: int, num_heads: int, max_seq_len: int | None) -> int:
    """How many splits of each context a launch takes (from host-side sizes only: a CUDA graph's bucket fixes
    it): enough programs for `TARGET_PROGRAMS`, none shorter than `MIN_SPLIT_TILES` tiles of the longest context
    where it is known."""
    programs = num_seqs * -(-num_heads // BLOCK_H)
    splits = max(1, min(MAX_SPLITS, TARGET_PROGRAMS // programs))
    if max_seq_len is not None:
        splits = min(splits, max(1, -(-max_seq_len // (MIN_SPLIT_TILES * TILE_N))))
    return splits


def latent_decode_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    ctx: PagedContext,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """One launch, or two with splits (CUDA, or CPU under ``TRITON_INTERPRET=1``), no device sync: capturable in a
    CUDA graph.

    Grid: (sequences, head blocks of ``BLOCK_H``, splits of the context). A program walks its part of its
    sequence's positions in tiles of ``TILE_N`` with an online softmax; each tile's latent rows [TILE_N, rank] are
    loaded once for its heads and serve both products (scores against q_latent, then the output as their weighted
    sum), so the cache is read once per head block and nothing per head is made of it. With several splits
    (`splits`, else `num_splits`: few sequences) each writes its normalized part and its log-sum-exp in fp32,
    and a second kernel merges them (flash decoding)."""
    if not triton_support.AVAILABLE:
        raise RuntimeError("latent_decode_triton needs triton")
    num_tokens, num_heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    _, block_size, one, width = cache.shape
    if one != 1 or width != rank + rope or q_rope.shape[:2] != q_latent.shape[:2]:
        raise ValueError(
            f"bad shapes: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, cache {tuple(cache.shape)}"
        )
    if not (q_latent.dtype == q_rope.dtype == cache.dtype):
        raise ValueError(
            f"q_latent/q_rope/cache dtypes differ: {q_latent.dtype}, {q_rope.dtype}, {cache.dtype}"
        )
    out = torch.zeros(num_tokens, num_heads, rank, dtype=q_latent.dtype, device=q_latent.device)
    num_seqs = ctx.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_tables = ctx.block_tables
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    # Triton on CPU tensors runs only under TRITON_INTERPRET=1, whose tl.dot on bf16 multiplies the raw bits
    # (triton 3.9): there the dots' operands go up to fp32 (the same rounding of p)
    interpreted = not q_latent.is_cuda
    splits = splits or num_splits(num_seqs, num_heads, ctx.max_seq_len)
    rank_pad = max(16, triton_support.next_power_of_2(rank))
    if splits > 1:  # each split's normalized output and log2-sum-exp, merged below
        parts = torch.empty(num_tokens, num_heads, splits, rank, dtype=torch.float32, device=out.device)
        lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=out.device)
    else:  # (not written)
        parts, lse = out, out
    grid = (num_seqs, triton_support.cdiv(num_heads, BLOCK_H), splits)
    _jit()._latent_decode_kernel[grid](
        out, parts, lse, q_latent, q_rope, cache, block_tables, ctx.query_start_loc, ctx.seq_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        num_heads,
        *q_latent.stride(), *q_rope.stride(), *out.stride(),
        cache.stride(0), cache.stride(1), cache.stride(3), block_tables.stride(0),
        BLOCK_SIZE=block_size, RANK=rank, RANK_PAD=rank_pad,
        ROPE=rope, ROPE_PAD=max(16, triton_support.next_power_of_2(rope)), BLOCK_H=BLOCK_H, TILE_N=TILE_N,
        NUM_SPLITS=splits,
        # fp32 gets true fp32 dots (tl.dot defaults to tf32 on NVIDIA); bf16 / fp16 the default
        PRECISION="ieee" if q_latent.dtype == torch.float32 or interpreted else None,
        DOT_FP32=interpreted,
        **launch_options(q_latent.dtype == torch.float32),
    )  # fmt: skip
    if splits > 1:
        _jit()._merge_splits_kernel[(num_seqs, num_heads)](
            out, parts, lse, ctx.query_start_loc, *out.stride(),
            RANK=rank, RANK_PAD=rank_pad, NUM_SPLITS=splits, SPLITS_PAD=triton_support.next_power_of_2(splits),
        )  # fmt: skip
    return out


def _jit():
    """This module's Triton kernels (motet/kernels/jit/latent_decode.py), imported at their first launch."""
    return triton_support.kernels(__name__)
