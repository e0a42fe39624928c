"""Quantized checkpoints in other formats, loaded into motet's int4 / int8 blocks (motet/kernels/ggml_blocks.py,
motet/kernels/gptq_awq.py, motet/engine/weights/gguf_weights.py, motet/engine/weights/quantized_checkpoint.py).

GGUF block types against gguf-py (llama.cpp's Python package): files written by its writer, blocks made by
its quantizers where it has one, else blocks of known bytes (a Q4_K quantizer below, random bytes for the
other K-quants and IQ types) read back by its dequantizer. GPTQ and AWQ checkpoints packed here as AutoGPTQ
and AutoAWQ pack them (each packing transcribed in its helper), against Hugging Face transformers on the
float checkpoint that an independent numpy reading of the packed tensors gives.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.gguf_weights import iter_gguf_weights
from motet.kernels import ggml_blocks
from motet.kernels.gptq_awq import from_gptq
from motet.kernels.quant import BLOCK, INT4, INT8
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.kernels.test_quantization import (
    HF_OF_GGUF,
    engine,
    gguf_blocks,
    gguf_reference,
    head_in_blocks,
    needs_native,
    quantizing_inputs,
    write_gguf,
)
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
T = gguf.GGMLQuantizationType
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# -- blocks of known bytes ------------------------------------------------------------------------------------


def _significant_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """`x` rounded to `bits` significant bits (so that its products with small integers fit an fp16)."""
    m, e = np.frexp(x.astype(np.float64))
    return np.ldexp(np.round(m * 2**bits) / 2**bits, e)


def quantize_q4_k(w: np.ndarray, exact: bool = False) -> np.ndarray:
    """Q4_K blocks of `w` [N, K] (K a multiple of 256), laid out as ggml's block_q4_K: fp16 d and dmin, the 8
    six-bit scales and mins packed in 12 bytes (get_scale_min_k4's layout), then 4 groups of 32 bytes, each
    holding sub-block 2j in its low nibbles and 2j + 1 in its high ones. Round-to-nearest per 32-value
    sub-block (not llama.cpp's search). `exact`: d and dmin with 5 significant bits, so that d * sc and
    dmin * m (sc, m < 64) are exact fp16s."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, neg_min = (hi - lo) / 15, -lo
    d, dmin = scale.max(-1) / 63, neg_min.max(-1) / 63
    if exact:
        d, dmin = _significant_bits(d, 5), _significant_bits(dmin, 5)
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.round(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.round(neg_min / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.round((x + (dminf * m)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4),
        ],
        axis=-1,
    )
    q = q.reshape(N, K // 256, 4, 2, 32)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(N, K // 256, 128)
    d_bytes, dmin_bytes = d[..., None].view(np.uint8), dmin[..., None].view(np.uint8)
    return np.concatenate([d_bytes, dmin_bytes, scales, qs], axis=-1).reshape(N, -1)


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes as `rows` rows of `cols` values in `qtype`, bit 6 of every byte cleared: any fp16, fp32,
    E8M0 or E4M3 scale in them is then finite and small, wherever the type keeps it."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8) & 0xBF


def gguf_py_quantizes(qtype: T) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """Blocks of `w` in `qtype`: gguf-py's quantizer, or for Q4_K the one above (with exact fp16 products)."""
    return quantize_q4_k(w, exact=True) if qtype == T.Q4_K else gguf.quants.quantize(w, qtype)


def dequantize(blocks: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))


# -- each block type against gguf-py ---------------------------------------------------------------------------

ROWS, COLS = 6, 512  # COLS: a multiple of every block size (Q1_0's 128, the K-quants' 256)
REQUANTIZED = [t for t in T if ggml_blocks.dequantizable(t) and ggml_blocks.native_format(t) is None]


@pytest.mark.parametrize("name,fmt", [("Q8_0", INT8), ("Q4_1", INT4), ("Q4_0", INT4)])
@pytest.mark.parametrize("source", ["gguf-py", "random bytes"])
def test_q8_0_q4_1_q4_0_map_onto_the_formats_exactly(name, fmt, source):
    qtype = T[name]
    if source == "gguf-py":
        w = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32) * 0.3
        blocks = gguf.quants.quantize(w, qtype)
    else:
        blocks = random_blocks(qtype, ROWS, COLS)
    assert ggml_blocks.native_format(qtype) == fmt
    q = ggml_blocks.from_ggml(blocks, qtype, (ROWS, COLS), fmt)
    assert q.format == fmt and q.shape == (ROWS, COLS)
    assert torch.equal(q.dequantize(), dequantize(blocks, qtype))  # Q4_0: min = -8 d, exact
    if name == "Q4_0":  # the 4-bit values are the file's bytes, unchanged
        assert torch.equal(q.data, torch.from_numpy(blocks.reshape(ROWS, -1, 18)[..., 2:].reshape(ROWS, -1)))


def test_q4_k_with_exact_fp16_products_maps_onto_int4_exactly():
    w = np.random.default_rng(2).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    blocks = quantize_q4_k(w, exact=True)
    deq = dequantize(blocks, T.Q4_K)
    assert (deq - torch.from_numpy(w)).abs().max() < 0.05 * 0.3  # a sane Q4_K encoding of w
    q = ggml_blocks.from_ggml(blocks, T.Q4_K, (ROWS, COLS), INT4)
    assert q.format == INT4 and torch.equal(q.dequantize(), deq)


@pytest.mark.parametrize("source", ["gaussian", "random bytes"])
def test_q4_k_scales_and_mins_rounded_to_fp16_stay_within_their_bound(source):
    """d * sc and dmin * m rounded to fp16 (each within 2^-11 of its value) move a weight by at most
    3 * 2^-11 of its 32-value sub-block's largest |weight| (ggml_blocks' docstring)."""
    rows, cols = 64, 4096
    if source == "gaussian":
        w = np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32) * 0.02
        blocks = quantize_q4_k(w)
    else:
        blocks = random_blocks(T.Q4_K, rows, cols, seed=3)
    want = dequantize(blocks, T.Q4_K).double()
    got = ggml_blocks.from_ggml(blocks, T.Q4_K, (rows, cols), INT4).dequantize().double()
    sub_max = want.reshape(rows, -1, BLOCK).abs().amax(-1, keepdim=True)
    err = (got - want).abs().reshape(rows, -1, BLOCK)
    assert (err <= 3 * 2**-11 * sub_max + 2**-24).all()  # + an fp16 subnormal's rounding
    assert err.max() > 0  # the rounding is real (the exact case is the test above)


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda t: t.name)
def test_other_types_are_requantized_to_int8_from_gguf_py_values(qtype):
    """A valid Q8_0 tensor (gguf-py reads our blocks to our values), each value within half an int8 step of
    gguf-py's dequantization of the file's blocks."""
    if gguf_py_quantizes(qtype):
        w = np.random.default_rng(4).standard_normal((ROWS, COLS)).astype(np.float32) * 0.1
        blocks = gguf.quants.quantize(w, qtype)
    else:
        blocks = random_blocks(qtype, ROWS, COLS, seed=int(qtype))
    want = dequantize(blocks, qtype)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    q = ggml_blocks.from_ggml(blocks, qtype, (ROWS, COLS), INT8)
    got = q.dequantize()
    assert q.format == INT8
    assert torch.equal(got, dequantize(gguf_blocks(q).numpy(), T.Q8_0))
    half_step = q.scales.float().repeat_interleave(BLOCK, dim=1) / 2
    # + what a subnormal fp16 scale's rounding (2^-25 at most) costs the block's largest value (127 steps)
    assert ((got - want).abs() <= half_step * (1 + 1e-3) + 127 * 2**-25).all()


