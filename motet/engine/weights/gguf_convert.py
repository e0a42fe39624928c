"""GGUF -> a Hugging Face checkpoint directory of the family its architecture names (motet/models/: each
declaration's `gguf` facts): dequantize to float32, undo llama.cpp's rotary row permutation of q_proj/k_proj
where its converter made one (llama, granite), take the norm weights' offset back out where the converter
added it (Gemma's 1 + w), rename the tensors to the family's Hugging Face names (its fused ones kept fused, as
Phi-3's checkpoints have them), and write config, weights and tokenizer files (motet/engine/weights/model_store.py calls it when it pulls the default model). The config and
tokenizer come from the file's metadata alone (motet/engine/weights/gguf_config.py's `hf_config`,
`write_hf_metadata`), which is all a bare GGUF file served as it is needs (motet/engine/weights/gguf_model.py). A
mixture of experts' stacked tensors are written an expert at a time, as its family's checkpoints hold them
(GPT-OSS's restacked, gate and up interleaved); a tensor the converter split in two is joined back (gguf_names.JOINS)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from motet.engine.weights import gguf_names
from motet.engine.weights.gguf_config import SPM_TOKENIZER, reader_config
from motet.engine.weights.gguf_pretokenizers import IGNORE_MERGES, pre_tokenizer
from motet.engine.weights.gguf_reader import open_gguf
from motet.engine.weights.gguf_spm import ADDED_TYPES, CONTROL, UNKNOWN, spm_tokenizer
from motet.engine.weights.pull_error import PullError
from motet.models import find
from motet.models.config import ModelConfig
from motet.models.projections import GATE_UP, projection_shapes

# Besides EOS, the ids llama.cpp ends a generation at (end of turn, Llama 3's <|eot_id|>; end of message).
_END_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# and the ends of a turn it knows by their text alone (src/llama-vocab.cpp's end-of-generation list), which the
# converter writes no key for: Gemma's <end_of_turn>, Phi-3's <|end|>, Llama 3's, ChatML's, GPT-OSS's return and call.
# (Its end-of-text tokens, <|endoftext|> and the like, are left to EOS: a file's EOS is its own.)
END_OF_TURN_TEXTS = (
    "<end_of_turn>",
    "<|end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
)
# GPT-OSS's harmony: <|end|> ends a message, not the turn, where <|return|> and <|call|> end it (llama.cpp's rule)
_HARMONY_ENDS = ("<|return|>", "<|call|>")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = False) -> Path:
    """Convert a GGUF file of a declared family (gpt2 BPE vocab) into a Hugging Face directory `out_dir`."""
    import gguf
    from safetensors.torch import save_file
    from tqdm import tqdm

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_gguf(gguf_path)
    meta, config = reader_config(reader, gguf_path.name)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    decl = find(config["architectures"])
    permuted = decl.gguf_permuted_qk

    out_dir.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    # a tensor the converter split in two (gguf_names.JOINS) -> its parts by their GGUF names
    halves: dict[str, dict[str, torch.Tensor]] = {}
    bar = tqdm(reader.tensors, desc="converting", unit="tensor", disable=not progress, file=sys.stderr)
    for t in bar:
        if t.name in gguf_names.CONFIG_TENSORS:  # (read into the config)
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # a writable copy
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = w.reshape(expected if len(expected) > 1 else (expected[0],))
        name = gguf_names.hf_name(t.name, decl)
        if gguf_names.joined(t.name, decl):
            halves.setdefault(name, {})[t.name] = w
            continue
        if gguf_names.EXPERT in name:  # stacked experts: each expert's own tensor
            state.update(zip(gguf_names.expert_names(name, w.shape[0]), w.unbind(0), strict=True))
            continue
        if offset := gguf_names.norm_offset(name, decl):
            w -= offset
        if permuted and name.endswith("self_attn.q_proj.weight"):
            w = gguf_names.unpermute_qk(w, n_head)
        elif permuted and name.endswith("self_attn.k_proj.weight"):
            w = gguf_names.unpermute_qk(w, n_kv)
        state[name] = w
    bar.close()
    state.update({name: gguf_names.join(name, parts, decl) for name, parts in halves.items()})
    if decl.expert_layout == "interleaved":
        state = _interleaved_experts(state)
    _check_shapes(state, config)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    write_hf_metadata(out_dir, meta, config)
    return out_dir


def _interleaved_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's experts as GPT-OSS's checkpoints stack them: gate_up_proj [E, H, 2I] (gate and up columns
    alternating) and down_proj [E, I, H], from each expert's gate_proj, up_proj [I, H] and down_proj [H, I]."""
    out, experts = {}, {}
    for name, w in state.items():
        prefix, found, rest = name.partition(".experts.")
        part = rest.split(".")
        if not found or len(part) != 3 or not part[0].isdigit():
            out[name] = w
            continue
        experts.setdefault(prefix, {}).setdefault(part[1], {})[int(part[0])] = w
    for prefix, parts in experts.items():
        stacked = {k: torch.stack([v[e] for e in range(len(v))]) for k, v in parts.items()}
        gate, up = (stacked[k].transpose(1, 2) for k in ("gate_proj", "up_proj"))
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack((gate, up), dim=-1).flatten(-2).contiguous()
        out[f"{prefix}.experts.down_proj"] = stacked["down_proj"].transpose(1, 2).contiguous()
    return out


