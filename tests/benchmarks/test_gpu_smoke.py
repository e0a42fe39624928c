"""The GPU benchmarks at their smallest settings. moe_gpu_bench.py runs anywhere (on a CPU under Triton's
interpreter, as tests/conftest.py sets it up there); gpu_bench.py and quant_gpu_bench.py time CUDA kernels with
CUDA graphs and events and run only on a CUDA device (skipped elsewhere). gpu_peer.py: tests/benchmarks/
test_gpu_peer.py (its --device cpu run)."""

from __future__ import annotations

import json

import pytest
import torch

from motet.kernels import triton_support
from tests.benchmarks.smoke import positive

pytestmark = [pytest.mark.smoke, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs CUDA: it times CUDA kernels with CUDA graphs and events on a CUDA device"
)


@pytest.mark.skipif(not triton_support.AVAILABLE, reason="triton not installed")
def test_moe_gpu_bench(tmp_path):
    """Two experts of 64x128, two token counts: the Triton kernel against the torch path (interpreted on a
    CPU: its error and the figures' shape, not its speed)."""
    from benchmarks import moe_gpu_bench

    moe_gpu_bench.main(["--device", "cuda" if CUDA else "cpu", "--shape", "2x64x128", "--top-k", "1",
                        "--tokens", "1,2", "--calls", "2", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["tokens"] for r in report["results"]] == [1, 2] and positive(report["copy_bandwidth"])
    for r in report["results"]:
        assert r["max_relative_error"] < 2e-2  # bf16 products summed in another order
        assert positive(r["kernel_us"], r["torch_us"], r["speedup"], r["kernel_bandwidth_fraction"])
    assert "| 2 | 2 |" in (tmp_path / "summary.md").read_text()


@needs_cuda
def test_gpu_bench(tiny_model_dir, tmp_path):
    from benchmarks import gpu_bench

    gpu_bench.main(
        ["--model-dir", str(tiny_model_dir), "--out", str(tmp_path), "--quick", "--new-tokens", "4"]
    )
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["sgmv"] and report["paged_attention"] and report["decode"]
    assert all(positive(r["tokens_per_s"]) for r in report["decode"])
    assert positive(report["batch1_weight_roofline"])


@needs_cuda
def test_quant_gpu_bench(tmp_path):
    from benchmarks import quant_gpu_bench

    quant_gpu_bench.main(
        ["--out", str(tmp_path), "--layers", "64x128", "--batches", "1", "--formats", "int4,int8"]
    )
    assert json.loads((tmp_path / "quant_gpu_bench.json").read_text())
    assert (tmp_path / "quant_gpu_bench.md").read_text()
