"""Paged attention: the torch reference (CPU path) and the Triton kernel against a naive float64 ground
truth. Without CUDA the kernel runs under TRITON_INTERPRET=1 (slow: shapes stay small)."""

from __future__ import annotations

import pytest
import torch

from motet.kernels import paged_attention as pa
from motet.kernels import paged_attention_cpu as pac
from motet.kernels import triton_support
from motet.kernels.attention_args import AttentionOptions, PagedContext

# tests/conftest.py turns TRITON_INTERPRET on (no CUDA) before anything imports triton.
HAS_TRITON = triton_support.AVAILABLE
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def naive_attention(q, kv_cache, ctx: PagedContext, options: AttentionOptions):
    """Simplest ground truth: per sequence, gather K/V position by position, full causal softmax in f64 (keys
    `window` or more positions back masked too, as transformers' sliding-window mask does)."""
    k_cache, v_cache = kv_cache
    block_tables, query_start_loc, seq_lens = ctx.block_tables, ctx.query_start_loc, ctx.seq_lens
    window, softcap, sinks = options.window, options.softcap, options.sinks
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        q_start, q_end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), q_end - q_start
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = block_tables[b].long().cpu()[pos // block_size]
        k = k_cache.cpu()[blocks, pos % block_size].double()  # [seq_len, kv_heads, head_dim]
        v = v_cache.cpu()[blocks, pos % block_size].double()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # query head h reads kv head h // group
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q_start:q_end].cpu().double(), k) * options.scale
        if softcap is not None:  # as transformers' Gemma 2 attention: before the mask
            s = torch.tanh(s / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)
        s[:, pos[None, :] > q_pos[:, None]] = float("-inf")
        if window is not None:
            s[:, pos[None, :] <= q_pos[:, None] - window] = float("-inf")
        if sinks is not None:  # as transformers' GPT-OSS attention: one more logit per head, then dropped
            column = sinks.cpu().double().view(-1, 1, 1).expand(-1, q_len, 1)
            p = torch.cat([s, column], dim=-1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def make_batch(
    seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, noncontig_q=False, device=DEVICE
):
    """(q, kv_cache, ctx) on `device`; seqs: (q_len, seq_len) per sequence. Blocks are a random permutation of
    the cache (with spare ones), block tables are padded with 0 and one extra column."""
    g = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(num_blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seqs), max(num_blocks_per_seq + [0]) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(num_blocks_per_seq):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    num_tokens = sum(q_len for q_len, _ in seqs)
    if noncontig_q:  # like a slice of a fused qkv projection
        q = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)[
            :, :num_heads
        ]
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    q_lens = torch.tensor([0] + [q_len for q_len, _ in seqs])
    query_start_loc = torch.cumsum(q_lens, 0).to(torch.int32)
    seq_lens = torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32)
    ctx = PagedContext(block_tables.to(device), query_start_loc.to(device), seq_lens.to(device))
    return q.to(device), (k_cache.to(device), v_cache.to(device)), ctx