def write_hf_metadata(out_dir: Path, meta: dict, config: dict) -> None:
    """config.json, generation_config.json and the tokenizer files (with the chat template) of a GGUF."""
    _write_json(out_dir / "config.json", config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    tokens = list(meta["tokenizer.ggml.tokens"])
    ends = [config["eos_token_id"]] if config["eos_token_id"] is not None else []
    ends += [int(meta[k]) for k in _END_TOKEN_KEYS if k in meta]
    ends += end_of_turn_ids(tokens)
    ends = list(dict.fromkeys(ends))
    if len(ends) > 1:
        gen["eos_token_id"] = ends
    _write_json(out_dir / "generation_config.json", gen)
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    _write_tokenizer(out_dir, meta, tokens, token_types, config["max_position_embeddings"])


def end_of_turn_ids(tokens: list[str]) -> list[int]:
    """The ids of the vocabulary's ends of a turn that llama.cpp knows by their text (END_OF_TURN_TEXTS), harmony's
    <|end|> left out."""
    ids = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
    if all(t in ids for t in _HARMONY_ENDS):
        ids.pop("<|end|>", None)
    return sorted(ids.values())


def _check_shapes(state: dict[str, torch.Tensor], cfg: dict) -> None:
    """The tensors a checkpoint of the config's family has, by the declaration: the attention's by its own
    (motet/models/attention.py's `checkpoint_shapes`), fused modules as one tensor, its norms (before the blocks,
    after them: by the decoder's names, renamed to the family's), a sparse layer's router, experts and shared
    expert (by the decoder's names, renamed)."""
    decl = find(cfg["architectures"])
    model = ModelConfig.from_dict(cfg)
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    shapes = projection_shapes(h, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], ff)
    rows = {m: out for m, (_, out) in shapes.items()}
    mlp = list(GATE_UP)
    for fused, parts in decl.fused_modules.items():
        if parts[0] in mlp:
            mlp = [fused]
        rows[fused] = sum(rows[p] for p in parts)
    attention = model.attention.checkpoint_shapes(model, decl.fused_modules)
    family = {v: k for k, v in decl.checkpoint_names.items()}  # the decoder's norm names -> the family's
    norms = (["input_layernorm", "post_attention_layernorm"] if decl.pre_norms else []) + (
        ["attn_out_norm", "mlp_out_norm"] if decl.post_norms else []
    )
    want = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want |= {p + k: v for k, v in attention.items()}
        if model.attention_sinks:
            want[p + "self_attn.sinks"] = (cfg["num_attention_heads"],)
        if i in model.sparse_layers:
            want |= _expert_shapes(model, p, family)
        else:
            want |= {p + f"mlp.{m}.weight": (rows[m], h) for m in mlp}
            want[p + "mlp.down_proj.weight"] = (h, ff)
        want |= {p + f"{family.get(n, n)}.weight": (h,) for n in norms}
        if model.output_bias:
            want[p + "self_attn.o_proj.bias"] = (h,)
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


