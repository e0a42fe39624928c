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


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    """llama.cpp writes Mixtral as a Llama file with experts: their count and how many a token takes."""
    return dict(
        model_type="mixtral",
        num_local_experts=key("expert_count"),
        num_experts_per_tok=key("expert_used_count"),
    )


MIXTRAL = Architecture(
    names=("MixtralForCausalLM",),
    experts=experts,
    checkpoint_names={"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    # llama.cpp's converter writes it as "llama" (q/k rows permuted) with stacked experts (`{e}`: each expert's)
    gguf="llama",
    gguf_permuted_qk=True,
    gguf_names={
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    },
    gguf_config=gguf_config,
)
