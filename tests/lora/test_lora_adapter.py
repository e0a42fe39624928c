"""PEFT LoRA adapter loading: what loads must equal what PEFT itself applies (merged weight minus base
weight), and every malformed adapter is refused with an AdapterError naming the problem."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from motet.lora.adapter import TARGET_MODULES, AdapterError, load_adapter, module_shape
from motet.models.config import ModelConfig

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecations inside PEFT

LAYERS = 3
HF_CONFIG = LlamaConfig(
    architectures=["LlamaForCausalLM"],
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,  # k/v out (32) differs from q/o (64): catches shape mix-ups
)
BASE = ModelConfig.from_dict(HF_CONFIG.to_dict())
ALL = list(TARGET_MODULES)


def save_peft_adapter(path, seed=0, **lora_kwargs) -> dict[tuple[int, str], torch.Tensor]:
    """Save a PEFT LoRA adapter with random non-zero A and B; return PEFT's own merged weight deltas."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(HF_CONFIG)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    for name, p in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:  # PEFT inits B to zero: a no-op delta would prove nothing
            p.data = torch.randn_like(p) * 0.2
    peft_model.save_pretrained(path)
    merged = peft_model.merge_and_unload().state_dict()
    deltas = {}
    for i in range(LAYERS):
        for m in TARGET_MODULES:
            key = f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight"
            if not torch.equal(merged[key], base[key]):
                deltas[(i, m)] = merged[key] - base[key]
    return deltas


def check_against_peft(adapter, deltas, ranks=None):
    assert set(adapter.weights) == set(deltas)
    for (layer, module), (A, B, scale) in adapter.weights.items():
        n_in, n_out = module_shape(BASE, module)
        assert A.dtype == B.dtype == torch.float32 and A.device.type == "cpu"
        assert A.shape[1] == n_in and B.shape[0] == n_out
        if ranks:
            assert A.shape[0] == ranks[(layer, module)]
        torch.testing.assert_close(B @ A * scale, deltas[(layer, module)], atol=1e-5, rtol=1e-4)
    assert adapter.rank == max(A.shape[0] for A, _, _ in adapter.weights.values())
    assert adapter.target_modules == {m for _, m in deltas}


@pytest.mark.parametrize(
    "kwargs, expected_modules",
    [
        (
            dict(r=4, target_modules=["q_proj", "v_proj"]),
            {(i, m) for i in range(LAYERS) for m in ("q_proj", "v_proj")},
        ),
        (
            dict(
                r=8, lora_alpha=16, target_modules=r".*\.layers\.[02]\.(self_attn\.(k|o)_proj|mlp\.down_proj)"
            ),
            {(i, m) for i in (0, 2) for m in ("k_proj", "o_proj", "down_proj")},
        ),
        (dict(r=16, lora_alpha=8, target_modules="all-linear"), {(i, m) for i in range(LAYERS) for m in ALL}),
        (dict(r=64, lora_alpha=32, target_modules=ALL), {(i, m) for i in range(LAYERS) for m in ALL}),
        (
            dict(r=8, target_modules=["gate_proj", "up_proj", "o_proj"], layers_to_transform=[0, 2]),
            {(i, m) for i in (0, 2) for m in ("gate_proj", "up_proj", "o_proj")},
        ),
        (
            dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL),
            {(i, m) for i in range(LAYERS) for m in ALL},
        ),
        (
            dict(r=4, target_modules=ALL, exclude_modules=["down_proj", "model.layers.1.self_attn.q_proj"]),
            {(i, m) for i in range(LAYERS) for m in ALL if m != "down_proj"} - {(1, "q_proj")},
        ),
    ],
    ids=[
        "list-r4",
        "regex-r8",
        "all-linear-r16",
        "all-seven-r64",
        "layers_to_transform",
        "rslora",
        "exclude",
    ],
)
def test_matches_peft_merge(tmp_path, kwargs, expected_modules):
    deltas = save_peft_adapter(tmp_path, **kwargs)
    assert set(deltas) == expected_modules  # the test adapter really targets what we think
    adapter = load_adapter(tmp_path, BASE)
    assert adapter.name == tmp_path.name and adapter.rank == kwargs["r"]
    check_against_peft(adapter, deltas)
    (A, B, scale) = next(iter(adapter.weights.values()))
    r, alpha = kwargs["r"], kwargs.get("lora_alpha", 8)
    assert scale == pytest.approx(alpha / math.sqrt(r) if kwargs.get("use_rslora") else alpha / r)


