"""Qwen2 and Qwen2.5: Llama's layers with q/k/v biases; a sliding window, where use_sliding_window says so, on the
layers from max_window_layers on."""

from motet.models.declaration import Architecture, bounded, sliding_layers, sliding_window


def qwen_sliding(cfg: dict, source: str) -> dict:
    """transformers' reading (Qwen2Config, Qwen3Config): a window only with use_sliding_window (false where
    unsaid), on the layers `layer_types` lists, or else on those from max_window_layers on; the others attend to
    every position."""
    window = sliding_window(cfg, source, used_by_default=False)
    default = ()
    if window is not None:
        first = bounded(cfg.get("max_window_layers", 28), "max_window_layers", source, 0, 2**31 - 1)
        default = tuple(range(first, int(cfg["num_hidden_layers"])))
    layers = sliding_layers(cfg, source, default)
    # no layer sliding: no window (a window with no layers named would slide every layer)
    return dict(sliding_window=window if layers else None, sliding_layers=layers)


QWEN2 = Architecture(names=("Qwen2ForCausalLM",), qkv_bias=True, options=qwen_sliding, gguf="qwen2")
