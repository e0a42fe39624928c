"""Qwen2-MoE (q/k/v biases, a shared expert behind a sigmoid gate) and Qwen3-MoE (per-head q/k norms, no
shared expert): experts on every `decoder_sparse_step`-th layer but `mlp_only_layers`."""

from motet.models.declaration import Architecture, ModelLoadError
from motet.models.fields import LIMITS, bounded, flag, is_number, sliding_window, top_k_experts
from motet.models.qwen2 import qwen_window


def experts(cfg: dict, num_layers: int, source: str) -> dict:
    # the Hub's Qwen3-MoE configs say num_experts; transformers >= 5 writes it as num_local_experts
    name = "num_local_experts" if "num_experts" not in cfg and "num_local_experts" in cfg else "num_experts"
    n = bounded(cfg[name], name, source, *LIMITS["num_experts"])
    step = bounded(cfg.get("decoder_sparse_step", 1), "decoder_sparse_step", source, 1, 1024)
    dense = cfg.get("mlp_only_layers") or []
    if not (isinstance(dense, list) and all(is_number(i) for i in dense)):
        raise ModelLoadError(f"{source}: mlp_only_layers must be a list of layer numbers, got {dense!r:.80}")
    dense = set(dense)
    sparse = tuple(i for i in range(num_layers) if n > 0 and i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=n,
        num_experts_per_tok=top_k_experts(cfg, n if sparse else None, source),
        moe_intermediate_size=bounded(
            cfg["moe_intermediate_size"], "moe_intermediate_size", source, *LIMITS["moe_intermediate_size"]
        ),
        norm_topk_prob=flag(cfg, "norm_topk_prob", source, False),
        shared_expert_intermediate_size=bounded(
            cfg.get("shared_expert_intermediate_size") or 0,
            "shared_expert_intermediate_size",
            source,
            *LIMITS["shared_expert_intermediate_size"],
        ),
        sparse_layers=sparse,
    )


def qwen2_moe_options(cfg: dict, source: str) -> dict:
    # Qwen2MoeConfig's layer_types: the even layers below max_window_layers slide
    return qwen_window(cfg, source, lambda i, first: i % 2 == 0 and i < first)


def qwen3_moe_options(cfg: dict, source: str) -> dict:
    # Qwen3-MoE's window (with use_sliding_window, false where unsaid) is every layer's
    return dict(sliding_window=sliding_window(cfg, source, used_by_default=False))


def gguf_experts(model_type: str, renormalized: bool):
    """The config fields of a Qwen MoE GGUF file (llama.cpp's qwen2moe / qwen3moe): transformers' model_type, the
    experts' and the shared expert's widths, whether the top-k weights are renormalized (llama.cpp: never for Qwen2-MoE, always for
    Qwen3-MoE, unless the file says)."""

    def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
        return dict(
            model_type=model_type,
            num_experts=key("expert_count"),
            num_experts_per_tok=key("expert_used_count"),
            moe_intermediate_size=key("expert_feed_forward_length"),
            shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0),
            norm_topk_prob=bool(key("expert_weights_norm", renormalized)),
        )

    return gguf_config


QWEN2_MOE = Architecture(
    names=("Qwen2MoeForCausalLM",),
    qkv_bias=True,
    experts=experts,
    options=qwen2_moe_options,
    gguf="qwen2moe",
    gguf_config=gguf_experts("qwen2_moe", False),
)
QWEN3_MOE = Architecture(
    names=("Qwen3MoeForCausalLM",),
    qk_norm=True,
    experts=experts,
    options=qwen3_moe_options,
    gguf="qwen3moe",
    gguf_config=gguf_experts("qwen3_moe", True),
    tool_format="hermes",
    reasoning_format="qwen3",
)
