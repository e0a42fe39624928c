"""Tiny random-weight Llama-family checkpoints (with a small byte-level tokenizer) built on the fly."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "motet", "tokens": [1, 2, 3], "ok": true}',
    "Ünïcödé façade naïve café — 東京 北京 🎵🎶 emoji and accents.",
] * 20

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Every tiny model's layers: built in a second, with grouped-query attention (4 query heads on 2 KV heads).
TINY_LAYERS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


# Each family's tiny checkpoint by its `arch` name: the transformers config class it is written with.
CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,  # q_norm / k_norm per head, no q/k/v biases
    "gemma2": Gemma2Config,  # Gemma 3's norms without q/k norms, soft-capping, every other layer sliding
    "gemma3": Gemma3TextConfig,  # sandwich norms (1 + w), GeGLU, sliding-window layers with their rope base
    "gpt_oss": GptOssConfig,  # sinks, o biases, YaRN, every other layer sliding, experts with biases
    "granite": GraniteConfig,  # embedding / attention / residual multipliers, logits scaling
    "olmo2": Olmo2Config,  # post-norms, q/k norms across heads
    "phi3": Phi3Config,  # q/k/v in one qkv_proj, gate/up in one gate_up_proj
    "mixtral": MixtralConfig,  # overrides: num_local_experts, num_experts_per_tok
    "qwen2_moe": Qwen2MoeConfig,  # overrides: num_experts, moe_intermediate_size, shared_expert_...
    "qwen3_moe": Qwen3MoeConfig,  # Qwen2-MoE's overrides less the shared expert; q_norm / k_norm per head
    "deepseek_v2": DeepseekV2Config,  # latent attention; overrides: kv_lora_rank, q_lora_rank, experts ...
    "deepseek_v3": DeepseekV3Config,  # V2's attention, sigmoid routing with a correction bias
}


def build_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny_model(path: Path, arch: str = "llama", tied: bool = True, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    tok = build_tokenizer()
    common = dict(
        vocab_size=320,
        **TINY_LAYERS,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    common.update(overrides)
    cfg_cls = CONFIGS[arch]
    model = AutoModelForCausalLM.from_config(cfg_cls(**common))
    with torch.no_grad():  # larger-than-default weights so that logits are far from uniform
        for p in model.parameters():
            if p.dim() in (2, 3):  # 3: an MoE layer's stacked expert weights
                p.normal_(0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id]}))
    return path