def _expert_shapes(cfg: ModelConfig, prefix: str, family: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """A sparse layer's tensors (under `prefix`, model.layers.{i}.) by their shapes: the router, each expert's
    gate, up and down, the shared expert and its gate; named as the decoder names them, each part renamed by
    `family` (the decoder's names -> the family's: Mixtral's block_sparse_moe, w1, w3, w2)."""
    h, inter, shared = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    E = cfg.num_experts
    want = {"mlp.gate.weight": (E, h)}
    if cfg.declaration.expert_layout == "interleaved":  # GPT-OSS's stacks (with its biases)
        want |= {"mlp.experts.gate_up_proj": (E, h, 2 * inter), "mlp.experts.down_proj": (E, inter, h)}
    else:
        for e in range(E):
            want |= {f"mlp.experts.{e}.{m}.weight": (inter, h) for m in GATE_UP}
            want[f"mlp.experts.{e}.down_proj.weight"] = (h, inter)
    if cfg.expert_bias:
        want |= {"mlp.gate.bias": (E,), "mlp.experts.gate_up_proj_bias": (E, 2 * inter)}
        want["mlp.experts.down_proj_bias"] = (E, h)
    if cfg.router_score_bias:  # (DeepSeek-V3's correction bias)
        want["mlp.gate.e_score_correction_bias"] = (E,)
    if shared:
        want |= {f"mlp.shared_expert.{m}.weight": (shared, h) for m in GATE_UP}
        want["mlp.shared_expert.down_proj.weight"] = (h, shared)
        if cfg.shared_expert_gate:
            want["mlp.shared_expert_gate.weight"] = (1, h)
    return {prefix + ".".join(family.get(n, n) for n in k.split(".")): v for k, v in want.items()}


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _write_tokenizer(
    out_dir: Path, meta: dict, tokens: list[str], token_types: list[int], max_len: int
) -> None:
    """tokenizer.json, special_tokens_map.json and tokenizer_config.json (with the chat template) of the GGUF's
    vocabulary: byte-level BPE (`_bpe_tokenizer`) or SentencePiece's (motet/engine/weights/gguf_spm.py), its
    special tokens by their ids in the metadata, BOS added where `tokenizer.ggml.add_bos_token` says (llama.cpp's
    default where it says nothing: for SentencePiece vocabularies, not for BPE ones)."""
    from tokenizers import processors

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    spm = meta.get("tokenizer.ggml.model") == SPM_TOKENIZER
    if spm:
        try:
            tok = spm_tokenizer(
                tokens,
                list(meta["tokenizer.ggml.scores"]),
                token_types,
                add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                unknown=name("unknown_token_id")
                or next((t for t, k in zip(tokens, token_types, strict=True) if k == UNKNOWN), None),
            )
        except ValueError as e:
            raise PullError(str(e)) from None
    else:
        tok = _bpe_tokenizer(meta, tokens, token_types)
    ids = {t: i for i, t in enumerate(tokens)}
    for t, kind in zip(tokens, token_types, strict=True):  # added tokens must keep their GGUF ids
        if kind in ADDED_TYPES and tok.token_to_id(t) != ids[t]:
            raise PullError(f"special token {t!r} did not keep its id {ids[t]}")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spm))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = (name("bos_token_id") if add_bos else None), (name("eos_token_id") if add_eos else None)
    if spm and (bos or eos):  # (a byte-level BPE tokenizer's post-processor is its own: _bpe_tokenizer's)
        first, second = ([bos] if bos else []), ([eos] if eos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=[*first, "$A", *second],
            pair=[*first, "$A", *second, *first, "$B:1", *second],
            special_tokens=[(t, ids[t]) for t in dict.fromkeys(first + second)],
        )
    tok.save(str(out_dir / "tokenizer.json"))

    # SmolLM2-Instruct's own tokenizer_config: bos <|im_start|>, eos/pad <|im_end|>, unk <|endoftext|>.
    specials = {
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "unk_token": name("unknown_token_id"),
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    control = {t for t, ty in zip(tokens, token_types, strict=True) if ty == CONTROL}
    extra = [t for t in ("<|im_start|>", "<|im_end|>") if t in control]
    special_map = dict(specials, additional_special_tokens=extra)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        **special_map,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", tok_cfg)


def _bpe_tokenizer(meta: dict, tokens: list[str], token_types: list[int]):
    """The byte-level BPE tokenizer of a gpt2 vocabulary, split before BPE as its `tokenizer.ggml.pre` names
    (motet/engine/weights/gguf_pretokenizers.py); control tokens are special added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    pre = meta.get("tokenizer.ggml.pre", "default")  # one of PRE_TOKENIZERS (hf_config checked)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise PullError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in IGNORE_MERGES
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    control = [t for t, ty in zip(tokens, token_types, strict=True) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok
