"""Qwen2 and Qwen2.5: Llama's layers with q/k/v biases; a sliding window, where use_sliding_window says so, on the
layers from max_window_layers on."""

from collections.abc import Callable

from motet.models.declaration import Architecture
from motet.models.fields import bounded, sliding_layers, sliding_window


def qwen_window(cfg: dict, source: str, slides: Callable[[int, int], bool]) -> dict:
    """transformers' reading of a Qwen config's window: one only with use_sliding_window (false where unsaid), on
    the layers `layer_types` lists, or else on each layer i that `slides(i, max_window_layers)`; the others attend
    to every position."""
    window = sliding_window(cfg, source, used_by_default=False)
    default = ()
    if window is not None:
        first = bounded(cfg.get("max_window_layers", 28), "max_window_layers", source, 0, 2**31 - 1)
        default = tuple(i for i in range(int(cfg["num_hidden_layers"])) if slides(i, first))
    layers = sliding_layers(cfg, source, default)
    # no layer sliding: no window (a window with no layers named would slide every layer)
    return dict(sliding_window=window if layers else None, sliding_layers=layers)


def options(cfg: dict, source: str) -> dict:
    return qwen_window(
        cfg, source, lambda i, first: i >= first
    )  # (Qwen2Config's and Qwen3Config's layer_types)


QWEN2 = Architecture(names=("Qwen2ForCausalLM",), qkv_bias=True, options=options, gguf="qwen2")
