"""What lora/ needs to know of the base model: the shapes of its decoder layers' linear modules.

A Protocol rather than the engine's ModelConfig, so that lora/ sits below engine/ and imports nothing of it
(engine.config.ModelConfig satisfies it, as does any object with these attributes).
"""

from __future__ import annotations

from typing import Protocol


class BaseShape(Protocol):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
