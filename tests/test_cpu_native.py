"""The native CPU kernels (motet/kernels/cpu_native.py) against float64 ground truths: paged attention against the
naive per-position attention of test_paged_attention, SGMV against the naive per-token LoRA delta of
test_sgmv, the small-M linear against float64 F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from motet.kernels import cpu_native
from tests.test_paged_attention import TOL, make_batch, naive_attention, random_seqs
from tests.test_sgmv import (
    GROUP_REF_CASES,
    REF_CASES,
    check_expand,
    check_group,
    make_case,
    make_group_case,
    naive,
    naive_group,
)

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 24)])
def test_attention_matches_naive(dtype, block_size, num_heads, num_kv_heads, head_dim):
    """Decodes, prefill chunks over cached context, fresh prefills, empty rows; K/V in the cache dtype."""
    g = torch.Generator().manual_seed(block_size + num_heads)
    seqs = random_seqs(g, n=10, max_ctx=90, max_chunk=40)
    args = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3)
    args = [t.cpu() for t in args]
    scale = head_dim**-0.5
    out = cpu_native.attention(*args, scale)
    assert out.shape == args[0].shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(*args, scale), **TOL[dtype])


def test_attention_strided_q_and_long_context():
    seqs = [(1, 700), (3, 300), (1, 1), (0, 9)]
    args = [t.cpu() for t in make_batch(seqs, 9, 3, 64, 16, torch.float32, noncontig_q=True)]
    out = cpu_native.attention(*args, 0.125)
    torch.testing.assert_close(out.double(), naive_attention(*args, 0.125), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", REF_CASES, ids=[f"case{c[0]}" for c in REF_CASES])
def test_sgmv_matches_naive(case, dtype):
    c = make_case(*case, dtype=dtype)
    _, delta = naive(c)
    y = c["y"].clone()
    cpu_native.sgmv(y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"])
    check_expand(y, c["y"], delta, dtype)


def test_sgmv_strided_output_and_cut_rank():
    """A module's columns of a fused output (a row-strided view) and stacks cut to the batch's rank."""
    c = make_case(2, 40, 7, 96, 64, 16)
    r = 8
    c["A"][:, r:] = 0
    c["B"][:, :, r:] = 0
    _, delta = naive(c)
    fused = torch.randn(40, 3 * 64)
    fused[:, 64:128] = c["y"]
    before = fused.clone()
    cpu_native.sgmv(
        fused[:, 64:128], c["x"], c["A"][:, :r], c["B"][:, :, :r], c["scales"], c["starts"], c["slots"]
    )
    check_expand(fused[:, 64:128], c["y"], delta, torch.float32)
    assert torch.equal(fused[:, :64], before[:, :64]) and torch.equal(fused[:, 128:], before[:, 128:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", GROUP_REF_CASES, ids=[f"case{c[0]}" for c in GROUP_REF_CASES])
def test_sgmv_group_matches_naive(case, dtype):
    """A module group (q/k/v, gate/up): one shrink over the rank-major A, each active module's expand into its
    columns; slots of mixed ranks and target sets, inactive modules untouched."""
    c = make_group_case(*case, dtype=dtype)
    y = c["y"].clone()
    cpu_native.sgmv(
        y, c["x"], c["A"], c["B"], c["scales"], c["starts"], c["slots"], sizes=c["sizes"], active=c["active"]
    )
    check_group(y, c, naive_group(c)[1], dtype, c["active"])


def test_sgmv_group_in_a_row_strided_output_with_cut_rank():
    """The group's columns inside a wider buffer, stacks cut to the batch's rank (the first n r rows of A)."""
    c = make_group_case(19, 30, 6, 64, (64, 32, 32), 8)
    S, n, R = c["A"].shape[0], 3, 8
    A2 = torch.zeros(S, 2 * R, n, 64)
    A2[:, :R] = c["A"].view(S, R, n, 64)
    B2 = torch.zeros(S, 128, 2 * R)
    B2[:, :, :R] = c["B"]
    wide = torch.randn(30, 200)
    wide[:, 40:168] = c["y"]
    before = wide.clone()
    y = wide[:, 40:168]
    cpu_native.sgmv(
        y,
        c["x"],
        A2.flatten(1, 2)[:, : n * R],
        B2[:, :, :R],
        c["scales"],
        c["starts"],
        c["slots"],
        sizes=c["sizes"],
    )
    check_group(y, c, naive_group(c)[1], torch.float32, (True,) * 3)
    assert torch.equal(wide[:, :40], before[:, :40]) and torch.equal(wide[:, 168:], before[:, 168:])


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 2, 3, 6, 7, 13, 100, 200])
@pytest.mark.parametrize("N,K", [(16, 16), (13, 40), (50, 37), (70, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_float64(w_dtype, M, N, K, bias):
    """Every row-tile remainder (M mod 6), panel remainder (N mod 16), several M chunks (M > 96)."""
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K + 3, generator=g)[:, 3:]  # row-strided
    w = torch.randn(N, K, generator=g).to(w_dtype)
    b = torch.randn(N, generator=g).to(w_dtype) if bias else None
    packed = cpu_native.pack(w)
    y = cpu_native.gemm(x, packed, N, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
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
