"""What an attention layer keeps in the paged KV cache, as a value its declaration gives (`AttentionShape`'s
`cache_layout`, read through ModelConfig.cache_layout): the runner's cache tensors, the memory sizing and the
blocks' layout read that value, and none of them asks which attention it is."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from motet.models.projections import QKV


class ModelSizes(Protocol):
    """What an attention's declaration reads of a model's config: ModelConfig (motet/models/config.py, which
    imports this module) has each."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    qk_norm: bool
    qk_norm_whole: bool
    projection_rows: dict[str, int]


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
    overrides what differs; a family names it (Architecture.attention) for the readers of a GGUF file, which read
    its tensors and metadata before there is a config."""

    # Its projections besides q, k, v and o (PEFT's names, under self_attn), each alone in a LoRA group after the
    # shared four (motet/lora/pool.py; every declared attention's: motet/models/__init__.py's OWN_PROJECTIONS)
    own_projections: ClassVar[tuple[str, ...]] = ()
    # The layer that runs it, as "module:Class" (imported when a model is built, the way vLLM's model registry names
    # its classes: the declaration stays below the engine)
    layer = "motet.engine.worker.model:Attention"

    # llama.cpp's names of its tensors that are not Llama's (a GGUF block tensor -> its Hugging Face module, as
    # Architecture.gguf_names): a family that declares the attention takes them into its own `gguf_names`.
    gguf_names: ClassVar[dict[str, str]] = {}
    # A tensor (its Hugging Face name's end) llama.cpp's converter writes as two GGUF tensors -> how their values
    # join back, in the order of the family's GGUF names for them (motet/engine/weights/gguf_names.py's JOINS).
    gguf_joins: ClassVar[dict[str, Callable]] = {}
    # The GGUF tensors (their block names) whose bias in the first layer means the file's `attention_bias`.
    gguf_bias_probes: ClassVar[tuple[str, ...]] = ("attn_q",)

    def cache_layout(self, cfg: ModelSizes) -> CacheLayout:
        """K and V of every KV head, `head_dim` wide each."""
        return CacheLayout(((cfg.num_key_value_heads, cfg.head_dim),) * 2)

    def checkpoint_modules(self, cfg: ModelSizes) -> tuple[str, ...] | None:
        """Its linear modules as the checkpoint (and so PEFT) names them, in order; None: q, k, v and o as the
        family fuses them (motet/models/declaration.py's fused_modules)."""
        return None

    def projection_shapes(self, cfg: ModelSizes) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of its projections by PEFT's names: q, k, v and o of every head."""
        h, q, kv = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}

    def lora_rows(
        self, cfg: ModelSizes, q_heads: tuple[int, int], kv_heads: tuple[int, int]
    ) -> dict[str, tuple[int, int] | None]:
        """A tensor-parallel rank's part of each projection's LoRA, the rank holding the query heads `q_heads`
        and KV heads `kv_heads` ((first, count)): the (start, count) of the output rows it keeps (o_proj: of the
        input columns), or None where every rank keeps all of it."""
        (q0, qn), (kv0, kvn), D = q_heads, kv_heads, cfg.head_dim
        kv = (kv0 * D, kvn * D)
        return {"q_proj": (q0 * D, qn * D), "k_proj": kv, "v_proj": kv, "o_proj": (q0 * D, qn * D)}

    def checkpoint_shapes(
        self, cfg: ModelSizes, fused_modules: Mapping[str, tuple[str, ...]]
    ) -> dict[str, tuple[int, ...]]:
        """Its tensors in a layer of its family's checkpoints, by their names under the layer
        (self_attn.q_proj.weight) and their shapes: q, k and v (or the module of the family's `fused_modules` that
        holds them: Phi-3's qkv_proj), o, the biases of q, k and v where `attention_bias` says, the q / k norms
        (per head or across them) where the family has them."""
        h, rows, attn = cfg.hidden_size, cfg.projection_rows, list(QKV)
        for fused, parts in fused_modules.items():
            if parts[0] in attn:
                attn = [fused]
            rows[fused] = sum(rows[p] for p in parts)
        q, kv = rows["q_proj"], rows["k_proj"]
        want = {f"self_attn.{m}.weight": (rows[m], h) for m in attn}
        want["self_attn.o_proj.weight"] = (h, q)
        if cfg.attention_bias:
            want |= {f"self_attn.{m}.bias": (rows[m],) for m in attn}
        if cfg.qk_norm:
            want |= {
                "self_attn.q_norm.weight": (q if cfg.qk_norm_whole else cfg.head_dim,),
                "self_attn.k_norm.weight": (kv if cfg.qk_norm_whole else cfg.head_dim,),
            }
        return want


PER_HEAD = AttentionShape()
