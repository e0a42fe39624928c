"""DeepSeek-V2 and V3 (multi-head latent attention over the latent paged cache, shared experts, group-limited
top-k, V3's sigmoid scores with the correction bias) on tiny random checkpoints written by transformers (norms,
biases and the correction bias randomized), against transformers, on both CPU paths (the eager model, and the
native step's latent op and routing options: motet/kernels/csrc/latent.h, routing.h): logits in batches, in
prefill chunks and one token a step (the absorbed decode form), 32 greedy tokens equal to `generate` in a chunked
batch, from the prefix cache and from the disk KV tier after a restart, handed from a prefill engine to a decode
engine through the shared KV tier (prefill/decode disaggregation), adapters on every latent projection against
PEFT, over two tensor-parallel ranks, served over HTTP; the latent cache's bytes a token against per-head K / V."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from motet.engine.config import EngineConfig
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_config import load_model_config
from motet.engine.worker import cpu_forward
from motet.engine.worker.latent_attention import LatentAttention
from motet.engine.worker.model import SparseMoE
from motet.kernels import cpu_native
from motet.lora.adapter import AdapterError
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs, hf_logits
from tests.models.test_moe import PATHS, randomize_norms
from tests.peft_adapters import peft_reference, save_peft_adapters
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# hidden 64, 4 heads, three layers (the first dense), kv_lora_rank 16: a latent row of 16 + 8 a token and layer
LATENT = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=96,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)
# YaRN with mscale_all_dim: the softmax scaled by mscale^2, cos / sin by mscale / mscale_all_dim's ratio
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=1024,
    mscale=1.0,
    mscale_all_dim=0.8,
    beta_fast=32,
    beta_slow=1,
)
MODELS = {
    # V2-Lite's shape: q straight from the hidden state, greedy softmax top-2 of 4, two shared experts
    "v2_lite": ("deepseek_v2", dict(LATENT, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2)),
    # V2: q through q_a_proj / q_a_layernorm / q_b_proj, biases, group-limited top-2 of 8 in 2 of 4 groups,
    # routed weights scaled, YaRN
    "v2": (
        "deepseek_v2",
        dict(
            LATENT,
            q_lora_rank=24,
            attention_bias=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters=YARN,
        ),
    ),
    # V3: sigmoid scores with the correction bias, groups by their best two, renormalized, scaled 2.5, YaRN
    "v3": (
        "deepseek_v3",
        dict(
            LATENT,
            q_lora_rank=24,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            rope_parameters=YARN,
        ),
    ),
    # V3 with q straight from the hidden state and the rotary on halves (rope_interleave false)
    "v3_halves": (
        "deepseek_v3",
        dict(
            LATENT,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            rope_interleave=False,
        ),
    ),  # fmt: skip
}


def randomize_biases(model_dir) -> None:
    """The attention's biases and V3's e_score_correction_bias drawn at random (transformers writes zeros)."""
    g = torch.Generator().manual_seed(2)
    weights = load_file(model_dir / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            t.copy_(0.3 * torch.randn(t.shape, generator=g))
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})


def build_deepseek(path, name: str):
    arch, overrides = MODELS[name]
    model_dir = build_tiny_model(path, arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)
    randomize_biases(model_dir)
    return model_dir


@pytest.fixture(scope="module", params=list(MODELS))
def deepseek(request, tmp_path_factory):
    return request.param, build_deepseek(tmp_path_factory.mktemp(request.param), request.param)


def deepseek_engine(model_dir, compiled: bool = True, **options) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir), block_size=8, num_kv_blocks=128, compile_step=compiled, **options
    )
    engine = LLMEngine(cfg, model_dir)
    model = engine.runner.model
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.layers)
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [False, True, True]
    # the native step runs latent attention and DeepSeek's routing wherever its kernels build
    assert (cpu_forward.unsupported(model, engine.runner.dtype) is None) == (cpu_native.library() is not None)
    assert (engine.runner.native is not None) == (compiled and cpu_native.library() is not None)
    return engine


def test_hf_checkpoint_keeps_what_the_test_means(deepseek):
    """The randomized tensors are in the checkpoint (a name transformers changed would leave them at 0 / 1)."""
    name, model_dir = deepseek
    weights = load_file(model_dir / "model.safetensors")
    assert weights["model.layers.0.self_attn.kv_a_layernorm.weight"].std() > 0.1
    assert ("model.layers.0.self_attn.q_proj.weight" in weights) == (MODELS[name][1]["q_lora_rank"] is None)
    if name.startswith("v3"):
        assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0.1


def test_latent_cache_is_at_most_a_quarter_of_per_head_kv(deepseek):
    """Each layer caches one row a token (c_kv and the rotated key: 16 + 8), per-head K / V would be every head's
    key (16 + 8) and value (12): 24 against 4 * 36 = 144 values, 1/6."""
    _, model_dir = deepseek
    engine = deepseek_engine(model_dir)
    caches = engine.runner.kv_caches
    assert all(len(parts) == 1 and parts[0].shape[1:] == (8, 1, 24) for parts in caches)
    per_token = sum(t[0].numel() * t[0].element_size() for t in caches) // (128 * 8)
    heads, layers = 4, 3
    per_head = layers * heads * (16 + 8 + 12) * 4  # fp32 K and V as transformers' expanded form holds them
    assert per_token == 3 * 24 * 4 == 288 and per_head == 1728
    assert per_token / per_head <= 1 / 4  # 1/6


@pytest.mark.parametrize("compiled", PATHS)
def test_logits_match_transformers_in_batches_and_chunks(deepseek, compiled):
    """Whole prompts in one batch (eager: the expanded form, several sequences at once), 7-token chunks (eager:
    expanded over cached c_kv, a 1-token prompt beside them in the absorbed form) and one token a step (every row
    absorbed: nine sequences, past the paged attention's batched decode threshold of eight). The native step
    computes every row in the absorbed form."""
    _, model_dir = deepseek
    engine = deepseek_engine(model_dir, compiled)
    refs = [hf_logits(model_dir, p) for p in PROMPTS]
    for chunk in (None, 7):
        for got, ref in zip(engine_logits(engine, PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    stepwise = [[(11 * i + 5 * j) % 300 + 3 for j in range(2 + 2 * i)] for i in range(9)]
    for got, prompt in zip(engine_logits(engine, stepwise, chunk=1), stepwise, strict=True):
        torch.testing.assert_close(got, hf_logits(model_dir, prompt), atol=2e-4, rtol=1e-4)


def test_native_step_of_each_tier_matches_transformers(deepseek, cpu_tier):
    """The latent op and the routing options in every instruction-set tier's build (its GEMMs, dot products and
    portable loops): fp32 logits of whole prompts, 7-token chunks and one token a step; V2's bf16 weights and cache
    within the native bf16 bound (0.01 of the fp32 probabilities, or the eager bf16 model's distance). (V3's tiny
    random router has near-ties, a choice 0.0009 ahead of the next at a token of PROMPTS[2]'s last layer, which bf16
    rounding flips on some tiers: its bf16 check is test_bf16_close_to_transformers_fp32's.)"""
    name, model_dir = deepseek
    if name not in ("v2", "v3"):
        pytest.skip("V2's and V3's routing, q through q_a / q_b: two of the four")
    engine = deepseek_engine(model_dir, True)
    assert engine.runner.cpu_kernels == cpu_tier
    prompts = PROMPTS[:5]
    refs = [hf_logits(model_dir, p) for p in prompts]
    for chunk in (None, 7, 1):
        for got, ref in zip(engine_logits(engine, prompts, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    if name != "v2":
        return
    eager = engine_logits(deepseek_engine(model_dir, False, dtype="bfloat16"), prompts)
    native = engine_logits(deepseek_engine(model_dir, True, dtype="bfloat16"), prompts, chunk=7)
    for got, base, ref in zip(native, eager, refs, strict=True):
        p_ref = ref.softmax(-1)
        bound = max(0.01, (base.float().softmax(-1) - p_ref).abs().max())
        assert (got.float().softmax(-1) - p_ref).abs().max() <= bound


@pytest.mark.parametrize("compiled", PATHS)
def test_tied_router_scores_pick_the_experts_torch_topk_picks(deepseek, tmp_path, compiled):
    """Layer 2's router zeroed (and V3's correction bias): every expert's score ties, and so does every group's;
    torch.topk does not simply take the lowest indices, and both paths choose groups and experts as it does."""
    name, model_dir = deepseek
    if name not in ("v2", "v3"):
        pytest.skip("V2's and V3's group-limited choice: two of the four")
    weights = load_file(model_dir / "model.safetensors")
    for key in ("model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias"):
        if key in weights:
            weights[key].zero_()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    engine = deepseek_engine(tmp_path, compiled)
    prompts = PROMPTS[1:4]
    for got, prompt in zip(engine_logits(engine, prompts, chunk=7), prompts, strict=True):
        torch.testing.assert_close(got, hf_logits(tmp_path, prompt), atol=2e-4, rtol=1e-4)


def test_bf16_close_to_transformers_fp32(deepseek):
    """bf16 weights and latent cache (both forms, 7-token chunks and a 1-token prompt): the eager model's
    probabilities within 0.02 of transformers' fp32 ones; the native step's (fp32 activations between its ops) at
    least as close as the eager bf16 model's, or within 0.01 (the native MoE tests' bound), at all but a few
    positions, and within 0.05 at those: a router whose top experts nearly tie may pick another one when its input
    was computed in another precision (the avx2 tier, which widens bf16 weights to fp32, flips one of V3's tiny
    random router's choices: 0.026 at one position, 0.0001-0.0008 at the others)."""
    name, model_dir = deepseek
    if name not in ("v3", "v2"):
        pytest.skip("V2's and V3's routing: two of the four")
    prompts = PROMPTS[:4]
    refs = [hf_logits(model_dir, p).softmax(-1) for p in prompts]
    eager = deepseek_engine(model_dir, False, dtype="bfloat16")
    assert eager.runner.kv_caches[0][0].dtype == torch.bfloat16
    eager_error = 0.0
    for got, ref in zip(engine_logits(eager, prompts, chunk=7), refs, strict=True):
        eager_error = max(eager_error, (got.float().softmax(-1) - ref).abs().max().item())
    assert eager_error < 0.02
    if cpu_native.library() is None:
        return
    native = deepseek_engine(model_dir, True, dtype="bfloat16")
    assert native.runner.kv_caches[0][0].dtype == torch.bfloat16
    for chunk in (7, 1):
        errors = torch.cat([
            (got.float().softmax(-1) - ref).abs().amax(-1)
            for got, ref in zip(engine_logits(native, prompts, chunk=chunk), refs, strict=True)
        ])  # fmt: skip
        assert (errors > max(0.01, eager_error)).sum() <= len(errors) // 20 and errors.max() < 0.05, errors


@pytest.mark.parametrize("compiled", PATHS)
def test_greedy_matches_generate_in_a_chunked_batch_and_from_the_prefix_cache(deepseek, compiled):
    _, model_dir = deepseek
    # a 48-token step budget: prompts are chunked and share steps with the others' decodes
    llm = LLM(
        str(model_dir), num_kv_blocks=128, block_size=8, max_num_batched_tokens=48, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == compiled
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5], PROMPTS[2]]  # 5, 60, 33 and 17 tokens
    expected = hf_greedy_outputs(model_dir, prompts, 32)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    # a second request sharing the 60-token prompt's first 56: its blocks from the prefix cache
    shared = PROMPTS[4][:56] + [9, 10, 11]
    (out,) = llm.generate([shared], params)
    assert out.num_cached_tokens == 56
    assert out.token_ids == hf_greedy_outputs(model_dir, [shared], 32)[0]


def test_a_restart_serves_latent_blocks_from_the_disk_tier(deepseek, tmp_path):
    name, model_dir = deepseek
    if name not in ("v2", "v3"):
        pytest.skip("one V2 and one V3 suffice")
    options = dict(num_kv_blocks=32, block_size=8, kv_disk_gb=0.01, kv_disk_dir=str(tmp_path / "kv"))
    system = [(7 * j) % 300 + 3 for j in range(64)]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    llm = LLM(str(model_dir), **options)
    llm.generate([system + [5]], params)
    llm.engine.close()
    again = LLM(str(model_dir), **options)  # a new engine, the same directory
    (out,) = again.generate([system + [9]], params)
    assert out.num_cached_tokens == 64
    (disk,) = [t for t in again.engine.stats().kv_tiers if t.tier == "disk"]
    assert disk.hit_tokens == 64
    assert out.token_ids == hf_greedy_outputs(model_dir, [system + [9]], 8)[0]
    again.engine.close()


def test_prefill_and_decode_engines_hand_latent_blocks_over(deepseek, tmp_path):
    """Prefill/decode disaggregation's hand-off (motet/cluster/replica.py's `prefill`): a prefill engine computes
    the prompt (one greedy token, as `prefill_spec` asks) and writes its full latent blocks through to the shared
    KV tier (`wait_saved`); a decode engine on the same store loads them as its cached prefix and continues: greedy
    tokens equal to transformers' `generate`."""
    name, model_dir = deepseek
    if name not in ("v2", "v3"):
        pytest.skip("one V2 and one V3 suffice")
    options = dict(num_kv_blocks=32, block_size=8, kv_shared_dir=str(tmp_path / "shared"), kv_shared_gb=0.05)
    prefill, decode = LLM(str(model_dir), **options), LLM(str(model_dir), **options)
    prompt = [(5 * j) % 300 + 3 for j in range(61)]  # 7 full blocks and 5 tokens
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, speculative=False)
    prefill.generate([prompt], once)
    prefill.engine.kv_connector.wait_saved()
    (out,) = decode.generate([prompt], SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    assert out.num_cached_tokens == 56
    (shared,) = [t for t in decode.engine.stats().kv_tiers if t.tier == "shared"]
    assert shared.hit_tokens == 56
    assert out.token_ids == hf_greedy_outputs(model_dir, [prompt], 16)[0]
    prefill.engine.close()
    decode.engine.close()


# Each attention's projections by PEFT's names: q straight from the hidden state, or through q_a / q_b
LORA_TARGETS = {
    "v2_lite": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "v2": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


@pytest.mark.parametrize("compiled", PATHS)
def test_two_tensor_parallel_ranks_match_transformers_and_peft(deepseek, tmp_path, compiled):
    """Two gloo ranks: each its heads' rows of q_proj / q_b_proj and kv_b_proj and columns of o_proj, the whole
    latent computed and cached on both, the experts' and MLPs' columns and the vocabulary split; an adapter's
    factors cut the same way. Natively each rank's latent op attends with its heads and the program's residual add
    all-reduces their partial sums."""
    from tests.engine.test_tensor_parallel import tp_workers

    name, model_dir = deepseek
    if name not in ("v2", "v3_halves"):
        pytest.skip("q_a / q_b and q_proj, V2's and V3's routing: two of the four")
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[2]]
    # an adapter on every latent projection, cut with the heads (q_a / kv_a whole on each rank)
    targets = LORA_TARGETS["v2_lite" if name == "v3_halves" else "v2"]
    peft = save_peft_adapters(model_dir, tmp_path, [("all", 8, targets)], std=0.1)
    names = ["all", None, "all"]
    options = dict(
        num_kv_blocks=128, block_size=8, tensor_parallel_size=2, max_lora_rank=8, compile_step=compiled
    )
    # one rank group for the logits, the greedy outputs and the adapter's (a group's start is seconds)
    with LLM(str(model_dir), **options) as llm:
        engine = llm.engine
        assert engine.runner.workers is not None
        assert (engine.runner.native is not None) == compiled
        assert engine.runner.model.layers[0].self_attn.num_heads == 2
        for got, p in zip(engine_logits(engine, PROMPTS, chunk=7), PROMPTS, strict=True):
            torch.testing.assert_close(got, hf_logits(model_dir, p), atol=2e-4, rtol=1e-4)
        outs = llm.generate(prompts, params)
        llm.add_lora("all", tmp_path / "all")
        adapted = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8), adapters=names
        )
    assert [o.token_ids for o in outs] == hf_greedy_outputs(model_dir, prompts, 16)
    for p, n, out in zip(prompts, names, adapted, strict=True):
        assert out.token_ids == peft_reference(peft, n, p, 8)[0][len(p) :], n
    assert tp_workers() == []


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_lora_on_the_latent_projections_matches_peft(name, tmp_path, compiled):
    """Adapters on every projection of the latent attention (eager: kv_b_proj's delta applied to each sequence's
    expanded context, so such a step computes its decode rows in the expanded form too; native: folded into the
    absorbed form's latent queries and outputs) and on q / kv_a / o only (the decode rows absorbed), with base
    rows, in 7-token chunks and one token a step, and greedy."""
    model_dir = build_deepseek(tmp_path / "model", name)
    targets = LORA_TARGETS[name]
    specs = [("all", 8, targets), ("no_kv_b", 4, [t for t in targets if t != "kv_b_proj"])]
    peft = save_peft_adapters(model_dir, tmp_path, specs, std=0.1)
    llm = LLM(
        str(model_dir), num_kv_blocks=128, block_size=8, max_lora_rank=8, max_loras=2, compile_step=compiled
    )
    assert (llm.engine.runner.native is not None) == compiled
    for adapter, _, _ in specs:
        llm.add_lora(adapter, tmp_path / adapter)
    prompts, names = PROMPTS[:4], ["all", None, "no_kv_b", "all"]
    for chunk, picked in ((7, [0, 1, 2, 3]), (1, [1, 2])):  # (one token a step: no_kv_b's rows absorbed)
        sub = [prompts[i] for i in picked]
        got = engine_logits(llm.engine, sub, chunk=chunk, adapters=[names[i] for i in picked])
        for i, g in zip(picked, got, strict=True):
            ref = peft_reference(peft, names[i], prompts[i], 0)[1]
            torch.testing.assert_close(g, ref, atol=2e-4, rtol=1e-4)
            if names[i] is not None:  # (the adapter does move the logits)
                assert (ref - peft_reference(peft, None, prompts[i], 0)[1]).abs().max() > 0.05
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for p, n, out in zip(prompts, names, llm.generate(prompts, params, adapters=names), strict=True):
        assert out.token_ids == peft_reference(peft, n, p, 8)[0][len(p) :], n


