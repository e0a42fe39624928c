"""motet/kernels/triton_support.py restates Triton's launch arithmetic so that sizing a launch imports no Triton:
the same numbers as Triton's own `cdiv` and `next_power_of_2`."""

from __future__ import annotations

import pytest

from motet.kernels import triton_support

triton = pytest.importorskip("triton")


def test_launch_arithmetic_is_tritons():
    sizes = [*range(0, 1100), 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]
    assert [triton_support.next_power_of_2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]
    pairs = [(x, y) for x in (*range(0, 70), 4095, 4096, 2**33 + 1) for y in (1, 2, 3, 16, 32, 64, 127, 4096)]
    assert [triton_support.cdiv(x, y) for x, y in pairs] == [triton.cdiv(x, y) for x, y in pairs]
    assert triton_support.AVAILABLE