def poison_before_window(kv_cache, ctx: PagedContext, block_size, window):
    """Point each sequence's table entries wholly before its first query's window at a block of NaNs: a
    sliding-window layer's cache reuses those blocks for newer tokens, so attention must never read them."""
    k_cache, v_cache = kv_cache
    block_tables, qsl, seq_lens = ctx.block_tables, ctx.query_start_loc, ctx.seq_lens
    held = {
        int(block_tables[b, i])
        for b in range(len(seq_lens))
        for i in range(-(-int(seq_lens[b]) // block_size))
    }
    poison = min(set(range(k_cache.shape[0])) - held)  # make_batch leaves spare blocks
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    for b in range(len(seq_lens)):
        q_len = int(qsl[b + 1] - qsl[b])
        first = max(0, int(seq_lens[b]) - q_len - window + 1)
        block_tables[b, : first // block_size] = poison


def random_seqs(g: torch.Generator, n: int, max_ctx: int, max_chunk: int):
    """A mixed batch: decodes, prefill chunks over cached context, fresh prefills, empty and 1-token."""
    seqs = [(1, 1), (0, 5)]
    for _ in range(n):
        kind = int(torch.randint(3, (1,), generator=g))
        ctx = int(torch.randint(max_ctx + 1, (1,), generator=g))
        if kind == 0:  # decode
            seqs.append((1, ctx + 1))
        elif kind == 1:  # chunk over cached context
            q_len = int(torch.randint(2, max_chunk + 1, (1,), generator=g))
            seqs.append((q_len, ctx + q_len))
        else:  # fresh prefill
            q_len = int(torch.randint(2, max_chunk + 1, (1,), generator=g))
            seqs.append((q_len, q_len))
    order = torch.randperm(len(seqs), generator=g).tolist()
    return [seqs[i] for i in order]


def check(fn, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, noncontig_q=False, **kw):
    """`fn` against naive_attention on make_batch's batch, with the options `kw` (window, softcap, sinks) and
    the hint max_query_len."""
    q, kv_cache, ctx = make_batch(
        seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, noncontig_q
    )
    ctx.max_query_len = kw.pop("max_query_len", None)
    options = AttentionOptions(head_dim**-0.5, **kw)
    expected = naive_attention(q, kv_cache, ctx, options)
    if options.window is not None:  # the blocks wholly before a sequence's window: poisoned, as if reused
        poison_before_window(kv_cache, ctx, block_size, options.window)
    out = fn(q, kv_cache, ctx, options)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_reference_matches_naive(dtype, block_size, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(block_size * 100 + num_heads)
    seqs = random_seqs(g, n=8, max_ctx=80, max_chunk=24)
    check(
        pac.paged_attention_reference, seqs, num_heads, num_kv_heads, 64, block_size, dtype, seed=block_size
    )


def test_reference_query_subchunks_and_noncontiguous_q(monkeypatch):
    # Force the memory-bounding split of long prefill chunks into several query sub-chunks.
    monkeypatch.setattr(pac, "_MAX_SCORE_ELEMS", 9 * 40 * 7)
    seqs = [(37, 37), (1, 50), (0, 3), (23, 60), (1, 1)]
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 16, torch.float32, noncontig_q=True)


def test_reference_consecutive_block_tables():
    """Tables that are runs of consecutive blocks are read through a view instead of a gather."""
    seqs = [(1, 40), (9, 33), (1, 1)]
    q, kv_cache, ctx = make_batch(seqs, 9, 3, 64, 16, torch.float32)
    ctx.block_tables = torch.tensor(
        [[0, 1, 2, 0], [3, 4, 5, 0], [6, 0, 0, 0]], dtype=torch.int32, device=DEVICE
    )  # runs
    options = AttentionOptions(0.125)
    out = pac.paged_attention_reference(q, kv_cache, ctx, options)
    expected = naive_attention(q, kv_cache, ctx, options)
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), **TOL[torch.float32])


def test_reference_all_decodes_and_empty_batch():
    seqs = [(1, n) for n in (1, 2, 15, 16, 17, 33, 100)]
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 16, torch.float32)
    check(pac.paged_attention_reference, [(0, 4), (0, 0)], 9, 3, 64, 16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_reference_batched_decode_path(dtype, num_heads, num_kv_heads):
    # Enough decode rows for the padded one-call path, mixed with prefill chunks and empty sequences.
    decodes = [(1, n) for n in (1, 2, 15, 16, 17, 33, 100, 5, 64, 9)]
    assert len(decodes) >= pac._BATCHED_DECODE_MIN
    seqs = decodes[:5] + [(7, 40), (0, 3)] + decodes[5:] + [(12, 12)]
    check(pac.paged_attention_reference, seqs, num_heads, num_kv_heads, 64, 16, dtype)


def test_decode_groups_bound_the_padding():
    lens = [100, 20, 110, 3000, 21, 22, 23, 24, 25, 26, 27, 120, 130, 140, 150, 160, 170]
    groups = pac.decode_groups(list(range(len(lens))), lens, block_size=16)
    assert [sorted(lens[b] for b in g) for g in groups] == [[20, 21, 22, 23, 24, 25, 26, 27]]
    # the short ones (and only them) padded together; 100..170 is one group of 7 < the minimum: per sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_decodes_of_mixed_lengths(dtype):
    # two batched groups (short and long contexts), an outlier and a prefill chunk, in one call
    decodes = [(1, n) for n in (5, 6, 7, 8, 9, 10, 11, 12)] + [(1, n) for n in range(200, 280, 10)]
    seqs = [(1, 900), *decodes[::2], (13, 40), *decodes[1::2]]
    lens = [n for _, n in seqs]
    rows = [b for b, (q_len, _) in enumerate(seqs) if q_len == 1]
    assert len(pac.decode_groups(rows, lens, 16)) == 2
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 16, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_reference_sliding_window(dtype, window, monkeypatch):
    """Sliding-window layers: decodes (alone and batched), chunks over a context longer than the window, fresh
    prefills longer than it, in query sub-chunks too; the blocks before each window hold NaNs."""
    g = torch.Generator().manual_seed(window)
    seqs = random_seqs(g, n=8, max_ctx=90, max_chunk=40) + [(1, n) for n in (3, 40, 41, 42, 50, 60, 64, 70)]
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 8, dtype, window=window)
    monkeypatch.setattr(pac, "_MAX_SCORE_ELEMS", 9 * 40 * 7)
    check(pac.paged_attention_reference, [(37, 100), (60, 60), (1, 80)], 9, 3, 64, 16, dtype, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_soft_capping(dtype):
    """Gemma 2's soft-capped scores (a cap of 2 changes every row), decodes batched or not, with a window too."""
    g = torch.Generator().manual_seed(7)
    seqs = random_seqs(g, n=8, max_ctx=60, max_chunk=20) + [(1, n) for n in (3, 40, 41, 42, 50, 60, 64, 70)]
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 8, dtype, softcap=2.0)
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 8, dtype, softcap=2.0, window=9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_sinks(dtype):
    """GPT-OSS's sinks (logits around the scores' size: they take a real share), decodes batched or not, with a
    window too."""
    g = torch.Generator().manual_seed(9)
    sinks = torch.randn(9, generator=g).to(DEVICE)
    seqs = random_seqs(g, n=8, max_ctx=60, max_chunk=20) + [(1, n) for n in (3, 40, 41, 42, 50, 60, 64, 70)]
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 8, dtype, sinks=sinks)
    check(pac.paged_attention_reference, seqs, 9, 3, 64, 8, dtype, sinks=sinks, window=5)


