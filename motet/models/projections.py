"""The decoder layer's linear projections by their Hugging Face names (q_proj ... down_proj), and how the decoder
(motet/engine/worker/model.py) fuses those that read the same input. One list for the checkpoint readers, the LoRA
format and pool, and the adapter trainer."""

from __future__ import annotations

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# Projections that read the same input, in the order of their rows in the decoder's fused module (qkv_proj,
# gate_up_proj; o_proj and down_proj alone): one matmul each, and one LoRA shrink and expand each.
PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (QKV, ("o_proj",), GATE_UP, ("down_proj",))
PROJECTIONS = tuple(m for group in PROJECTION_GROUPS for m in group)  # every one: what LoRA may target
# (an attention's own projections besides these: its declaration's, motet/models/attention.py's own_projections)
# The decoder's fused modules -> the projections they hold, rows in this order.
DECODER_FUSED = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}
# A projection -> (the decoder's fused module that holds it, its shard there).
FUSED_SHARD = {m: (fused, i) for fused, parts in DECODER_FUSED.items() for i, m in enumerate(parts)}


def projection_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int
) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of a decoder layer of these sizes."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
