"""Quantized weights (motet/kernels/quant.py; `--quantization int8|int4`).

The formats against gguf-py (llama.cpp's own Python package), which reads and writes the same blocks; the
native kernels (motet/kernels/csrc/qgemm.h, AVX2 and the portable build) against float64 products of the
dequantized weights; the engine quantizing a float checkpoint against Hugging Face transformers (and PEFT
with adapters) on that checkpoint with its projections replaced by their dequantized values; the native
CPU step against the eager model, both quantized."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.worker.memory import weights_bytes
from motet.kernels import cpu_native
from motet.kernels.quant import BLOCK, FORMATS, INT8, MXFP4, QuantizedWeight, quantize_activations
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.engine.test_model_store import GGUF_NAME, _llama_cpp_permute
from tests.peft_adapters import TINY_ADAPTERS, peft_reference, save_peft_adapters, tiny_requests
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels")
FORMAT_NAMES = sorted(FORMATS)


def gguf_blocks(q: QuantizedWeight) -> torch.Tensor:
    """The weight as its GGUF tensor's bytes (uint8 [N, K / 32 * block bytes]): the inverse of the format's
    `from_gguf_blocks`, as gguf-py reads and writes them."""
    N, K = q.shape
    parts = [q.scales[..., None].view(torch.uint8)]
    if q.mins is not None:
        parts.append(q.mins[..., None].view(torch.uint8))
    parts.append(q.data.reshape(N, K // BLOCK, -1).view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(N, -1)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- the formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_gguf_blocks_read_as_gguf_py_dequantizes_them(name):
    """A GGUF tensor quantized by gguf-py maps onto the format byte for byte, with gguf-py's values."""
    fmt = FORMATS[name]
    w = torch.randn(7, 5 * BLOCK, generator=torch.Generator().manual_seed(1)) * 0.3
    blocks = gguf_quants.quantize(w.numpy(), fmt.ggml_type)
    q = fmt.from_gguf_blocks(torch.from_numpy(blocks), tuple(w.shape))
    want = torch.from_numpy(gguf_quants.dequantize(blocks, fmt.ggml_type))
    assert torch.equal(q.dequantize(), want)
    assert torch.equal(gguf_blocks(q), torch.from_numpy(blocks))


def test_mxfp4_blocks_read_as_gguf_py_dequantizes_them():
    """GGML's MXFP4 blocks (an E8M0 byte, then 16 bytes of FP4 codes) map onto the format byte for byte, with
    gguf-py's values: scales over the whole exponent range, every code."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 4 * BLOCK, generator=g) * torch.exp2(
        torch.randint(-30, 30, (6, 1), generator=g).float()
    )
    blocks = gguf_quants.quantize(w.numpy(), MXFP4.ggml_type)
    raw = torch.from_numpy(blocks).view(6, 4, 17)
    raw[0, 0, 0], raw[0, 1, 0], raw[1, 0, 0] = 0, 1, 254  # 2^-127 (subnormal), 2^-126, 2^127
    raw[2, :, 1:] = torch.randint(0, 256, (4, 16), generator=g, dtype=torch.uint8)  # every code
    q = MXFP4.from_gguf_blocks(raw.reshape(6, -1), tuple(w.shape))
    want = torch.from_numpy(gguf_quants.dequantize(raw.reshape(6, -1).numpy(), MXFP4.ggml_type))
    assert torch.equal(q.dequantize(), want)
    assert torch.equal(gguf_blocks(q), raw.reshape(6, -1))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantize_rounds_each_value_to_its_block_grid(name):
    """Our quantization is a valid block of the GGML type (gguf-py reads it to our values), each value within
    half a step of the original, and no worse than gguf-py's own quantization of the same weight."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(2)
    w = torch.randn(9, 4 * BLOCK, generator=g) * torch.rand(9, 1, generator=g)
    w[3, :BLOCK] = 0.25  # a constant block (scale 0)
    q = fmt.quantize(w)
    deq = q.dequantize()
    ours = torch.from_numpy(gguf_quants.dequantize(gguf_blocks(q).numpy(), fmt.ggml_type))
    assert torch.equal(deq, ours)
    step = q.scales.float().repeat_interleave(BLOCK, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-3 * w.abs() + 1e-6).all()
    theirs = gguf_quants.dequantize(gguf_quants.quantize(w.numpy(), fmt.ggml_type), fmt.ggml_type)
    assert (deq - w).pow(2).mean() <= torch.from_numpy(theirs - w.numpy()).pow(2).mean() * 1.05
    torch.testing.assert_close(deq[3, :BLOCK], w[3, :BLOCK], atol=1e-3, rtol=0)
    assert q.nbytes == w.numel() // BLOCK * fmt.gguf_block_bytes