def test_dispatcher_uses_reference_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(pa, "paged_attention_reference", lambda *a, **k: calls.append(1) or "ref")
    q = torch.zeros(1, 2, 64)
    assert pa.paged_attention(q, None, None, None) == "ref" and calls


# ------------------------------------------------------------------------------------------------- triton


@needs_triton
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim,dtype",
    [
        (16, 9, 3, 64, torch.float32),
        (8, 4, 4, 64, torch.float32),
        (32, 8, 2, 128, torch.float32),
        (16, 8, 2, 64, torch.bfloat16),
    ],
)
def test_triton_matches_naive(block_size, num_heads, num_kv_heads, head_dim, dtype):
    g = torch.Generator().manual_seed(block_size + head_dim)
    seqs = random_seqs(g, n=4, max_ctx=40, max_chunk=12)
    check(pa.paged_attention_triton, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=1)
    # The decode-only tiling (max_query_len=1) and a non-contiguous q.
    decodes = [(1, n) for n in (1, 9, 16, 37)] + [(0, 3)]
    check(
        pa.paged_attention_triton,
        decodes,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=2,
        noncontig_q=True,
        max_query_len=1,
    )


@needs_triton
def test_triton_long_chunk_spans_query_blocks():
    # 70 new tokens over 30 cached: several query blocks per sequence, with block size 8 (tiles span blocks).
    check(
        pa.paged_attention_triton, [(70, 100), (1, 5), (0, 9)], 4, 1, 64, 8, torch.float32, max_query_len=70
    )