def test_rank_and_alpha_patterns(tmp_path):
    deltas = save_peft_adapter(
        tmp_path,
        r=8,
        lora_alpha=16,
        target_modules=ALL,
        rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 16, r"layers\.2\.mlp\.up_proj": 2},
        alpha_pattern={"v_proj": 32, r"model\.layers\.[01]\.mlp\.gate_proj": 3},
    )
    adapter = load_adapter(tmp_path, BASE, name="tenant-a")
    ranks = {(i, m): 8 for i in range(LAYERS) for m in ALL}
    ranks.update({(i, "q_proj"): 4 for i in range(LAYERS)})
    ranks.update({(1, "down_proj"): 16, (2, "up_proj"): 2})
    check_against_peft(adapter, deltas, ranks)
    assert adapter.name == "tenant-a" and adapter.rank == 16
    assert adapter.weights[(0, "v_proj")][2] == pytest.approx(32 / 8)
    assert adapter.weights[(1, "gate_proj")][2] == pytest.approx(3 / 8)
    assert adapter.weights[(2, "gate_proj")][2] == pytest.approx(16 / 8)


def test_adapter_name_segment_in_keys_and_half_precision(tmp_path):
    deltas = save_peft_adapter(tmp_path, r=4, target_modules=["q_proj", "down_proj"])
    file = tmp_path / "adapter_model.safetensors"
    tensors = load_file(file)
    renamed = {
        k.replace("lora_A.weight", "lora_A.default.weight"): v.to(torch.bfloat16) for k, v in tensors.items()
    }
    save_file(renamed, file)
    adapter = load_adapter(tmp_path, BASE)
    assert set(adapter.weights) == set(deltas)
    for key, (A, B, scale) in adapter.weights.items():
        assert A.dtype == torch.float32
        torch.testing.assert_close(B @ A * scale, deltas[key], atol=0.05, rtol=0.02)


# --- refusals --------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    """A valid adapter (r=4 on q/v of every layer) and helpers to edit its config and tensors."""
    save_peft_adapter(tmp_path, r=4, target_modules=["q_proj", "v_proj"])
    cfg_file, st_file = tmp_path / "adapter_config.json", tmp_path / "adapter_model.safetensors"

    class Saved:
        path = tmp_path

        @staticmethod
        def edit_config(**changes):
            cfg = json.loads(cfg_file.read_text())
            cfg.update(changes)
            cfg_file.write_text(json.dumps(cfg))

        @staticmethod
        def edit_tensors(fn):
            tensors = load_file(st_file)
            fn(tensors)
            save_file(tensors, st_file)

    return Saved


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def refused(path, match, **kwargs):
    with pytest.raises(AdapterError, match=match):
        load_adapter(path, BASE, **kwargs)


