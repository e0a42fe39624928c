"""engine.checkpoint on tiny random Llama / Mistral / Qwen2 checkpoints written by transformers itself."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from motet.engine.weights.checkpoint import iter_weights, weight_files
from motet.engine.weights.model_config import load_model_config
from motet.models.declaration import ModelLoadError
from tests.tiny_models import TINY_LAYERS


def load_state_dict(path, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Every weight the loader reads (motet/engine/weights/checkpoint.py iter_weights), floating-point ones cast to
    `dtype`: what the tests hold against transformers' own loading."""
    state = {}
    for name, stored in iter_weights(path):
        t = stored.load()
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    return state


TINY = dict(vocab_size=256, **TINY_LAYERS, max_position_embeddings=512)


def _make(kind: str, tied: bool):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, tie_word_embeddings=tied))
    if kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 500000.0,
        }
        return tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, tie_word_embeddings=tied, rope_parameters=rope))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**TINY, tie_word_embeddings=tied, sliding_window=None))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY, tie_word_embeddings=tied))
    raise AssertionError(kind)


def _save(model, path, sharded: bool = False):
    if sharded:
        model.save_pretrained(path, max_shard_size="50KB")
    else:
        model.save_pretrained(path)
    return path


def _reference_state(model, tied: bool) -> dict[str, torch.Tensor]:
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:  # the model ties lm_head to the embedding; the checkpoint leaves it out
        ref.pop("lm_head.weight", None)
    return ref


CASES = [
    ("llama", True),
    ("llama", False),
    ("llama3", True),
    ("mistral", False),
    ("qwen2", False),
    ("qwen2", True),
]


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize(("kind", "tied"), CASES, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in CASES])
def test_load_state_dict_matches_transformers(tmp_path, kind, tied, sharded):
    model = _make(kind, tied)
    _save(model, tmp_path, sharded)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(weight_files(tmp_path)) > 1
    ref = _reference_state(model, tied)

    got = load_state_dict(tmp_path, torch.float32, "cpu")
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert got[name].dtype == torch.float32 and got[name].device.type == "cpu"
        assert torch.equal(got[name], t), name
    assert ("lm_head.weight" in got) == (not tied)
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in got
        assert "model.layers.1.self_attn.v_proj.bias" in got

    bf16 = load_state_dict(tmp_path, torch.bfloat16, "cpu")
    for name, t in ref.items():
        assert bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], t.to(torch.bfloat16)), name

    # iter_weights yields each tensor once, in the stored dtype
    names = [n for n, _ in iter_weights(tmp_path)]
    assert sorted(names) == sorted(ref)


@pytest.mark.parametrize(("kind", "tied"), CASES, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in CASES])
def test_load_model_config_matches_transformers(tmp_path, kind, tied):
    model = _make(kind, tied)
    _save(model, tmp_path)
    hf = model.config
    cfg = load_model_config(tmp_path)
    assert cfg.architecture == type(model).__name__
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.num_attention_heads == hf.num_attention_heads
    assert cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.hidden_size // hf.num_attention_heads
    assert cfg.tie_word_embeddings == tied
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.attention_bias == (kind == "qwen2")
    if kind == "llama3":
        assert cfg.rope_theta == 500000.0
        assert cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.rope_scaling["factor"] == 8.0
        assert cfg.rope_scaling["original_max_position_embeddings"] == 128


def test_llama31_style_config_json(tmp_path):
    """A config.json in the transformers 4.x spelling (rope_theta + rope_scaling at the top level)."""
    _save(_make("llama", False), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    cfg["eos_token_id"] = [128001, 128008, 128009]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").unlink()
    mc = load_model_config(tmp_path)
    assert mc.rope_theta == 500000.0
    assert mc.rope_scaling["rope_type"] == "llama3"
    assert mc.eos_token_ids == (128001, 128008, 128009)


def test_generation_config_eos_wins(tmp_path):
    _save(_make("llama", True), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eos_token_id"] = 2
    cfg["bos_token_id"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))
    mc = load_model_config(tmp_path)
    assert mc.eos_token_ids == (2, 7)
    assert mc.bos_token_id == 1
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_model_config(tmp_path).eos_token_ids == (5,)
    (tmp_path / "generation_config.json").unlink()
    assert load_model_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        load_model_config(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    model = _make("llama", False)
    _save(model, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    load_model_config(tmp_path)  # the config itself is fine
    with pytest.raises(ModelLoadError, match=r"pickle.*safetensors") as e:
        list(iter_weights(tmp_path))
    assert "pytorch_model.bin" in str(e.value)
    with pytest.raises(ModelLoadError, match="pickle"):
        load_state_dict(tmp_path, torch.float32, "cpu")

    (tmp_path / "pytorch_model.bin").rename(tmp_path / "weights.pt")
    with pytest.raises(ModelLoadError, match="pickle"):
        list(iter_weights(tmp_path))


def test_missing_shard_is_named(tmp_path):
    _save(_make("llama", False), tmp_path, sharded=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    victim = shards[len(shards) // 2]
    (tmp_path / victim).unlink()
    gen = iter_weights(tmp_path)
    with pytest.raises(ModelLoadError, match=victim.replace(".", r"\.")):
        next(gen)  # reported before any tensor is read


def test_bad_index_and_bad_file(tmp_path):
    _save(_make("llama", False), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        list(iter_weights(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="index"):
        list(iter_weights(tmp_path))


def test_unsupported_architecture(tmp_path):
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model_config(tmp_path)


def test_missing_directory_and_no_weights(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="nope"):
        load_model_config(missing)
    with pytest.raises(ModelLoadError, match="nope"):
        list(iter_weights(missing))
    empty = tmp_path / "empty"
    _save(_make("llama", True), empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"empty.*no model weights"):
        load_state_dict(empty, torch.float32, "cpu")


def test_derived_rotary_buffers_are_skipped(tmp_path):
    w = {
        "model.embed_tokens.weight": torch.randn(8, 4),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(2),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, dtype=torch.float16),
    }
    save_file(w, str(tmp_path / "model.safetensors"))
    got = load_state_dict(tmp_path, torch.float32, "cpu")
    assert set(got) == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"}
    assert torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], w["model.layers.0.self_attn.q_proj.weight"].float()
    )
