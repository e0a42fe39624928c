"""The experts of a mixture-of-experts layer in Triton: a grouped GEMM over rows sorted by expert.

`Experts.grouped` (motet/engine/worker/model.py) has every (token, choice) row go through its expert: gate/up,
SiLU * up, down. In torch that is two products per expert that has rows, each a launch, most of them tiny at
decode. Here the rows (sorted by expert, as the torch path sorts them) are cut into tiles of BLOCK_M rows of
one expert each (an expert's last tile partly empty), and one launch computes every tile of the whole
layer's product: program (tile, n-block) loads the tile's rows, its expert's [BLOCK_N, K] slice of the stacked
weight [E, N, K] (rows contiguous along K, as the checkpoint stores them), and multiplies with fp32
accumulation: vLLM's fused-MoE layout (`moe_align_block_size`), without its padding of the rows themselves.
The first launch (gate/up) applies SiLU(gate) * up in registers when `act` is set: its program computes the
gate and the up columns of the same n-block and writes only their product, so the intermediate activations
are written once, at half the width.

`grouped_experts(rows, expert_ids, gate_up, down)` is the entry point (CUDA, or CPU under TRITON_INTERPRET=1);
`applies` says where the model uses it. The tile table is built with one host sync (the experts' row counts),
which the torch path also pays.
"""

from __future__ import annotations

import torch

from motet.kernels import triton_support

BLOCK_M = 16  # rows per tile: decode gives each expert a few rows
BLOCK_N = 64
BLOCK_K = 32


def applies(x: torch.Tensor) -> bool:
    """Whether the experts' product on `x` goes through this kernel (CUDA, Triton installed)."""
    return triton_support.AVAILABLE and x.is_cuda


def tile_table(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tile: its expert, its first row, its row count (<= BLOCK_M), for rows sorted by expert."""
    experts, starts, rows = [], [], []
    start = 0
    for e, n in enumerate(counts):
        for first in range(0, n, BLOCK_M):
            experts.append(e)
            starts.append(start + first)
            rows.append(min(BLOCK_M, n - first))
        start += n

    def t(v):
        return torch.tensor(v, dtype=torch.int32, device=device)

    return t(experts), t(starts), t(rows)


def _launch(x: torch.Tensor, w: torch.Tensor, tiles, n_out: int, act: bool) -> torch.Tensor:
    out = torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)
    experts, starts, rows = tiles
    if len(experts) == 0:
        return out
    grid = (len(experts), triton_support.cdiv(n_out, BLOCK_N))
    _jit()._grouped_kernel[grid](
        x, w, out, experts, starts, rows,
        n_out, x.shape[1], x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ACT=act, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 or not x.is_cuda else "tf32",  # fp32: exact
        INTERPRETED=not x.is_cuda,
    )  # fmt: skip
    return out


def grouped_experts(
    rows: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Each row of `rows` [R, H] through its expert (`expert_ids` [R]): SiLU(gate) * up, then down, with the
    stacked weights gate_up [E, 2I, H] and down [E, H, I]; the rows' order is kept."""
    assert rows.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    order = expert_ids.argsort(stable=True)
    counts = torch.bincount(expert_ids, minlength=gate_up.shape[0]).tolist()  # the one host sync
    tiles = tile_table(counts, rows.device)
    x = rows[order].contiguous()
    h = _launch(x, gate_up, tiles, gate_up.shape[1] // 2, act=True)
    y = _launch(h, down, tiles, down.shape[1], act=False)
    return torch.empty_like(y).index_copy_(0, order, y)


def _jit():
    """This module's Triton kernels (motet/kernels/jit/triton_moe.py), imported at their first launch."""
    return triton_support.kernels(__name__)
