"""Whether Triton is installed (it is Linux-only: the kernels' torch references serve elsewhere), found without
importing it, and the kernel modules' Triton kernels, imported at their first launch.

Importing Triton takes a third of a second or more, and a host without a GPU launches no kernel of it (the tests
do, on CPU tensors, under TRITON_INTERPRET=1): each kernel module (motet/kernels/<name>.py) holds its dispatch and
torch reference, and its `@triton.jit` kernels live in motet/kernels/jit/<name>.py, which `kernels` imports. The
dispatch's own arithmetic uses `cdiv` and `next_power_of_2` below, Triton's (triton/runtime/jit.py's `cdiv` and
`next_power_of_2`) restated, so that sizing a launch needs no import either."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

AVAILABLE = importlib.util.find_spec("triton") is not None


def kernels(module: str) -> ModuleType:
    """The Triton kernels of the kernel module named `module` (its `__name__`), imported (with Triton) once."""
    return importlib.import_module(module.replace("motet.kernels.", "motet.kernels.jit.", 1))


def cdiv(x: int, y: int) -> int:
    """Triton's `triton.cdiv`: x / y rounded up."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """Triton's `triton.next_power_of_2`: the least power of two >= n (for 32- and 64-bit n as Triton computes it)."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    n += 1
    return n
