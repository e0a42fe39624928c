"""DeepSeek's GGUF files as llama.cpp's converter writes them (architecture "deepseek2", V2-Lite, V2 and V3 alike):
its tensor names and its keys read as the config.json of DeepSeek-V2 or V3 (motet/models/deepseek.py declares
them)."""

from __future__ import annotations

from motet.models.latent import LatentAttention

# llama.cpp's converter's names (V2 and V3 alike): its attention's (the declaration's), then its shared experts'
GGUF_NAMES = LatentAttention.gguf_names | {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    """llama.cpp's deepseek2 files (V2-Lite, V2, V3): V3 where the experts are scored by sigmoid
    (expert_gating_func 2), or where the file says no gating but holds V3's correction bias (exp_probs_b: the
    converter writes the gating from config.json's scoring_func, which transformers 5 does not save; llama.cpp
    reads such a file's scores as softmax, its default for older V2 files, with the bias added for choosing, a
    router of no transformers model, where V3's own is sigmoid), else softmax (older V2 files); the latent widths
    (current files: key_length_mla / value_length_mla, key_length being the absorbed form's kv_lora_rank + rope;
    older ones: key_length / value_length), YaRN's mscale_all_dim from yarn_log_multiplier (written 0.1 x it;
    llama.cpp's rotary scales cos / sin by 1, transformers' by mscale / mscale_all_dim: one value for both)."""
    gating = key("expert_gating_func")
    if gating is None:
        sigmoid = any(name.endswith(".exp_probs_b.bias") for name in tensors)
    else:
        sigmoid = gating == 2
    rope = key("rope.dimension_count")
    k_len = key("attention.key_length_mla") or cfg["head_dim"]
    v_len = key("attention.value_length_mla") or key("attention.value_length")
    groups = key("expert_group_count")
    yarn = cfg["rope_scaling"]
    if yarn and yarn["rope_type"] == "yarn":
        log_mul = key("rope.scaling.yarn_log_multiplier")
        scale = (
            {"mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
            if log_mul
            else {"attention_factor": 1.0}
        )
        yarn = {**yarn, **scale}
    return dict(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        kv_lora_rank=key("attention.kv_lora_rank"),
        q_lora_rank=key("attention.q_lora_rank"),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=k_len - rope,
        v_head_dim=v_len,
        head_dim=rope,  # (transformers' config: the rotated part's width)
        partial_rotary_factor=1.0,
        rotary_dim=rope,
        num_key_value_heads=cfg["num_attention_heads"],
        rope_interleave=True,  # llama.cpp rotates neighbouring pairs, as DeepSeek's checkpoints hold them
        rope_scaling=yarn,
        n_routed_experts=key("expert_count"),
        num_experts_per_tok=key("expert_used_count"),
        moe_intermediate_size=key("expert_feed_forward_length"),
        n_shared_experts=key("expert_shared_count", 0),
        first_k_dense_replace=key("leading_dense_block_count", 0),
        routed_scaling_factor=key("expert_weights_scale", 1.0),
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if groups else "greedy"),
        n_group=groups,
        topk_group=key("expert_group_used_count"),
    )
