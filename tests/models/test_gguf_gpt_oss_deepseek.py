"""GPT-OSS and DeepSeek GGUF files, written with gguf-py the way llama.cpp's converter writes them (its
GptOssModel and DeepseekV2Model classes), from the tiny random checkpoints of test_gpt_oss.py and test_deepseek.py:

- GPT-OSS ("gpt-oss"): the sinks as attn_sinks.weight, the router ffn_gate_inp with its bias, each expert's
  interleaved gate / up columns split into ffn_gate_exps / ffn_up_exps [E, I, H] (their biases into [E, I] each),
  down as ffn_down_exps [E, H, I]; MXFP4 experts repacked into GGML's blocks (the E8M0 byte, then codes j and
  j + 16 a byte), the window of the even layers, YaRN.
- DeepSeek ("deepseek2"; V3 by its sigmoid gating): the latent widths (key_length_mla, value_length_mla), the
  leading dense layers, the shared experts, the correction bias exp_probs_b, YaRN's log multiplier (0.1 x
  mscale_all_dim), kv_b_proj split into attn_k_b [H, rank, nope] (transposed) and attn_v_b [H, v, rank] (older
  files: attn_kv_b whole).

Served bare (`LLM(file.gguf)`) against transformers on the source checkpoint: float files within 2e-4 and greedy
tokens equal, MXFP4 experts but for rounding flips (the inputs of the quantized products rounded alike), a Q8_0
DeepSeek file against transformers on gguf-py's dequantization of the same blocks; and converted back
(`convert_gguf`) to the source's tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.gguf_convert import convert_gguf
from motet.engine.worker.latent_attention import LatentAttention
from motet.kernels.quant import INT8, MXFP4
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs
from tests.engine.test_gguf_model_file import OPTIONS, add_base_keys, add_gpt2_vocab
from tests.kernels.test_quantization import (
    assert_close_but_for_rounding_flips,
    needs_native,
    quantizing_inputs,
)
from tests.models.test_deepseek import LATENT, randomize_biases
from tests.models.test_deepseek import MODELS as DEEPSEEK_MODELS
from tests.models.test_gguf_moe import DISTINCT_PROMPTS, assert_converted_back, hf_prompt_logits
from tests.models.test_gpt_oss import build_gpt_oss, mxfp4_reference, save_mxfp4
from tests.models.test_moe import randomize_norms
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
PATHS = [pytest.param(False, id="eager"), pytest.param(True, id="native", marks=needs_native)]


def assert_float_file_is_the_source(llm: LLM, source) -> None:
    """A float file served bare: logits within 2e-4 of transformers on the source checkpoint in 7-token chunks, 16
    greedy tokens equal to its `generate`."""
    refs = hf_prompt_logits(source)
    for got, want in zip(engine_logits(llm.engine, PROMPTS, chunk=7), refs, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    prompts = [PROMPTS[1], PROMPTS[4]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, min_tokens=16))
    assert [o.token_ids for o in outs] == hf_greedy_outputs(source, prompts, 16)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MOTET_CACHE_DIR", str(root))
    return root


def _add(writer, name: str, w: torch.Tensor, qtype: str) -> None:
    """A tensor in `qtype` where it is a weight (`.weight`) of whole blocks (the converter's F16 fallback: F32
    here, as are norms, biases, routers and the embedding table), else F32."""
    blocks = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    quantized = (
        qtype != "F32"
        and name.endswith(".weight")
        and w.dim() >= 2
        and w.shape[-1] % blocks == 0
        and not name.split(".")[-2].startswith(("ffn_gate_inp", "token_embd"))
    )
    data = w.float().contiguous().numpy()
    if quantized:
        t = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)
    else:
        writer.add_tensor(name, data)


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _yarn(writer, rope: dict) -> None:
    """TextModel.set_gguf_parameters' YaRN keys."""
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


# -- GPT-OSS ---------------------------------------------------------------------------------------------------
def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A checkpoint's MXFP4 pair (blocks [E, R, G, 16], codes 2j / 2j + 1 a byte; scales [E, R, G]) as the
    converter's repack_mxfp4 writes it: [E, R, G * 17] bytes, each block its scale byte, then codes j / j + 16."""
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)  # [E, R, G, 32] in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    raw = torch.cat((scales.unsqueeze(-1), packed), dim=-1)
    return raw.reshape(*raw.shape[:2], -1).numpy()


