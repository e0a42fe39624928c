"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layers, with q/k/v in one checkpoint module (qkv_proj) and gate/up
in another (gate_up_proj); PEFT adapters for them target those names."""

from motet.models.declaration import Architecture

PHI3 = Architecture(
    names=("Phi3ForCausalLM",),
    fused_modules={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
)