def test_valid_fixture_loads(saved):
    assert load_adapter(saved.path, BASE).rank == 4


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(peft_type="PREFIX_TUNING"), "peft_type is 'PREFIX_TUNING'"),
        (dict(peft_type=None), "peft_type is None"),
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="all"), "bias 'all'"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(lora_bias=True), "lora_bias"),
        (dict(layer_replication=[[0, 2], [1, 3]]), "layer_replication"),
        (dict(alora_invocation_tokens=[1, 2]), "alora_invocation_tokens"),
        (
            dict(target_modules=["q_proj", "v_proj", "embed_tokens"]),
            "no lora_A/lora_B weights for model.embed_tokens",
        ),
        (dict(target_modules=["q_proj", "v_proj", "lm_head"]), "no lora_A/lora_B weights for lm_head"),
        (dict(target_modules=r".*(q_proj|v_proj|lm_head)"), "no lora_A/lora_B weights for lm_head"),
        (dict(target_modules=["qkv_proj"]), "selects no module"),
        (
            dict(target_modules=["q_proj"]),
            "weights for model.layers.0.self_attn.v_proj, which target_modules",
        ),
        (
            dict(target_modules=["q_proj", "v_proj", "o_proj"]),
            "no lora_A/lora_B weights for model.layers.0.self_attn.o",
        ),
        (dict(target_modules=[1, 2]), "target_modules must be"),
        (dict(target_modules="(unclosed"), "not a valid regex"),
        (dict(r=8), r"shape \[4, 64\], expected \[8, 64\] \(rank 8"),
        (dict(r="4"), "r must be a positive integer"),
        (dict(r=0), "r must be a positive integer"),
        (dict(lora_alpha=float("nan")), "lora_alpha must be a positive number"),
        (dict(rank_pattern={"q_proj": 2}), r"q_proj.lora_A.weight' has shape \[4, 64\], expected \[2, 64\]"),
        (dict(rank_pattern=["q_proj"]), "rank_pattern must be an object"),
        (dict(layers_to_transform="0"), "layers_to_transform"),
    ],
)
def test_config_refusals(saved, changes, match):
    saved.edit_config(**changes)
    refused(saved.path, match)


def test_rank_above_max(saved):
    refused(
        saved.path,
        "rank 4 of model.layers.0.self_attn.q_proj is above this server's max LoRA rank 2",
        max_rank=2,
    )


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(Q_B), "q_proj.lora_A.weight' has no matching lora_B"),
        (lambda t: t.pop(Q_A), "q_proj.lora_B.weight' has no matching lora_A"),
        (lambda t: t.__setitem__(Q_A.replace("layers.0", "layers.7"), t.pop(Q_A)), "layer 7 is out of range"),
        (
            lambda t: t.__setitem__(Q_A.replace("q_proj", "qkv_proj"), t[Q_A].clone()),
            "unknown module self_attn.qkv_proj",
        ),
        (
            lambda t: t.__setitem__(Q_A.replace("self_attn", "mlp"), t[Q_A].clone()),
            "unknown module mlp.q_proj",
        ),
        (
            lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.ones(64)),
            "maps to no LoRA layer/module",
        ),
        (lambda t: t.__setitem__(Q_A.replace("lora_A", "lora_A.other"), t[Q_A].clone()), "duplicate lora_A"),
        (
            lambda t: t.__setitem__(
                "base_model.model.model.embed_tokens.lora_embedding_A", torch.ones(4, 96)
            ),
            "has weights for model.embed_tokens, which target_modules",
        ),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.ones(4, 64)),
            "has weights for lm_head, which target_modules",
        ),
        (
            lambda t: t.__setitem__("base_model.model.lm_head.base_layer.weight", torch.ones(97, 64)),
            "resized vocabulary",
        ),
        (
            lambda t: t.__setitem__(Q_A.replace("lora_A.weight", "lora_magnitude_vector"), torch.ones(64)),
            "DoRA",
        ),
        (lambda t: t.__setitem__(Q_A, torch.randn(4, 32)), r"shape \[4, 32\], expected \[4, 64\]"),
        (lambda t: t.__setitem__(Q_B, torch.randn(32, 4)), r"shape \[32, 4\], expected \[64, 4\]"),
        (lambda t: t[Q_B].__setitem__((3, 1), float("nan")), "q_proj.lora_B.weight' has non-finite"),
        (lambda t: t[Q_A].__setitem__((0, 0), float("inf")), "q_proj.lora_A.weight' has non-finite"),
        (lambda t: t.__setitem__(Q_A, t[Q_A].to(torch.int32)), "dtype 'I32'"),
    ],
    ids=[
        "A-without-B",
        "B-without-A",
        "layer-out-of-range",
        "unknown-module",
        "wrong-parent",
        "non-lora-key",
        "duplicate",
        "embedding",
        "lm_head",
        "resized-head",
        "dora-magnitude",
        "A-shape",
        "B-shape",
        "nan",
        "inf",
        "int-dtype",
    ],
)
def test_tensor_refusals(saved, edit, match):
    saved.edit_tensors(edit)
    refused(saved.path, match)


