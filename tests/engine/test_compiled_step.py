"""The compiled CPU step (motet/engine/worker/cpu_forward.py: the decoder stack in one native call) against the eager
model, its reference: the same logits for every row of mixed batches (prefill chunks, decodes, several
adapters and the base model), in fp32 and bf16 weights, and the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.kernels import cpu_native
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.peft_adapters import tiny_requests
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels")


def engines(model_dir, dtype="float32", **options):
    """(eager, compiled) engines on the same checkpoint, on the CPU (on CUDA the compiled step is CUDA graphs:
    tests/engine/test_cuda_graphs.py)."""
    out = []
    for compiled in (False, True):
        cfg = EngineConfig(
            model=str(model_dir), device="cpu", dtype=dtype, block_size=8, num_kv_blocks=256, max_lora_rank=64,
            compile_step=compiled, **options,
        )  # fmt: skip
        engine = LLMEngine(cfg, model_dir=model_dir)
        assert (engine.runner.native is not None) == compiled
        out.append(engine)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("chunk", [None, 7])
def test_compiled_logits_equal_eager(tmp_path, arch, chunk):
    model_dir = build_tiny_model(tmp_path, arch=arch)
    eager, compiled = engines(model_dir)
    for a, b in zip(
        engine_logits(eager, PROMPTS, chunk), engine_logits(compiled, PROMPTS, chunk), strict=True
    ):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_compiled_bf16_close_to_eager_bf16_and_fp32(tiny_model_dir):
    """bf16 weights and KV: the compiled step keeps activations in fp32 between its ops (where the CPU has bf16
    dot products, a linear's input is rounded to bf16 for its product only), so it is at least as close to the
    fp32 model as the eager bf16 model (which rounds after every op) is."""
    fp32 = engine_logits(engines(tiny_model_dir)[0], PROMPTS[:4])
    eager, compiled = engines(tiny_model_dir, dtype="bfloat16")
    for ref, a, b in zip(
        fp32, engine_logits(eager, PROMPTS[:4]), engine_logits(compiled, PROMPTS[:4]), strict=True
    ):
        p_ref, p_eager, p_comp = ref.softmax(-1), a.softmax(-1), b.softmax(-1)
        assert (p_comp - p_ref).abs().max() <= max(0.01, (p_eager - p_ref).abs().max())


def test_compiled_mixed_adapters_equal_eager(tiny_model_dir, tiny_loras):
    prompts, names = tiny_requests()
    outs = []
    for engine in engines(tiny_model_dir, max_loras=4):
        for name, path in tiny_loras[1].items():
            engine.add_lora(name, path)
        outs.append(engine_logits(engine, prompts, chunk=11, adapters=names, order=[3, 0, 7, 1, 6, 2, 5, 4]))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_compiled_bf16_adapters_close_to_eager_bf16_and_fp32(tiny_model_dir, tiny_loras):
    """Mixed adapters in prefill chunks and decodes, bf16 weights and pool: the compiled step's LoRA deltas (where
    the CPU has bf16 dot products: x and the shrink rounded to bf16, the expand inside the base product) are at
    least as close to the fp32 model with the same adapters as the eager bf16 model's."""
    prompts, names = tiny_requests()

    def logits(engine):
        for name, path in tiny_loras[1].items():
            engine.add_lora(name, path)
        return engine_logits(engine, prompts, chunk=11, adapters=names, order=[3, 0, 7, 1, 6, 2, 5, 4])

    fp32 = logits(engines(tiny_model_dir, max_loras=4)[0])
    eager, compiled = (logits(e) for e in engines(tiny_model_dir, dtype="bfloat16", max_loras=4))
    for ref, a, b in zip(fp32, eager, compiled, strict=True):
        p_ref, p_eager, p_comp = ref.softmax(-1), a.softmax(-1), b.softmax(-1)
        assert (p_comp - p_ref).abs().max() <= max(0.01, (p_eager - p_ref).abs().max())


def test_compiled_greedy_equals_eager(tiny_model_dir, tiny_loras):
    prompts, names = tiny_requests()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = []
    for engine in engines(tiny_model_dir, max_loras=4, max_num_batched_tokens=48):
        refs = {name: engine.add_lora(name, path) for name, path in tiny_loras[1].items()}
        ids = [
            engine.add_request(p, params, adapter=refs.get(n)) for p, n in zip(prompts, names, strict=True)
        ]
        done, answers = {}, RequestOutputs()
        while engine.has_unfinished():
            for out in answers.step(engine):
                if out.finished:
                    done[out.request_id] = out.token_ids
        tokens.append([done[i] for i in ids])
    assert tokens[0] == tokens[1]


def test_compile_off_keeps_the_eager_model(tiny_model_dir):
    eager, compiled = engines(tiny_model_dir)
    assert eager.runner.model.layers[0].mlp.down_proj.weight.numel() > 0
    assert compiled.runner.model.layers[0].mlp.down_proj.weight.numel() == 0  # the arena holds it
