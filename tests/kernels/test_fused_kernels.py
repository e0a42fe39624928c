"""The fused kernels of the model's CUDA path, RMSNorm with the residual add (motet/kernels/fused_norm.py), the
rotary with the KV-cache write (motet/kernels/rope_kv.py) and SwiGLU's SiLU(gate) * up
(motet/kernels/activation.py), against their torch references (the model's computation off CUDA); and the
model running them against Hugging Face transformers (PEFT with adapters).

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py) and the model's
CUDA branch is forced on with `fused_on_cpu`. The interpreter's fp32 -> bf16 conversion truncates where the
GPU rounds to nearest (triton 3.9, interpreter.py `_convert_float`): bf16 results are compared within a
few units in the last place there, and the residual stream bit for bit on a GPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.model import SparseMoE
from motet.kernels import activation, fused_norm, rope_kv, triton_support
from motet.kernels.rope_kv import RotaryAngles
from tests.engine.helpers import finished_tokens
from tests.engine.test_engine import PROMPTS, engine_logits, hf_logits
from tests.kernels.gpu_build import gpu_builds
from tests.models.test_moe import MOE_MODELS, randomize_norms
from tests.peft_adapters import peft_reference, tiny_requests
from tests.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.skipif(not triton_support.AVAILABLE, reason="triton not installed"),
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: one unit in the last place, relative


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


# -- RMSNorm, with and without the residual add ------------------------------------------------------------

SHAPES = [(1, 8), (7, 33), (5, 576), (3, 1000)]  # one row; rows not a power of two; SmolLM's hidden size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_rms_norm_matches_reference(rows, dim, dtype):
    x = rand(rows, dim, dtype=dtype, seed=dim, scale=3.0)
    weight = (1 + 0.3 * rand(dim, seed=1)).to(dtype)
    got = fused_norm.rms_norm(x, weight, 1e-5)
    want = fused_norm.rms_norm_reference(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # fp32: the sum of squares in another order; bf16: one rounding apart (two where the interpreter truncates)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=2 * BF16_EPS)
    torch.testing.assert_close(got, want, **tol)


def test_rms_norm_reads_strided_rows():
    """A column slice (rows apart by more than the dimension) normalises as its contiguous copy."""
    wide = rand(6, 100, seed=3)
    weight = 1 + 0.3 * rand(40, seed=4)
    got = fused_norm.rms_norm(wide[:, 20:60], weight, 1e-6)
    torch.testing.assert_close(got, fused_norm.rms_norm_reference(wide[:, 20:60].contiguous(), weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_add_rms_norm_matches_reference(rows, dim, dtype):
    x = rand(rows, dim, dtype=dtype, seed=dim)
    residual = rand(rows, dim, dtype=dtype, seed=dim + 1, scale=4.0)
    weight = (1 + 0.3 * rand(dim, seed=2)).to(dtype)
    before = x.clone(), residual.clone()
    out, new_residual = fused_norm.add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_residual = fused_norm.add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # the inputs stay as they were
    assert out.dtype == new_residual.dtype == dtype
    if dtype == torch.float32 or not INTERPRETED:  # the stream in the model's dtype, rounded as torch does
        assert torch.equal(new_residual, want_residual)
    else:  # truncated, not rounded: within one unit
        torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=BF16_EPS)
    # bf16: the norm of a sum one unit apart, rounded once more
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=4 * BF16_EPS)
    torch.testing.assert_close(out, want_out, **tol)


def test_no_rows():
    x = torch.zeros(0, 16, device=DEVICE)
    assert fused_norm.rms_norm(x, torch.ones(16, device=DEVICE), 1e-6).shape == (0, 16)
    out, res = fused_norm.add_rms_norm(x, x, torch.ones(16, device=DEVICE), 1e-6)
    assert out.shape == res.shape == (0, 16)


# -- rotary + KV-cache write ---------------------------------------------------------------------------------


def tables(head_dim: int, positions: int, theta: float = 10000.0):
    """fp32 cos / sin [P, D / 2] as the model builds them (float64 angles)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def qkv_views(qkv, heads, kv_heads, head_dim):
    """q, k, v as the model takes them: views of the fused projection's columns."""
    T, q_end, k_end = qkv.shape[0], heads * head_dim, (heads + kv_heads) * head_dim
    return (
        qkv[:, :q_end].view(T, heads, head_dim),
        qkv[:, q_end:k_end].view(T, kv_heads, head_dim),
        qkv[:, k_end:].view(T, kv_heads, head_dim),
    )


