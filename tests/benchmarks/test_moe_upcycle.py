"""benchmarks/moe_upcycle.py: a Mixtral made of exact copies of a dense Llama's MLP computes the dense model,
with and without the residual stream rotated (transformers on both checkpoints)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.moe_upcycle import upcycle
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny Llama whose norms are not all ones (so folding them into the projections is tested)."""
    path = build_tiny_model(tmp_path_factory.mktemp("dense"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    hf.save_pretrained(path, safe_serialization=True)
    return path


def logits(path, ids):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("rotated", [False, True])
def test_exact_copies_compute_the_dense_model(dense, tmp_path, rotated):
    ids = list(range(3, 40))
    moe = upcycle(dense, tmp_path / "moe", experts=4, top_k=2, noise=0.0, rotated=rotated)
    assert AutoModelForCausalLM.from_pretrained(moe).config.model_type == "mixtral"
    want = logits(dense, ids)
    assert torch.allclose(logits(moe, ids), want, atol=1e-4 * want.abs().max().item())


def test_noise_makes_the_experts_differ(dense, tmp_path):
    ids = list(range(3, 40))
    moe = upcycle(dense, tmp_path / "moe", experts=4, top_k=2, noise=0.1)
    assert not torch.allclose(logits(moe, ids), logits(dense, ids), atol=1e-3)
