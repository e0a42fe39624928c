"""DeepSeek-V2 / V2-Lite and DeepSeek-V3: multi-head latent attention (ModelConfig.attention: the KV cache keeps
each token's compressed c_kv and one rotated key, the rotary on the rotated part only, in DeepSeek's interleaved
pairs, the softmax scaled by YaRN's mscale twice), the first `first_k_dense_replace` layers dense, the others
`n_routed_experts` experts plus `n_shared_experts` always-on shared experts (ungated, as one MLP of their summed
width). V2 routes by a softmax over the experts (greedy, or group-limited: top-k within the `topk_group` groups
of the best expert), V3 by each expert's sigmoid with a correction bias for choosing, in the groups of the best
two; both scale the chosen weights by `routed_scaling_factor`."""

from __future__ import annotations

from motet.models.declaration import Architecture, ModelLoadError
from motet.models.deepseek_gguf import GGUF_NAMES, gguf_config
from motet.models.fields import LIMITS, bounded, bounded_number, flag, top_k_experts
from motet.models.latent import LatentAttention

RANKS = (1, 2**16)  # kv_lora_rank, q_lora_rank and the head widths
# what transformers' DeepseekV3Config gives a config.json that omits them (transformers 5 saves only what differs
# from its defaults); V2's defaults (no groups, a factor of 1) are the loader's own
V3_DEFAULTS = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}


def _experts(cfg: dict, num_layers: int, source: str, sigmoid: bool) -> dict:
    if sigmoid:
        cfg = V3_DEFAULTS | cfg
    n = bounded(cfg.get("n_routed_experts") or 0, "n_routed_experts", source, *LIMITS["num_experts"])
    first_dense = bounded(cfg.get("first_k_dense_replace") or 0, "first_k_dense_replace", source, 0, 1024)
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(
            f"{source}: moe_layer_freq {cfg['moe_layer_freq']!r}: motet reads DeepSeek's experts on every layer "
            "from first_k_dense_replace on (moe_layer_freq 1)"
        )
    sparse = tuple(range(first_dense, num_layers)) if n else ()
    inter = bounded(
        cfg["moe_intermediate_size"], "moe_intermediate_size", source, *LIMITS["moe_intermediate_size"]
    )
    shared = bounded(cfg.get("n_shared_experts") or 0, "n_shared_experts", source, 0, 64)
    scoring = cfg.get("scoring_func") or ("sigmoid" if sigmoid else "softmax")  # (the Hub's configs say it)
    if scoring != ("sigmoid" if sigmoid else "softmax"):
        raise ModelLoadError(
            f"{source}: scoring_func {scoring!r}: DeepSeek-{'V3' if sigmoid else 'V2'} routes by "
            f"{'sigmoid' if sigmoid else 'softmax'}"
        )
    method = cfg.get("topk_method") or ("noaux_tc" if sigmoid else "greedy")
    methods = ("noaux_tc",) if sigmoid else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ModelLoadError(f"{source}: topk_method {method!r}: motet routes by {' or '.join(methods)}")
    groups, kept = 1, 1
    if method != "greedy" and cfg.get("n_group"):
        groups = bounded(cfg["n_group"], "n_group", source, 1, max(1, n))
        kept = bounded(cfg.get("topk_group") or groups, "topk_group", source, 1, groups)
        if n % groups:
            raise ModelLoadError(f"{source}: n_group ({groups}) must divide n_routed_experts ({n})")
        if sigmoid and n // groups < 2:  # (transformers' router fails on it: topk of 2 in a group of 1)
            raise ModelLoadError(
                f"{source}: n_routed_experts ({n}) / n_group ({groups}): DeepSeek-V3 scores each group of experts "
                "by its best two, so every group must hold at least two"
            )
    return dict(
        num_experts=n,
        num_experts_per_tok=top_k_experts(cfg, n if sparse else None, source),
        moe_intermediate_size=inter,
        # V2 as transformers reads it: the chosen softmax weights as they are (its norm_topk_prob unread)
        norm_topk_prob=flag(cfg, "norm_topk_prob", source, True) if sigmoid else False,
        shared_expert_intermediate_size=inter * shared,
        shared_expert_gate=False,
        sparse_layers=sparse,
        router_scoring="sigmoid" if sigmoid else "softmax",
        router_score_bias=sigmoid,
        expert_groups=groups,
        expert_groups_kept=kept,
        routed_scaling_factor=bounded_number(
            cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor", source
        ),
    )


def v2_experts(cfg: dict, num_layers: int, source: str) -> dict:
    return _experts(cfg, num_layers, source, sigmoid=False)


def v3_experts(cfg: dict, num_layers: int, source: str) -> dict:
    return _experts(cfg, num_layers, source, sigmoid=True)


def latent_options(cfg: dict, source: str) -> dict:
    """The latent attention's widths; the q / k head width is the unrotated and rotated parts together, the
    rotary turns the rotated part only (config.json's head_dim, where written, is that part's width)."""
    q_rank = cfg.get("q_lora_rank")
    latent = LatentAttention(
        kv_lora_rank=bounded(cfg["kv_lora_rank"], "kv_lora_rank", source, *RANKS),
        q_lora_rank=None if q_rank is None else bounded(q_rank, "q_lora_rank", source, *RANKS),
        qk_nope_head_dim=bounded(cfg["qk_nope_head_dim"], "qk_nope_head_dim", source, 0, 2**12),
        qk_rope_head_dim=bounded(cfg["qk_rope_head_dim"], "qk_rope_head_dim", source, 2, 2**12),
        v_head_dim=bounded(cfg["v_head_dim"], "v_head_dim", source, *RANKS),
        rope_interleave=flag(cfg, "rope_interleave", source, True),
    )
    if latent.qk_rope_head_dim % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim must be even, got {latent.qk_rope_head_dim}")
    return dict(
        attention=latent,
        head_dim=latent.qk_nope_head_dim + latent.qk_rope_head_dim,
        rotary_dim=latent.qk_rope_head_dim,
        # every head reads the one latent: config.json's num_key_value_heads is not read
        num_key_value_heads=bounded(cfg["num_attention_heads"], "num_attention_heads", source, 1, 1024),
    )


DEEPSEEK_V2 = Architecture(
    names=("DeepseekV2ForCausalLM",),
    attention=LatentAttention,
    experts=v2_experts,
    options=latent_options,
    checkpoint_names={"shared_experts": "shared_expert"},
    # llama.cpp writes V2 and V3 as "deepseek2" (V3 by its sigmoid gating: `gguf_config`)
    gguf="deepseek2",
    gguf_names=GGUF_NAMES,
    gguf_config=gguf_config,
)
DEEPSEEK_V3 = Architecture(
    names=("DeepseekV3ForCausalLM",),
    attention=LatentAttention,
    experts=v3_experts,
    options=latent_options,
    checkpoint_names={"shared_experts": "shared_expert"},
    skips_trailing_layers=True,  # its multi-token-prediction layer(s), not read (as transformers)
    gguf_names=GGUF_NAMES,  # (its files are "deepseek2" ones: DEEPSEEK_V2's `gguf`)
)
