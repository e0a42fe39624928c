"""What an attention layer keeps in the paged KV cache, as a value its declaration gives (`AttentionShape`'s
`cache_layout`, read through ModelConfig.cache_layout): the runner's cache tensors, the memory sizing and the
blocks' layout read that value, and none of them asks which attention it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from motet.models.config import ModelConfig


@dataclass(frozen=True)
class CacheLayout:
    """What one layer's paged cache keeps a token: `parts`, (heads, width) of each cache tensor (per-head
    attention's K and V of every KV head; or one row a token, that every query head reads). Under tensor
    parallelism each rank keeps its share of the KV heads, or with `replicated` all of every part. The parts are
    alike in shape where there are several (a block off the device stacks them: engine/core/kv_blocks.py).
    `per_head_elements`: what per-head K and V of the same attention would keep a token (None, the default: this
    layout is per-head K and V, and keeps `elements`)."""

    parts: tuple[tuple[int, int], ...]
    replicated: bool = False
    per_head_elements: int | None = None

    def __post_init__(self):
        if self.per_head_elements is None:
            object.__setattr__(self, "per_head_elements", self.elements)

    @property
    def elements(self) -> int:
        """Elements a token keeps in the layer's cache, over all ranks (times the KV dtype's size: its bytes)."""
        return sum(heads * width for heads, width in self.parts)

    def rank_parts(self, local_kv_heads: int) -> tuple[tuple[int, int], ...]:
        """The parts one rank keeps, holding `local_kv_heads` of the KV heads."""
        if self.replicated:
            return self.parts
        return tuple((local_kv_heads, width) for _, width in self.parts)

    def rank_share(self, kv_heads_share: float) -> float:
        """A rank's share of a block's bytes, the rank holding `kv_heads_share` of the KV heads."""
        return 1 if self.replicated else kv_heads_share


class AttentionShape:
    """An attention layer's shape as a family declares it. This base is the per-head attention (each group of
    query heads reads its own key and value head); a variant, declared beside the families under motet/models/,
    overrides what differs."""

    # The layer that runs it, as "module:Class" (imported when a model is built, the way vLLM's model registry names
    # its classes: the declaration stays below the engine)
    layer = "motet.engine.worker.model:Attention"

    def cache_layout(self, cfg: ModelConfig) -> CacheLayout:
        """K and V of every KV head, `head_dim` wide each."""
        return CacheLayout(((cfg.num_key_value_heads, cfg.head_dim),) * 2)

    def checkpoint_modules(self, cfg: ModelConfig) -> tuple[str, ...] | None:
        """Its linear modules as the checkpoint (and so PEFT) names them, in order; None: q, k, v and o as the
        family fuses them (motet/models/declaration.py's fused_modules)."""
        return None

    def projection_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of its projections by PEFT's names: q, k, v and o of every head."""
        h, q, kv = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def lora_rows(
        self, cfg: ModelConfig, q_heads: tuple[int, int], kv_heads: tuple[int, int]
    ) -> dict[str, tuple[int, int] | None]:
        """A tensor-parallel rank's part of each projection's LoRA, the rank holding the query heads `q_heads`
        and KV heads `kv_heads` ((first, count)): the (start, count) of the output rows it keeps (o_proj: of the
        input columns), or None where every rank keeps all of it."""
        (q0, qn), (kv0, kvn), D = q_heads, kv_heads, cfg.head_dim
        kv = (kv0 * D, kvn * D)
        return {"q_proj": (q0 * D, qn * D), "k_proj": kv, "v_proj": kv, "o_proj": (q0 * D, qn * D)}


PER_HEAD = AttentionShape()
