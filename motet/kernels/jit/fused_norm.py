"""The Triton kernels of motet/kernels/fused_norm.py, which imports this module at their first launch (on CUDA, or
under TRITON_INTERPRET=1): a start that never launches them never imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_xt, stride_xd, stride_rt, stride_rd,
    D, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program per row; the whole row in registers (BLOCK >= D). `out` and `res_out` are contiguous
    rows of D."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + row * stride_xt + cols * stride_xd, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rt + cols * stride_rd, mask=ok, other=0.0).to(tl.float32)
        # the stream is kept in its dtype: the norm is of the rounded sum
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * D + cols, s, mask=ok)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=ok)
