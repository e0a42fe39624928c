"""Mixture-of-experts GGUF files (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE), written with gguf-py the way
llama.cpp's convert_hf_to_gguf.py writes them (Mixtral as a "llama" file with q/k rows permuted, each layer's
experts stacked into ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, rows, cols] beside its router ffn_gate_inp;
older Mixtral files one tensor an expert, ffn_gate.E; Qwen2-MoE's shared expert ffn_*_shexp and its gate
ffn_gate_inp_shexp), from tiny random transformers checkpoints:
served bare (`LLM(file.gguf)`) with transformers' logits on the same weights: float files (F32, F16, BF16) within
2e-4, Q8_0 and Q4_1 files against gguf-py's dequantization of the same blocks; and converted back (`convert_gguf`)
to the source's tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from motet.engine.llm import LLM
from motet.engine.weights.gguf_config import hf_config, metadata_of
from motet.engine.weights.gguf_convert import convert_gguf
from motet.engine.worker.model import Experts
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.engine.test_gguf_model_file import OPTIONS, add_base_keys, add_gpt2_vocab
from tests.kernels.test_quantization import (
    assert_close_but_for_rounding_flips,
    needs_native,
    quantizing_inputs,
)
from tests.models.test_gguf_families import permute
from tests.models.test_moe import randomize_norms
from tests.models.test_moe_quantized import rounding_experts
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# name -> (tiny_models arch, GGUF architecture, checkpoint overrides); widths in whole blocks of 32 (Q8_0, Q4_1)
MODELS = {
    "mixtral": ("mixtral", "llama", dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)),
    # a shared expert behind its sigmoid gate, top-2 of 4 not renormalized (every layer sparse: llama.cpp's
    # qwen2moe has no dense layers)
    "qwen2_moe": (
        "qwen2_moe",
        "qwen2moe",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        ),
    ),
    # per-head q/k norms, head_dim apart from hidden / heads, top-2 of 4 renormalized (llama.cpp's qwen3moe)
    "qwen3_moe": (
        "qwen3_moe",
        "qwen3moe",
        dict(
            num_hidden_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
            head_dim=32,
        ),
    ),
}
Q8_0 = "Q8_0"
Q4_1 = "Q4_1"


def _stacked_name(arch: str, part: str) -> str:
    """The Hugging Face name convert_hf_to_gguf maps a layer's stacked experts from (experts.{xid} merged away)."""
    return {"gate": "w1", "up": "w3", "down": "w2"}[part] if arch == "mixtral" else f"{part}_proj"


def gguf_tensors(
    arch: str, gguf_arch: str, model_dir: Path, cfg, per_expert: bool = False
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (one tensor an expert, as transformers saves them) as llama.cpp's converter writes
    them: its tensor name map, q/k rows permuted in a "llama" file, each layer's experts stacked [E, rows, cols]
    (or, `per_expert`, one tensor each: blk.N.ffn_gate.E, as older Mixtral files hold them)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], cfg.num_hidden_layers)
    state = load_file(model_dir / "model.safetensors")
    experts: dict[tuple[int, str], list[tuple[int, torch.Tensor]]] = {}
    out = {}
    for name, w in state.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():  # one expert's projection
            i = parts.index("experts")
            experts.setdefault((int(parts[2]), parts[i + 2]), []).append((int(parts[i + 1]), w.clone()))
            continue
        w = w.clone()
        if gguf_arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = w
    assert experts, "the checkpoint holds its experts one tensor each"
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for (layer, projection), ws in experts.items():
        ws = [w for _, w in sorted(ws, key=lambda x: x[0])]
        part = {
            "w1": "gate",
            "w3": "up",
            "w2": "down",
            "gate_proj": "gate",
            "up_proj": "up",
            "down_proj": "down",
        }
        stacked = f"model.layers.{layer}.{block}.experts.{_stacked_name(arch, part[projection])}.weight"
        gguf_name = names.get_name(stacked, try_suffixes=(".weight",))
        assert gguf_name is not None and gguf_name.endswith("_exps.weight"), stacked
        if per_expert:
            for e, w in enumerate(ws):
                out[gguf_name.replace("_exps.weight", f".{e}.weight")] = w
        else:
            out[gguf_name] = torch.stack(ws)
    return out