def test_inputs_not_in_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        FORMATS["int8"].quantize(torch.randn(4, 40))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_reference_linear_matches_float64(name):
    g = torch.Generator().manual_seed(3)
    q = FORMATS[name].quantize(torch.randn(11, 3 * BLOCK, generator=g))
    x, b = torch.randn(5, 3 * BLOCK, generator=g), torch.randn(11, generator=g)
    want = F.linear(quantize_activations(x).double(), q.dequantize(torch.float64), b.double())
    torch.testing.assert_close(q.linear(x, b).double(), want, atol=1e-5, rtol=1e-5)


def test_activations_are_quantized_as_gguf_py_quantizes_q8_0():
    """The CPU product's activations: llama.cpp's Q8_0 rounding of each block (gguf-py's, to the tie)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4 * BLOCK, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    x[2, :BLOCK] = 0  # an all-zero block
    raw = gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    torch.testing.assert_close(quantize_activations(x), want, atol=0, rtol=1e-6)
    assert not torch.equal(quantize_activations(x), x)


# -- the native kernels --------------------------------------------------------------------------------------


def random_weight(name: str, N: int, K: int, g: torch.Generator) -> QuantizedWeight:
    """A weight in format `name`: a float weight quantized, or (MXFP4, read from checkpoints, never quantized
    here) random codes under random exponents around 1."""
    if name != MXFP4.name:
        return FORMATS[name].quantize(torch.randn(N, K, generator=g))
    data = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    return QuantizedWeight(
        MXFP4, data, torch.randint(118, 130, (N, K // BLOCK), generator=g, dtype=torch.uint8), None
    )


def check_qgemm(name: str, M: int, N: int, K: int, bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q = random_weight(name, N, K, g)
    x = torch.randn(M, K + 3, generator=g)[:, 3:]  # row-strided
    b = torch.randn(N, generator=g) if bias else None
    packed = cpu_native.pack_quantized(q)
    want = F.linear(
        quantize_activations(x).double(), q.dequantize(torch.float64), None if b is None else b.double()
    )
    y = cpu_native.gemm(x, packed, N, b, quantized=name)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)
    base = torch.randn(M, N + 5, generator=g)  # accumulate into a row-strided output
    out = base.clone()
    cpu_native.gemm(x, packed, N, b, out=out[:, 2 : 2 + N], accumulate=True, quantized=name)
    torch.testing.assert_close(
        out[:, 2 : 2 + N].double(), base[:, 2 : 2 + N].double() + want, atol=1e-4, rtol=1e-4
    )
    assert torch.equal(out[:, :2], base[:, :2]) and torch.equal(out[:, 2 + N :], base[:, 2 + N :])


@needs_native
@pytest.mark.parametrize("name", [*FORMAT_NAMES, MXFP4.name])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 13, 100, 200])
@pytest.mark.parametrize("N,K", [(16, 32), (1, 64), (13, 96), (50, 160), (70, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_qgemm_matches_float64_of_dequantized(cpu_tier, name, M, N, K, bias):
    """One row tile (M <= 4) and several, every panel remainder (N mod 16), several row chunks (M > 96); in each
    instruction-set tier (the scalar one: the portable loops; avx512*: VNNI)."""
    check_qgemm(name, M, N, K, bias, seed=M * N + K)


@needs_native
@pytest.mark.parametrize("name", [*FORMAT_NAMES, MXFP4.name])
def test_a_rows_product_does_not_depend_on_its_batch(cpu_tier, name):
    """Exact integer block sums, added in one order per row: a row alone, or among 1-130 others, gives the
    same bits (a request's output cannot depend on what else the step holds)."""
    g = torch.Generator().manual_seed(11)
    q = random_weight(name, 45, 96, g)
    packed = cpu_native.pack_quantized(q)
    x = torch.randn(131, 96, generator=g)
    alone = cpu_native.gemm(x[:1].contiguous(), packed, 45, quantized=name)
    for M in (2, 3, 4, 5, 9, 97, 131):
        assert torch.equal(cpu_native.gemm(x[:M].contiguous(), packed, 45, quantized=name)[:1], alone)


@needs_native
@pytest.mark.parametrize("name", [*FORMAT_NAMES, MXFP4.name])
@pytest.mark.parametrize(
    "rows,N,K",
    [
        ([0, 1, 3, 0], 45, 64),  # a small product: one thread
        ([1, 0, 1, 0, 0, 1, 1, 0], 256, 64),  # decode: a row an expert, the panels split over the threads
        (
            [5, 0, 130, 2, 0, 9],
            70,
            96,
        ),  # prefill: an expert's rows in several chunks, rows quantized in parallel
    ],
    ids=["small", "decode", "prefill"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_expert_product_matches_each_experts_product(cpu_tier, name, rows, N, K, bias):
    """The MoE op's grouped GEMM on quantized experts (one parallel region for every expert with rows) against
    each expert's rows times its dequantized weight in float64, and bit for bit against the quantized GEMM of
    each expert's rows alone (the per-expert product it replaces); in each instruction-set tier."""
    g = torch.Generator().manual_seed(len(rows) * N + K)
    weights = [random_weight(name, N, K, g) for _ in rows]
    b = torch.randn(len(rows), N, generator=g) if bias else None
    offsets = torch.tensor([0, *rows]).cumsum(0)
    x = torch.randn(int(offsets[-1]), K + 3, generator=g)[:, 3:]  # row-strided
    packed = torch.stack([cpu_native.pack_quantized(q) for q in weights])
    y = cpu_native.experts(x, offsets, packed, N, b, quantized=name)
    assert y.shape == (x.shape[0], N)
    for e, q in enumerate(weights):
        seg = slice(int(offsets[e]), int(offsets[e + 1]))
        if seg.start == seg.stop:
            continue
        be = None if b is None else b[e]
        want = F.linear(
            quantize_activations(x[seg]).double(),
            q.dequantize(torch.float64),
            None if be is None else be.double(),
        )
        torch.testing.assert_close(y[seg].double(), want, atol=1e-4, rtol=1e-4)
        alone = cpu_native.gemm(x[seg], cpu_native.pack_quantized(q), N, be, quantized=name)
        assert torch.equal(y[seg], alone)


@needs_native
def test_qgemm_refuses_inputs_not_in_whole_blocks():
    q = FORMATS["int8"].quantize(torch.randn(16, 64))
    packed = cpu_native.pack_quantized(q)
    status = cpu_native.library().motet_gemm(
        cpu_native.QUANT_CODES["int8"], torch.zeros(1, 40).data_ptr(), 40, 1, 40, packed.data_ptr(), 16,
        None, torch.zeros(1, 16).data_ptr(), 16, 0,
    )  # fmt: skip
    assert status != 0


@pytest.mark.parametrize("fmt", ["int8", "int4", "float32", "bfloat16"])
def test_rows_read_back_from_packed_panels_are_the_weights_rows(fmt):
    """A tied embedding table looked up in its packed lm_head (cpu_native.packed_rows): each row is the weight's
    row as its format defines it (QuantizedWeight.dequantize; a float weight's own values), rows past a panel's
    16 and the last, partial panel included."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(45, 96, generator=g)
    rows = torch.tensor([0, 15, 16, 44, 31, 7, 7, 33])
    if fmt in FORMATS:
        q = FORMATS[fmt].quantize(w)
        got, want = cpu_native.packed_rows(cpu_native.pack_quantized(q), rows, 96, fmt), q.dequantize()[rows]
    else:
        w = w.to(getattr(torch, fmt))
        got, want = cpu_native.packed_rows(cpu_native.pack(w), rows, 96), w.float()[rows]
    assert torch.equal(got, want)


# -- the engine ----------------------------------------------------------------------------------------------


def dequantized_checkpoint(model_dir: Path, out: Path, name: str) -> Path:
    """`model_dir` with every decoder projection replaced by its `name`-quantized values and the lm_head by
    its int8 values, untied from the embedding table (the reference)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        for module_name, module in hf.named_modules():
            if module_name.split(".")[-1] in PROJECTIONS:
                module.weight.copy_(FORMATS[name].quantize(module.weight).dequantize())
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = torch.nn.Parameter(INT8.quantize(hf.lm_head.weight).dequantize())
    hf.save_pretrained(out, safe_serialization=True)
    for f in model_dir.iterdir():  # tokenizer and generation config
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def quantizing_inputs(
    model: torch.nn.Module, lm_head: bool = True, projections: tuple[str, ...] = PROJECTIONS
) -> torch.nn.Module:
    """`model` (HF or PEFT) with the inputs of its (quantized) `projections` (and lm_head) rounded as the CPU product rounds
    them (Q8_0 blocks, checked against gguf-py above): with a dequantized checkpoint, the reference. A LoRA
    layer's adapter sees its input unrounded: only its base layer's is."""
    names = (*projections, "lm_head") if lm_head else projections
    for module_name, module in model.named_modules():
        parts = module_name.split(".")
        if parts[-1] == "base_layer":
            parts.pop()
        if parts[-1] in names and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (quantize_activations(args[0]),))
    return model


def head_in_blocks(runner) -> bool:
    """Whether the served lm_head multiplies in blocks (the native step packs it and releases the layer's own)."""
    if runner.native is not None:
        return runner.native.lm_format is not None
    return runner.model.lm_head.quantized is not None


def engine(model_dir, **options) -> LLMEngine:
    cfg = EngineConfig(model=str(model_dir), device="cpu", block_size=8, num_kv_blocks=256, **options)
    return LLMEngine(cfg, model_dir=model_dir)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])  # qwen2: q/k/v biases
