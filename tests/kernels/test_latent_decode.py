"""The absorbed MLA decode (motet/kernels/latent_decode.py): its torch reference and its Triton kernel against a
naive float64 ground truth written from the layout (each head's latent query against the cached c_kv, its rotated
query against the shared rotated key, the softmax's sum of c_kv), in decode batches whose contexts cross block
boundaries, in fp32 and bf16; and the kernel built for sm_80 / sm_90 without spills. Without CUDA the kernel runs
under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from motet.kernels import latent_decode as ld
from motet.kernels import triton_support
from motet.kernels.attention_args import PagedContext
from tests.kernels.gpu_build import gpu_builds

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_support.AVAILABLE, reason="triton not installed")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def naive_latent_decode(q_latent, q_rope, cache, ctx: PagedContext, scale):
    """Per sequence, its rows gathered position by position, the scores and softmax in float64."""
    rank = q_latent.shape[-1]
    out = torch.zeros(q_latent.shape, dtype=torch.float64)
    qsl, lens, tables = ctx.query_start_loc.cpu(), ctx.seq_lens.cpu(), ctx.block_tables.cpu().long()
    block_size = cache.shape[1]
    for b in range(len(lens)):
        if qsl[b + 1] == qsl[b]:
            continue
        row, pos = int(qsl[b]), torch.arange(int(lens[b]))
        rows = cache.cpu()[tables[b, pos // block_size], pos % block_size, 0].double()  # [S, rank + rope]
        s = q_latent[row].cpu().double() @ rows[:, :rank].T + q_rope[row].cpu().double() @ rows[:, rank:].T
        out[row] = (s * scale).softmax(-1) @ rows[:, :rank]
    return out


def decode_batch(lens, heads, rank, rope, block_size, dtype, seed=0, strided=False, empty=()):
    """(q_latent, q_rope, cache, ctx): one new token for each sequence of `lens` (none for those in `empty`),
    its blocks a random permutation of the cache with spares, tables padded with 0; `strided`: the queries slices
    of one wider tensor, as the model's concatenation would leave them."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(per_seq) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[used : used + n]
        used += n
    cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=g).to(dtype)
    q_lens = torch.tensor([0] + [0 if b in empty else 1 for b in range(len(lens))])
    qsl = torch.cumsum(q_lens, 0).to(torch.int32)
    T = int(qsl[-1]) + 1  # one spare row past the sequences' (zeros in the output)
    q = torch.randn(T, heads, rank + rope + (5 if strided else 0), generator=g).to(dtype)
    q_latent, q_rope = q[..., :rank], q[..., rank : rank + rope]
    if not strided:
        q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    ctx = PagedContext(tables.to(DEVICE), qsl.to(DEVICE), torch.tensor(lens, dtype=torch.int32).to(DEVICE))
    return q_latent.to(DEVICE), q_rope.to(DEVICE), cache.to(DEVICE), ctx


def check(fn, lens, heads, rank, rope, block_size, dtype, splits=None, **kw):
    q_latent, q_rope, cache, ctx = decode_batch(lens, heads, rank, rope, block_size, dtype, **kw)
    scale = (rank + rope) ** -0.5
    out = fn(q_latent, q_rope, cache, ctx, scale, *([splits] if splits else []))
    assert out.shape == q_latent.shape and out.dtype == dtype
    expected = naive_latent_decode(q_latent, q_rope, cache, ctx, scale)
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])
    assert out[-1].abs().max() == 0  # the spare row


