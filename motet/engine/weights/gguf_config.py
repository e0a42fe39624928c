"""A GGUF file's metadata read as the Hugging Face config.json of the family its architecture names (motet/models/:
each declaration's `gguf` facts and its own keys), or refused in one line naming the key and what motet serves:
the config a bare GGUF file is served with (motet/engine/weights/gguf_model.py) and `motet pull` converts to."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from motet.engine.weights.gguf_names import CONFIG_TENSORS
from motet.models import DECLARATIONS, GGUF_ARCHITECTURES, from_gguf
from motet.models.declaration import ModelLoadError
from motet.models.fields import LIMITS, bounded


def metadata_of(reader) -> dict:
    """A GGUFReader's metadata fields as Python values (strings, numbers, lists)."""
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field type gguf cannot decode; none that we need
            continue
    return out


def _f32_round(x: float) -> float:
    """A float32 metadata value as the short decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


_GGUF_FIELDS = {  # GGUF key (after the architecture's prefix: llama.block_count) -> the config.json field
    "vocab_size": "vocab_size",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
    "expert_count": "num_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
# tokenizer.ggml.model values motet builds a tokenizer for (motet/engine/weights/gguf_convert.py): byte-level BPE,
# and SentencePiece's (llama.cpp's name for it: Llama 2's, Mistral 7B's, Gemma's, Phi-3's files; gguf_spm.py)
BPE_TOKENIZER, SPM_TOKENIZER = "gpt2", "llama"
TOKENIZER_MODELS = (BPE_TOKENIZER, SPM_TOKENIZER)
# llama.cpp's names (tokenizer.ggml.pre) for the splits motet builds (motet/engine/weights/gguf_pretokenizers.py):
# GPT-2's ("olmo": OLMo 1's); digits one by one, then GPT-2's (SmolLM's, StarCoder's, "refact": Granite 3's);
# Qwen2's; Llama 3's ("dbrx": cl100k's, as Phi-4's and OLMo 2's files say); o200k's ("gpt-4o": GPT-OSS's);
# DeepSeek LLM's and V2's ("deepseek-llm"); DeepSeek-V3's ("deepseek-v3"), as llama.cpp's llama-vocab.cpp groups them
PRE_TOKENIZERS = (
    "smollm",
    "default",
    "gpt-2",
    "olmo",
    "starcoder",
    "refact",
    "qwen2",
    "llama-bpe",
    "dbrx",
    "gpt-4o",
    "deepseek-llm",
    "deepseek-v3",
)
_ROPE_SCALINGS = ("none", "linear", "yarn")  # llama.rope.scaling.type values motet's rotary implements
# the converter's YaRN keys (after rope.scaling.) -> transformers' rope_scaling fields
_YARN_FIELDS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",
    "yarn_ext_factor": "extrapolation_factor",
}


def reader_config(reader, source: str) -> tuple[dict, dict]:
    """A GGUFReader's metadata (`metadata_of`) and its file's config.json (`hf_config`)."""
    meta = metadata_of(reader)
    factors = {
        t.name: [float(x) for x in t.data.reshape(-1)] for t in reader.tensors if t.name in CONFIG_TENSORS
    }
    return meta, hf_config(meta, {t.name for t in reader.tensors}, source, factors)


def hf_config(
    meta: dict,
    tensor_names: Collection[str],
    source: str,
    config_tensors: Mapping[str, list[float]] | None = None,
) -> dict:
    """The Hugging Face config.json of a GGUF from its metadata (and the values of its `CONFIG_TENSORS`, which
    `config_tensors` holds by name); tied embeddings when it has no output.weight; a mixture of experts' sparse
    layers those with a router (ffn_gate_inp), the others dense (mlp_only_layers).

    ModelLoadError, naming the key and what is supported, for a file motet cannot serve: another architecture,
    experts in a family motet serves dense, another tokenizer, rope scaling other than linear, YaRN or LongRoPE's
    factors, a partial rotary over interleaved q/k rows (llama's files)."""

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{source}: {what}")

    arch = meta.get("general.architecture")
    experts = meta.get(f"{arch}.expert_count") or 0
    decl = from_gguf(arch, experts != 0) if isinstance(arch, str) else None
    if decl is None:
        raise refuse(
            f"GGUF architecture {arch!r}; motet serves GGUF files of architecture "
            f"{', '.join(map(repr, GGUF_ARCHITECTURES))} ('llama': Llama, Mistral, SmolLM and the "
            f"other models llama.cpp converts so); serve other models from their Hugging Face checkpoint directory"
        )
    if experts and decl.experts is None:
        moe = ", ".join(repr(d.gguf) for d in DECLARATIONS if d.gguf and d.experts)
        raise refuse(
            f"a mixture of experts ({experts!r:.20} experts) in a {arch!r} file; motet serves the experts of GGUF "
            f"files of architecture {moe} ('llama': Mixtral)"
        )
    tok_model = meta.get("tokenizer.ggml.model")
    if tok_model not in TOKENIZER_MODELS:
        raise refuse(
            f"tokenizer {tok_model!r} (tokenizer.ggml.model); motet builds the tokenizer of a GGUF file for "
            f"{BPE_TOKENIZER!r} (byte-level BPE) and {SPM_TOKENIZER!r} (SentencePiece) vocabularies"
        )
    if tok_model == SPM_TOKENIZER and "tokenizer.ggml.scores" not in meta:
        raise refuse("a SentencePiece vocabulary without its scores (tokenizer.ggml.scores)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if tok_model == BPE_TOKENIZER and pre not in PRE_TOKENIZERS:
        raise refuse(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre); motet builds {', '.join(map(repr, PRE_TOKENIZERS))}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise refuse(
            "rope frequency factors (a rope_freqs tensor, as Llama 3.1 and later store their rope scaling); "
            "motet does not read them from a GGUF file: serve the model's Hugging Face checkpoint directory"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in _ROPE_SCALINGS:
        raise refuse(
            f"rope scaling {scaling!r} ({arch}.rope.scaling.type); motet implements {_ROPE_SCALINGS}"
        )
    factors = config_tensors or {}
    if any(name in tensor_names for name in CONFIG_TENSORS) and sorted(factors) != sorted(CONFIG_TENSORS):
        raise refuse(f"LongRoPE's factors come as both {' and '.join(CONFIG_TENSORS)}, got {sorted(factors)}")
    try:
        # The hyperparameters under their GGUF names, each within what a config may say (config.py LIMITS)
        # before anything is computed from them.
        for suffix, field in _GGUF_FIELDS.items():
            if (key := f"{arch}.{suffix}") in meta:
                bounded(meta[key], key, source, *LIMITS[field])
        n_head = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_head))
        rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        context = int(meta[f"{arch}.context_length"])

        def key(suffix: str, default=None):
            value = meta.get(f"{arch}.{suffix}", default)
            return _f32_round(value) if isinstance(value, float) else value

        config = {
            "architectures": [decl.name],
            "model_type": arch,
            "vocab_size": int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
            "hidden_size": hidden,
            "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
            "num_hidden_layers": int(meta[f"{arch}.block_count"]),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": context,
            "rms_norm_eps": _f32_round(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            "rope_theta": _f32_round(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            "rope_scaling": None
            if scaling == "none"
            else {"rope_type": scaling, "factor": _f32_round(meta[f"{arch}.rope.scaling.factor"])},
            # (the attention's first projections, as its declaration names them)
            "attention_bias": any(f"blk.0.{t}.bias" in tensor_names for t in decl.attention.gguf_bias_probes),
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
            "torch_dtype": "float32",
            "use_cache": True,
        }
        if scaling == "yarn":  # its original context, and the converter's other keys where it wrote them
            yarn = config["rope_scaling"]
            yarn["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
            for suffix, field in _YARN_FIELDS.items():
                if (value := key(f"rope.scaling.{suffix}")) is not None:
                    yarn[field] = value
        if rotary != head_dim:  # (transformers' partial rotary; motet reads rotary_dim first, no rounding)
            config["partial_rotary_factor"] = rotary / head_dim
            config["rotary_dim"] = rotary
        if factors:  # LongRoPE (Phi-3's converter: its factors as tensors, its attention factor as a key)
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": [_f32_round(f) for f in factors["rope_factors_long.weight"]],
                "short_factor": [_f32_round(f) for f in factors["rope_factors_short.weight"]],
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length", context)),
            }
            if (attention := key("rope.scaling.attn_factor")) is not None:
                config["rope_scaling"]["attention_factor"] = attention
        if experts:  # the layers with a router are sparse, the others dense
            config["mlp_only_layers"] = [
                i
                for i in range(config["num_hidden_layers"])
                if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
            ]
        if decl.gguf_config is not None:  # the family's own fields
            config.update(decl.gguf_config(key, config, source, tensor_names))
    except KeyError as e:
        raise refuse(f"GGUF metadata has no {e.args[0]!r}") from None
    except ModelLoadError:
        raise
    except (TypeError, ValueError, ArithmeticError) as e:  # a per-layer array where a number belongs, ...
        raise refuse(f"GGUF metadata not understood ({e})") from None
    if rotary != head_dim and decl.gguf_permuted_qk:
        raise refuse(
            f"rope over {rotary} of {head_dim} head dimensions in a file whose q/k rows llama.cpp interleaved "
            f"({arch!r}); motet reads a partial rotary from files that keep Hugging Face's order (Phi-3's, Qwen's)"
        )
    return config