def test_file_limits(saved):
    size = (saved.path / "adapter_model.safetensors").stat().st_size
    refused(saved.path, f"{size} bytes is above the limit of 1000 bytes", max_file_bytes=1000)
    refused(saved.path, "12 tensors is above the limit of 11", max_tensors=11)
    refused(saved.path, "header of .* bytes is above the limit of 64", max_header_bytes=64)
    load_adapter(saved.path, BASE, max_file_bytes=size, max_tensors=12)


def test_huge_header_refused_before_parsing(tmp_path, saved):
    st = saved.path / "adapter_model.safetensors"
    st.write_bytes(struct.pack("<Q", 1 << 40) + b"{")  # a header "length" of 1 TiB: never read
    refused(saved.path, "header of 1099511627776 bytes is above the limit")
    st.write_bytes(struct.pack("<Q", 1000) + b"{}")
    refused(saved.path, "truncated")
    st.write_bytes(b"\x01\x02")
    refused(saved.path, "truncated")
    st.write_bytes(struct.pack("<Q", 4) + b"nope")
    refused(saved.path, "header is not valid JSON")
    header = json.dumps({Q_A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}}).encode()
    st.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)  # data shorter than declared
    refused(saved.path, "not a valid safetensors file")


def test_missing_and_malformed_files(saved, tmp_path):
    cfg = saved.path / "adapter_config.json"
    cfg.write_text("{not json")
    refused(saved.path, "adapter_config.json: not valid JSON")
    cfg.write_text("[1, 2]")
    refused(saved.path, "adapter_config.json: must be a JSON object")
    cfg.unlink()
    refused(saved.path, "adapter_config.json: missing")
    refused(tmp_path / "nope", "does not exist")

    st = saved.path / "adapter_model.safetensors"
    st.rename(saved.path / "adapter_model.bin")
    refused(saved.path, "adapter_model.bin: pickled checkpoints are refused.*convert")
    (saved.path / "adapter_model.bin").unlink()
    refused(saved.path, "adapter_model.safetensors: missing")


def test_module_shape():
    assert module_shape(BASE, "q_proj") == (64, 64)
    assert module_shape(BASE, "k_proj") == module_shape(BASE, "v_proj") == (64, 32)
    assert module_shape(BASE, "o_proj") == (64, 64)
    assert module_shape(BASE, "gate_proj") == module_shape(BASE, "up_proj") == (64, 128)
    assert module_shape(BASE, "down_proj") == (128, 64)
    assert module_shape(BASE, "embed_tokens") == (BASE.vocab_size, 64)  # in: the vocabulary (a lookup)
    assert module_shape(BASE, "lm_head") == (64, BASE.vocab_size)
    with pytest.raises(AdapterError, match="unknown module 'norm'"):
        module_shape(BASE, "norm")


def test_safetensors_bytes_is_the_size_safetensors_writes():
    """The size a job reserves for an adapter's weights file (motet/lora/peft_format.py): safetensors' own file of
    the same tensors, its header (names, dtypes, shapes, offsets, padding) included."""
    from safetensors.torch import save

    from motet.lora.peft_format import PEFT_METADATA, safetensors_bytes

    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    gen = torch.Generator().manual_seed(0)
    for case in range(40):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        tensors = {}
        for i in range(n):
            dtype = list(dtypes)[int(torch.randint(0, 4, (1,), generator=gen))]
            shape = tuple(
                int(d)
                for d in torch.randint(1, 40, (int(torch.randint(1, 3, (1,), generator=gen)),), generator=gen)
            )
            name = f"base_model.model.model.layers.{i * 7 % 11}.mlp.{'é' if case % 5 == 0 else ''}up_proj.lora_{'AB'[i % 2]}.weight"
            tensors[name] = (dtype, shape)
        written = save(
            {k: torch.zeros(s, dtype=dtypes[d]) for k, (d, s) in tensors.items()}, metadata=PEFT_METADATA
        )
        assert safetensors_bytes(tensors) == len(written), tensors
