"""What lora/ needs to know of the base model: the shapes of its decoder layers' linear modules, its vocabulary.

A Protocol rather than the engine's ModelConfig, so that lora/ sits below engine/ and imports nothing of it
(engine.config.ModelConfig satisfies it, as does any object with these attributes). A base may also say
`is_moe` (a mixture-of-experts model, whose MLPs LoRA does not target yet: `is_moe_base`); absent, False.
"""

from __future__ import annotations

from typing import Protocol


class BaseShape(Protocol):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def is_moe_base(base: BaseShape) -> bool:
    """Whether `base` is a mixture-of-experts model (ModelConfig.is_moe); bases without the attribute are dense."""
    return bool(getattr(base, "is_moe", False))