ROPE_CASES = {
    # tokens, heads, kv heads, head_dim (half not a power of two), block size, cache blocks, slots (-1: skipped)
    "gqa": (7, 6, 2, 24, 4, 5, [13, -1, 0, 19, 7, -1, 2]),
    "mha-d64": (3, 2, 2, 64, 8, 2, [15, 3, -1]),
    "one-token": (1, 4, 1, 40, 16, 1, [5]),
    "all-padding": (4, 2, 1, 16, 4, 2, [-1, -1, -1, -1]),
}


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rotary_kv_write_matches_reference(case, dtype, qk_norm):
    T, H, KV, D, block_size, blocks, slots = ROPE_CASES[case]
    qkv = rand(T, (H + 2 * KV) * D, dtype=dtype, seed=T * D, scale=2.0)
    cos, sin = tables(D, 64)
    # positions and slots: rows of one packed buffer, as the runner transfers a step's inputs; here columns
    # (strided) of it
    packed = torch.tensor([[63, 0, 17, 5, 40, 1, 33][:T], slots], device=DEVICE).t()
    positions, slot_mapping = packed[:, 0], packed[:, 1]
    caches = rand(2, blocks, block_size, KV, D, dtype=dtype, seed=5)
    norms = (
        ((1 + 0.3 * rand(D, seed=6)).to(dtype), (1 + 0.3 * rand(D, seed=7)).to(dtype), 1e-6)
        if qk_norm
        else ()
    )

    want_caches = caches.clone()
    want_q = rope_kv.rotary_kv_reference(
        *qkv_views(qkv, H, KV, D), RotaryAngles(positions, cos, sin), *want_caches, slot_mapping, *norms
    )
    got_qkv, got_caches = qkv.clone(), caches.clone()
    q, k, v = qkv_views(got_qkv, H, KV, D)
    got_q = rope_kv.rotary_kv_write(
        q, k, v, RotaryAngles(positions, cos, sin), *got_caches, slot_mapping, *norms
    )

    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, in the projection's q columns
    assert torch.equal(got_qkv[:, H * D :], qkv[:, H * D :])  # k and v are only read
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[[s for s in slots if s >= 0]] = True
    written = written.view(blocks, block_size).to(DEVICE)
    for got, old in zip(got_caches, caches, strict=True):
        assert torch.equal(got[~written], old[~written])  # negative slots and the rest: untouched
    assert torch.equal(got_caches[1], want_caches[1])  # v: a copy
    # fp32: the same products (an FMA apart on a GPU); bf16: rounded once (truncated under the interpreter),
    # with q/k norms the normalised head rounded before the rotation too: a unit of the inputs' scale
    if dtype == torch.float32:
        tol = dict(atol=1e-5, rtol=1e-5)
    else:
        tol = dict(atol=(4 if qk_norm else 2) * BF16_EPS * 2.0, rtol=2 * BF16_EPS)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_caches[0], want_caches[0], **tol)


def test_rotary_kv_write_refuses_mismatched_shapes():
    q, k, v = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)
    cos, sin = tables(16, 8)
    angles = RotaryAngles(torch.zeros(2, dtype=torch.long), cos.cpu(), sin.cpu())
    with pytest.raises(ValueError, match="bad shapes"):
        rope_kv.rotary_kv_write(
            q, k, v, angles, torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(2)
        )
    with pytest.raises(ValueError, match="come together"):
        rope_kv.rotary_kv_write(q, k, v, angles, torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16),
                                torch.zeros(2), torch.ones(16))  # fmt: skip


