"""GGUF -> a Hugging Face checkpoint directory of the family its architecture names (motet/models/: each
declaration's `gguf` facts): dequantize to float32, undo llama.cpp's rotary row permutation of q_proj/k_proj
where its converter made one (llama, granite), take the norm weights' offset back out where the converter
added it (Gemma's 1 + w), rename the tensors to the family's Hugging Face names (its fused ones kept fused, as
Phi-3's checkpoints have them), and write config, weights and tokenizer files (motet/engine/weights/model_store.py calls it when it pulls the default model). The config and
tokenizer come from the file's metadata alone (`hf_config`, `write_hf_metadata`), which is all a bare GGUF
file served as it is needs (motet/engine/weights/gguf_model.py)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from motet.models import DECLARATIONS, Architecture, find, from_gguf
from motet.models.declaration import ModelLoadError
from motet.models.fields import LIMITS, bounded
from motet.models.projections import GATE_UP, QKV, projection_shapes


class PullError(ModelLoadError):
    """`pull()` could not fetch or convert the default model; the message says what to check."""


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head q / k norms
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


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


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of q_proj/k_proj rows.

    llama.cpp stores each head's rows with the two rotary halves interleaved (pairs (i, i + d/2) next
    to each other, for GPT-J-style rope); Hugging Face keeps the halves apart (rotate_half). The GGUF
    layout is `hf.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`, so the inverse swaps back.
    """
    rows = weight.shape[0]
    head_dim = rows // n_head
    w = weight.reshape(n_head, head_dim // 2, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def hf_name(gguf_name: str, decl: Architecture) -> str:
    """A GGUF tensor's Hugging Face name in the checkpoints of `decl`'s family."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    module = m and (decl.gguf_names.get(m.group(2)) or _BLOCK_NAMES.get(m.group(2)))
    if module:
        return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
    if gguf_name.startswith("rope_factors"):
        raise PullError(
            f"GGUF tensor {gguf_name!r}: rope frequency factors (LongRoPE's, as Phi-3's 128k models store them); "
            f"motet does not read them from a GGUF file: serve the model's Hugging Face checkpoint directory"
        )
    raise PullError(f"GGUF tensor {gguf_name!r} has no Hugging Face {decl.name} counterpart")


def norm_offset(name: str, decl: Architecture) -> float:
    """What llama.cpp's converter added to a tensor (by its Hugging Face name): the family's norm weight offset
    to each norm weight (Gemma's RMSNorm multiplies by 1 + w; llama.cpp's by the weight as stored)."""
    return decl.norm_weight_offset if name.endswith("norm.weight") else 0.0


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = False) -> Path:
    """Convert a GGUF file of a declared family (gpt2 BPE vocab) into a Hugging Face directory `out_dir`."""
    import gguf
    from safetensors.torch import save_file
    from tqdm import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = metadata_of(reader)
    config = hf_config(meta, [t.name for t in reader.tensors], gguf_path.name)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    decl = find(config["architectures"])
    permuted = decl.gguf_permuted_qk

    out_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(reader.tensors, desc="converting", unit="tensor", disable=not progress, file=sys.stderr)
    for t in bar:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # a writable copy
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = w.reshape(expected if len(expected) > 1 else (expected[0],))
        name = hf_name(t.name, decl)
        if offset := norm_offset(name, decl):
            w -= offset
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, n_head)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, n_kv)
        state[name] = w
    bar.close()
    _check_shapes(state, config)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    write_hf_metadata(out_dir, meta, config)
    return out_dir


_GGUF_FIELDS = {  # GGUF key (after the architecture's prefix: llama.block_count) -> the config.json field
    "vocab_size": "vocab_size",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
}
TOKENIZER_MODEL = "gpt2"  # byte-level BPE
# llama.cpp's names (tokenizer.ggml.pre) for the splits motet builds: GPT-2's ("olmo": OLMo 1's); digits one by
# one, then GPT-2's (SmolLM's, StarCoder's, "refact": Granite 3's); Qwen2's; Llama 3's ("dbrx": cl100k's, as
# Phi-4's and OLMo 2's files say), as llama.cpp's llama-vocab.cpp groups them
PRE_TOKENIZERS = ("smollm", "default", "gpt-2", "olmo", "starcoder", "refact", "qwen2", "llama-bpe", "dbrx")
# Qwen2's (and Qwen3's) split before byte-level BPE: its tokenizer.json's Split pattern, one digit at a time
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Llama 3's: Qwen2's with numbers in runs of up to three digits
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_ROPE_SCALINGS = ("none", "linear")  # llama.rope.scaling.type values motet's rotary implements
# Besides EOS, the ids llama.cpp ends a generation at (end of turn, Llama 3's <|eot_id|>; end of message).
_END_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def hf_config(meta: dict, tensor_names: Collection[str], source: str) -> dict:
    """The Hugging Face config.json of a GGUF from its metadata; tied embeddings when it has no output.weight.

    ModelLoadError, naming the key and what is supported, for a file motet cannot serve: another architecture,
    a mixture of experts, another tokenizer, rope scaling other than linear, partial rotary."""

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(f"{source}: {what}")

    arch = meta.get("general.architecture")
    decl = from_gguf(arch) if isinstance(arch, str) else None
    if decl is None:
        raise refuse(
            f"GGUF architecture {arch!r}; motet serves GGUF files of architecture "
            f"{', '.join(repr(d.gguf) for d in DECLARATIONS if d.gguf)} ('llama': Llama, Mistral, SmolLM and the "
            f"other models llama.cpp converts so); serve other models from their Hugging Face checkpoint directory"
        )
    if int(meta.get(f"{arch}.expert_count") or 0) > 0:
        raise refuse(
            f"a mixture of experts ({meta[f'{arch}.expert_count']} experts); motet serves dense models"
        )
    tok_model = meta.get("tokenizer.ggml.model")
    if tok_model != TOKENIZER_MODEL:
        raise refuse(
            f"tokenizer {tok_model!r} (tokenizer.ggml.model); motet builds the tokenizer of a GGUF file for "
            f"{TOKENIZER_MODEL!r} byte-level BPE vocabularies only"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
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
            else {"rope_type": "linear", "factor": _f32_round(meta[f"{arch}.rope.scaling.factor"])},
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
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
        if decl.gguf_config is not None:  # the family's own fields
            config.update(decl.gguf_config(key, config, source))
    except KeyError as e:
        raise refuse(f"GGUF metadata has no {e.args[0]!r}") from None
    except ModelLoadError:
        raise
    except (TypeError, ValueError, ArithmeticError) as e:  # a per-layer array where a number belongs, ...
        raise refuse(f"GGUF metadata not understood ({e})") from None
    if rotary != head_dim:
        raise refuse(f"rope over {rotary} of {head_dim} head dimensions; motet rotates whole heads")
    return config


def write_hf_metadata(out_dir: Path, meta: dict, config: dict) -> None:
    """config.json, generation_config.json and the tokenizer files (with the chat template) of a GGUF."""
    _write_json(out_dir / "config.json", config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    ends = [config["eos_token_id"]] if config["eos_token_id"] is not None else []
    ends += [int(meta[k]) for k in _END_TOKEN_KEYS if k in meta and int(meta[k]) not in ends]
    if len(ends) > 1:
        gen["eos_token_id"] = ends
    _write_json(out_dir / "generation_config.json", gen)
    tokens = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    _write_tokenizer(out_dir, meta, tokens, token_types, config["max_position_embeddings"])


def _check_shapes(state: dict[str, torch.Tensor], cfg: dict) -> None:
    """The tensors a checkpoint of the config's family has, by the declaration: fused modules as one tensor,
    its norms (before the blocks, after them: by the decoder's names, renamed to the family's), q/k norms per
    head or across them."""
    decl = find(cfg["architectures"])
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    shapes = projection_shapes(h, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], ff)
    rows = {m: out for m, (_, out) in shapes.items()}
    q, kv = rows["q_proj"], rows["k_proj"]
    attn, mlp = list(QKV), list(GATE_UP)
    for fused, parts in decl.fused_modules.items():
        for group in (attn, mlp):
            if parts[0] in group:
                group[:] = [fused]
        rows[fused] = sum(rows[p] for p in parts)
    family = {v: k for k, v in decl.checkpoint_names.items()}  # the decoder's norm names -> the family's
    norms = (["input_layernorm", "post_attention_layernorm"] if decl.pre_norms else []) + (
        ["attn_out_norm", "mlp_out_norm"] if decl.post_norms else []
    )
    want = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want |= {p + f"self_attn.{m}.weight": (rows[m], h) for m in attn}
        want |= {p + f"mlp.{m}.weight": (rows[m], h) for m in mlp}
        want |= {p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, ff)}
        want |= {p + f"{family.get(n, n)}.weight": (h,) for n in norms}
        if cfg["attention_bias"]:
            want |= {p + f"self_attn.{m}.bias": (rows[m],) for m in attn}
        if decl.qk_norm:
            want |= {
                p + "self_attn.q_norm.weight": (q if decl.qk_norm_whole else cfg["head_dim"],),
                p + "self_attn.k_norm.weight": (kv if decl.qk_norm_whole else cfg["head_dim"],),
            }
    if not cfg["tie_word_embeddings"]:
        want["lm_head.weight"] = (cfg["vocab_size"], h)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    bad = [
        f"{k}: {tuple(state[k].shape)} != {v}"
        for k, v in want.items()
        if k in state and tuple(state[k].shape) != v
    ]
    if missing or extra or bad:
        raise PullError(
            f"converted GGUF does not match its metadata: "
            f"missing={missing[:5]} extra={extra[:5]} bad={bad[:5]}"
        )


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _write_tokenizer(
    out_dir: Path, meta: dict, tokens: list[str], token_types: list[int], max_len: int
) -> None:
    """tokenizer.json etc. for the gpt2 byte-level BPE vocabulary of the GGUF.

    The GGUF pre-tokenizer 'smollm' is the original SmolLM2 tokenizer.json's: every digit on its own,
    then GPT-2 byte-level splitting. Control tokens (token_type 3) are special added tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre", "default")  # one of PRE_TOKENIZERS (hf_config checked)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise PullError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("qwen2", "llama-bpe", "dbrx"):
        from tokenizers import Regex

        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(
                    Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), behavior="isolated"
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    control = [t for t, ty in zip(tokens, token_types, strict=True) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    for t in control:  # they must keep their GGUF ids
        if tok.token_to_id(t) != vocab[t]:
            raise PullError(f"special token {t!r} did not keep its id {vocab[t]}")
    tok.save(str(out_dir / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None else None

    # SmolLM2-Instruct's own tokenizer_config: bos <|im_start|>, eos/pad <|im_end|>, unk <|endoftext|>.
    specials = {
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "unk_token": name("unknown_token_id"),
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    extra = [t for t in ("<|im_start|>", "<|im_end|>") if t in control]
    special_map = dict(specials, additional_special_tokens=extra)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        **special_map,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", tok_cfg)
