"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's layers without q/k norms and with soft-capping (attention scores and
the final logits squashed by cap * tanh(x / cap)), sliding-window layers every other one (`layer_types`, by
default the even layers) sharing the global rope base."""

import dataclasses

from motet.models.declaration import ModelLoadError
from motet.models.fields import every_other_layer
from motet.models.gemma3 import GEMMA3, gemma_gguf, gemma_options


def options(cfg: dict, source: str) -> dict:
    return gemma_options(cfg, source, every_other_layer(cfg))


def gguf_config(key, cfg: dict, source: str, tensors) -> dict:
    """llama.cpp's reading: every other layer sliding (the even ones), a window of 4096 where unsaid, one rope
    base for all layers."""
    if key("rope.freq_base_swa", cfg["rope_theta"]) != cfg["rope_theta"]:
        raise ModelLoadError(f"{source}: a rope base of its own on the sliding layers; Gemma 2 shares one")
    return dict(
        gemma_gguf(key, cfg, 2, 46),
        sliding_window=key("attention.sliding_window", 4096),
        attn_logit_softcapping=key("attn_logit_softcapping", None),
    )


GEMMA2 = dataclasses.replace(
    GEMMA3,
    names=("Gemma2ForCausalLM",),
    qk_norm=False,
    options=options,
    gguf="gemma2",
    gguf_config=gguf_config,
)
