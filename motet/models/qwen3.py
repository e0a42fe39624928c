"""Qwen3 (dense): Llama's layers with each head's q and k RMS-normalized before the rotary, no q/k/v biases; calls
in `<tool_call>` blocks, reasoning in `<think>`."""

from motet.models.declaration import Architecture

QWEN3 = Architecture(
    names=("Qwen3ForCausalLM",), qk_norm=True, gguf="qwen3", tool_format="hermes", reasoning_format="qwen3"
)