def write_moe_gguf(
    model_dir: Path, out: Path, name: str, qtype: str = "F32", per_expert: bool = False
) -> Path:
    """`model_dir` as one GGUF file as llama.cpp's converter writes its family (the keys of its LlamaModel,
    Qwen2MoeModel, Qwen3MoeModel), projections and experts in `qtype`, norms and routers F32."""
    arch, gguf_arch, _ = MODELS[name]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = hf.config
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch=gguf_arch)
    add_base_keys(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(cfg.num_local_experts if arch == "mixtral" else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "mixtral":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    else:
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "qwen3_moe":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_gpt2_vocab(writer, model_dir, cfg.vocab_size, "qwen2" if arch != "mixtral" else "gpt-2")
    for gguf_name, w in gguf_tensors(arch, gguf_arch, model_dir, cfg, per_expert).items():
        routed = gguf_name.split(".")[-2].startswith("ffn_gate_inp")  # routers and the shared expert's gate
        t = gguf.GGMLQuantizationType[
            qtype if w.dim() >= 2 and not routed and "token_embd" not in gguf_name else "F32"
        ]
        data = w.numpy() if t.name == "F32" else gguf.quants.quantize(w.numpy(), t)
        writer.add_tensor(gguf_name, data, raw_dtype=None if t.name == "F32" else t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantized_reference(model_dir: Path, out: Path, qtype: str) -> Path:
    """The source checkpoint with every weight the file holds in `qtype` blocks replaced by gguf-py's
    dequantization of them (the embedding table, norms and routers as they are)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t = gguf.GGMLQuantizationType[qtype]
    with torch.no_grad():
        for name, p in hf.named_parameters():
            routed = name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
            )
            if p.dim() >= 2 and not routed and "embed_tokens" not in name:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), t), t)))
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module", params=list(MODELS))
def moe(request, tmp_path_factory) -> tuple[str, Path]:
    arch, _, overrides = MODELS[request.param]
    source = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=arch, tied=False, **overrides)
    randomize_norms(source)
    return request.param, source


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MOTET_CACHE_DIR", str(root))
    return root


PATHS = [pytest.param(False, id="eager"), pytest.param(True, id="native", marks=needs_native)]


# prompts that share no prefix, so that a rounding flip in one is not counted again in the others
_g = torch.Generator().manual_seed(0)
DISTINCT_PROMPTS = [torch.randint(3, 300, (n,), generator=_g).tolist() for n in (1, 5, 17, 33, 60, 24)]


def hf_prompt_logits(
    model_dir: Path, projections: tuple[str, ...] | None = None, prompts=PROMPTS
) -> list[torch.Tensor]:
    """transformers' logits of the prompts; with `projections`, those layers' and the lm_head's inputs rounded
    as the CPU's quantized product rounds them, and the experts' products' too (the eager experts)."""
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    if projections is not None:
        hf = quantizing_inputs(hf, lm_head=True, projections=projections)
        for module in hf.modules():
            if type(module).__name__.endswith("Experts"):
                module.forward = rounding_experts(module.forward, torch.nn.functional.linear)
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in prompts]


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_float_file_served_bare_matches_hf(moe, tmp_path, compiled, dtype):
    name, source = moe
    path = write_moe_gguf(source, tmp_path / "bare" / f"{name}-{dtype}.gguf", name, dtype)
    llm = LLM(str(path), compile_step=compiled, **OPTIONS)
    served = llm.engine.runner.model.config
    ref = source if dtype == "F32" else dequantized_reference(source, tmp_path / "ref", dtype)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    assert served.architecture == hf.config.architectures[0] and served.is_moe
    assert served.sparse_layers == tuple(range(served.num_hidden_layers))
    assert (llm.engine.runner.native is not None) == compiled
    for got, want in zip(engine_logits(llm.engine, PROMPTS, chunk=7), hf_prompt_logits(ref), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", PATHS)
def test_older_mixtral_file_one_tensor_an_expert(tmp_path, compiled):
    arch, _, overrides = MODELS["mixtral"]
    source = build_tiny_model(tmp_path / "src", arch=arch, tied=False, **overrides)
    path = write_moe_gguf(source, tmp_path / "bare" / "mixtral-old.gguf", "mixtral", per_expert=True)
    llm = LLM(str(path), compile_step=compiled, **OPTIONS)
    for got, want in zip(engine_logits(llm.engine, PROMPTS), hf_prompt_logits(source), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("qtype", [Q8_0, Q4_1])
def test_quantized_file_matches_hf_on_gguf_py_dequantized(moe, tmp_path, compiled, qtype):
    """The projections, the experts (each in its blocks, motet/engine/worker/model.py's QuantizedExperts), the
    shared expert and the lm_head served in their blocks (int8 for Q8_0, int4 for Q4_1; their inputs rounded to
    int8 blocks, as the reference rounds them): transformers on gguf-py's dequantization of the same blocks, but
    for rounding flips.
    (The issue's perplexity / top-1 tolerance is a real model's on real text: a tiny random model's logits are
    too flat for a top-1 agreement to mean anything, so the reference is the file's own values.)"""
    name, source = moe
    path = write_moe_gguf(source, tmp_path / "bare" / f"{name}-{qtype}.gguf", name, qtype)
    eng = LLM(str(path), compile_step=compiled, **OPTIONS).engine
    if not compiled:
        fmt = {"Q8_0": "int8", "Q4_1": "int4"}[qtype]
        model = eng.runner.model
        formats = {lin.quantized.format.name if lin.quantized else None for lin in model.decoder_linears()}
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        formats |= {q.weight.format.name for e in experts for q in e.quantized.values()}
        assert formats == {fmt} and all(len(e.quantized) == 2 for e in experts)
    ref = dequantized_reference(source, tmp_path / "ref", qtype)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    want = hf_prompt_logits(ref, projections, DISTINCT_PROMPTS)
    assert_close_but_for_rounding_flips(engine_logits(eng, DISTINCT_PROMPTS, chunk=7), want)


def test_converts_back_to_the_source_checkpoint(moe, tmp_path):
    """`convert_gguf` writes each expert's tensors under the family's names, equal to the source's."""
    name, source = moe
    out = convert_gguf(write_moe_gguf(source, tmp_path / "g" / f"{name}.gguf", name), tmp_path / "out")
    assert_converted_back(out, source)


def assert_converted_back(out, source) -> None:
    """Every tensor `convert_gguf` wrote to `out` equal to the source checkpoint's, and transformers' logits on
    them its logits on the source."""
    got, want = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert torch.equal(got[key], w), key
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, want_logits in zip(PROMPTS[:3], hf_prompt_logits(source), strict=False):
            torch.testing.assert_close(
                converted(torch.tensor([p])).logits[0], want_logits, atol=1e-5, rtol=1e-5
            )


def test_what_a_moe_file_cannot_say_is_refused(tmp_path):
    """Experts in a file of a family motet serves dense, and a partial rotary over q/k rows llama.cpp interleaved,
    each name what the file holds."""
    arch, _, overrides = MODELS["mixtral"]
    source = build_tiny_model(tmp_path / "src", arch=arch, tied=False, **overrides)
    reader = gguf.GGUFReader(str(write_moe_gguf(source, tmp_path / "m.gguf", "mixtral")))
    meta, names = metadata_of(reader), {t.name for t in reader.tensors}
    assert hf_config(meta, names, "m.gguf")["architectures"] == ["MixtralForCausalLM"]
    qwen2 = {k.replace("llama.", "qwen2."): v for k, v in meta.items()} | {"general.architecture": "qwen2"}
    with pytest.raises(ModelLoadError, match=r"a mixture of experts \(4 experts\) in a 'qwen2' file"):
        hf_config(qwen2, names, "q.gguf")
    with pytest.raises(ModelLoadError, match=r"rope over 8 of 16 head dimensions .*interleaved"):
        hf_config({**meta, "llama.rope.dimension_count": 8}, names, "m.gguf")
