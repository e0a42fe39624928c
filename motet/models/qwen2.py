"""Qwen2 and Qwen2.5: Llama's layers with q/k/v biases."""

from motet.models.declaration import Architecture

QWEN2 = Architecture(names=("Qwen2ForCausalLM",), qkv_bias=True, gguf="qwen2")
