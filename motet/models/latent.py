"""The shape of DeepSeek's multi-head latent attention, as a family declares it (motet/models/deepseek.py) and the
decoder, the KV cache and the GGUF readers read it (ModelConfig.attention; Architecture.attention)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from motet.models.attention import AttentionShape, CacheLayout, ModelSizes

if TYPE_CHECKING:
    import torch


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [H * (nope + v), rank] from the converter's attn_k_b [H, rank, nope] (each head's key half,
    transposed) and attn_v_b [H, v, rank]: each head's key rows, then its value rows."""
    import torch

    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1)


@dataclass(frozen=True)
class LatentAttention(AttentionShape):
    """DeepSeek's multi-head latent attention (MLA): q from the hidden state (`q_proj`, or through a low-rank
    `q_a_proj` -> RMSNorm -> `q_b_proj` where `q_lora_rank` is set), each head's q a part without the rotary
    (`qk_nope_head_dim`) and a rotated part (`qk_rope_head_dim`); one `kv_a_proj_with_mqa` makes every token's
    latent `c_kv` (`kv_lora_rank`, RMS-normed) and one rotated key shared by all heads; `kv_b_proj` expands c_kv
    into each head's unrotated key and its value (`v_head_dim`). The KV cache keeps c_kv and the rotated key only.
    `rope_interleave`: the rotated parts pair neighbouring values (DeepSeek's layout) rather than halves."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    layer = "motet.engine.worker.latent_attention:LatentAttention"
    # (its q_proj, unfused, takes the q/k/v group with k and v empty)
    own_projections: ClassVar[tuple[str, ...]] = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    # llama.cpp's converter's names (V2 and V3 alike); current converters split kv_b_proj into attn_k_b / attn_v_b
    gguf_names: ClassVar[dict[str, str]] = {
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b.weight": "self_attn.kv_b_proj.weight",
        "attn_v_b.weight": "self_attn.kv_b_proj.weight",
    }
    gguf_joins: ClassVar[dict[str, Callable]] = {"self_attn.kv_b_proj.weight": _kv_b}
    # its first projections: q_a (or q, which has no bias) and kv_a
    gguf_bias_probes: ClassVar[tuple[str, ...]] = ("attn_q_a", "attn_kv_a_mqa")

    def cache_layout(self, cfg: ModelSizes) -> CacheLayout:
        """One row a token, c_kv then the rotated key (vLLM's MLA layout), that every head reads: every
        tensor-parallel rank keeps all of it. Per-head K and V would be every head's key (its unrotated and rotated
        parts: `head_dim`) and value, as the expanded form makes them."""
        return CacheLayout(
            ((1, self.kv_lora_rank + self.qk_rope_head_dim),),
            replicated=True,
            per_head_elements=cfg.num_attention_heads * (cfg.head_dim + self.v_head_dim),
        )

    def checkpoint_modules(self, cfg: ModelSizes) -> tuple[str, ...]:
        q = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def projection_shapes(self, cfg: ModelSizes) -> dict[str, tuple[int, int]]:
        """Its projections' (q_proj where `q_lora_rank` is None, else q_a_proj and q_b_proj); k_proj and v_proj
        (and q_proj beside q_a_proj) empty."""
        h, heads, qk = cfg.hidden_size, cfg.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        shapes = {
            "q_proj": (h, 0),
            "k_proj": (h, 0),
            "v_proj": (h, 0),
            "kv_a_proj_with_mqa": (h, self.kv_lora_rank + self.qk_rope_head_dim),
            "kv_b_proj": (self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)),
            "o_proj": (heads * self.v_head_dim, h),
        }
        if self.q_lora_rank is None:
            shapes["q_proj"] = (h, heads * qk)
        else:
            shapes |= {"q_a_proj": (h, self.q_lora_rank), "q_b_proj": (self.q_lora_rank, heads * qk)}
        return shapes

    def lora_rows(
        self, cfg: ModelSizes, q_heads: tuple[int, int], kv_heads: tuple[int, int]
    ) -> dict[str, tuple[int, int] | None]:
        """Its heads' rows of q / q_b / kv_b and columns of o; q_a and kv_a whole on every rank."""
        (q0, qn) = q_heads
        qk, kv_b = self.qk_nope_head_dim + self.qk_rope_head_dim, self.qk_nope_head_dim + self.v_head_dim
        return {
            "q_proj": (q0 * qk, qn * qk),
            "q_b_proj": (q0 * qk, qn * qk),
            "kv_b_proj": (q0 * kv_b, qn * kv_b),
            "o_proj": (q0 * self.v_head_dim, qn * self.v_head_dim),
            "q_a_proj": None,
            "kv_a_proj_with_mqa": None,
        }

    def checkpoint_shapes(
        self, cfg: ModelSizes, fused_modules: Mapping[str, tuple[str, ...]]
    ) -> dict[str, tuple[int, ...]]:
        """q (q_proj, or q_a_proj, its norm and q_b_proj where `q_lora_rank` is set), kv_a_proj_with_mqa and its
        norm, kv_b_proj and o_proj; the biases of q_a, kv_a and o where `attention_bias` says."""
        h, heads, qk = cfg.hidden_size, cfg.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        kv_a = self.kv_lora_rank + self.qk_rope_head_dim
        want = {
            "kv_a_proj_with_mqa.weight": (kv_a, h),
            "kv_a_layernorm.weight": (self.kv_lora_rank,),
            "kv_b_proj.weight": (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            "o_proj.weight": (h, heads * self.v_head_dim),
        }
        if self.q_lora_rank is None:
            want["q_proj.weight"] = (heads * qk, h)
        else:
            want |= {"q_a_proj.weight": (self.q_lora_rank, h), "q_a_layernorm.weight": (self.q_lora_rank,)}
            want["q_b_proj.weight"] = (heads * qk, self.q_lora_rank)
        if cfg.attention_bias:
            want |= {"kv_a_proj_with_mqa.bias": (kv_a,), "o_proj.bias": (h,)}
            if self.q_lora_rank is not None:
                want["q_a_proj.bias"] = (self.q_lora_rank,)
        return {f"self_attn.{k}": v for k, v in want.items()}
