"""RMSNorm, and the residual add fused into it (vLLM's ``fused_add_rms_norm``), in the activations' dtype.

Per row of ``x [T, D]``: ``out = x * rsqrt(mean(x^2) + eps) * weight``, accumulated in fp32 inside the kernel
and rounded once into ``x``'s dtype; with a residual, first ``residual = x + residual`` (rounded into the
residual stream's dtype, the model's) and the norm of that sum. No fp32 tensor is materialised: one launch
reads each row once and writes ``out`` (and the new residual), where the torch path casts the whole row to
fp32, normalises, multiplies and casts back (four kernels on CUDA in bf16) and adds in a fifth.

``rms_norm_reference`` / ``add_rms_norm_reference`` define the meaning (the model's computation off CUDA,
unchanged: ``F.rms_norm`` of the fp32 row, then the cast); ``rms_norm`` / ``add_rms_norm`` are the Triton
launches (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``applies`` says where the model uses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from motet.kernels import triton_support


def applies(x: torch.Tensor) -> bool:
    """Whether the model's norms on `x` go through the Triton kernels (CUDA, Triton installed)."""
    return triton_support.AVAILABLE and x.is_cuda


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in fp32, rounded to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual): the sum in the residual's dtype, then its norm."""
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference`` in one launch: a new tensor in x's dtype (x's rows may be strided)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_reference`` in one launch: (out in x's dtype, the new residual in residual's dtype), both
    new tensors (the inputs are left as they are)."""
    if residual.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def _launch(x, residual, weight, eps, out, residual_out) -> None:
    if not triton_support.AVAILABLE:
        raise RuntimeError("the fused RMSNorm kernels need triton")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {dim}")
    x2, out2 = x.reshape(-1, dim), out.view(-1, dim)  # x may be a strided view of rows (reshape: a view)
    rows = x2.shape[0]
    if rows == 0:
        return
    has_residual = residual is not None
    r2 = residual.reshape(-1, dim) if has_residual else x2  # unused without a residual
    ro2 = residual_out.view(-1, dim) if has_residual else out2
    block = triton_support.next_power_of_2(dim)
    _jit()._rms_norm_kernel[(rows,)](
        x2, r2, weight, out2, ro2,
        x2.stride(0), x2.stride(1), r2.stride(0), r2.stride(1),
        dim, eps,
        HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip


def _jit():
    """This module's Triton kernels (motet/kernels/jit/fused_norm.py), imported at their first launch."""
    return triton_support.kernels(__name__)