def write_gpt_oss_gguf(model_dir: Path, out: Path, mxfp4_dir: Path | None = None, qtype: str = "F32") -> Path:
    """GptOssModel's file: the base keys, YaRN, the window, the experts' width; tensors by gguf-py's name map,
    the experts split (from `mxfp4_dir`'s blocks where given, repacked)."""
    cfg = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).config
    writer = gguf.GGUFWriter(str(out), arch="gpt-oss")
    add_base_keys(writer, cfg)
    _yarn(writer, cfg.rope_parameters)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_gpt2_vocab(writer, model_dir, cfg.vocab_size, "gpt-2")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg.num_hidden_layers)
    blocks = load_file(mxfp4_dir / "model.safetensors") if mxfp4_dir else {}
    for name, w in load_file(model_dir / "model.safetensors").items():
        if name.endswith("sinks"):
            name += ".weight"
        if ".experts." not in name:
            _add(writer, names.get_name(name, try_suffixes=(".weight", ".bias")), w, qtype)
            continue
        layer = name.split(".")[2]
        if name.endswith("_bias"):  # [E, 2I] gate / up columns alternating, or down's [E, H]
            parts = {"gate": w[..., 0::2], "up": w[..., 1::2]} if "gate_up" in name else {"down": w}
            for part, b in parts.items():
                writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.bias", b.contiguous().numpy())
            continue
        if f"{name}_blocks" in blocks:  # [E, R, G, 16]: gate rows 0, 2, ..., up rows 1, 3, ...
            b, s = blocks[f"{name}_blocks"], blocks[f"{name}_scales"]
            parts = (
                {"gate": (b[:, 0::2], s[:, 0::2]), "up": (b[:, 1::2], s[:, 1::2])}
                if "gate_up" in name
                else {}
            )
            for part, (pb, ps) in (parts or {"down": (b, s)}).items():
                raw = ggml_mxfp4(pb.contiguous(), ps.contiguous())
                writer.add_tensor(
                    f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4
                )
            continue
        t = w.transpose(1, 2)  # [E, 2I, H] or [E, H, I]
        parts = {"gate": t[:, 0::2], "up": t[:, 1::2]} if "gate_up" in name else {"down": t}
        for part, pw in parts.items():
            _add(writer, f"blk.{layer}.ffn_{part}_exps.weight", pw.contiguous(), qtype)
    _finish(writer)
    return out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, Path]:
    """The float checkpoint (2 blocks a row) and its MXFP4 one (test_gpt_oss.py's)."""
    source = build_gpt_oss(tmp_path_factory.mktemp("gpt_oss"), intermediate_size=64)
    return source, save_mxfp4(source, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "m")


@pytest.mark.parametrize("compiled", PATHS)
def test_gpt_oss_float_file_matches_transformers(gpt_oss, tmp_path, compiled):
    """Sinks, biases, the router's bias, the experts' split gate / up and their biases, the window of the even
    layers (served past it) and YaRN from the file: logits within 2e-4, greedy tokens equal."""
    source, _ = gpt_oss
    llm = LLM(str(write_gpt_oss_gguf(source, tmp_path / "g.gguf")), compile_step=compiled, **OPTIONS)
    cfg = llm.engine.runner.model.config
    assert cfg.attention_sinks and cfg.expert_bias and cfg.sliding_layers == (0,) and cfg.sliding_window == 12
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert_float_file_is_the_source(llm, source)


def held_in_blocks(name: str, w: torch.Tensor, qtype: str) -> bool:
    """Whether a source tensor (by its Hugging Face name) is written in `qtype` (`_add`: weights of whole blocks
    but the routers and the embedding table, never a bias; kv_b_proj's parts are nope and rank wide here, not whole
    blocks)."""
    if qtype == "F32" or name.endswith("kv_b_proj.weight") or not name.endswith(".weight"):
        return False
    blocks = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    router = name.endswith(("mlp.gate.weight", "mlp.router.weight", "embed_tokens.weight"))
    return w.dtype == torch.float32 and w.dim() >= 2 and w.shape[-1] % blocks == 0 and not router