def test_a_native_type_is_not_read_as_another_format():
    blocks = gguf.quants.quantize(np.ones((2, 64), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="Q8_0 blocks are not int4"):
        ggml_blocks.from_ggml(blocks, T.Q8_0, (2, 64), INT4)


# -- GGUF files served -----------------------------------------------------------------------------------------

Q4_TYPES = {  # Q4_0 and Q4_K projections (each fused layer's parts in one type); the embedding table Q4_0
    "token_embd": "Q4_0", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_0",
    "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q4_K",
}  # fmt: skip


FLIP_BOUND = (
    1.0  # how far an int8 rounding flip of one activation moves these tiny models' logits (< 0.52 seen)
)


def assert_close_but_for_flips(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """The engine's logits against the reference's, prompt by prompt. Both round the quantized layers' inputs
    to int8 blocks; where an activation sits on a rounding boundary the two, computing it in another float
    order, round it one step apart, and every logit after it moves (on the 256-wide model, by up to 0.52 in
    the native step, where 20% of single-token rows flip, against 2-3% in the eager model). The right blocks
    keep the mean difference under 0.1 (measured 0.04 at most, 0.0005 eager); the wrong weights (here: the
    unquantized ones) move it by about 1.0, and any layout error by the logits' own spread."""
    diffs = torch.cat([(g - w).abs().flatten() for g, w in zip(got, want, strict=True)])
    assert diffs.max() < FLIP_BOUND and diffs.mean() < 0.1, (diffs.max().item(), diffs.mean().item())


def assert_served_like_hf(served: Path, reference: Path, compiled: bool, **options) -> None:
    """`served` through the LLM class (greedy) and the engine's logits, against transformers on `reference`
    with the inputs of its quantized layers rounded as the CPU product rounds them (tests/kernels/test_quantization.py's
    `quantizing_inputs`): each greedy token is the reference's argmax given the tokens before it, but for a
    rounding flip."""
    llm = LLM(str(served), device="cpu", block_size=8, num_kv_blocks=256, compile_step=compiled, **options)
    hf = AutoModelForCausalLM.from_pretrained(reference, torch_dtype=torch.float32).eval()
    hf = quantizing_inputs(hf, lm_head=head_in_blocks(llm.engine.runner))
    prompts = PROMPTS[1:4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    argmax = []
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 10
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (chosen >= logits.amax(-1) - FLIP_BOUND).all()
        argmax += (chosen == logits.amax(-1)).tolist()
    assert sum(argmax) >= 0.8 * len(argmax)  # and mostly the argmax itself
    with torch.no_grad():
        want = [hf(torch.tensor([prompt])).logits[0] for prompt in PROMPTS]
    assert_close_but_for_flips(engine_logits(llm.engine, PROMPTS), want)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_gguf_q4_0_and_q4_k_served_match_hf_on_gguf_py_dequantized(tmp_path, compiled):
    model_dir = build_tiny_model(tmp_path / "model", hidden_size=256, intermediate_size=512)  # Q4_K: K % 256
    served = write_gguf(model_dir, tmp_path / "gguf", Q4_TYPES, quantize)
    reference = gguf_reference(model_dir, tmp_path / "ref", Q4_TYPES, quantize)
    assert_served_like_hf(served, reference, compiled, quantization="gguf")
    if not compiled:
        eng = engine(served, quantization="gguf", compile_step=False)
        formats = [lin.quantized.format.name for lin in eng.runner.model.decoder_linears()]
        assert formats == ["int4"] * 8
        assert eng.runner.model.lm_head.quantized.format == INT4  # the tied Q4_0 table's blocks


def gguf_py_requantized_reference(model_dir: Path, out: Path, types: dict[str, str]) -> Path:
    """`model_dir` with each projection as gguf-py's dequantization of its `types` block, requantized to Q8_0
    and dequantized again by gguf-py (what motet's int8 requantization stands for, by llama.cpp's own
    quantizer)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    gguf_of = {h.split(".")[-1]: g for g, h in HF_OF_GGUF.items()}
    with torch.no_grad():
        for module_name, module in hf.named_modules():
            qtype = T[types.get(gguf_of.get(module_name.split(".")[-1], ""), "F32")]
            if qtype != T.F32:
                values = gguf.quants.dequantize(gguf.quants.quantize(module.weight.numpy(), qtype), qtype)
                q8 = dequantize(gguf.quants.quantize(np.ascontiguousarray(values), T.Q8_0), T.Q8_0)
                module.weight.copy_(q8)
    hf.save_pretrained(out, safe_serialization=True)
    return out


def test_other_types_and_mixed_fused_layers_are_served_in_int8_and_logged_once(tmp_path, caplog):
    """Q4_K_M-style mixes: a fused layer's parts in different types (q/k Q4_1, v Q5_1) all in int8, a
    type without a layout of its own (Q5_0) in int8; one log line names the types requantized. Against
    transformers on gguf-py's values, the logits move no more than (twice) what gguf-py's own requantization
    of those values to Q8_0 moves them."""
    types = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q5_1", "attn_output": "Q5_0", "ffn_gate": "Q8_0"}
    types |= {"ffn_up": "Q8_0", "ffn_down": "Q5_0"}
    model_dir = build_tiny_model(tmp_path / "model")
    served = write_gguf(model_dir, tmp_path / "gguf", types)
    with caplog.at_level(logging.WARNING, logger="motet.engine.weights.gguf_weights"):
        eng = engine(served, quantization="gguf", compile_step=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "motet.engine.weights.gguf_weights"]
    assert len(lines) == 1 and lines[0].startswith("model.gguf: Q4_1, Q5_0, Q5_1 tensors requantized to int8")
    assert [lin.quantized.format.name for lin in eng.runner.model.decoder_linears()] == ["int8"] * 8
    exact = AutoModelForCausalLM.from_pretrained(gguf_reference(model_dir, tmp_path / "ref", types)).eval()
    requantized = gguf_py_requantized_reference(model_dir, tmp_path / "ref-q8", types)
    requantized = AutoModelForCausalLM.from_pretrained(requantized).eval()
    exact, requantized = (
        quantizing_inputs(m, lm_head=False) for m in (exact, requantized)
    )  # as the CPU rounds
    ours, theirs = 0.0, 0.0
    for prompt, got in zip(PROMPTS, engine_logits(eng, PROMPTS), strict=True):
        with torch.no_grad():
            want, llama_cpp = (
                exact(torch.tensor([prompt])).logits[0],
                requantized(torch.tensor([prompt])).logits[0],
            )
        ours, theirs = (
            max(ours, (got - want).abs().max().item()),
            max(theirs, (llama_cpp - want).abs().max().item()),
        )
    assert 0 < ours <= 2 * theirs, (ours, theirs)


def test_a_type_gguf_py_cannot_dequantize_is_refused(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")

    def with_q8_1(w, qtype):
        return random_blocks(qtype, *w.shape) if qtype == T.Q8_1 else gguf.quants.quantize(w, qtype)

    served = write_gguf(model_dir, tmp_path / "q8_1", {"attn_q": "Q4_1", "ffn_down": "Q8_1"}, with_q8_1)
    with pytest.raises(
        ModelLoadError,
        match=r"model\.gguf: tensor 'blk\.0\.ffn_down\.weight' is Q8_1, which gguf-py cannot dequantize; "
        r"motet serves GGUF tensors in Q8_0, Q4_1, Q4_0, Q4_K blocks as they are",
    ):
        engine(served, quantization="gguf")


def write_tables_gguf(path: Path, tied: bool) -> dict[str, np.ndarray]:
    """A GGUF file of an embedding table (Q4_0) and, untied, an lm_head (Q6_K, known bytes); blocks by name."""
    rng = np.random.default_rng(5)
    tensors = {
        "token_embd.weight": (quantize(rng.standard_normal((8, 256)).astype(np.float32), T.Q4_0), T.Q4_0)
    }
    if not tied:
        tensors["output.weight"] = (random_blocks(T.Q6_K, 8, 256), T.Q6_K)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_head_count(4)
    for name, (blocks, qtype) in tensors.items():
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {n: b for n, (b, _) in tensors.items()}


def test_the_lm_head_and_a_tied_table_come_in_blocks(tmp_path):
    """output.weight in its blocks (Q6_K requantized to int8), the embedding table looked up in the file's own
    blocks (rows as gguf-py dequantizes them); a table without output.weight (tied: it is the lm_head too) looked
    up the same way, and the lm_head in blocks of it (Q4_0 as int4, exactly)."""
    ids = torch.tensor([[7, 0], [3, 3]])
    blocks = write_tables_gguf(tmp_path / "untied.gguf", tied=False)
    untied = dict(iter_gguf_weights(tmp_path / "untied.gguf"))
    table = dequantize(blocks["token_embd.weight"], T.Q4_0)
    assert torch.equal(untied["model.embed_tokens.weight"](ids), table[ids])
    head, want = untied["lm_head.weight"], dequantize(blocks["output.weight"], T.Q6_K)
    half_step = head.scales.float().repeat_interleave(BLOCK, dim=1) / 2
    assert head.format == INT8 and ((head.dequantize() - want).abs() <= half_step + 127 * 2**-25).all()
    write_tables_gguf(tmp_path / "tied.gguf", tied=True)
    tied = dict(iter_gguf_weights(tmp_path / "tied.gguf"))
    assert sorted(tied) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert torch.equal(tied["model.embed_tokens.weight"](ids), table[ids])
    assert tied["lm_head.weight"].format == INT4 and torch.equal(tied["lm_head.weight"].dequantize(), table)


# -- GPTQ and AWQ checkpoints ---------------------------------------------------------------------------------

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's packing order (awq/utils/packing_utils.py)


def round_to_nearest_4bit(w_t: np.ndarray, group_size: int, sym: bool) -> tuple[np.ndarray, ...]:
    """q [K, N], zeros and scales [K / g, N] of `w_t` [K, N] (a weight transposed, as GPTQ and AWQ hold it):
    plain round-to-nearest per group (GPTQ's and AWQ's searches only choose other values). Scales have 6
    significant bits, so scale * zero (zero < 32) is an exact fp16: the int4 blocks then hold exactly the
    values the reference reads."""
    K, N = w_t.shape
    g = K if group_size == -1 else group_size
    x = w_t.reshape(K // g, g, N).astype(np.float64)
    if sym:
        scales = np.abs(x).max(1) * 2 / 15
        zeros = np.full(scales.shape, 8)
    else:
        lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
        scales = (hi - lo) / 15
        zeros = np.clip(np.round(-lo / scales), 0, 15).astype(np.int64)
    scales = _significant_bits(scales, 6).astype(np.float16)
    q = np.clip(np.round(x / scales.astype(np.float64)[:, None]) + zeros[:, None], 0, 15).astype(np.int64)
    return np.ascontiguousarray(q.reshape(K, N)), np.ascontiguousarray(zeros), np.ascontiguousarray(scales)


def pack_gptq(q: np.ndarray, zeros: np.ndarray, v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's QuantLinear.pack (qlinear_cuda_old, 4 bits): qweight row i holds inputs 8i..8i+7 (input
    8i + j at bits 4j), qzeros column c outputs 8c..8c+7; v1 stores each zero minus one."""
    K, N = q.shape
    qweight = np.zeros((K // 8, N), dtype=np.uint32)
    for j in range(8):
        qweight |= q[j::8].astype(np.uint32) << (4 * j)
    stored = (zeros - 1) & 0xF if v1 else zeros
    qzeros = np.zeros((zeros.shape[0], N // 8), dtype=np.uint32)
    for j in range(8):
        qzeros |= stored[:, j::8].astype(np.uint32) << (4 * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def pack_awq(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoAWQ's WQLinear_GEMM packing: word c of a row holds outputs 8c..8c+7, output 8c + AWQ_ORDER[i] at
    bits 4i; zeros the same way, as they are."""

    def pack(values):
        out = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
        return out.view(np.int32)

    return pack(q), pack(zeros)


def read_gptq(qweight, qzeros, scales, g_idx, v1: bool) -> np.ndarray:
    """The documented formula, read straight from the packed words: W[k, n] = s[g, n] * (q[k, n] - z[g, n]),
    g = g_idx[k]; returned as a weight [N, K] (float32)."""
    qw, qz = qweight.view(np.uint32), qzeros.view(np.uint32)
    K, N = qw.shape[0] * 8, qw.shape[1]
    q = np.stack([(qw >> (4 * j)) & 0xF for j in range(8)], axis=1).reshape(K, N).astype(np.float64)
    z = np.stack([(qz >> (4 * j)) & 0xF for j in range(8)], axis=2).reshape(-1, N).astype(np.float64) + v1
    s = scales.astype(np.float64)
    return (s[g_idx] * (q - z[g_idx])).T.astype(np.float32)


def read_awq(qweight, qzeros, scales, group_size: int) -> np.ndarray:
    def unpack(words):
        out = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.float64)
        for col in range(words.shape[1]):
            for i in range(8):
                out[:, col * 8 + AWQ_ORDER[i]] = (words[:, col].view(np.uint32) >> (4 * i)) & 0xF
        return out

    q, z = unpack(qweight), unpack(qzeros)
    K = q.shape[0]
    group = np.arange(K) // (K if group_size == -1 else group_size)
    return (scales.astype(np.float64)[group] * (q - z[group])).T.astype(np.float32)


def quantized_checkpoint(
    model_dir: Path, out: Path, quant_config: dict, reference: Path | None = None
) -> Path:
    """`model_dir` as a GPTQ / AWQ checkpoint (config.json's quantization_config, each projection packed);
    `reference`: the float checkpoint whose projections are the packed tensors' values, read by the helpers
    above."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    method, g = quant_config["quant_method"], quant_config["group_size"]
    v1 = quant_config.get("checkpoint_format", "gptq") == "gptq"
    tensors = {}
    for name, t in hf.state_dict().items():
        module = name.split(".")[-2]
        if module not in PROJECTIONS or not name.endswith(".weight"):
            tensors[name] = t.contiguous()
            continue
        prefix = name.removesuffix(".weight")
        q, zeros, scales = round_to_nearest_4bit(t.t().numpy(), g, quant_config.get("sym", False))
        if method == "gptq":
            qweight, qzeros = pack_gptq(q, zeros, v1)
            g_idx = np.arange(q.shape[0], dtype=np.int32) // (q.shape[0] if g == -1 else g)
            tensors[f"{prefix}.g_idx"] = torch.from_numpy(g_idx)
            values = read_gptq(qweight, qzeros, scales, g_idx, v1)
        else:
            qweight, qzeros = pack_awq(q, zeros)
            values = read_awq(qweight, qzeros, scales, g)
        tensors |= {
            f"{prefix}.qweight": torch.from_numpy(qweight),
            f"{prefix}.qzeros": torch.from_numpy(qzeros),
        }
        tensors[f"{prefix}.scales"] = torch.from_numpy(scales)
        with torch.no_grad():
            t.copy_(torch.from_numpy(values))  # hf's own parameter: the reference checkpoint's value
    if reference is not None:
        hf.save_pretrained(reference, safe_serialization=True)
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quant_config}))
    if config.get("tie_word_embeddings"):  # one tensor: the embedding table
        tensors.pop("lm_head.weight")
    save_file(tensors, str(out / "model.safetensors"))
    return out


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
CHECKPOINTS = {
    "gptq-v1-g32-llama": ("llama", True, GPTQ),
    "gptq-v2-g64-sym-qwen2": ("qwen2", False, GPTQ | {"group_size": 64, "sym": True, "checkpoint_format": "gptq_v2"}),
    "gptq-v1-per-row-desc-act-trivial": ("llama", False, GPTQ | {"group_size": -1, "desc_act": True}),
    "awq-g32-qwen2": ("qwen2", False, AWQ),
    "awq-g64-llama": ("llama", True, AWQ | {"group_size": 64}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CHECKPOINTS))
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_native)], ids=["eager", "native"])
def test_gptq_and_awq_checkpoints_served_match_hf_on_their_values(tmp_path, case, compiled):
    arch, tied, quant_config = CHECKPOINTS[case]
    model_dir = build_tiny_model(tmp_path / "model", arch=arch, tied=tied)
    served = quantized_checkpoint(model_dir, tmp_path / "q", quant_config, reference=tmp_path / "ref")
    assert_served_like_hf(served, tmp_path / "ref", compiled)
    if not compiled:  # --quantization naming the checkpoint's own method changes nothing
        eng = engine(served, quantization=quant_config["quant_method"], compile_step=False)
        assert {lin.quantized.format.name for lin in eng.runner.model.decoder_linears()} == {"int4"}
        assert eng.runner.model.lm_head.quantized is None


def test_gptq_mins_rounded_to_fp16_stay_within_their_bound():
    """With scales of any fp16 value, min = -scale * zero rounds to fp16: within 2^-11 of it."""
    rng = np.random.default_rng(6)
    K, N, g = 256, 64, 64
    q = rng.integers(0, 16, size=(K, N))
    zeros = rng.integers(0, 16, size=(K // g, N))
    scales = rng.uniform(1e-3, 0.1, size=(K // g, N)).astype(np.float16)
    qweight, qzeros = pack_gptq(q, zeros, v1=False)
    g_idx = np.arange(K) // g
    want = torch.from_numpy(read_gptq(qweight, qzeros, scales, g_idx, v1=False)).double()
    got = from_gptq(
        torch.from_numpy(qweight), torch.from_numpy(qzeros), torch.from_numpy(scales), None, g, False
    ).dequantize()
    bound = 2**-11 * torch.from_numpy(scales.astype(np.float64) * zeros)[g_idx].t()
    assert ((got.double() - want).abs() <= bound + 1e-9).all() and (got.double() != want).any()


def test_bad_gptq_and_awq_checkpoints_are_refused(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")
    gptq = quantized_checkpoint(model_dir, tmp_path / "gptq", GPTQ)
    cases = 0

    def refused(config_changes: dict, match: str, tensors=None, **options):
        nonlocal cases
        cases += 1
        d = tmp_path / f"case{cases}"
        shutil.copytree(gptq, d)
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"] |= config_changes
        (d / "config.json").write_text(json.dumps(config))
        if tensors is not None:
            from safetensors.torch import load_file

            save_file(tensors(load_file(str(d / "model.safetensors"))), str(d / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=match):
            engine(d, **options)

    refused({"bits": 8}, r"gptq with bits 8 is not supported; motet serves 4-bit GPTQ .* and AWQ")
    refused(
        {"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported; motet serves 4-bit"
    )
    refused({"checkpoint_format": "marlin"}, r"GPTQ checkpoint_format 'marlin' is not supported")
    refused({"quant_method": "awq", "version": "gemv"}, r"AWQ version 'gemv' is not supported")
    refused({"group_size": 16}, r"group_size 16 is not supported: .* a group must be a multiple of 32")

    def transposed(t):  # one projection's qweight stored [out, in / 8] instead of [in / 8, out]
        name = "model.layers.0.self_attn.o_proj.qweight"
        return t | {name: t[name].t().contiguous()}

    refused(
        {},
        r"o_proj: qweight int32 \[64, 8\], qzeros int32 \[2, 8\], scales float16 \[2, 64\], g_idx int32 \[64\] "
        r"do not make a GPTQ weight: expected qweight int32 \[in / 8, out\]",
        transposed,
    )

    def shuffled_groups(t):  # act order: g_idx with inputs of one block in different groups
        name = "model.layers.1.mlp.down_proj.g_idx"
        return t | {
            name: t[name][torch.randperm(t[name].numel(), generator=torch.Generator().manual_seed(0))]
        }

    act_order = (
        r"down_proj: g_idx puts inputs of one block of 32 in different groups \(an act-order, desc_act=true"
    )
    refused({"desc_act": True}, act_order, shuffled_groups)

    def no_zeros(t):
        return {n: v for n, v in t.items() if n != "model.layers.0.mlp.up_proj.qzeros"}

    refused({}, r"missing model\.layers\.0\.mlp\.up_proj\.qzeros", no_zeros)
    refused({}, r"--quantization int4: .* is a GPTQ checkpoint .*; drop --quantization", quantization="int4")
    refused({}, r"--quantization awq: .* is a GPTQ checkpoint", quantization="awq")
    with pytest.raises(ModelLoadError, match=r"--quantization gptq: .* is not a GPTQ checkpoint"):
        engine(model_dir, quantization="gptq")


def test_cli_takes_a_checkpoints_own_method():
    from motet.api.cli import build_parser, engine_config

    for method in ("gptq", "awq"):
        args = build_parser().parse_args(["generate", "--quantization", method, "--prompt", "hi"])
        assert engine_config(args).quantization == method