def test_what_is_not_served_yet_is_refused_by_name(deepseek, tmp_path):
    name, model_dir = deepseek
    if name != "v2":
        pytest.skip("once")
    # (quantized as it loads: tests/models/test_deepseek_quantized.py; but not where a projection's inputs are not
    # whole blocks: this checkpoint's q_b_proj has 24)
    with pytest.raises(ModelLoadError, match="q_b_proj has 24"):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16, quantization="int8"), model_dir)
    save_peft_adapters(model_dir, tmp_path, [("a", 4, ["q_b_proj", "o_proj"])], std=0.1)
    config = (
        tmp_path / "a" / "adapter_config.json"
    )  # the MLP as a target (the experts: PEFT's raw parameters)
    config.write_text(config.read_text().replace('"o_proj"', '"down_proj"'))
    llm = LLM(str(model_dir), num_kv_blocks=16, max_lora_rank=8)
    with pytest.raises(AdapterError, match="mixture-of-experts model's MLP"):
        llm.add_lora("a", tmp_path / "a")


@pytest.mark.slow
def test_served_over_http_matches_transformers(tmp_path):
    """`motet serve` on the V3 checkpoint (uvicorn on a loopback port): greedy completions through the OpenAI SDK
    equal to transformers' continuation of the same prompt tokens."""
    from openai import OpenAI

    from tests.live_server import ThreadServer

    model_dir = build_deepseek(tmp_path / "model", "v3")
    server = ThreadServer(  # float32: greedy tokens equal to transformers' fp32 model's (bf16 parts at near-ties)
        "--model", str(model_dir), "--data-dir", str(tmp_path / "data"), "--num-kv-blocks", "128", "--block-size", "8",
        "--dtype", "float32",
    )  # fmt: skip
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        served = client.models.list().data[0].id
        prompts = [PROMPTS[1], PROMPTS[4]]
        for prompt, expected in zip(prompts, hf_greedy_outputs(model_dir, prompts, 8), strict=True):
            out = client.completions.create(
                model=served,
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"min_tokens": 8, "return_token_ids": True},
            )
            assert out.choices[0].model_extra["token_ids"] == expected
    finally:
        server.stop()


