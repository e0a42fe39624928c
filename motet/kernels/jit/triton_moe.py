"""The Triton kernels of motet/kernels/triton_moe.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl

from motet.kernels.jit.triton_quant import round_to


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_rows_ptr,
    N, K, stride_xm, stride_we, stride_wn, stride_om,
    ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out[rows of a tile, n-block] = x[rows] @ W[e, n-block]^T; with ACT, W holds gate rows [0, N) and up
    rows [N, 2N) and out = SiLU(x @ gate^T) * (x @ up^T)."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    rows = tl.load(tile_rows_ptr + tile)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < rows
    n_mask = offs_n < N
    x_tile = x_ptr + (start + offs_m)[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert * stride_we
    w_tile = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]: W^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_mask = offs_k < K - k0
        a = tl.load(x_tile + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_tile + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if INTERPRETED:  # the interpreter's 16-bit dots multiply raw bits (triton 3.9): fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if ACT:
            b_up = tl.load(w_tile + N * stride_wn + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if INTERPRETED:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    if ACT:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + (start + offs_m)[:, None] * stride_om + offs_n[None, :]
    tl.store(
        out, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=m_mask[:, None] & n_mask[None, :]
    )