# -- SiLU(gate) * up -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 48), (3, 1000), (2, 2100)])  # 2100: three column blocks
def test_silu_and_mul_matches_reference(rows, inter, dtype):
    gate_up = rand(rows, 2 * inter, dtype=dtype, seed=inter, scale=3.0)
    got = activation.silu_and_mul(gate_up)
    want = activation.silu_and_mul_reference(gate_up)
    assert got.dtype == dtype and got.shape == (rows, inter)
    # fp32: exp in another implementation; bf16: SiLU's output rounded (truncated under the interpreter), then
    # the product: a unit or two apart
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=4 * BF16_EPS)
    torch.testing.assert_close(got, want, **tol)


def test_silu_and_mul_no_rows():
    assert activation.silu_and_mul(torch.zeros(0, 16, device=DEVICE)).shape == (0, 8)


# -- the GPU build, without a GPU ----------------------------------------------------------------------------

COMPILE_CHECK = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from motet.kernels.jit import activation, fused_norm, rope_kv
from tests.kernels.gpu_build import resource_usage

out = []
for name, arch, consts in json.loads(sys.argv[1]):
    if name == "norm":
        kernel, warps = fused_norm._rms_norm_kernel, min(16, max(1, consts["BLOCK"] // 256))
        sig = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", eps="fp32")
    elif name == "silu":
        kernel, warps = activation._silu_and_mul_kernel, max(1, consts["BLOCK"] // 256)
        sig = dict(x_ptr="*bf16", out_ptr="*bf16")
    else:
        kernel, warps = rope_kv._rotary_kv_kernel, max(1, min(16, consts["HEADS_PAD"] * consts["HALF_PAD"] // 256))
        sig = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
                   pos_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*bf16",
                   kw_ptr="*bf16", eps="fp32")
    full = {n: "i32" for n in kernel.arg_names}
    full.update(sig)
    full.update({n: "constexpr" for n in consts})
    k = triton.compile(ASTSource(kernel, full, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=warps))
    out.append(dict(name=name, arch=arch, **resource_usage(k, kernel.fn.__name__)))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests above run the kernels natively")
def test_kernels_compile_for_the_gpu_without_spills(tmp_path):
    """The kernels built for sm_90 (H100) and sm_80 (A100) by triton's compiler and ptxas as a launch builds
    them, at Llama-3-8B / 70B shapes (hidden 4096 / 8192; 32 or 64 query heads of 128, 8 kv heads) and with
    Qwen3's q/k norms: registers only (no spill to local memory) and no global scratch (nothing for a CUDA
    graph to allocate at launch)."""
    rope = dict(NUM_HEADS=32, NUM_KV_HEADS=8, BLOCK_SIZE=16, HALF=64, HALF_PAD=64, HEADS_PAD=32)
    cases = [
        ("norm", 90, dict(HAS_RESIDUAL=True, BLOCK=4096)),
        ("norm", 80, dict(HAS_RESIDUAL=False, BLOCK=8192)),
        ("rope", 90, dict(rope, HAS_NORM=True)),
        ("rope", 80, dict(rope, NUM_HEADS=64, HEADS_PAD=64, HAS_NORM=False)),
        ("silu", 90, dict(BLOCK=activation.BLOCK)),
    ]
    builds = gpu_builds(COMPILE_CHECK, cases, tmp_path)
    assert len(builds) == len(cases)
    for build in builds:
        assert build["spill"] == 0 and build["regs"] <= 255 and build["scratch"] == 0, build


# -- the model on its CUDA branch ----------------------------------------------------------------------------


@pytest.fixture
def fused(monkeypatch) -> Counter:
    """The model's CUDA branch: on a GPU as it is; without one forced on for CPU tensors (the kernels under the
    interpreter). Counts the kernels' launches, to show they ran."""
    calls: Counter = Counter()
    kernels = (
        (fused_norm, ("rms_norm", "add_rms_norm")),
        (rope_kv, ("rotary_kv_write",)),
        (activation, ("silu_and_mul",)),
    )
    for module, names in kernels:
        if INTERPRETED:
            monkeypatch.setattr(module, "applies", lambda x: True)
        for name in names:

            def counted(*args, _launch=getattr(module, name), _name=name, **kwargs):
                calls[_name] += 1
                return _launch(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return calls


def eager_engine(model_dir, dtype="float32", **options) -> LLMEngine:
    """The eager model (not the native CPU step, which does not use its modules' forward)."""
    config = EngineConfig(model=str(model_dir), device=DEVICE, dtype=dtype, block_size=8, num_kv_blocks=128,
                          compile_step=False, **options)  # fmt: skip
    return LLMEngine(config, model_dir=model_dir)


MODELS = {
    "llama": ("llama", {}),
    "qwen2-bias-untied": ("qwen2", {"tie_word_embeddings": False}),  # q/k/v biases
    "qwen3-moe-qk-norm": MOE_MODELS["qwen3_moe"],  # per-head q/k norms, head_dim apart from hidden / heads
    "mixtral": MOE_MODELS["mixtral"],  # every layer sparse
}


# ragged prompts of 1 to 33 tokens (56 in all: each kernel program costs milliseconds under the interpreter)
SHORT_PROMPTS = PROMPTS[:4]


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory):
    arch, overrides = MODELS[request.param]
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, **overrides)
    randomize_norms(path)  # norm weights the kernels must read from the right place
    return path


def test_model_logits_match_hf(model_dir, fused):
    """fp32: every row of ragged prompts in one flattened batch, then in 8-token chunks (rows at later
    positions beside a cached context)."""
    engine = eager_engine(model_dir)
    refs = [hf_logits(model_dir, p) for p in SHORT_PROMPTS]
    for chunk in (None, 8):
        for got, ref in zip(engine_logits(engine, SHORT_PROMPTS, chunk=chunk), refs, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    layers = engine.model_config.num_hidden_layers
    steps = fused["rms_norm"]  # one plain norm a step (the first layer's), then each later norm adds
    assert steps > 0 and fused["add_rms_norm"] == steps * 2 * layers
    assert fused["rotary_kv_write"] == steps * layers
    dense = sum(not isinstance(layer.mlp, SparseMoE) for layer in engine.runner.model.layers)
    shared = sum(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None
                 for layer in engine.runner.model.layers)  # fmt: skip
    assert fused["silu_and_mul"] == steps * (dense + shared)


def test_model_greedy_decode_matches_hf_generate(tmp_path, fused):
    """Decode steps (one token per sequence, a batch of several) give HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp_path)
    randomize_norms(model_dir)
    engine = eager_engine(model_dir)
    prompts = SHORT_PROMPTS
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    tokens = finished_tokens(engine)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p in prompts:
        ref = hf.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert tokens[tuple(p)] == ref[0, len(p) :].tolist()
    assert fused["rotary_kv_write"] > 0


def test_model_bf16_close_to_the_torch_path(tiny_model_dir, fused, monkeypatch):
    """bf16: the kernels' logits beside the torch path's (the same roundings but for the interpreter's
    truncation), and both near the fp32 model's."""
    got = engine_logits(eager_engine(tiny_model_dir, "bfloat16"), SHORT_PROMPTS)
    assert fused["add_rms_norm"] > 0
    fp32 = engine_logits(eager_engine(tiny_model_dir), SHORT_PROMPTS)
    monkeypatch.undo()  # the torch path: what the model computes off CUDA
    if INTERPRETED:
        want = engine_logits(eager_engine(tiny_model_dir, "bfloat16"), SHORT_PROMPTS)
        for g, w in zip(got, want, strict=True):
            assert (g.softmax(-1) - w.softmax(-1)).abs().max() < 0.02
    for g, f in zip(got, fp32, strict=True):
        assert (g.softmax(-1) - f.softmax(-1)).abs().max() < 0.05


def test_model_with_adapters_matches_peft(tiny_model_dir, tiny_loras, fused):
    """The LoRA deltas land in qkv before the fused rotary reads it: mixed adapters give what PEFT gives."""
    peft, paths = tiny_loras
    engine = eager_engine(tiny_model_dir, max_lora_rank=32)
    for name, path in paths.items():
        engine.add_lora(name, path)
    prompts, names = tiny_requests()
    prompts = [p[:9] for p in prompts]  # every adapter (and none), up to 9 tokens each
    for got, prompt, name in zip(engine_logits(engine, prompts, adapters=names), prompts, names, strict=True):
        torch.testing.assert_close(got, peft_reference(peft, name, prompt, 0)[1], atol=2e-4, rtol=1e-4)
    assert fused["rotary_kv_write"] > 0