# The Hub's config.json of DeepSeek-V2-Lite and DeepSeek-V3 (the fields the loader reads, as written there:
# rope_scaling in the old style, no head_dim, V3's multi-token-prediction layer)
V2_LITE_HUB = dict(
    architectures=["DeepseekV2ForCausalLM"], attention_bias=False, bos_token_id=100000, eos_token_id=100001,
    first_k_dense_replace=1, hidden_act="silu", hidden_size=2048, intermediate_size=10944, kv_lora_rank=512,
    max_position_embeddings=163840, model_type="deepseek_v2", moe_intermediate_size=1408, moe_layer_freq=1,
    n_group=1, n_routed_experts=64, n_shared_experts=2, norm_topk_prob=False, num_attention_heads=16,
    num_experts_per_tok=6, num_hidden_layers=27, num_key_value_heads=16, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, rms_norm_eps=1e-06,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                      original_max_position_embeddings=4096, type="yarn"),
    rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax", tie_word_embeddings=False, topk_group=1,
    topk_method="greedy", v_head_dim=128, vocab_size=102400,
)  # fmt: skip
V3_HUB = dict(
    architectures=["DeepseekV3ForCausalLM"], attention_bias=False, bos_token_id=0, eos_token_id=1,
    first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, intermediate_size=18432, kv_lora_rank=512,
    max_position_embeddings=163840, model_type="deepseek_v3", moe_intermediate_size=2048, moe_layer_freq=1,
    n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True, num_attention_heads=128,
    num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128, num_nextn_predict_layers=1,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096, type="yarn"),
    rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", tie_word_embeddings=False, topk_group=4,
    topk_method="noaux_tc", v_head_dim=128, vocab_size=129280,
)  # fmt: skip


