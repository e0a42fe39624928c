"""Triton where it is installed, None elsewhere (it is Linux-only): the kernels' torch references serve then.

The kernel modules import `triton` and `tl` from here and test `triton is not None` in their `applies`."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is Linux-only; the torch reference serves elsewhere
    triton = None
    tl = None

__all__ = ["tl", "triton"]