@needs_triton
@pytest.mark.parametrize("window", [1, 7, 32])
def test_triton_sliding_window(window):
    g = torch.Generator().manual_seed(window)
    seqs = random_seqs(g, n=4, max_ctx=60, max_chunk=40) + [(70, 100)]
    check(
        pa.paged_attention_triton, seqs, 8, 2, 64, 8, torch.float32, seed=3, window=window, max_query_len=70
    )
    decodes = [(1, n) for n in (1, 9, 16, 37, 64)]
    check(pa.paged_attention_triton, decodes, 8, 2, 64, 8, torch.float32, window=window, max_query_len=1)


@needs_triton
def test_triton_soft_capping():
    g = torch.Generator().manual_seed(11)
    seqs = random_seqs(g, n=4, max_ctx=50, max_chunk=30)
    check(pa.paged_attention_triton, seqs, 8, 2, 64, 8, torch.float32, seed=4, softcap=2.0, max_query_len=30)
    check(pa.paged_attention_triton, seqs, 8, 2, 64, 8, torch.float32, seed=4, softcap=2.0, window=6)


@needs_triton
def test_triton_attention_sinks():
    g = torch.Generator().manual_seed(13)
    sinks = torch.randn(8, generator=g).to(DEVICE)
    seqs = random_seqs(g, n=4, max_ctx=50, max_chunk=30)
    check(pa.paged_attention_triton, seqs, 8, 2, 64, 8, torch.float32, seed=5, sinks=sinks, max_query_len=30)
    decodes = [(1, n) for n in (1, 9, 16, 37)]
    check(
        pa.paged_attention_triton, decodes, 8, 2, 64, 8, torch.float32, sinks=sinks, window=7, max_query_len=1
    )


# -------------------------------------------------------------------------------------------- write_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache(dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([13, -1, 0, 7, -1, 19])
    # k as a non-contiguous view (a slice of a fused projection)
    k = torch.randn(6, 2 * num_kv_heads, head_dim, generator=g).to(dtype)[:, :num_kv_heads]
    v = torch.randn(6, num_kv_heads, head_dim, generator=g).to(dtype)
    pa.write_kv_cache(k, v, k_cache, v_cache, slots)

    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    written = [(t, s) for t, s in enumerate(slots.tolist()) if s >= 0]
    for t, s in written:
        assert torch.equal(k_flat[s], k[t]) and torch.equal(v_flat[s], v[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[[s for _, s in written]] = False
    assert torch.equal(k_flat[untouched], k_before.view(-1, num_kv_heads, head_dim)[untouched])
    assert torch.equal(v_flat[untouched], v_before.view(-1, num_kv_heads, head_dim)[untouched])

    # All slots skipped: nothing changes.
    pa.write_kv_cache(k, v, k_cache, v_cache, torch.full((6,), -1))
    assert torch.equal(k_flat[untouched], k_before.view(-1, num_kv_heads, head_dim)[untouched])


def test_write_then_attend_matches_naive():
    # The engine's order within a layer: write the new tokens' K/V, then attend over the cache.
    seqs = [(3, 10), (1, 6)]
    q, kv_cache, ctx = make_batch(seqs, 4, 2, 64, 4, torch.float32)
    g = torch.Generator().manual_seed(3)
    k_new = torch.randn(4, 2, 64, generator=g).to(DEVICE)
    v_new = torch.randn(4, 2, 64, generator=g).to(DEVICE)
    slots = []
    for b, (q_len, seq_len) in enumerate(seqs):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(ctx.block_tables[b, p // 4]) * 4 + p % 4)
    pa.write_kv_cache(k_new, v_new, *kv_cache, torch.tensor(slots, device=DEVICE))
    options = AttentionOptions(0.125)
    out = pa.paged_attention(q, kv_cache, ctx, options)
    expected = naive_attention(q, kv_cache, ctx, options)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])