@pytest.mark.parametrize("hub", [V2_LITE_HUB, V3_HUB], ids=["v2_lite", "v3"])
def test_hub_configs_read_as_transformers_reads_them(hub):
    """The real models' configs: the latent cache's ratio to per-head K / V (V2-Lite 1/8.9, V3 1/71), the softmax
    scale with YaRN's mscale and the rotary's frequencies and attention factor equal to transformers'."""
    from transformers import AutoConfig

    from motet.engine.worker.latent_attention import latent_softmax_scale
    from motet.engine.worker.model import rope_inv_freq
    from motet.models.config import ModelConfig

    cfg = ModelConfig.from_dict(hub)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in hub.items() if k != "architectures"})
    module = __import__(
        f"transformers.models.{hub['model_type']}.modeling_{hub['model_type']}", fromlist=["x"]
    )
    prefix = "DeepseekV2" if hub["model_type"] == "deepseek_v2" else "DeepseekV3"
    with torch.device("meta"):
        attention = getattr(module, f"{prefix}Attention")(hf_cfg, 0)
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(hf_cfg)
    assert latent_softmax_scale(cfg) == pytest.approx(attention.scaling, rel=1e-6)
    inv_freq, factor = rope_inv_freq(cfg)
    torch.testing.assert_close(inv_freq.float(), rotary.inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(rotary.attention_scaling, rel=1e-6)
    ratio = cfg.kv_elements_per_token / cfg.per_head_kv_elements_per_token
    heads = hub["num_attention_heads"]
    assert cfg.cache_layout.parts == ((1, 512 + 64),)
    assert ratio == pytest.approx(576 / (heads * (192 + 128))) and ratio <= 1 / 4  # V2-Lite 0.1125, V3 0.0141
    assert cfg.sparse_layers[0] == hub["first_k_dense_replace"]
    assert (cfg.router_scoring, cfg.expert_groups) == (hub["scoring_func"], hub["n_group"])


@pytest.mark.parametrize("hub", [V2_LITE_HUB, V3_HUB], ids=["v2_lite", "v3"])
def test_a_config_that_omits_the_routing_defaults_reads_as_transformers_reads_it(hub):
    """transformers 5 saves only the fields that differ from its defaults: a config.json without n_group,
    topk_group, routed_scaling_factor, norm_topk_prob, topk_method or scoring_func routes as transformers' config
    of it does."""
    from transformers import AutoConfig

    from motet.models.config import ModelConfig

    omitted = (
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "topk_method",
        "scoring_func",
    )
    trimmed = {k: v for k, v in hub.items() if k not in omitted}
    cfg = ModelConfig.from_dict(trimmed)
    hf = AutoConfig.for_model(**{k: v for k, v in trimmed.items() if k != "architectures"})
    groups = hf.n_group if getattr(hf, "topk_method", "noaux_tc") != "greedy" and hf.n_group else 1
    assert (cfg.expert_groups, cfg.routed_scaling_factor) == (groups, hf.routed_scaling_factor)
    if groups > 1:
        assert cfg.expert_groups_kept == hf.topk_group
    if hub is V3_HUB:
        assert cfg.norm_topk_prob == hf.norm_topk_prob and (cfg.expert_groups, cfg.expert_groups_kept) == (
            8,
            4,
        )


def test_v3_skips_its_multi_token_prediction_layer_and_v2_refuses_extra_layers(tmp_path):
    """A V3 checkpoint's tensors of the layer after the decoder's (its MTP layer) are not read, as transformers
    skips them; V2 has none, so there such a tensor has no place."""
    for name in ("v3_halves", "v2_lite"):
        model_dir = build_deepseek(tmp_path / name, name)
        weights = load_file(model_dir / "model.safetensors")
        weights["model.layers.3.self_attn.kv_a_layernorm.weight"] = torch.ones(16)
        save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
        if name == "v3_halves":
            engine = deepseek_engine(model_dir)
            (got,) = engine_logits(engine, [PROMPTS[2]])
            torch.testing.assert_close(got, hf_logits(model_dir, PROMPTS[2]), atol=2e-4, rtol=1e-4)
        else:
            with pytest.raises(
                ModelLoadError, match=r"layers\.3\.self_attn\.kv_a_layernorm\.weight' has no place"
            ):
                deepseek_engine(model_dir)


# Configs transformers computes that the native step once refused mid-step (`program: unsupported arguments`):
EDGES = {
    # group-limited routing whose kept group holds 2 experts and 3 are chosen: V2's third among the zeroed scores
    # (weighing 0), V3's among the ruled-out ones (tied at -inf: torch.topk's pick, weighing its score)
    "v2_few_kept": (
        "deepseek_v2",
        dict(
            LATENT,
            q_lora_rank=None,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=1,
        ),
    ),
    "v3_few_kept": (
        "deepseek_v3",
        dict(LATENT, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=1),
    ),
    # one routed expert (transformers saves it as one tensor an expert, as it saves every DeepSeek checkpoint)
    "v2_one_expert": (
        "deepseek_v2",
        dict(LATENT, q_lora_rank=None, n_routed_experts=1, num_experts_per_tok=1),
    ),
    # no unrotated key part: the native latent op folds that part into the query, so the eager model runs it
    "no_nope": (
        "deepseek_v2",
        dict(LATENT, q_lora_rank=None, qk_nope_head_dim=0, n_routed_experts=4, num_experts_per_tok=2),
    ),
}


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("name", list(EDGES))
def test_edge_configs_match_transformers(name, tmp_path, compiled, caplog):
    """Each served as transformers computes it (logits whole, in 7-token chunks and a token a step), natively
    where the native program runs it, else eagerly with the reason logged: never a step that raises."""
    arch, overrides = EDGES[name]
    model_dir = build_tiny_model(tmp_path, arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)
    randomize_biases(model_dir)
    caplog.set_level(logging.INFO, logger="motet.engine")
    cfg = EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=128, compile_step=compiled)
    engine = LLMEngine(cfg, model_dir)
    native = compiled and name != "no_nope"
    assert (engine.runner.native is not None) == native
    if compiled and not native:
        assert "not for this model (qk_nope_head_dim 0" in caplog.text
    prompts = PROMPTS[:4]
    refs = [hf_logits(model_dir, p) for p in prompts]
    for chunk in (None, 7, 1):
        for got, ref in zip(engine_logits(engine, prompts, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_v3_with_a_group_of_one_expert_is_refused_in_one_line(tmp_path):
    """A V3 group of one expert (here the one routed expert): transformers' router takes each group's best two
    and raises; motet refuses it at load, naming the fields."""
    v3 = build_tiny_model(
        tmp_path / "v3",
        arch="deepseek_v3",
        tied=False,
        **dict(LATENT, q_lora_rank=None, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1),
    )
    with pytest.raises((RuntimeError, IndexError)):
        hf_logits(v3, PROMPTS[0])
    with pytest.raises(ModelLoadError, match=r"n_routed_experts \(1\) / n_group \(1\).*at least two"):
        load_model_config(v3)


@pytest.mark.parametrize(
    "factor, says",
    [
        (1e39, "routed_scaling_factor must be finite in float32"),
        # finite in float32, but the routed experts' sum overflows it (issue 68, finding 13: every answer an empty
        # abort)
        (1e38, r"routed_scaling_factor must be a number at least 1e-06 and at most 1e\+06, got 1e\+38"),
    ],
)
def test_a_scaling_factor_that_overflows_float32_is_refused_in_one_line(tmp_path, factor, says):
    """routed_scaling_factor 1e39 (finite in float64, inf in float32) or 1e38 (whose products are inf):
    transformers' logits carry nothing (all NaN, or the same for every token: the residual stream inf, normed to
    0); refused at load, the field named."""
    scaled = build_tiny_model(
        tmp_path / "v2",
        arch="deepseek_v2",
        tied=False,
        **dict(
            LATENT, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=factor
        ),
    )
    ref = hf_logits(scaled, PROMPTS[1])
    assert ref.isnan().all() or (ref == ref[:, :1]).all()
    with pytest.raises(ModelLoadError, match=says) as e:
        load_model_config(scaled)
    assert "\n" not in str(e.value)
