"""The Triton kernels of motet/kernels/activation.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_xd, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_xt + cols * stride_xd, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_xt + (cols + inter) * stride_xd, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded as F.silu's output is
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
