"""Llama 1-3.x, SmolLM, and Mistral (the same layers; Mistral's sliding window is config.json's
`sliding_window`, read for every architecture)."""

from motet.models.declaration import Architecture

LLAMA = Architecture(names=("LlamaForCausalLM", "MistralForCausalLM"), gguf="llama", gguf_permuted_qk=True)
