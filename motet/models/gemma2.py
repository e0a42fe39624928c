"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's layers without q/k norms and with soft-capping (attention scores and
the final logits squashed by cap * tanh(x / cap)), sliding-window layers every other one (`layer_types`, by
default the even layers) sharing the global rope base."""

from motet.models.declaration import Architecture
from motet.models.gemma3 import GEMMA_NORM_NAMES, gemma_options


def options(cfg: dict, source: str) -> dict:
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(int(cfg["num_hidden_layers"]))
    ]
    return gemma_options({**cfg, "layer_types": types}, source)


GEMMA2 = Architecture(
    names=("Gemma2ForCausalLM",),
    post_norms=True,
    norm_weight_offset=1.0,
    options=options,
    checkpoint_names=GEMMA_NORM_NAMES,
)
