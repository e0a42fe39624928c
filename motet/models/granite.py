"""Granite 3 (GraniteForCausalLM): Llama's layers with four constant scales: the embeddings times
embedding_multiplier, attention scores times attention_multiplier (in place of 1 / sqrt(head_dim)), each block's
output times residual_multiplier before the residual add, and the logits divided by logits_scaling."""

from motet.models.declaration import Architecture
from motet.models.fields import bounded_number


def options(cfg: dict, source: str) -> dict:
    names = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
    return {name: bounded_number(cfg.get(name, 1.0), name, source) for name in names}


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    """The multipliers as llama.cpp's converter writes them (as scales, each only where the config had it) and
    reads them: attention scores by 1/sqrt(head_dim) where unsaid, the others 1."""
    return dict(
        embedding_multiplier=key("embedding_scale", None) or 1.0,
        attention_multiplier=key("attention.scale", None) or cfg["head_dim"] ** -0.5,
        residual_multiplier=key("residual_scale", None) or 1.0,
        logits_scaling=key("logit_scale", None) or 1.0,
    )


# llama.cpp's converter permutes q/k rows for its rotary, as Llama's
GRANITE = Architecture(
    names=("GraniteForCausalLM",),
    options=options,
    gguf="granite",
    gguf_permuted_qk=True,
    gguf_config=gguf_config,
)