def rounded_checkpoint(model_dir: Path, out: Path, qtype: str) -> Path:
    """The checkpoint with every tensor the file holds in `qtype` as gguf-py's values of it (an MXFP4
    checkpoint's blocks as they are)."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out)
    weights = load_file(model_dir / "model.safetensors")
    t = gguf.GGMLQuantizationType[qtype]
    for name, w in weights.items():
        if held_in_blocks(name, w, qtype):
            values = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), t), t)
            w.copy_(torch.from_numpy(np.array(values, dtype=np.float32)).reshape(w.shape))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "rest, compiled",
    [
        ("F32", False),
        pytest.param("F32", True, marks=needs_native),
        ("BF16", False),
        ("Q8_0", False),
        pytest.param("Q8_0", True, marks=needs_native),
    ],
)
def test_gpt_oss_mxfp4_experts_stay_in_their_blocks(gpt_oss, tmp_path, rest, compiled):
    """The MXFP4 experts served in their blocks, never dequantized, the other weights in F32, BF16 or Q8_0 (the
    attention's projections and the lm_head in their blocks): transformers on the MXFP4 checkpoint with those
    weights as gguf-py's values (the inputs of every quantized product rounded as the CPU's product rounds
    them), but for rounding flips."""
    source, mxfp4_dir = gpt_oss
    path = write_gpt_oss_gguf(source, tmp_path / "m.gguf", mxfp4_dir, rest)
    llm = LLM(str(path), compile_step=compiled, **OPTIONS)
    if not compiled:
        model = llm.engine.runner.model
        experts = model.layers[0].mlp.experts
        assert {k: q.weight.format for k, q in experts.quantized.items()} == {
            "gate_up_proj": MXFP4,
            "down_proj": MXFP4,
        }
        assert experts.gate_up_proj.numel() == 0
        held = {
            lin.quantized.format if lin.quantized is not None else None for lin in model.decoder_linears()
        }
        assert held == ({INT8} if rest == "Q8_0" else {None})
    hf = mxfp4_reference(rounded_checkpoint(mxfp4_dir, tmp_path / "ref", rest))
    if rest == "Q8_0":
        hf = quantizing_inputs(hf, lm_head=True, projections=("q_proj", "k_proj", "v_proj", "o_proj"))
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0] for p in DISTINCT_PROMPTS]
    assert_close_but_for_rounding_flips(engine_logits(llm.engine, DISTINCT_PROMPTS, chunk=7), want)


def test_gpt_oss_converts_back_to_the_source_checkpoint(gpt_oss, tmp_path):
    """The experts restacked as GPT-OSS's checkpoints hold them (gate_up [E, H, 2I] interleaved, its bias
    interleaved, down [E, I, H]), the sinks without their suffix: every tensor equal to the source's."""
    source, _ = gpt_oss
    out = convert_gguf(write_gpt_oss_gguf(source, tmp_path / "g.gguf"), tmp_path / "out")
    assert_converted_back(out, source)


# -- DeepSeek --------------------------------------------------------------------------------------------------
# YaRN with mscale equal to mscale_all_dim: what a GGUF file can say (the converter writes mscale_all_dim alone;
# llama.cpp's rotary scales cos / sin by 1, which transformers does where the two are equal, as in DeepSeek's
# own checkpoints)
YARN = dict(DEEPSEEK_MODELS["v2"][1]["rope_parameters"], mscale=0.8, mscale_all_dim=0.8)
# the Hub's configs say scoring_func (transformers' tiny config does not): the converter's gating key from it
SCORING = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}
GGUF_MODELS = (
    "v2_lite",
    "v2",
    "v3",
)  # (v3_halves: a rotary on halves, which llama.cpp's deepseek2 never reads)


def build_deepseek_gguf_source(path: Path, name: str) -> Path:
    arch, overrides = DEEPSEEK_MODELS[name]
    if "rope_parameters" in overrides:
        overrides = {**overrides, "rope_parameters": YARN}
    model_dir = build_tiny_model(path, arch=arch, tied=False, **overrides)
    randomize_norms(model_dir)
    randomize_biases(model_dir)
    return model_dir


