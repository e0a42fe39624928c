"""The W8A16 / W4A16 (and MXFP4) Triton GEMM (motet/kernels/triton_quant.py) against float64 products of the dequantized
weight (`QuantizedWeight.dequantize(torch.float64)`), and the model's dispatch to it against Hugging Face
transformers on the dequantized checkpoint.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is imported):
shapes stay small, and the GPU build is checked by compiling it for sm_80 / sm_90 (no device needed). With a
GPU the same tests run natively, and CUDA graph capture is checked too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.worker.layers import Linear
from motet.kernels import triton_quant, triton_support
from motet.kernels.quant import FORMATS, MXFP4, QuantizedWeight
from motet.kernels.triton_quant import TileConfig, choose_config, quant_linear
from tests.engine.helpers import mixed_adapter_tokens
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.kernels.gpu_build import gpu_builds
from tests.kernels.test_quantization import dequantized_checkpoint, random_weight
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(not triton_support.AVAILABLE, reason="triton not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
FORMAT_NAMES = sorted(FORMATS)


def make_case(name: str, M: int, N: int, K: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """A random weight quantized in `name` (rows of different magnitudes, one constant block), x and bias."""
    g = torch.Generator().manual_seed(seed)
    if name == MXFP4.name:  # (read from checkpoints, never quantized here: every code, exponents around 1)
        q = random_weight(name, N, K, g).to(DEVICE)
    else:
        w = torch.randn(N, K, generator=g) * (0.2 + torch.rand(N, 1, generator=g))
        w[1, :32] = 0.5  # a block with scale 0
        q = FORMATS[name].quantize(w).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    return x, q, b


def check(out: torch.Tensor, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """fp32: the float64 product of the dequantized weight within fp32 accumulation error. 16-bit x: the
    weight is rounded to x's dtype first (as `QuantizedWeight.linear` does, and F.linear on a bf16 weight),
    then the float64 product of those values, rounded once to x's dtype: within half a unit in the last place
    (2^-8 relative for bf16) plus the accumulation's error."""
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], q.shape[0]) and out.device == x.device
    weight = q.dequantize(torch.float64 if x.dtype == torch.float32 else x.dtype).cpu().double()
    want = x.cpu().double() @ weight.T
    if bias is not None:
        want += bias.cpu().double()
    got = out.cpu().double()
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    else:
        ulp = torch.finfo(x.dtype).eps / 2
        assert ((got - want).abs() <= want.abs() * ulp + 1e-3).all(), (got - want).abs().max()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 3, 16, 33])
@pytest.mark.parametrize("name", [*FORMAT_NAMES, MXFP4.name])
def test_matches_float64_of_dequantized(name, M, dtype, bias):
    """N = 72 and K = 320 leave partial tiles in both (the chosen tiles: 64 outputs, 128 or 256 inputs)."""
    x, q, b = make_case(name, M, 72, 320, dtype, bias, seed=M)
    check(quant_linear(x, q, b), x, q, b)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_fp16(name):
    x, q, b = make_case(name, 5, 40, 96, torch.float16, True)
    check(quant_linear(x, q, b), x, q, b)


TILINGS = {
    "split4": TileConfig(16, 16, 32, split_k=4),  # 10 K steps in splits of 3, 3, 3, 1; 3 output tiles
    "split2": TileConfig(16, 32, 64, split_k=2),  # two row tiles
    "nosplit": TileConfig(32, 16, 128, split_k=1),
}


@pytest.mark.parametrize(
    "name,tiles,dtype,bias",
    [
        ("int4", "split4", torch.bfloat16, True),
        ("int8", "split4", torch.float32, True),
        ("int4", "split2", torch.float32, False),
        ("int8", "split2", torch.bfloat16, False),
        ("int4", "nosplit", torch.float32, True),
        ("int8", "nosplit", torch.bfloat16, True),
    ],
    ids=lambda v: str(v).removeprefix("torch.") if not isinstance(v, bool) else ("bias" if v else "nobias"),
)
def test_tilings_and_split_k(name, tiles, dtype, bias):
    """Split-K's partials summed by the second kernel (with the bias there), several row and output tiles."""
    x, q, b = make_case(name, 20, 40, 320, dtype, bias, seed=7)
    check(quant_linear(x, q, b, config=TILINGS[tiles]), x, q, b)


def test_narrow_layer_splits_k_by_default():
    """One output tile and 8 K steps: the default launch splits K (the interpreter stands for 2 SMs)."""
    x, q, b = make_case("int8", 2, 40, 1024, torch.float32, True, seed=3)
    assert choose_config(2, 40, 1024, 8, 2).split_k == 2
    check(quant_linear(x, q, b), x, q, b)


