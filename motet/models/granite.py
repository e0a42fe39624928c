"""Granite 3 (GraniteForCausalLM): Llama's layers with four constant scales: the embeddings times
embedding_multiplier, attention scores times attention_multiplier (in place of 1 / sqrt(head_dim)), each block's
output times residual_multiplier before the residual add, and the logits divided by logits_scaling."""

import math

from motet.models.declaration import Architecture, ModelLoadError


def options(cfg: dict, source: str) -> dict:
    out = {}
    for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
        value = float(cfg.get(name, 1.0))
        if not (math.isfinite(value) and value > 0):
            raise ModelLoadError(f"{source}: {name} must be a positive number, got {cfg.get(name)!r}")
        out[name] = value
    return out


GRANITE = Architecture(names=("GraniteForCausalLM",), options=options)
