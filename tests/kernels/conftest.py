"""The kernels' tests run at two compute threads whatever the suite's default (scripts/test.sh runs one a process):
what they check includes how each kernel splits its work between threads."""

from __future__ import annotations

import pytest
import torch

KERNEL_TEST_THREADS = 2


@pytest.fixture(autouse=True)
def two_compute_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(KERNEL_TEST_THREADS)
    yield
    torch.set_num_threads(before)
