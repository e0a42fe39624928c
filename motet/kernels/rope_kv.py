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

from motet.kernels.fused_norm import rms_norm_reference
from motet.kernels.paged_attention import write_kv_cache
from motet.kernels.triton_support import tl, triton


def applies(x: torch.Tensor) -> bool:
    """Whether the model's rotary and KV write on `x` go through `rotary_kv_write` (CUDA, Triton installed)."""
    return triton is not None and x.is_cuda


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
    if triton is None:
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
    half_pad = triton.next_power_of_2(half)
    heads_pad = triton.next_power_of_2(max(num_heads, num_kv_heads))
    _rotary_kv_kernel[(num_tokens, 2)](
        q, k, v, k_cache, v_cache, positions, slot_mapping, cos, sin,
        q_norm if has_norm else cos, k_norm if has_norm else cos,
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        cos.stride(0), sin.stride(0), positions.stride(0), slot_mapping.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=k_cache.shape[1], HALF=half,
        HALF_PAD=half_pad, HEADS_PAD=heads_pad, HAS_NORM=has_norm,
        num_warps=max(1, min(16, heads_pad * half_pad // 256)),
    )  # fmt: skip
    return q


if triton is not None:

    @triton.jit
    def _rotated_heads(
        x_ptr, stride_h, stride_d, num_heads, w_ptr, eps, cos, sin,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        """A token's heads [HEADS_PAD, HALF_PAD] x 2 halves, RMS-normalised by `w` and rounded to their dtype
        first (HAS_NORM), rotated in fp32: (first halves, second halves, the mask of real values)."""
        h = tl.arange(0, HEADS_PAD)
        i = tl.arange(0, HALF_PAD)
        ok = (h[:, None] < num_heads) & (i[None, :] < HALF)
        ptrs = x_ptr + h[:, None] * stride_h + i[None, :] * stride_d
        x1 = tl.load(ptrs, mask=ok, other=0.0)
        x2 = tl.load(ptrs + HALF * stride_d, mask=ok, other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
            x1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
            x2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin, ok

    @triton.jit
    def _rotary_kv_kernel(
        q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        stride_cos, stride_sin, stride_pos, stride_slot, eps,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr,
        HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        """Program (t, 0): token t's query heads; (t, 1): its kv heads."""
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        h = tl.arange(0, HEADS_PAD)
        pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0)[None, :]
        if tl.program_id(1) == 0:  # the query heads: rotated in place
            src = q_ptr + t * stride_qt
            o1, o2, ok = _rotated_heads(
                src, stride_qh, stride_qd, NUM_HEADS, qw_ptr, eps, cos, sin, HALF, HALF_PAD, HEADS_PAD, HAS_NORM,
            )  # fmt: skip
            dst = src + h[:, None] * stride_qh + i[None, :] * stride_qd
            tl.store(dst, o1.to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(dst + HALF * stride_qd, o2.to(q_ptr.dtype.element_ty), mask=ok)
        else:  # the kv heads: rotated k and v into the cache, unless the slot is negative
            slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
            if slot >= 0:
                o1, o2, ok = _rotated_heads(
                    k_ptr + t * stride_kt, stride_kh, stride_kd, NUM_KV_HEADS, kw_ptr, eps, cos, sin,
                    HALF, HALF_PAD, HEADS_PAD, HAS_NORM,
                )  # fmt: skip
                block = slot // BLOCK_SIZE
                off = slot % BLOCK_SIZE
                # rounded to k's dtype first (the torch path's rotated k), then to the cache's
                k_dtype = k_cache_ptr.dtype.element_ty
                o1 = o1.to(k_ptr.dtype.element_ty).to(k_dtype)
                o2 = o2.to(k_ptr.dtype.element_ty).to(k_dtype)
                k_dst = k_cache_ptr + block * stride_kcb + off * stride_kcs
                k_dst += h[:, None] * stride_kch + i[None, :] * stride_kcd
                tl.store(k_dst, o1, mask=ok)
                tl.store(k_dst + HALF * stride_kcd, o2, mask=ok)
                v_src = v_ptr + t * stride_vt + h[:, None] * stride_vh + i[None, :] * stride_vd
                v_dst = v_cache_ptr + block * stride_vcb + off * stride_vcs
                v_dst += h[:, None] * stride_vch + i[None, :] * stride_vcd
                v_dtype = v_cache_ptr.dtype.element_ty
                v1 = tl.load(v_src, mask=ok)
                v2 = tl.load(v_src + HALF * stride_vd, mask=ok)
                tl.store(v_dst, v1.to(v_dtype), mask=ok)
                tl.store(v_dst + HALF * stride_vcd, v2.to(v_dtype), mask=ok)
