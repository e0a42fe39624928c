"""The rotary embedding and the KV-cache write in one kernel (and Qwen3's per-head q/k RMSNorm before them).

Inputs are views of the fused qkv projection's output: ``q [T, H, D]``, ``k`` / ``v [T, KV, D]`` (strided: no
copy). Hugging Face layout: the two rotated halves of a head are its first and second ``D / 2`` values; the
angles come from fp32 tables ``cos`` / ``sin [P, D / 2]`` read at each token's position on the device. Two
programs per token: one rotates its query heads in place (``q`` then holds what attention reads), the other
rotates its k heads into the cache at flat slot ``slot_mapping[t]`` and copies its v heads beside them, or
skips both where the slot is negative (a CUDA-graph padding row, a token whose KV is already cached), as
``write_kv_cache`` does.
With ``q_norm`` / ``k_norm`` weights each head is first RMS-normalised over ``D`` and rounded to its dtype,
as the torch path rounds the norm's output before rotating.

``rotary_kv_reference`` defines the meaning (the model's torch path: fp32 rotation, cast back, then
``write_kv_cache``), and also rotates part of each head: with tables ``[P, R / 2]`` narrower than ``D / 2``
only a head's first ``R`` values turn (their two halves), the rest pass as they are (transformers' partial
rotary, Phi-4-mini's); ``rotary_kv_write`` rotates whole heads. ``rotary_kv_write`` is the Triton launch (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``), replacing on CUDA the torch path's fp32 cast, six products and sums, a cat, a
cast back and the write kernel (nine more with q/k norms); ``applies`` says where the model uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from motet.kernels import triton_support
from motet.kernels.fused_norm import rms_norm_reference
from motet.kernels.paged_attention import write_kv_cache


def applies(x: torch.Tensor) -> bool:
    """Whether the model's rotary and KV write on `x` go through `rotary_kv_write` (CUDA, Triton installed)."""
    return triton_support.AVAILABLE and x.is_cuda


@dataclass
class RotaryAngles:
    """A step's rotary angles: each token's position and the fp32 tables `cos` / `sin` [P, D / 2]. The kernel
    reads the tables at the positions on the device; the torch path gathers each token's rows on first use
    and every layer of the step reuses them."""

    positions: torch.Tensor  # [T]
    cos: torch.Tensor
    sin: torch.Tensor
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's cos and sin [T, 1, D / 2]."""
        if self._rows is None:
            self._rows = self.cos[self.positions].unsqueeze(1), self.sin[self.positions].unsqueeze(1)
        return self._rows


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` [T, heads, D] rotated by each token's cos / sin [T, 1, R / 2] (fp32), in x's dtype: its first R
    values of each head (R = D: all of them), the rest as they are."""
    rotary = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary].float().chunk(2, dim=-1)
    turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return turned if rotary == x.shape[-1] else torch.cat((turned, x[..., rotary:]), dim=-1)


def rotary_kv_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    angles: RotaryAngles,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The rotated q (a new tensor); rotated k and v written to the caches at `slot_mapping`."""
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    cos, sin = angles.rows()
    write_kv_cache(rotate_reference(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return rotate_reference(q, cos, sin)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    angles: RotaryAngles,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """`rotary_kv_reference` in one launch, q rotated in place (returned); no device sync. `k` is read only."""
    if not triton_support.AVAILABLE:
        raise RuntimeError("rotary_kv_write needs triton")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    positions, cos, sin = angles.positions, angles.cos, angles.sin
    if (
        head_dim % 2
        or k.shape != (num_tokens, num_kv_heads, head_dim)
        or v.shape != k.shape
        or k_cache.shape[2:] != (num_kv_heads, head_dim)
        or v_cache.shape != k_cache.shape
        or cos.shape[1] != head_dim // 2
        or sin.shape != cos.shape
        or cos.stride(1) != 1
        or sin.stride(1) != 1
    ):
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, cos {tuple(cos.shape)}"
        )
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if num_tokens == 0:
        return q
    has_norm = q_norm is not None
    half = head_dim // 2
    half_pad = triton_support.next_power_of_2(half)
    heads_pad = triton_support.next_power_of_2(max(num_heads, num_kv_heads))
    _jit()._rotary_kv_kernel[(num_tokens, 2)](
        q, k, v, k_cache, v_cache, positions, slot_mapping, cos, sin,
        q_norm if has_norm else cos, k_norm if has_norm else cos,
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        cos.stride(0), sin.stride(0), positions.stride(0), slot_mapping.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=k_cache.shape[1], HALF=half,
        HALF_PAD=half_pad, HEADS_PAD=heads_pad, HAS_NORM=has_norm,
        num_warps=max(1, min(16, heads_pad * half_pad // 256)),
    )  # fmt: skip
    return q


def _jit():
    """This module's Triton kernels (motet/kernels/jit/rope_kv.py), imported at their first launch."""
    return triton_support.kernels(__name__)
