"""The native CPU kernels (motet/kernels/cpu_native.py) against float64 ground truths, in every instruction-set tier
this CPU runs (tests/kernels/cpu_tiers.py): paged attention against the naive per-position attention of
test_paged_attention, SGMV over the adapters' pool against a naive per-row LoRA delta from the adapters' own
factors, the linear against float64 F.linear (of x rounded to bf16 where the tier multiplies bf16 weights with
bf16 activations: the result is then exact products summed in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from motet.kernels import cpu_isa, cpu_native
from motet.kernels.attention_args import AttentionOptions, PagedContext
from motet.lora.adapter import module_shape
from motet.models.projections import PROJECTION_GROUPS
from tests.kernels.cpu_tiers import ref_activations, reset
from tests.kernels.test_paged_attention import TOL, check, make_batch, naive_attention, random_seqs
from tests.lora.test_lora_pool import BASE, LAYOUT

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels")


@pytest.fixture(autouse=True)
def tier(cpu_tier):
    """Every test here runs once per tier (tests/conftest.py's cpu_tier)."""
    return cpu_tier


# The kernels each tier's build must hold (cpu_native.KERNEL_BITS): a tier whose flags compiled less is a bug.
TIER_KERNELS = {"avx512bf16": ["avx2", "bf16_dot", "vnni"], "avx512vnni": ["avx2", "vnni"], "avx2": ["avx2"],
                "scalar": []}  # fmt: skip


def test_tier_builds_its_kernels(tier):
    if tier == "scalar" and cpu_isa.BY_NAME["scalar"].flags == ():
        pytest.skip("not x86: the scalar tier is the compiler's default target")
    assert cpu_native.kernels() == TIER_KERNELS[tier]
    assert cpu_native.bf16_activations() == ("bf16_dot" in TIER_KERNELS[tier])


def test_the_highest_tier_runs_unless_a_lower_one_is_named(tier, monkeypatch, caplog):
    best = next(t.name for t in cpu_isa.TIERS if not cpu_isa.missing(t))
    monkeypatch.delenv(cpu_isa.ENV)
    reset()
    assert cpu_native.isa() == best
    monkeypatch.setenv(cpu_isa.ENV, "avx9000")
    reset()
    assert cpu_native.isa() == best and "names no tier" in caplog.text
    unrunnable = [t.name for t in cpu_isa.TIERS if cpu_isa.missing(t)]
    if unrunnable:
        monkeypatch.setenv(cpu_isa.ENV, unrunnable[0])
        reset()
        assert cpu_native.isa() == best and "lacks" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 24)])
def test_attention_matches_naive(dtype, block_size, num_heads, num_kv_heads, head_dim):
    """Decodes, prefill chunks over cached context, fresh prefills, empty rows; K/V in the cache dtype."""
    g = torch.Generator().manual_seed(block_size + num_heads)
    seqs = random_seqs(g, n=10, max_ctx=90, max_chunk=40)
    q, kv_cache, ctx = make_batch(
        seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3, device="cpu"
    )
    options = AttentionOptions(head_dim**-0.5)
    out = cpu_native.attention(q, kv_cache, ctx, options)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(q, kv_cache, ctx, options), **TOL[dtype])


