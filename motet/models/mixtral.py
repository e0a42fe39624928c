"""Mixtral: Mistral's attention, every layer's MLP a mixture of `num_local_experts` experts (w1 / w3 / w2 are
gate / up / down), the top-k router weights always renormalized."""

from motet.models.declaration import Architecture
from motet.models.fields import LIMITS, bounded, top_k_experts


def experts(cfg: dict, num_layers: int, source: str) -> dict:
    n = bounded(cfg["num_local_experts"], "num_local_experts", source, *LIMITS["num_experts"])
    return dict(
        num_experts=n,
        num_experts_per_tok=top_k_experts(cfg, n, source),
        moe_intermediate_size=cfg["intermediate_size"],  # (checked with the dense fields)
        norm_topk_prob=True,
        sparse_layers=tuple(range(num_layers)),
    )


MIXTRAL = Architecture(
    names=("MixtralForCausalLM",),
    experts=experts,
    checkpoint_names={"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
)
