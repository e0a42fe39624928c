"""OLMo 2 (Olmo2ForCausalLM): q and k RMS-normalized over all their heads, and post-norms: each block (attention,
MLP) reads the residual stream as it is and its output is normed before it joins the stream."""

from motet.models.declaration import Architecture, ModelLoadError


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    if key("attention.sliding_window", 0):
        raise ModelLoadError(
            f"{source}: sliding-window layers (attention.sliding_window: an OLMo 3 file); motet serves OLMo 2"
        )
    return {}


OLMO2 = Architecture(
    names=("Olmo2ForCausalLM",),
    qk_norm=True,
    qk_norm_whole=True,
    pre_norms=False,
    post_norms=True,
    # its norms after the attention and the MLP -> the decoder's names for them
    checkpoint_names={
        "post_attention_layernorm": "attn_out_norm",
        "post_feedforward_layernorm": "mlp_out_norm",
    },
    # llama.cpp's converter keeps q/k rows in Hugging Face's order (its NEOX rotary)
    gguf="olmo2",
    gguf_names={
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_config=gguf_config,
)
