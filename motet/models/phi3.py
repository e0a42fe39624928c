"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layers, with q/k/v in one checkpoint module (qkv_proj) and gate/up
in another (gate_up_proj); PEFT adapters for them target those names."""

from motet.models.declaration import Architecture


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    """The window its converter writes (0: none; llama.cpp itself ignores it, transformers applies it) and the
    context the rope was trained on."""
    return dict(
        sliding_window=key("attention.sliding_window", 0) or None,
        original_max_position_embeddings=key(
            "rope.scaling.original_context_length", cfg["max_position_embeddings"]
        ),
    )


PHI3 = Architecture(
    names=("Phi3ForCausalLM",),
    fused_modules={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    # llama.cpp's files keep both fused tensors (ffn_up: gate's rows, then up's), rows in Hugging Face's order
    gguf="phi3",
    gguf_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    gguf_config=gguf_config,
)