def write_deepseek_gguf(
    model_dir: Path, out: Path, qtype: str = "F32", split_kv_b: bool = True, gating: bool = True
) -> Path:
    """DeepseekV2Model's file: MLA as MQA (head_count_kv 1, key_length kv_lora_rank + rope, the MLA widths apart),
    the leading dense layers, experts' keys, YaRN's log multiplier; tensors by gguf-py's name map, experts stacked,
    kv_b_proj split into attn_k_b / attn_v_b (or, not `split_kv_b`, as older converters wrote it: attn_kv_b whole,
    every head a KV head, key_length / value_length the heads' widths). Not `gating`: no expert_gating_func, as the
    converter writes a config.json without scoring_func (transformers 5 saves none)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = hf.config
    raw = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch="deepseek2")
    kv_heads = 1 if split_kv_b else cfg.num_attention_heads  # MLA as MQA (older files: every head)
    add_base_keys(writer, SimpleNamespace(**{**cfg.to_dict(), "num_key_value_heads": kv_heads}))
    rope = cfg.rope_parameters
    _yarn(writer, rope)
    if raw.get("n_group") is not None:
        writer.add_expert_group_count(raw["n_group"])
    if raw.get("topk_group") is not None:
        writer.add_expert_group_used_count(raw["topk_group"])
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if gating:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType[SCORING[cfg.model_type].upper()])
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    if split_kv_b:
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
    else:  # (the older converter's widths: each head's key and value)
        writer.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_shared_count(cfg.n_shared_experts or 0)
    if raw.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(raw["routed_scaling_factor"])
    if raw.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_gpt2_vocab(writer, model_dir, cfg.vocab_size, "gpt-2")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name, w in load_file(model_dir / "model.safetensors").items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault((parts[2], parts[i + 2]), {})[int(parts[i + 1])] = w
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = w.view(heads, nope + v, w.shape[-1])
            k_b, v_b = kv_b[:, :nope].transpose(1, 2), kv_b[:, nope:]
            _add(writer, f"blk.{parts[2]}.attn_k_b.weight", k_b.contiguous(), qtype)
            _add(writer, f"blk.{parts[2]}.attn_v_b.weight", v_b.contiguous(), qtype)
            continue
        _add(writer, names.get_name(name, try_suffixes=(".weight", ".bias")), w, qtype)
    for (layer, projection), ws in experts.items():
        stacked = torch.stack([ws[e] for e in range(len(ws))])
        _add(writer, f"blk.{layer}.ffn_{projection.removesuffix('_proj')}_exps.weight", stacked, qtype)
    _finish(writer)
    return out


@pytest.fixture(scope="module", params=GGUF_MODELS)
def deepseek(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_deepseek_gguf_source(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_deepseek_float_file_matches_transformers(deepseek, tmp_path, split_kv_b):
    """V2-Lite (q straight from the hidden state, greedy softmax), V2 (q through its low rank, biases,
    group-limited, scaled, YaRN) and V3 (sigmoid with the correction bias, renormalized, YaRN) from their files,
    kv_b_proj split as current converters write it and whole as older ones did: logits within 2e-4, greedy
    tokens equal."""
    name, source = deepseek
    llm = LLM(str(write_deepseek_gguf(source, tmp_path / f"{name}.gguf", split_kv_b=split_kv_b)), **OPTIONS)
    model = llm.engine.runner.model
    want_arch = AutoModelForCausalLM.from_pretrained(source).config.architectures[0]
    assert model.config.architecture == want_arch
    assert all(isinstance(layer.self_attn, LatentAttention) for layer in model.layers)
    assert model.config.sparse_layers == (1, 2)
    assert_float_file_is_the_source(llm, source)


@pytest.mark.parametrize("compiled", PATHS)
def test_deepseek_q8_0_file_matches_transformers_on_gguf_py_dequantized(deepseek, tmp_path, compiled):
    """The experts, the shared experts, the dense layer's MLP, q_proj (V2-Lite) and the lm_head served in their
    Q8_0 blocks (their inputs rounded alike in the reference); the latent projections held in blocks (q_a_proj,
    kv_a_proj_with_mqa) dequantized as they load: transformers on gguf-py's dequantization, but for rounding
    flips, on both CPU paths."""
    name, source = deepseek
    path = write_deepseek_gguf(source, tmp_path / f"{name}.gguf", "Q8_0")
    eng = LLM(str(path), compile_step=compiled, **OPTIONS).engine
    model = eng.runner.model
    if not compiled:  # (the native step packs the blocks into its arena and releases the module's copies)
        experts = [layer.mlp.experts for layer in model.layers[1:]]
        assert all(q.weight.format is INT8 for e in experts for q in e.quantized.values())
        assert model.layers[0].mlp.gate_up_proj.quantized.format is INT8
        assert model.layers[0].self_attn.kv_a_proj_with_mqa.quantized is None
    ref = rounded_checkpoint(source, tmp_path / "ref", "Q8_0")
    want = hf_prompt_logits(ref, ("q_proj", "gate_proj", "up_proj", "down_proj"), DISTINCT_PROMPTS)
    assert_close_but_for_rounding_flips(engine_logits(eng, DISTINCT_PROMPTS, chunk=7), want)


def test_v3_file_without_a_gating_key_is_read_by_its_correction_bias(tmp_path):
    """llama.cpp's converter writes expert_gating_func from config.json's scoring_func, which transformers 5 does
    not save: a V3 checkpoint saved by it converts to a file holding V3's correction bias (exp_probs_b) and no
    gating key. It is V3's (llama.cpp reads its scores as softmax, its default for older V2 files, which hold no
    such bias; no transformers router is softmax with that bias): logits within 2e-4 of transformers."""
    source = build_deepseek_gguf_source(tmp_path / "src", "v3")
    llm = LLM(str(write_deepseek_gguf(source, tmp_path / "v3.gguf", gating=False)), **OPTIONS)
    assert llm.engine.runner.model.config.architecture == "DeepseekV3ForCausalLM"
    assert_float_file_is_the_source(llm, source)


def test_deepseek_converts_back_to_the_source_checkpoint(deepseek, tmp_path):
    """kv_b_proj joined back from attn_k_b / attn_v_b, the experts one tensor each, the shared experts and the
    correction bias under DeepSeek's names: every tensor equal to the source's, transformers' logits on them."""
    name, source = deepseek
    out = convert_gguf(write_deepseek_gguf(source, tmp_path / f"{name}.gguf"), tmp_path / "out")
    assert_converted_back(out, source)


