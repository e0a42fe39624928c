"""GPT-OSS (GptOssForCausalLM): biases on q/k/v and o, a sink logit per head in each attention softmax,
sliding-window layers every other one (`layer_types`), YaRN rotary, and a mixture of experts on every layer: a
router with a bias, whose top-k logits are softmaxed, experts with biases and a clamped SwiGLU, stored stacked
with gate and up columns interleaved (in MXFP4 in OpenAI's checkpoints). It writes harmony: its calls and
reasoning are channels of its output."""

from motet.models.declaration import Architecture, ModelLoadError
from motet.models.fields import bounded_number, every_other_layer, flag, sliding_layers
from motet.models.mixtral import experts  # the same: every layer, num_local_experts, top-k renormalized


def options(cfg: dict, source: str) -> dict:
    # OpenAI's checkpoints hold the experts in MXFP4, dequantized as they load (motet/engine/weights/mxfp4.py)
    quantization = cfg.get("quantization_config") or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if quantization and method != "mxfp4":
        raise ModelLoadError(
            f"{source}: quantization_config {method!r}: GPT-OSS checkpoints are read in floats or with MXFP4 experts"
        )
    return dict(
        output_bias=flag(cfg, "attention_bias", source, True),
        attention_sinks=True,
        expert_bias=True,
        expert_act="swiglu_limit",
        swiglu_alpha=bounded_number(cfg.get("swiglu_alpha", 1.702), "swiglu_alpha", source),
        swiglu_limit=bounded_number(cfg.get("swiglu_limit", 7.0), "swiglu_limit", source),
        sliding_layers=sliding_layers(cfg, source, every_other_layer(cfg)),
    )


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    """llama.cpp's gpt-oss files: the experts' count and top-k, the window of the even layers (llama.cpp slides
    every other layer, as `layer_types` defaults), YaRN as OpenAI's checkpoints say it (truncate false)."""
    rope = cfg["rope_scaling"]
    return dict(
        model_type="gpt_oss",
        num_local_experts=key("expert_count"),
        num_experts_per_tok=key("expert_used_count"),
        sliding_window=key("attention.sliding_window"),
        rope_scaling={**rope, "truncate": False} if rope and rope["rope_type"] == "yarn" else rope,
    )


GPT_OSS = Architecture(
    names=("GptOssForCausalLM",),
    qkv_bias=True,
    experts=experts,
    options=options,
    activation=None,  # (its experts' own clamped SwiGLU; transformers' GPT-OSS reads no hidden_act)
    expert_layout="interleaved",
    checkpoint_names={"router": "gate"},
    tool_format="openai",  # harmony's channels: calls on commentary, reasoning on analysis
    reasoning_format="openai_gptoss",
    # llama.cpp's converter: the sinks as a weight, the router ffn_gate_inp, each expert's gate and up split
    # (weights [E, I, H] each, in MXFP4 blocks from OpenAI's checkpoints; biases [E, I] each)
    gguf="gpt-oss",
    gguf_names={
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp": "mlp.router",
        "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    },
    gguf_config=gguf_config,
)
