"""4-bit GPTQ and AWQ projections, as Hugging Face checkpoints store them, in motet's int4 format.

Both store a linear layer's weight W [N, K] (N outputs, K inputs) as 4-bit integers q with, per group of
g consecutive inputs and per output, an fp16 scale s and a 4-bit zero point z: W[n, k] = s * (q - z).

- GPTQ (AutoGPTQ / GPTQModel, `qlinear_cuda_old`'s packing): `qweight` int32 [K / 8, N], eight inputs per
  word along K (input k in bits 4 * (k % 8) of word k // 8); `qzeros` int32 [K / g, N / 8], eight outputs
  per word along N (output n in bits 4 * (n % 8)); `scales` fp16 [K / g, N]; `g_idx` int32 [K], the group
  of each input (k // g, unless quantized with desc_act, "act order"). Checkpoint format "gptq" (v1) stores
  each zero minus one (AutoGPTQ's pack: `zeros -= 1`; its kernels add the one back, so a stored 15 is 16),
  "gptq_v2" the zero itself.
- AWQ (AutoAWQ's GEMM version): `qweight` int32 [K, N / 8], eight outputs per word along N in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i of word c holds output 8 * c + order[i]); `qzeros`
  int32 [K / g, N / 8] packed the same way; `scales` fp16 [K / g, N]. Zeros are stored as they are.

In int4 (blocks of 32 inputs, value = q * scale + min) every 32-block of a group takes the group's scale
and min = -scale * zero rounded to fp16 (exact where the product fits fp16's 11 bits, e.g. a symmetric
zero of 8; else within 2^-11 of it). A block's 32 inputs must share one group: g a multiple of 32, and
with desc_act a g_idx constant over each block, else `ValueError` (an act-order checkpoint's groups are
scattered over K; serving it would mean permuting each layer's activations, which motet's kernels do not).
"""

from __future__ import annotations

import torch

from motet.kernels.quant import BLOCK, INT4, QuantizedWeight