assert LATENT["first_k_dense_replace"] == 1  # (the sparse layers the tests name)


def test_deepseek_metadata_reads_as_llama_cpp_reads_it(tmp_path):
    """V3 by its sigmoid gating, V2's softmax where a file says none (older V2 files); YaRN's mscale_all_dim
    from the log multiplier, and without one cos / sin and the softmax unscaled (llama.cpp's reading); a
    tensor's half without the other refused by name."""
    from motet.engine.weights import gguf_names
    from motet.engine.weights.gguf_config import hf_config, metadata_of
    from motet.models.declaration import ModelLoadError
    from motet.models.deepseek import DEEPSEEK_V2

    source = build_deepseek_gguf_source(tmp_path / "src", "v3")
    reader = gguf.GGUFReader(str(write_deepseek_gguf(source, tmp_path / "v3.gguf")))
    meta, names = metadata_of(reader), {t.name for t in reader.tensors}
    config = hf_config(meta, names, "v3.gguf")
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["norm_topk_prob"]
    assert config["rope_scaling"]["mscale_all_dim"] == pytest.approx(0.8)
    assert (config["kv_lora_rank"], config["qk_nope_head_dim"], config["v_head_dim"]) == (16, 16, 12)
    older = {k: v for k, v in meta.items() if not k.endswith(("gating_func", "yarn_log_multiplier"))}
    v2_names = {n for n in names if not n.endswith("exp_probs_b.bias")}  # (V2 has no correction bias)
    config = hf_config(older, v2_names, "old.gguf")
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["scoring_func"] == "softmax"
    # no gating said, V3's correction bias held (a V3 checkpoint transformers 5 saved, converted): V3
    assert hf_config(older, names, "v3.gguf")["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (
        config["rope_scaling"]["attention_factor"] == 1.0 and "mscale_all_dim" not in config["rope_scaling"]
    )
    half = {"blk.0.attn_k_b.weight": torch.zeros(4, 16, 16)}
    with pytest.raises(ModelLoadError, match=r"blk.0.attn_k_b.weight are only part of .*kv_b_proj"):
        gguf_names.join("model.layers.0.self_attn.kv_b_proj.weight", half, DEEPSEEK_V2)