def test_choice_of_launch():
    """Decode batches (M <= 16) get one launch whatever M; every SM of an H100 (132) gets a program, or the
    splits are as short as they may be; a layer wide enough to fill the GPU is not split."""
    for N, K in [(14336, 4096), (4096, 14336), (576, 1536)]:
        for bits in (4, 8):
            configs = {choose_config(M, N, K, bits, 132) for M in range(1, 17)}
            assert len(configs) == 1
            (c,) = configs
            assert c.block_m == 16 and c.block_k * bits // 8 == 128  # a 128-byte line of each row a step
            steps = -(-K // c.block_k)
            per_split = -(-steps // c.split_k)
            assert per_split * (c.split_k - 1) < steps  # no empty split
            programs = -(-N // c.block_n) * c.split_k
            assert programs >= 132 or per_split < 2 * triton_quant.MIN_STEPS_PER_SPLIT
    assert choose_config(1, 14336, 4096, 4, 132).split_k == 1  # up_proj of an 8B model: 224 tiles
    assert choose_config(1, 4096, 14336, 4, 132).split_k > 1  # its down_proj: 64 tiles alone
    assert choose_config(512, 4096, 4096, 4, 132).split_k == 1  # prefill: tiles enough
    fp32 = choose_config(1, 4096, 4096, 4, 132, x_bytes=4)  # half the K step (registers, shared memory)
    assert fp32.block_k == choose_config(1, 4096, 4096, 4, 132).block_k // 2


def test_batch_rows_do_not_change_a_rows_result():
    """M <= 16 shares one launch: row 0's output is bit for bit the same alone and among 15 others."""
    x, q, _ = make_case("int4", 16, 72, 320, torch.bfloat16, False, seed=5)
    assert torch.equal(quant_linear(x[:1], q), quant_linear(x, q)[:1])


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_strided_and_batched_inputs(name):
    """x as a column slice of a wider buffer, and with leading dimensions: nn.Linear's contract."""
    _, q, b = make_case(name, 1, 40, 64, torch.float32, True)
    wide = torch.randn(6, 100, device=DEVICE)
    x = wide[:, 8:72]
    check(quant_linear(x, q, b), x, q, b)
    x3 = torch.randn(2, 3, 64, device=DEVICE)
    out = quant_linear(x3, q, b)
    assert out.shape == (2, 3, 40)
    check(out.reshape(6, 40), x3.reshape(6, 64), q, b)
    empty = quant_linear(torch.empty(0, 64, device=DEVICE), q, b)
    assert empty.shape == (0, 40)


def test_refuses_what_does_not_fit():
    _, q, _ = make_case("int4", 1, 40, 64, torch.float32, False)
    with pytest.raises(ValueError, match="does not fit"):
        quant_linear(torch.randn(2, 32, device=DEVICE), q)
    with pytest.raises(ValueError, match="does not fit"):
        quant_linear(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), q)
    with pytest.raises(ValueError, match="bias"):
        quant_linear(torch.randn(2, 64, device=DEVICE), q, torch.zeros(41, device=DEVICE))
    with pytest.raises(ValueError, match="one device"):
        quant_linear(torch.randn(2, 64, device="meta"), q)
    with pytest.raises(ValueError, match="powers of two"):
        TileConfig(16, 48, 64)


# -- dispatch --------------------------------------------------------------------------------------------


def test_kernel_applies_to_cuda_tensors_only(monkeypatch):
    assert triton_quant.applies(torch.zeros(1, device=DEVICE)) == (DEVICE == "cuda")
    assert not triton_quant.applies(torch.zeros(1))
    monkeypatch.setattr(triton_support, "AVAILABLE", False)
    assert not triton_quant.applies(torch.zeros(1, device=DEVICE))  # no triton: the reference serves


def _count_kernel_calls(monkeypatch) -> list:
    """Make every tensor one the kernel applies to (on CPU the interpreter runs it); count its calls."""
    calls = []
    real = triton_quant.quant_linear

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_quant, "applies", lambda x: True)
    monkeypatch.setattr(triton_quant, "quant_linear", counted)
    return calls


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantized_linear_dispatches_to_the_kernel(monkeypatch, name):
    lin = Linear(64, 40, bias=True).to(DEVICE)
    lin.quantize(FORMATS[name])
    x = torch.randn(3, 64, device=DEVICE)
    with torch.no_grad():
        calls = _count_kernel_calls(monkeypatch)
        got = lin(x)
    assert calls == [(3, 64)]
    check(got, x, lin.quantized, lin.bias)  # the activations unrounded (the CPU product rounds them)


@pytest.mark.parametrize("name,arch", [("int4", "qwen2"), ("int8", "llama")])  # qwen2: q/k/v biases
def test_tiny_quantized_model_through_the_kernel(tmp_path, monkeypatch, name, arch):
    """The eager model quantized (fp32), every quantized product through the kernel (the projections and the
    int8 lm_head), against Hugging Face transformers on the checkpoint with those weights dequantized."""
    model_dir = build_tiny_model(tmp_path / "model", arch=arch)
    reference = AutoModelForCausalLM.from_pretrained(
        dequantized_checkpoint(model_dir, tmp_path / "dequantized", name), torch_dtype=torch.float32
    ).eval()
    config = EngineConfig(model=str(model_dir), device=DEVICE, block_size=8, num_kv_blocks=256,
                          quantization=name, compile_step=False)  # fmt: skip
    eng = LLMEngine(config, model_dir=model_dir)
    prompts = PROMPTS[:3]  # 1, 5 and 17 tokens in chunks of 8: steps of 14, 8 and 1 rows
    calls = _count_kernel_calls(monkeypatch)
    got = engine_logits(eng, prompts, chunk=8)
    # 9 quantized products a step: 4 projections in each of 2 layers, and the lm_head
    assert [shape[0] for shape in calls] == [14] * 9 + [8] * 9 + [1] * 9
    for prompt, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, want, atol=2e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cuda_graph_replays_the_kernel(name):
    """Captured (split-K and not) and replayed on new inputs: the eager results, bit for bit."""
    for N, K in [(4096, 4096), (96, 2048)]:
        x, q, b = make_case(name, 4, N, K, torch.bfloat16, True)
        static_x = x.clone()
        quant_linear(static_x, q, b)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = quant_linear(static_x, q, b)
        for seed in range(3):
            static_x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
            graph.replay()
            torch.testing.assert_close(static_out, quant_linear(static_x, q, b), atol=0, rtol=0)


# -- the GPU build, without a GPU ----------------------------------------------------------------------------

COMPILE_CHECK = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from motet.kernels import triton_quant as tq, triton_support
from tests.kernels.gpu_build import resource_usage

kernel = triton_support.kernels(tq.__name__)._quant_gemm_kernel
aligned = ["x_ptr", "q_ptr", "s_ptr", "m_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm", "stride_qn",
           "stride_sn", "stride_mn", "stride_os", "stride_om"]  # what triton specializes at a launch on a 4096-wide layer
unit = ["stride_xk", "stride_qk", "stride_sk", "stride_mk", "stride_on"]
out = []
for fmt, M, arch in json.loads(sys.argv[1]):
    int4, mxfp4 = fmt in ("int4", "mxfp4"), fmt == "mxfp4"
    c = tq.choose_config(M, 4096, 4096, 4 if int4 else 8, 132)
    sig = {n: "i32" for n in kernel.arg_names}
    sig.update(x_ptr="*bf16", q_ptr="*u8", s_ptr="*u8" if mxfp4 else "*fp16", m_ptr="*u8" if mxfp4 else "*fp16",
               bias_ptr="*bf16", out_ptr="*bf16")
    consts = dict(INT4=int4, MXFP4=mxfp4, HAS_BIAS=True, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCKS_PER_STEP=c.block_k // 32,
                  PRECISION=None, DOT_FP32=False, **{n: 1 for n in unit})
    sig.update({n: "constexpr" for n in consts})
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    out.append(dict(fmt=fmt, M=M, arch=arch, **resource_usage(k, "_quant_gemm_kernel"),
                    async_copies=k.asm["ptx"].count("cp.async.cg.shared.global"), mma=k.asm["ptx"].count("mma")))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the tests above run the kernel natively")
def test_compiles_for_the_gpu_without_spills(tmp_path):
    """The kernel built for sm_90 (H100) and sm_80 (A100) by triton's own compiler and ptxas, as a launch
    would build it: registers only (no spill to local memory), weight tiles copied asynchronously into shared
    memory (the software pipeline), products on the tensor cores (mma, or wgmma on sm_90 for large tiles)."""
    cases = [
        ("int4", 1, 90),
        ("int8", 16, 90),
        ("int4", 1, 80),
        ("int4", 512, 90),
        ("mxfp4", 1, 90),
        ("mxfp4", 512, 90),
    ]
    for build in gpu_builds(COMPILE_CHECK, cases, tmp_path):
        assert build["spill"] == 0 and build["regs"] <= 255, build
        assert build["async_copies"] > 0 and build["mma"] > 0, build
        assert build["scratch"] == 0, (
            build
        )  # no global scratch: nothing for a CUDA graph to allocate at launch


@needs_cuda
@pytest.mark.parametrize("adapters", [0, 2], ids=["base", "2-adapters"])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantized_decode_from_graphs_equals_eager(tiny_model_dir, tmp_path, name, adapters):
    """The kernel inside the decode CUDA graphs (motet/engine/worker/cuda_graphs.py): greedy tokens of ragged
    prompts in bf16, with and without adapters on top, the same as eager steps."""
    from motet.engine.sampling_params import SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (1, 5, 17, 33, 60, 2, 9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        config = EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", device="cuda", block_size=8,
                              num_kv_blocks=256, quantization=name, compile_step=graphs)  # fmt: skip
        eng = LLMEngine(config, model_dir=tiny_model_dir)
        outs[graphs] = mixed_adapter_tokens(eng, prompts, params, adapters, tmp_path)
        assert not graphs or eng.runner.graphs.replays > 0
    assert outs[True] == outs[False]
