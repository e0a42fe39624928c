"""The Triton grouped-expert kernel (motet/kernels/triton_moe.py) against a float64 product per row, and the
model's dispatch to it. Without CUDA it runs under TRITON_INTERPRET=1 (tests/conftest.py): small shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from motet.kernels import triton_moe, triton_support

pytestmark = pytest.mark.skipif(not triton_support.AVAILABLE, reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(rows, expert_ids, gate_up, down) -> torch.Tensor:
    """Row by row in float64: SiLU(gate) * up, then down, with the row's expert."""
    out = []
    inter = gate_up.shape[1] // 2
    for row, e in zip(rows.double(), expert_ids.tolist(), strict=True):
        gate, up = (gate_up[e].double() @ row).split(inter)
        out.append(down[e].double() @ (F.silu(gate) * up))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "E,H,inter,ids",
    [
        (4, 64, 48, [3, 0, 3, 1, 3, 0]),  # expert 2 has no row; I not a multiple of the 64-column block
        (
            3,
            40,
            80,
            [1] * 19 + [0, 2],
        ),  # 19 rows of one expert: two tiles, the second partly empty; K % 32 != 0
    ],
)
def test_grouped_experts_match_float64_rows(E, H, inter, ids, dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.2).to(DEVICE, dtype)
    down = (torch.randn(E, H, inter, generator=g) * 0.2).to(DEVICE, dtype)
    rows = torch.randn(len(ids), H, generator=g).to(DEVICE, dtype)
    expert_ids = torch.tensor(ids, device=DEVICE)
    got = triton_moe.grouped_experts(rows, expert_ids, gate_up, down)
    want = reference(rows.cpu(), expert_ids.cpu(), gate_up.cpu(), down.cpu())
    assert got.dtype == dtype and got.shape == (len(ids), H)
    # fp32: accumulation error; bf16: the intermediate activations are rounded to bf16 between the launches
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.cpu().double(), want, **tol)


def test_no_rows_make_no_launch():
    gate_up, down = torch.zeros(2, 8, 16, device=DEVICE), torch.zeros(2, 16, 4, device=DEVICE)
    out = triton_moe.grouped_experts(
        torch.zeros(0, 16, device=DEVICE), torch.zeros(0, dtype=torch.long, device=DEVICE), gate_up, down
    )
    assert out.shape == (0, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_model_dispatches_its_experts_to_the_kernel_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from tests.engine.test_engine import PROMPTS, engine_logits
    from tests.models.test_moe import MOE_MODELS
    from tests.tiny_models import build_tiny_model

    arch, overrides = MOE_MODELS["mixtral"]
    model_dir = build_tiny_model(tmp_path / "m", arch=arch, **overrides)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), device="cuda", num_kv_blocks=64), model_dir=model_dir
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for got, prompt in zip(engine_logits(engine, PROMPTS), PROMPTS, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