# contexts of 1 token, within a block, at and across block boundaries, past a tile of 32, one long
LENS = [1, 7, 8, 9, 16, 17, 33, 70]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_naive(dtype):
    check(ld.latent_decode_reference, LENS, 4, 16, 8, 8, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,splits", [(8, 1), (16, 1), (8, 3)])
def test_kernel_matches_naive(dtype, block_size, splits):
    """4 heads (one padded head block), rank 16, rope 8 (padded to 16): the tiny checkpoints' shapes; the context
    whole, or in 3 splits merged (empty ones among them: a context of 1 to 70 positions in tiles of 32)."""
    check(ld.latent_decode_triton, LENS, 4, 16, 8, block_size, dtype, splits, seed=block_size)


def test_splits_fill_the_gpu_from_host_sizes():
    """Few sequences: more splits, up to MAX_SPLITS, none shorter than MIN_SPLIT_TILES tiles of the longest
    context where the step says it (a CUDA graph's hint is the model's length: its bucket fixes the splits)."""
    assert ld.num_splits(1, 128, None) == 16  # DeepSeek-V3's 128 heads: 8 head blocks
    assert ld.num_splits(1, 16, 4096) == ld.MAX_SPLITS  # V2-Lite's 16: one
    assert ld.num_splits(1, 16, 200) == 2  # 200 positions: two splits of at least 4 tiles of 32
    assert ld.num_splits(64, 128, None) == 1 and ld.num_splits(8, 16, None) == 16


@needs_triton
def test_kernel_heads_over_blocks_widths_unpadded_strided_and_empty_rows():
    """20 heads (two head blocks, the second part padding), rank 24 and rope 12 (neither a power of two), the
    queries strided slices, a sequence without a new token among them (its rows zeros, merged or not), and a block
    of 64 positions (two tiles within one block); in the splits `num_splits` picks (10 programs: 12), and whole."""
    check(
        ld.latent_decode_triton, [5, 40, 3, 64, 65], 20, 24, 12, 64, torch.float32, strided=True, empty=(2,)
    )
    check(ld.latent_decode_triton, [1, 31, 32, 33], 20, 24, 12, 16, torch.bfloat16, 1, strided=True)


@needs_triton
def test_kernel_refuses_mismatched_shapes_and_dtypes():
    q_latent, q_rope, cache, ctx = decode_batch([3], 4, 16, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="bad shapes"):
        ld.latent_decode_triton(q_latent, q_rope[..., :4], cache, ctx, 0.1)
    with pytest.raises(ValueError, match="dtypes differ"):
        ld.latent_decode_triton(q_latent.bfloat16(), q_rope, cache, ctx, 0.1)


def test_dispatch_by_device(monkeypatch):
    """CPU tensors take the reference; the kernel where `applies` says (CUDA)."""
    calls = []
    monkeypatch.setattr(ld, "latent_decode_triton", lambda *a: calls.append("triton"))
    monkeypatch.setattr(ld, "latent_decode_reference", lambda *a: calls.append("reference"))
    q_latent, q_rope, cache, ctx = decode_batch([3], 4, 16, 8, 8, torch.float32)
    ld.latent_decode(q_latent, q_rope, cache, ctx, 0.1)
    monkeypatch.setattr(ld, "applies", lambda x: True)
    ld.latent_decode(q_latent, q_rope, cache, ctx, 0.1)
    assert calls == (["triton", "triton"] if DEVICE == "cuda" else ["reference", "triton"])


COMPILE_CHECK = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from motet.kernels import latent_decode, triton_support
from tests.kernels.gpu_build import resource_usage

out = []
for name, arch, dtype, consts in json.loads(sys.argv[1]):
    kernel = getattr(triton_support.kernels(latent_decode.__name__), name)
    full = {n: "i32" for n in kernel.arg_names}
    full.update(out_ptr=f"*{dtype}", parts_ptr="*fp32", lse_ptr="*fp32", query_start_loc_ptr="*i32")
    if name == "_latent_decode_kernel":
        full.update(ql_ptr=f"*{dtype}", qr_ptr=f"*{dtype}", cache_ptr=f"*{dtype}", block_tables_ptr="*i32",
                    seq_lens_ptr="*i32", scale_log2="fp32")
        options = latent_decode.launch_options(dtype == "fp32")
    else:
        options = {}
    full.update({n: "constexpr" for n in consts})
    k = triton.compile(ASTSource(kernel, full, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                       options=options)
    out.append(dict(name=name, arch=arch, dtype=dtype, **resource_usage(k, kernel.fn.__name__)))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests above run the kernel natively")
def test_kernel_compiles_for_the_gpu_without_spills(tmp_path):
    """Built for sm_90 (H100) and sm_80 (A100) by triton's compiler and ptxas as a launch builds it, at DeepSeek-V2
    / V3's shapes (kv_lora_rank 512, qk_rope_head_dim 64, 16-position blocks), whole or in splits, and the splits'
    merge: registers only (no spill to local
    memory) and no global scratch (nothing for a CUDA graph to allocate at launch)."""
    shapes = dict(
        BLOCK_SIZE=16, RANK=512, RANK_PAD=512, ROPE=64, ROPE_PAD=64, BLOCK_H=ld.BLOCK_H, TILE_N=ld.TILE_N
    )
    cases = [
        (
            "_latent_decode_kernel",
            arch,
            dtype,
            dict(shapes, NUM_SPLITS=splits, PRECISION="ieee" if dtype == "fp32" else None, DOT_FP32=False),
        )
        for arch in (90, 80)
        for dtype in ("bf16", "fp32")
        for splits in (1, ld.MAX_SPLITS)
    ]
    merge = dict(RANK=512, RANK_PAD=512, NUM_SPLITS=ld.MAX_SPLITS, SPLITS_PAD=ld.MAX_SPLITS)
    cases += [("_merge_splits_kernel", arch, "bf16", merge) for arch in (90, 80)]
    builds = gpu_builds(COMPILE_CHECK, cases, tmp_path)
    assert len(builds) == len(cases)
    for build in builds:
        assert build["spill"] == 0 and build["regs"] <= 255 and build["scratch"] == 0, build


@needs_triton
def test_the_model_decodes_through_the_kernel(tmp_path, monkeypatch):
    """The latent attention's decode rows through the kernel (forced on for CPU tensors: under the interpreter),
    one token a step, every row absorbed: logits within 2e-4 of transformers'."""
    from tests.engine.test_engine import PROMPTS, engine_logits, hf_logits
    from tests.models.test_deepseek import build_deepseek, deepseek_engine

    launches = []
    triton_path = ld.latent_decode_triton
    monkeypatch.setattr(ld, "applies", lambda x: True)
    monkeypatch.setattr(ld, "latent_decode_triton", lambda *a: launches.append(1) or triton_path(*a))
    model_dir = build_deepseek(tmp_path, "v2")
    prompts = [PROMPTS[1], PROMPTS[2][:9]]
    # (the eager model: the native CPU step has its own latent op)
    engine = deepseek_engine(model_dir, compiled=False)
    for got, prompt in zip(engine_logits(engine, prompts, chunk=1), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(model_dir, prompt), atol=2e-4, rtol=1e-4)
    assert len(launches) >= 3 * 8  # three layers a step
