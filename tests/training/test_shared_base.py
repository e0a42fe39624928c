"""A job's frozen base is the server's prepared weights, mapped (motet/training/shared_base.py): its projections'
and embedding's values live in the cache entry's file the server maps (no private copy), the model computes what
transformers' own computes, and the adapter a run trains is the one a run over a private copy of the base trains.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from motet.engine.llm import LLM
from motet.engine.weights.prepared_store import DATA, PreparedStore
from motet.kernels import cpu_native
from motet.training.shared_base import PanelLinear, panel_product, panel_product_t
from motet.training.trainer import load_base, train
from tests.training.test_trainer import assert_same, chats, make_run, weights

pytestmark = [
    pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels"),
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]


@pytest.fixture
def served(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model started as the server starts it, its prepared weights in this test's own cache: the entry's
    data file."""
    monkeypatch.setenv("MOTET_WEIGHTS_CACHE_DIR", str(tmp_path / "weights"))
    LLM(str(tiny_model_dir), device="cpu", block_size=8, num_kv_blocks=64)
    (entry,) = PreparedStore(tmp_path / "weights").entries()
    return entry.path / DATA


def mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def base_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor of the frozen base (its parameters, and a shared base's panels held as plain attributes)."""
    found = {n: p for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        for attr in ("weight", "panels"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                found.setdefault(f"{name}.{attr}", t)
    return found


def test_the_frozen_base_is_the_servers_mapping_not_a_copy(served, tiny_model_dir):
    model = load_base(tiny_model_dir, "float32")
    ranges = mapped_from(served)
    assert ranges
    tensors = base_tensors(model)
    assert any(n.endswith("embed_tokens.weight") for n in tensors)
    for name, t in tensors.items():  # every tensor of the base: the projections, the table, the norms
        ptr = t.untyped_storage().data_ptr()
        assert any(start <= ptr < end for start, end in ranges), f"{name} is a copy of its own"


def test_the_shared_base_computes_what_transformers_computes(served, tiny_model_dir, tiny_hf_model):
    model = load_base(tiny_model_dir, "float32")
    ids = torch.randint(
        0, tiny_hf_model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(model(ids).logits, tiny_hf_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_panel_products_and_gradient_are_linears(served, tiny_model_dir):
    model = load_base(tiny_model_dir, "float32")
    lin = next(m for m in model.modules() if isinstance(m, PanelLinear) and m.out_features % 16 == 0)
    weight = lin.panels.permute(0, 2, 1).reshape(-1, lin.in_features)[: lin.out_features]  # [N, K]
    assert torch.equal(lin.weight[2:7], weight[2:7]) and lin.weight.shape == weight.shape
    x = torch.randn(3, 5, lin.in_features, requires_grad=True)
    torch.testing.assert_close(panel_product(x, lin.panels, lin.out_features), x @ weight.T)
    g = torch.randn(3, 5, lin.out_features)
    torch.testing.assert_close(panel_product_t(g, lin.panels), g @ weight)
    lin(x).backward(g)
    torch.testing.assert_close(x.grad, g @ weight)


def test_the_adapter_is_the_one_a_private_copy_trains(served, tiny_model_dir, tmp_path, monkeypatch):
    lines = [{"messages": c} for c in chats(7)]
    shared = make_run(tiny_model_dir, tmp_path, "shared", "supervised", lines, n_epochs=2, batch_size=2)
    assert train(shared) == "succeeded"
    monkeypatch.setenv("MOTET_WEIGHTS_CACHE_DIR", str(tmp_path / "empty"))  # no entry: a private copy
    private = make_run(tiny_model_dir, tmp_path, "private", "supervised", lines, n_epochs=2, batch_size=2)
    assert not any(isinstance(m, PanelLinear) for m in load_base(tiny_model_dir, "float32").modules())
    assert train(private) == "succeeded"
    assert_same(weights(shared.adapter), weights(private.adapter), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (37, 20), (100, 13)])
def test_the_kernels_unpack_rows_of_panels_as_the_weight_holds_them(n, k, dtype):
    weight = torch.randn(n, k).to(dtype)
    packed = cpu_native.pack(weight)
    for start, stop in [(0, n), (16, min(n, 40)), (32, 33), (16, 16)]:
        torch.testing.assert_close(
            cpu_native.unpack_rows(packed, start, stop), weight[start:stop].float(), rtol=0, atol=0
        )
