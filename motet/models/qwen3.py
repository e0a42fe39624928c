"""Qwen3 (dense): Llama's layers with each head's q and k RMS-normalized before the rotary, no q/k/v biases, Qwen2's
sliding window; calls in `<tool_call>` blocks, reasoning in `<think>`."""

from motet.models.declaration import Architecture
from motet.models.qwen2 import options

QWEN3 = Architecture(
    names=("Qwen3ForCausalLM",),
    qk_norm=True,
    options=options,
    gguf="qwen3",
    tool_format="hermes",
    reasoning_format="qwen3",
)