def test_bf16_products_of_a_row_do_not_depend_on_the_batch(tier):
    """In the bf16 dot-product tier a row's product, its attention and its LoRA delta are the same bit for bit
    whatever else the step holds and however its prompt was chunked (one order of additions in every tile): a
    request's output never depends on another's."""
    if not cpu_native.bf16_activations():
        pytest.skip(f"tier {tier}: no bf16 dot products (its row tiles sum in different orders)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 200, generator=g).bfloat16()
    x = torch.randn(150, 200, generator=g)
    packed = cpu_native.pack(w)
    whole = cpu_native.gemm(x, packed, 70)
    for m in (1, 2, 5, 7, 12, 13, 30, 97):
        assert torch.equal(cpu_native.gemm(x[:m].contiguous(), packed, 70), whole[:m]), m
        assert torch.equal(cpu_native.gemm(x[m : m + 1].contiguous(), packed, 70), whole[m : m + 1]), m
    # a prompt computed whole, or in chunks over its cached context: the same outputs (a window too)
    q, kv_cache, _ = make_batch([(60, 60)], 9, 3, 64, 16, torch.bfloat16, seed=3)
    q = torch.randn(q.shape, generator=g)
    table = torch.arange(8, dtype=torch.int32)[None]
    for window in (None, 21):
        opts = AttentionOptions(0.125, window)
        one = cpu_native.attention(q, kv_cache, PagedContext(table, torch.tensor([0, 60], dtype=torch.int32),
                                                             torch.tensor([60], dtype=torch.int32)), opts)  # fmt: skip
        for start in (0, 7, 33, 59):
            ctx = PagedContext(
                table, torch.tensor([0, 60 - start], dtype=torch.int32), torch.tensor([60], dtype=torch.int32)
            )
            assert torch.equal(cpu_native.attention(q[start:].contiguous(), kv_cache, ctx, opts), one[start:])


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (16, 1, 64), (8, 2, 128), (8, 2, 24)]
)
@pytest.mark.parametrize("options", [{}, {"window": 21}, {"softcap": 3.0}, {"sinks": True}], ids=str)
def test_attention_fp32_queries_over_a_bf16_cache(block_size, num_heads, num_kv_heads, head_dim, options):
    """The native step's attention: fp32 queries over a bf16 cache (in the avx512bf16 tier, blocks of query tokens
    against tiles of 16 keys through bf16 dot products, q and the probabilities rounded to bf16; a head size that is
    no multiple of 32 the fp32 kernel's), prefill chunks over context, fresh prefills, decodes, every option."""
    g = torch.Generator().manual_seed(block_size + num_heads + head_dim)
    seqs = random_seqs(g, n=10, max_ctx=90, max_chunk=40)
    q, kv_cache, ctx = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=7)
    q = torch.randn(q.shape, generator=g)
    if options.get("sinks"):
        options = {**options, "sinks": torch.randn(num_heads, generator=g)}
    opts = AttentionOptions(head_dim**-0.5, **options)
    out = cpu_native.attention(q, kv_cache, ctx, opts)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(q, kv_cache, ctx, opts), **TOL[torch.bfloat16])


def test_attention_strided_q_and_long_context():
    seqs = [(1, 700), (3, 300), (1, 1), (0, 9)]
    args = make_batch(seqs, 9, 3, 64, 16, torch.float32, noncontig_q=True, device="cpu")
    options = AttentionOptions(0.125)
    out = cpu_native.attention(*args, options)
    torch.testing.assert_close(out.double(), naive_attention(*args, options), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "options",
    [
        {"window": 5},
        {"window": 37},
        {"softcap": 3.0},
        {"sinks": True},
        {"window": 9, "softcap": 2.0, "sinks": True},
    ],
    ids=["window-5", "window-37", "softcap", "sinks", "all"],
)
def test_attention_options_match_naive(dtype, block_size, options):
    """A sliding window (the blocks wholly before it poisoned with NaNs: a window pool's ring reuses them),
    Gemma 2's soft-capped scores, GPT-OSS's sinks, and all three at once; blocks of 4 rows too, where eight keys
    span three blocks of a shuffled table."""
    g = torch.Generator().manual_seed(block_size + len(options))
    seqs = random_seqs(g, n=10, max_ctx=90, max_chunk=40)
    if options.get("sinks"):
        options = {**options, "sinks": torch.randn(9, generator=g)}
    check(cpu_native.attention, seqs, 9, 3, 32, block_size, dtype, seed=5, **options)


