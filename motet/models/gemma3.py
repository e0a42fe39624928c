"""Gemma 3, text (Gemma3ForCausalLM): sandwich norms (before and after each block) whose weights are offsets from
1, per-head q/k norms, embeddings times sqrt(hidden), GELU (tanh) in the MLP, attention scaled by
query_pre_attn_scalar, and sliding-window layers (`layer_types`) with their own rope base
(rope_local_base_freq), which keep only their window past it (motet/engine/core/kv_window.py)."""

import math

from motet.models.declaration import Architecture
from motet.models.fields import bounded, bounded_number, sliding_layers

# Gemma's norms after the attention, before the MLP and after it -> the decoder's names for them
GEMMA_NORM_NAMES = {
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_out_norm",
}


def gemma_options(cfg: dict, source: str, default_sliding: tuple[int, ...]) -> dict:
    """What Gemma 2 and 3 read alike: the embedding and query scales, soft-capping, the sliding layers
    (`default_sliding` where config.json does not list them)."""
    caps = {}
    for field, cap in (
        ("attn_softcap", "attn_logit_softcapping"),
        ("logit_softcap", "final_logit_softcapping"),
    ):
        if cfg.get(cap) is not None:
            caps[field] = bounded_number(cfg[cap], cap, source)
    return dict(
        embedding_multiplier=math.sqrt(int(cfg["hidden_size"])),
        attention_multiplier=bounded_number(
            cfg.get("query_pre_attn_scalar", 256), "query_pre_attn_scalar", source
        )
        ** -0.5,
        sliding_layers=sliding_layers(cfg, source, default_sliding),
        **caps,
    )


def gemma_gguf(key, cfg: dict, pattern: int, layers_27b: int) -> dict:
    """A Gemma file's config as llama.cpp reads it: sliding layers by attention.sliding_window_pattern (a flag
    per layer, or every n-th layer global: `pattern` when unsaid), queries scaled by 1/sqrt(head_dim) but for
    the 27B (`layers_27b` layers: 1/sqrt(hidden / heads)), norm weights stored as 1 + w (GGUF_NAMES)."""
    n = int(cfg["num_hidden_layers"])
    flags = key("attention.sliding_window_pattern", pattern)
    if not isinstance(flags, list):
        flags = [int(flags) == 0 or i % int(flags) < int(flags) - 1 for i in range(n)]
    big = n == layers_27b
    return dict(
        layer_types=["sliding_attention" if f else "full_attention" for f in flags],
        query_pre_attn_scalar=cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=key("final_logit_softcapping", None),
    )


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    window = key("attention.sliding_window", 0)
    out = dict(gemma_gguf(key, cfg, 6, 62), model_type="gemma3_text", sliding_window=window or None)
    if not window:  # no sliding layers
        out["layer_types"] = ["full_attention"] * int(cfg["num_hidden_layers"])
    return dict(out, rope_local_base_freq=key("rope.freq_base_swa", 10000.0))


# the GGUF names of its norms after the attention, before the MLP and after it
GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def options(cfg: dict, source: str) -> dict:
    # without layer_types (the Hub's first configs), transformers' reading of sliding_window_pattern: every
    # pattern-th layer global, the others sliding
    pattern = bounded(cfg.get("sliding_window_pattern", 6), "sliding_window_pattern", source, 1, 1024)
    default = tuple(i for i in range(int(cfg["num_hidden_layers"])) if (i + 1) % pattern)
    local, name = cfg.get("rope_local_base_freq"), "rope_local_base_freq"  # the Hub's configs
    if local is None:  # transformers >= 5 nests it per layer type
        local = ((cfg.get("rope_parameters") or {}).get("sliding_attention") or {}).get("rope_theta", 10000.0)
        name = "rope_parameters.sliding_attention.rope_theta"
    return dict(gemma_options(cfg, source, default), rope_local_theta=bounded_number(local, name, source))


GEMMA3 = Architecture(
    names=("Gemma3ForCausalLM",),
    qk_norm=True,
    post_norms=True,
    norm_weight_offset=1.0,
    activation=("hidden_activation", "gelu_pytorch_tanh"),  # GeGLU
    options=options,
    checkpoint_names=GEMMA_NORM_NAMES,
    gguf="gemma3",
    gguf_names=GGUF_NAMES,
    gguf_config=gguf_config,
)