def test_quantized_model_matches_hf_on_the_dequantized_checkpoint(tmp_path, name, arch, tied):
    model_dir = build_tiny_model(tmp_path / "model", arch=arch, tied=tied)
    reference = dequantized_checkpoint(model_dir, tmp_path / "dequantized", name)
    quantized = engine(model_dir, quantization=name, compile_step=False)
    model = quantized.runner.model
    assert all(lin.quantized is not None and lin.weight.numel() == 0 for lin in model.decoder_linears())
    assert model.lm_head.quantized.format is INT8  # the lm_head in int8, the table as it was
    assert model.embed_tokens.weight.numel() > 0
    hf = quantizing_inputs(AutoModelForCausalLM.from_pretrained(reference, torch_dtype=torch.float32).eval())
    got = engine_logits(quantized, PROMPTS)
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    assert_close_but_for_rounding_flips(got, want)
    original = engine_logits(engine(model_dir, compile_step=False), PROMPTS)  # quantization changed them
    for a, c in zip(got, original, strict=True):
        assert (a - c).abs().max() > 1e-3


def assert_close_but_for_rounding_flips(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Two implementations of the quantized model, prompt by prompt: their float rounding differs in the last
    bits, and where an activation sits on a rounding boundary of its int8 block the two round it one step
    apart, which moves the logits after it by about a step times the weights. Half the prompts or more see no flip
    (logits within 1e-4); none drifts by more than 0.1."""
    flipped = 0
    for g, w in zip(got, want, strict=True):
        diff = (g - w).abs().max().item()
        assert diff < 0.1, diff
        flipped += diff > 1e-4
    assert flipped <= len(got) // 2, f"{flipped} of {len(got)} prompts differ by more than 1e-4"


@needs_native
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_native_step_equals_eager_quantized(tmp_path, name, arch, chunk):
    """The tolerance of tests/engine/test_compiled_step.py; decode rows (unpacked per tile) and prefill chunks."""
    model_dir = build_tiny_model(tmp_path, arch=arch)
    eager = engine(model_dir, quantization=name, compile_step=False)
    native = engine(model_dir, quantization=name)
    assert native.runner.native is not None and eager.runner.native is None
    assert_close_but_for_rounding_flips(
        engine_logits(native, PROMPTS, chunk), engine_logits(eager, PROMPTS, chunk)
    )


@needs_native
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_native_bf16_quantized_close_to_eager_fp32_quantized(tiny_model_dir, name):
    """bf16 norms/embeddings/KV with quantized projections: within what bf16 costs the unquantized model."""
    ref = engine_logits(engine(tiny_model_dir, quantization=name, compile_step=False), PROMPTS[:4])
    got = engine_logits(engine(tiny_model_dir, quantization=name, dtype="bfloat16"), PROMPTS[:4])
    for a, b in zip(ref, got, strict=True):
        assert (a.softmax(-1) - b.softmax(-1)).abs().max() < 0.05


@pytest.fixture(scope="module")
def int4_loras(tmp_path_factory):
    """A tiny model, its int4-dequantized twin, and PEFT adapters over the twin (the reference)."""
    root = tmp_path_factory.mktemp("int4-loras")
    model_dir = build_tiny_model(root / "model")
    reference = dequantized_checkpoint(model_dir, root / "dequantized", "int4")
    peft = quantizing_inputs(save_peft_adapters(reference, root / "adapters", TINY_ADAPTERS, std=0.1))
    return model_dir, peft, {n: root / "adapters" / n for n, _, _ in TINY_ADAPTERS}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_adapters_over_a_quantized_base_match_peft_on_the_dequantized_base(int4_loras, compiled):
    model_dir, peft, paths = int4_loras
    eng = engine(model_dir, quantization="int4", compile_step=compiled, max_loras=4, max_lora_rank=32)
    for n, path in paths.items():
        eng.add_lora(n, path)
    prompts, names = tiny_requests()
    refs = [peft_reference(peft, n, p, 0)[1] for p, n in zip(prompts, names, strict=True)]
    for chunk in (None, 7):
        assert_close_but_for_rounding_flips(engine_logits(eng, prompts, chunk, names), refs)


def test_quantized_weights_take_fewer_bytes(tiny_model_dir):
    sizes = {}
    for q in (None, "int8", "int4"):
        model = engine(tiny_model_dir, quantization=q, compile_step=False).runner.model
        sizes[q] = weights_bytes(model, torch.device("cpu"))
    assert sizes["int4"] < sizes["int8"] < sizes[None]


def test_bad_quantization_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")
    odd = build_tiny_model(tmp_path, hidden_size=48, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="hidden_size is 48"):
        engine(odd, quantization="int8")


def test_cli_refuses_an_unknown_quantization():
    proc = subprocess.run(
        [sys.executable, "-m", "motet.api.cli", "generate", "--quantization", "q3", "--prompt", "hi"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 2 and "--quantization" in proc.stderr and "int4" in proc.stderr


def test_cli_passes_the_quantization_to_the_engine():
    from motet.api.cli import build_parser, engine_config

    args = build_parser().parse_args(["generate", "--quantization", "int4", "--prompt", "hi"])
    assert engine_config(args).quantization == "int4"
    assert engine_config(build_parser().parse_args(["generate", "--prompt", "hi"])).quantization is None


# -- GGUF files served in their own blocks --------------------------------------------------------------------

GGUF_TYPES = {  # a llama.cpp-style mix: each fused layer's parts in one type; the embedding table quantized too
    "token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q8_0",
    "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q8_0",
}  # fmt: skip
HF_OF_GGUF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def add_llama_tensors(writer, hf, types: dict[str, str], quantize, permute: bool = True) -> None:
    """`hf`'s weights into a GGUF `writer` under llama.cpp's names (q/k rows permuted for its rotary where
    `permute`, as for the llama architecture; an untied lm_head as output.weight), each in `types`' GGML type
    (F32 where not named), `quantize`d; q/k/v biases and per-head q/k norms (Qwen2, Qwen3) in F32."""
    import gguf

    cfg, state = hf.config, hf.state_dict()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for g, h in (("attn_q", "q_proj.bias"), ("attn_k", "k_proj.bias"), ("attn_v", "v_proj.bias"),
                     ("attn_q_norm", "q_norm.weight"), ("attn_k_norm", "k_norm.weight")):  # fmt: skip
            if p + h in state:
                writer.add_tensor(f"blk.{i}.{g}.{h.rsplit('.', 1)[1]}", state[p + h].numpy())
    tensors = {"token_embd": state["model.embed_tokens.weight"], "output_norm": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for g, h in HF_OF_GGUF.items():
            w = state[f"model.layers.{i}.{h}.weight"]
            if permute and g in ("attn_q", "attn_k"):
                w = _llama_cpp_permute(
                    w, cfg.num_attention_heads, None if g == "attn_q" else cfg.num_key_value_heads
                )
            tensors[f"blk.{i}.{g}"] = w
    for name, w in tensors.items():
        qtype = gguf.GGMLQuantizationType[types.get(name.split(".")[-1], "F32")]
        data = w.numpy() if qtype.name == "F32" else quantize(w.numpy(), qtype)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=None if qtype.name == "F32" else qtype)


def write_gguf(model_dir: Path, out: Path, types: dict[str, str], quantize=None) -> Path:
    """`model_dir`'s weights as llama.cpp's converter writes them (q/k rows permuted for its rotary), each
    tensor in `types`' GGML type (F32 where not named), quantized by gguf-py (or `quantize(array, type)`: a
    type gguf-py only dequantizes); config and tokenizer copied."""
    import gguf

    quantize = quantize or gguf.quants.quantize

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = hf.config
    out.mkdir()
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch="llama")
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    add_llama_tensors(writer, hf, types, quantize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in model_dir.iterdir():  # config and tokenizer; the weights are only the GGUF's
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def gguf_reference(model_dir: Path, out: Path, types: dict[str, str], quantize=None) -> Path:
    """`model_dir` with each tensor replaced by gguf-py's dequantization of its `types` block (a row-wise
    format: the same whether the rows were permuted first or not), quantized as `write_gguf` does."""
    import gguf

    quantize = quantize or gguf.quants.quantize

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    gguf_of = {h.split(".")[-1]: g for g, h in HF_OF_GGUF.items()} | {"embed_tokens": "token_embd"}
    with torch.no_grad():
        for module_name, module in hf.named_modules():
            qtype = types.get(gguf_of.get(module_name.split(".")[-1], ""), "F32")
            if qtype != "F32":
                t = gguf.GGMLQuantizationType[qtype]
                deq = gguf.quants.dequantize(quantize(module.weight.numpy(), t), t)
                module.weight.copy_(torch.from_numpy(deq))
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_gguf_blocks_served_as_they_are_match_hf_on_gguf_py_dequantized(tmp_path, compiled):
    model_dir = build_tiny_model(tmp_path / "model")
    served = write_gguf(model_dir, tmp_path / "gguf", GGUF_TYPES)
    eng = engine(served, quantization="gguf", compile_step=compiled)
    if not compiled:
        formats = [lin.quantized.format.name for lin in eng.runner.model.decoder_linears()]
        assert formats == ["int4", "int8", "int4", "int8"] * 2  # qkv, o, gate_up, down per layer
    hf = AutoModelForCausalLM.from_pretrained(gguf_reference(model_dir, tmp_path / "ref", GGUF_TYPES)).eval()
    hf = quantizing_inputs(hf, lm_head=True)  # the tied Q8_0 table is the lm_head, in its blocks
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    assert_close_but_for_rounding_flips(engine_logits(eng, PROMPTS), want)


def test_a_directory_without_a_gguf_file_is_refused(tmp_path):
    """(Other block types, fused layers with parts in different types, types gguf-py cannot dequantize:
    tests/kernels/test_quant_formats.py.)"""
    model_dir = build_tiny_model(tmp_path / "model")
    with pytest.raises(ModelLoadError, match="no .gguf file"):
        engine(model_dir, quantization="gguf")


@pytest.mark.slow
def test_default_model_from_its_q4_1_file_equals_the_dequantized_model(default_model_dir, gguf_dir, tmp_path):
    """The default model served from the GGUF it is pulled from (Q4_1 projections kept as int4 blocks) gives
    the next-token distributions of transformers on the float checkpoint `motet pull` dequantizes from the
    same file, with the quantized products' inputs rounded as the CPU product rounds them. (Greedy agreement
    with the float model: benchmarks/quant_quality.py.)"""
    served = tmp_path / "model"
    served.mkdir()
    for f in Path(default_model_dir).iterdir():
        if f.suffix not in (".safetensors", ".gguf"):  # (a pull by this motet keeps its model.gguf)
            (served / f.name).symlink_to(f)
    (served / "model.gguf").symlink_to(gguf_dir / GGUF_NAME)
    options = dict(device="cpu", num_kv_blocks=128, block_size=16)
    gguf_engine = LLMEngine(EngineConfig(model=str(served), quantization="gguf", **options), model_dir=served)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    hf = quantizing_inputs(hf, lm_head=head_in_blocks(gguf_engine.runner))
    tok = gguf_engine.tokenizer
    prompts = [
        tok.encode_chat([{"role": "user", "content": q}])
        for q in (
            "What is the capital of France?",
            "Write a haiku about the sea.",
            "List three prime numbers.",
        )
    ]
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    got = torch.cat(engine_logits(gguf_engine, prompts))
    # 30 layers amplify the last-bit differences into rounding flips everywhere (logits move by up to ~1.5,
    # as much as rounding the activations at all moves them): the next-token distributions must agree
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    total_variation = 0.5 * (got.softmax(-1) - want.softmax(-1)).abs().sum(-1)
    assert agree >= 0.95 and total_variation.mean() < 0.05, (agree, total_variation.mean())


def test_pull_keeps_the_gguf_it_converted(tmp_path, monkeypatch):
    """`motet pull` leaves the GGUF file beside the converted checkpoint, where `--quantization gguf` finds it."""
    from motet.engine.weights import model_store
    from motet.engine.weights.gguf_weights import gguf_file

    def fake_fetch(dest, progress):
        dest.mkdir(parents=True)
        (dest / "x.gguf").write_bytes(b"GGUF blocks")
        return dest / "x.gguf"

    def fake_convert(gguf_path, out_dir, progress=False):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(model_store, "convert_gguf", fake_convert)
    d = model_store.pull(cache_dir=tmp_path, progress=False)
    assert gguf_file(d) == d / "model.gguf" and (d / "model.gguf").read_bytes() == b"GGUF blocks"