@pytest.mark.parametrize(
    "block_size,table,window",
    [(4, [0, 5, 2, 7, 4, 9], 22), (2, [0, 7, 8, 3, 1, 2, 4, 5, 6, 9, 10, 11], None)],
    ids=["window-from-mid-block", "blocks-of-2"],
)
def test_attention_keys_across_small_blocks(block_size, table, window):
    """Eight keys read as consecutive cache rows only where they are: here the first and the eighth key sit 7
    rows apart but the blocks between them do not (a ring's table, or a table of blocks of 2)."""
    g = torch.Generator().manual_seed(0)
    seq_len, heads, kv_heads, dim = 24, 4, 2, 16
    k_cache, v_cache = (torch.randn(12, block_size, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(2, heads, dim, generator=g)
    tensors = (torch.tensor(t, dtype=torch.int32) for t in ([table], [0, 2], [seq_len]))
    args = q, (k_cache, v_cache), PagedContext(*tensors), AttentionOptions(dim**-0.5, window)
    out = cpu_native.attention(*args)
    torch.testing.assert_close(out.double(), naive_attention(*args), **TOL[torch.float32])


def adapter_pool(dtype, count=12, seed=0):
    """A pool of `count` random adapters of mixed ranks (1..16) and targets, as the engine packs them."""
    from motet.lora.adapter import TARGET_MODULES, LoRAAdapter
    from motet.lora.pool import AdapterPool, pack

    g = torch.Generator().manual_seed(seed)
    pool, adapters = AdapterPool(LAYOUT, 8 << 20, dtype=dtype), {}
    for uid in range(1, count + 1):
        rank = int(torch.randint(1, 17, (1,), generator=g))
        mods = [m for m in TARGET_MODULES if torch.rand(1, generator=g) < 0.5] or ["v_proj"]
        weights = {}
        for layer in range(BASE.num_hidden_layers):
            for m in mods:
                n_in, n_out = module_shape(BASE, m)
                a = torch.randn(rank, n_in, generator=g) / n_in**0.5
                weights[(layer, m)] = (a, torch.randn(n_out, rank, generator=g), 0.5 + uid / 8)
        adapters[uid] = LoRAAdapter(f"a{uid}", rank, weights)
        pool.place(uid, pack(adapters[uid], LAYOUT, dtype), lambda u: False)
    return pool, adapters


def naive_delta(adapters, rows, x, layer, modules, dtype):
    """Per row, float64, from the factors as the pool stores them (A, B * scale rounded to its dtype); where the
    tier multiplies a bf16 pool with bf16 activations, of x and of the shrink's h rounded to bf16 (as torch's bf16
    LoRA rounds them). Also returns the bound of one bf16 rounding step of h (|B| |h| 2^-8): the kernel's fp32 sums
    may land on the other side of a rounding boundary than float64's."""
    sizes = [y for _, y in (module_shape(BASE, m) for m in modules)]
    out, col = torch.zeros(x.shape[0], sum(sizes), dtype=torch.float64), 0
    slack = torch.zeros_like(out)
    x = ref_activations(x, dtype)
    for m, size in zip(modules, sizes, strict=True):
        for t, uid in enumerate(rows):
            if uid and (layer, m) in adapters[uid].weights:
                a, b, scale = adapters[uid].weights[(layer, m)]
                bs = (b * scale).to(dtype).double()
                h = a.to(dtype).double() @ x[t, : a.shape[1]].double()
                if dtype == torch.bfloat16 and cpu_native.bf16_activations():
                    slack[t, col : col + size] = bs.abs() @ h.abs() * 2**-8
                    h = h.bfloat16().double()
                out[t, col : col + size] = bs @ h
        col += size
    return out, slack


def native_sgmv(y, x, pool, rows, layer, group, sizes):
    starts = torch.arange(len(rows) + 1, dtype=torch.int32)  # every row its own segment (decode)
    slots = torch.tensor([pool.slot_of[u] if u else -1 for u in rows], dtype=torch.int32)
    geo = [g.a_ld for g in pool.layout.groups], [g.bt_ld for g in pool.layout.groups]
    desc = cpu_native.LoraPool.of(pool.data, pool.desc, *geo)
    cpu_native.sgmv(y, x, desc, pool.dtype, starts, slots, group=group, layer=layer, sizes=sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sgmv_decode_rows_of_many_adapters_match_naive(dtype):
    """64 rows, each its own segment, over 12 adapters of mixed ranks and targets and base rows: every group."""
    pool, adapters = adapter_pool(dtype)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 13, (64,), generator=g).tolist()
    for group, modules in enumerate(PROJECTION_GROUPS):  # (the native step's: the per-head decoder's)
        n_in = module_shape(BASE, modules[0])[0]
        sizes = [module_shape(BASE, m)[1] for m in modules]
        x = torch.randn(64, n_in, generator=g)
        y0 = torch.randn(64, sum(sizes), generator=g)
        y = y0.clone()
        native_sgmv(y, x, pool, rows, 1, group, sizes)
        delta, slack = naive_delta(adapters, rows, x, 1, modules, dtype)
        want = y0.double() + delta
        assert ((y.double() - want).abs() <= slack + 1e-4 + 1e-4 * want.abs()).all()
        assert torch.equal(
            y[[t for t, u in enumerate(rows) if not u]], y0[[t for t, u in enumerate(rows) if not u]]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sgmv_segments_of_many_rows_match_naive(dtype):
    """Segments of several rows (the scheduler's order: one per adapter), of every length around the kernels'
    row tiles (1 to 40 rows: the bf16 tier's shrink takes 8, its expand 12), base segments between them, mixed
    ranks (odd ones: a rank's last pair) and targets: every group."""
    pool, adapters = adapter_pool(dtype, seed=5)
    g = torch.Generator().manual_seed(2)
    lengths = [1, 3, 8, 9, 12, 13, 25, 40, 2, 7]
    uids = [3, 0, 7, 1, 12, 0, 5, 9, 2, 11]
    rows = [u for u, n in zip(uids, lengths, strict=True) for _ in range(n)]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([pool.slot_of[u] if u else -1 for u in uids], dtype=torch.int32)
    desc = cpu_native.LoraPool.of(
        pool.data, pool.desc, [g.a_ld for g in pool.layout.groups], [g.bt_ld for g in pool.layout.groups]
    )
    for group, modules in enumerate(PROJECTION_GROUPS):
        n_in = module_shape(BASE, modules[0])[0]
        sizes = [module_shape(BASE, m)[1] for m in modules]
        x = torch.randn(len(rows), n_in, generator=g)
        y0 = torch.randn(len(rows), sum(sizes), generator=g)
        y = y0.clone()
        cpu_native.sgmv(y, x, desc, pool.dtype, starts, slots, group=group, layer=1, sizes=sizes)
        delta, slack = naive_delta(adapters, rows, x, 1, modules, dtype)
        want = y0.double() + delta
        assert ((y.double() - want).abs() <= slack + 1e-4 + 1e-4 * want.abs()).all()
        base = [t for t, u in enumerate(rows) if not u]
        assert torch.equal(y[base], y0[base])


def test_sgmv_strided_output_and_narrower_input():
    """The group's columns inside a wider buffer (a row-strided view), x narrower than the pool's A rows (a
    tensor-parallel rank's part of o_proj's input)."""
    pool, adapters = adapter_pool(torch.float32, seed=3)
    q = module_shape(BASE, "o_proj")[0]
    rows = [1, 1, 0, 4, 7, 7, 7, 2]
    x = torch.randn(len(rows), q)
    x[:, q // 2 :] = 0  # the rank's part: the first half of the inputs (the rest is another rank's)
    wide = torch.randn(len(rows), 100)
    before = wide.clone()
    hid = module_shape(BASE, "o_proj")[1]
    native_sgmv(wide[:, 10 : 10 + hid], x[:, : q // 2].contiguous(), pool, rows, 0, 1, [hid])
    want = (
        before[:, 10 : 10 + hid].double() + naive_delta(adapters, rows, x, 0, ("o_proj",), torch.float32)[0]
    )
    torch.testing.assert_close(wide[:, 10 : 10 + hid].double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(wide[:, :10], before[:, :10]) and torch.equal(
        wide[:, 10 + hid :], before[:, 10 + hid :]
    )


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 2, 3, 6, 7, 11, 13, 25, 100, 200])
@pytest.mark.parametrize("N,K", [(16, 16), (13, 40), (50, 37), (70, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_float64(w_dtype, M, N, K, bias):
    """Every row-tile remainder (M mod 6 and mod 12: the AVX2 and the bf16 dot tiles), panel remainder (N mod
    16), odd K (the dot product's pairs of k), several M chunks (M > 96)."""
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K + 3, generator=g)[:, 3:]  # row-strided
    w = torch.randn(N, K, generator=g).to(w_dtype)
    b = torch.randn(N, generator=g).to(w_dtype) if bias else None
    packed = cpu_native.pack(w)
    y = cpu_native.gemm(x, packed, N, b)
    want = F.linear(ref_activations(x, w_dtype).double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (M, N)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)
    # accumulate into a row-strided output
    base = torch.randn(M, N + 5, generator=g)
    out = base.clone()
    cpu_native.gemm(x, packed, N, b, out=out[:, 2 : 2 + N], accumulate=True)
    torch.testing.assert_close(
        out[:, 2 : 2 + N].double(), base[:, 2 : 2 + N].double() + want, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(out[:, :2], base[:, :2]) and torch.equal(out[:, 2 + N :], base[:, 2 + N :])