PACK = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output held by each nibble of an AWQ word, 8 outputs a word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (low nibble first), unpacked along `dim` (uint8)."""
    w = words.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * w.dim()
    shape[dim + 1] = PACK
    values = (w >> _SHIFTS.reshape(shape)) & 0xF  # arithmetic shift of negative words: the mask keeps 4 bits
    out_shape = list(words.shape)
    out_shape[dim] *= PACK
    return values.to(torch.uint8).reshape(out_shape)


def _check_layout(method: str, layout: str, tensors: dict[str, torch.Tensor], expected: dict) -> None:
    """ValueError naming every part's shape and dtype where one is not the layout's (`expected`: name ->
    (shape, allowed dtypes))."""
    if all(
        tuple(tensors[n].shape) == shape and tensors[n].dtype in dtypes
        for n, (shape, dtypes) in expected.items()
    ):
        return
    found = ", ".join(
        f"{n} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}" for n, t in tensors.items()
    )
    raise ValueError(f"{found} do not make a {method} weight: expected {layout}")


_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _groups_of_blocks(g_idx: torch.Tensor, groups: int) -> torch.Tensor:
    """The group of each 32-input block, from each input's group; ValueError where a block spans groups."""
    K = g_idx.numel()
    per_block = g_idx.reshape(K // BLOCK, BLOCK).long()
    if not (per_block == per_block[:, :1]).all():
        raise ValueError(
            f"g_idx puts inputs of one block of {BLOCK} in different groups (an act-order, desc_act=true, "
            f"quantization): motet's int4 blocks take one scale per {BLOCK} consecutive inputs and do not "
            f"permute activations; serve a checkpoint quantized with desc_act=false"
        )
    first = per_block[:, 0]
    if first.min() < 0 or first.max() >= groups:
        raise ValueError(f"g_idx holds groups outside 0..{groups - 1}")
    return first


def to_int4(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, block_group: torch.Tensor
) -> QuantizedWeight:
    """int4 blocks of W[n, k] = scales[g, n] * (q[k, n] - zeros[g, n]), g = block_group[k // 32]: q uint8 [K, N]
    in 0..15, zeros [G, N] (0..16), scales [G, N]."""
    K, N = q.shape
    values = q.t().reshape(N, K // BLOCK, BLOCK)  # the weight's rows, cut into blocks along K
    data = values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)  # int4's packing: j low, j + 16 high
    s = scales.float()[block_group]  # [K / 32, N]
    mins = -(s * zeros.float()[block_group])
    out = QuantizedWeight(
        INT4, data.reshape(N, K // 2).contiguous(), s.t().half().contiguous(), mins.t().half().contiguous()
    )
    if not (torch.isfinite(out.scales).all() and torch.isfinite(out.mins).all()):
        raise ValueError("a group's scale or scale * zero is not a finite fp16")
    return out


def _group_count(K: int, group_size: int) -> int:
    g = K if group_size == -1 else group_size
    if g <= 0 or g % BLOCK or K % g:
        raise ValueError(
            f"group_size {group_size} with {K} inputs: motet takes groups that are a multiple of {BLOCK} "
            f"inputs (or -1, one group) and divide the input size"
        )
    return K // g


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zeros_minus_one: bool,
) -> QuantizedWeight:
    """A GPTQ 4-bit projection (the module docstring) as int4; `zeros_minus_one` for the v1 format."""
    layout = (
        "qweight int32 [in / 8, out], qzeros int32 [groups, out / 8], scales fp16 [groups, out], g_idx [in]"
    )
    if qweight.dim() != 2 or qweight.shape[1] % PACK:
        _check_layout("GPTQ", layout, {"qweight": qweight}, {"qweight": ((), ())})
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    G = _group_count(K, group_size)
    if g_idx is None:
        g_idx = torch.arange(K) // (K // G)
    _check_layout(
        "GPTQ", f"{layout}, groups = in / group_size",
        {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx},
        {
            "qweight": ((K // PACK, N), (torch.int32,)), "qzeros": ((G, N // PACK), (torch.int32,)),
            "scales": ((G, N), _SCALE_DTYPES), "g_idx": ((K,), (torch.int32, torch.int64)),
        },
    )  # fmt: skip
    zeros = _nibbles(qzeros, 1).to(torch.int32) + int(zeros_minus_one)
    return to_int4(_nibbles(qweight, 0), zeros, scales, _groups_of_blocks(g_idx, G))


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> QuantizedWeight:
    """An AWQ GEMM 4-bit projection (the module docstring) as int4."""
    layout = "qweight int32 [in, out / 8], qzeros int32 [groups, out / 8], scales fp16 [groups, out]"
    if qweight.dim() != 2:
        _check_layout("AWQ", layout, {"qweight": qweight}, {"qweight": ((), ())})
    K, N = qweight.shape[0], qweight.shape[1] * PACK
    G = _group_count(K, group_size)
    _check_layout(
        "AWQ", f"{layout}, groups = in / group_size",
        {"qweight": qweight, "qzeros": qzeros, "scales": scales},
        {"qweight": ((K, N // PACK), (torch.int32,)), "qzeros": ((G, N // PACK), (torch.int32,)), "scales": ((G, N), _SCALE_DTYPES)},
    )  # fmt: skip
    # nibble i of word c is output 8c + AWQ_ORDER[i]: output 8c + j is nibble AWQ_ORDER.index(j)
    inverse = torch.tensor([AWQ_ORDER.index(j) for j in range(PACK)])
    order = (torch.arange(N // PACK)[:, None] * PACK + inverse).reshape(-1)
    q = _nibbles(qweight, 1)[:, order]
    zeros = _nibbles(qzeros, 1)[:, order].to(torch.int32)
    return to_int4(q, zeros, scales, torch.arange(K // BLOCK) * BLOCK // (K // G))
