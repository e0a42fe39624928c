"""The decoder's two building blocks that every attention kind and MLP shares: `Linear` (a projection whose CPU
product may run through oneDNN on a prepacked weight, or through its quantized format) and `RMSNorm` (with the
residual add fused in)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from motet.kernels import fused_norm, triton_quant
from motet.kernels.quant import QuantizedWeight, WeightFormat


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def quantized_product(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) with W in its blocks: the Triton GEMM on the stored blocks on CUDA (W8A16 / W4A16 /
    MXFP4), the format's CPU reference product elsewhere (`QuantizedWeight.linear`)."""
    if triton_quant.applies(x):
        return triton_quant.quant_linear(x, weight, bias)
    return weight.linear(x, bias)


class Linear(nn.Linear):
    """nn.Linear whose CPU product can run through oneDNN on a prepacked weight.

    On CPU `F.linear` goes to MKL. On this machine (AMD EPYC, AVX-512) oneDNN with a prepacked weight
    measured 2.6-3.2x faster for fp32 at 32-64 rows, 1.3-3x at one row, and 1.2-2x for bf16 (vLLM's
    CPU backend uses oneDNN too). The CPU runner calls `prepack()`; the plain weight stays for tied
    embeddings, LoRA and checkpoints.

    A quantized layer holds its weight in `quantized` (its float `weight` released) and multiplies through
    the Triton W8A16 / W4A16 kernel on CUDA (motet/kernels/triton_quant.py), elsewhere through the format's
    reference product (`QuantizedWeight.linear`); the native CPU step packs the same weight for its
    quantized kernels."""

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None

    def quantize(self, fmt: WeightFormat) -> None:
        """Hold the weight in `fmt` from now on (quantized from its current values, on its device)."""
        self.quantized = fmt.quantize(self.weight.detach())
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device), False)
        self.packed_weight = None

    def prepack(self, rows_hint: int = 64) -> bool:
        """Pack the weight for oneDNN; False (F.linear stays) where oneDNN cannot run this dtype on this
        CPU (its bf16 path needs AVX-512 or AVX-NE-CONVERT), or the weight is quantized."""
        if self.quantized is not None:
            return False
        # a plain attribute, made after .to(device/dtype); the hint only tunes the layout (64 >= 1, 32)
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows_hint)
        except RuntimeError:
            self.packed_weight = None
        return self.packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized_product(self.quantized, x, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, in fp32 inside and the input's dtype outside; with a `residual`, the
    residual stream's add fused in (vLLM's `fused_add_rms_norm`). On CUDA one Triton launch each
    (motet/kernels/fused_norm.py), elsewhere its torch reference."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (norm(x + residual), x + residual), new tensors."""
        fused = fused_norm.applies(x)
        if residual is None:
            return (fused_norm.rms_norm if fused else fused_norm.rms_norm_reference)(x, self.weight, self.eps)
        add_norm = fused_norm.add_rms_norm if fused else fused_norm.add_rms_norm_reference
        return add_norm(x, residual, self.weight, self.eps)
