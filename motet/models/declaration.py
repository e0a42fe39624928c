"""What a model architecture is to motet: a short declaration of how its checkpoint maps onto the one decoder
every backend runs (motet/engine/model.py: embedding, layers of attention and MLP or experts between RMS norms,
a final norm and the head). A declaration names the Hugging Face architectures it serves, the options its
layers use, how its config.json's own fields read, and the module names its checkpoints use where they differ
from the decoder's. The engine, the loaders and the kernels ask the declaration; none of them tests an
architecture's name (tests/models/test_model_declarations.py)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field


class ModelLoadError(ValueError):
    """A model that cannot be served; the message names the file or field to fix."""


@dataclass(frozen=True)
class Architecture:
    # The config.json `architectures` names this declaration serves (the first: the one motet writes, e.g. for
    # a GGUF file's config).
    names: tuple[str, ...]
    # Attention: q/k/v biases where config.json does not say (attention_bias / qkv_bias), and each head's q and k
    # RMS-normalized over head_dim before the rotary (Qwen3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # OLMo 2: the q and k norms span all heads (q_norm over num_heads x head_dim) rather than each head, and each
    # block's output is normed before it joins the residual stream, with no norm before the block.
    qk_norm_whole: bool = False
    post_norms: bool = False
    # Gemma: norms before the blocks too (sandwich norms, with post_norms), norm weights stored as an offset
    # from 1 (RMSNorm multiplies by 1 + w), and the MLP's activation (config.json's hidden_activation).
    pre_norms: bool = True
    norm_weight_offset: float = 0.0
    # A mixture of experts: (config.json, number of layers, source) -> the ModelConfig's expert fields
    # (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    # shared_expert_intermediate_size, sparse_layers). None: every layer's MLP is dense.
    experts: Callable[[dict, int, str], dict] | None = None
    # The family's own config.json fields: (config.json, source) -> more ModelConfig fields (Granite's
    # multipliers). None: none.
    options: Callable[[dict, str], dict] | None = None
    # Checkpoint module names -> the decoder's (a name part of `model.layers.{i}...` is renamed as it is read).
    checkpoint_names: dict[str, str] = field(default_factory=dict)
    # A checkpoint module that holds several of the decoder's projections, their rows one after the other
    # (Phi-3's qkv_proj: q_proj, k_proj, v_proj): split as it is read, and a LoRA adapter's factors with it.
    fused_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # How its checkpoints stack experts: "decoder" (the decoder's [E, 2I, H] gate rows then up rows, and
    # [E, H, I], or one tensor an expert's projection) or "interleaved" (GPT-OSS's [E, H, 2I] with gate and up
    # columns alternating, and [E, I, H]): converted as they load.
    expert_layout: str = "decoder"
    # The `general.architecture` of the GGUF files llama.cpp's converter writes for it (None: not read from GGUF),
    # the prefix of its hyperparameters' keys, and whether that converter interleaved q/k rows for its rotary
    # (llama's `permute`; Qwen's files keep Hugging Face's order).
    gguf: str | None = None
    gguf_permuted_qk: bool = False
    # The GGUF block tensors whose Hugging Face module is not Llama's (attn_norm -> input_layernorm, ffn_norm ->
    # post_attention_layernorm, ...): Gemma's and OLMo 2's post-norms, Phi-3's fused attn_qkv / ffn_up. A norm
    # weight is stored as llama.cpp multiplies by it: with `norm_weight_offset` added (Gemma's 1 + w).
    gguf_names: dict[str, str] = field(default_factory=dict)
    # The family's own config.json fields from its GGUF keys: (key -> value, by the key's name after the
    # architecture's prefix, e.g. "attention.sliding_window", or the default given; the config read so far;
    # source) -> fields added to or replacing the config's (model_type where it is not the GGUF architecture).
    gguf_config: Callable[[Callable[..., object], dict, str], dict] | None = None
    # How the family writes tool calls and reasoning, by vLLM's --tool-call-parser and --reasoning-parser names
    # (motet/grammar/tool_formats.py, motet/grammar/reasoning.py), where every checkpoint of the architecture
    # writes the same: `motet serve` picks them with no flag (a flag wins). None: the chat template's markers say.
    tool_format: str | None = None
    reasoning_format: str | None = None

    @property
    def name(self) -> str:
        return self.names[0]


# What a served config may say, checked before anything is allocated (a config or GGUF file is input: a
# context length of 0 or 2**32 layers must be one clear line, never a crash or an allocation that never ends).
LIMITS = {
    "vocab_size": (1, 2**24),
    "hidden_size": (1, 2**16),
    "intermediate_size": (1, 2**18),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position_embeddings": (1, 2**24),
    "num_experts": (0, 4096),
    "moe_intermediate_size": (0, 2**18),
    "shared_expert_intermediate_size": (0, 2**18),
}


def is_number(value) -> bool:
    """A JSON number (or a GGUF file's numpy scalar): not a bool, not a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def bounded(value, field: str, source: str, lo: int, hi: int) -> int:
    """`value` as an int within [lo, hi], or ModelLoadError naming `field` and the range (a string, a bool, 2.5,
    1e999 and -Infinity are no integers)."""
    whole = is_number(value) and math.isfinite(value) and int(value) == value
    if not whole:
        raise ModelLoadError(f"{source}: {field} must be an integer from {lo} to {hi}, got {value!r}")
    n = int(value)
    if not lo <= n <= hi:
        raise ModelLoadError(f"{source}: {field} must be from {lo} to {hi}, got {n}")
    return n


def bounded_number(
    value,
    name: str,
    source: str,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> float:
    """A finite number from config.json within the bounds given (a rope factor of at least 1, an epsilon above 0
    and below 1), or ModelLoadError naming it and them."""
    bounds = [
        (word, limit, test)
        for word, limit, test in (
            ("above", above, float.__gt__),
            ("at least", at_least, float.__ge__),
            ("below", below, float.__lt__),
            ("at most", at_most, float.__le__),
        )
        if limit is not None
    ]
    if (
        is_number(value)
        and math.isfinite(value)
        and all(test(float(value), limit) for _, limit, test in bounds)
    ):
        return float(value)
    what = " and ".join(f"{word} {limit:g}" for word, limit, _ in bounds)
    what = "a positive number" if what == "above 0" else f"a number {what}".rstrip()
    raise ModelLoadError(f"{source}: {name} must be {what}, got {value!r:.80}")


def bounded_float(value, name: str, source: str) -> float:
    """A positive, finite number from config.json (a soft-capping constant), or ModelLoadError naming it."""
    return bounded_number(value, name, source, above=0.0)


def flag(cfg: dict, name: str, source: str, default: bool) -> bool:
    """A true / false field of config.json (null: the default); a string such as "false" is refused, not read as
    true."""
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {name} must be true or false, got {value!r}")
    return value


def sliding_window(cfg: dict, source: str, used_by_default: bool) -> int | None:
    """config.json's sliding_window where use_sliding_window says it is used (unsaid: `used_by_default`, Mistral's
    reading; Qwen's configs default to false); None: no window."""
    window = cfg.get("sliding_window") if flag(cfg, "use_sliding_window", source, used_by_default) else None
    return None if window is None else bounded(window, "sliding_window", source, 1, 2**24)


def sliding_layers(cfg: dict, source: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The layers config.json's `layer_types` says slide (a list of "sliding_attention" / "full_attention", one
    per layer); without it `default`."""
    types = cfg.get("layer_types")
    if types is None:
        return default
    n = int(cfg["num_hidden_layers"])
    kinds = ("sliding_attention", "full_attention")
    if not (isinstance(types, list) and len(types) == n and all(t in kinds for t in types)):
        raise ModelLoadError(
            f"{source}: layer_types must list {n} layer types, each one of {', '.join(kinds)}; got "
            f"{json.dumps(types)[:80]}"
        )
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def every_other_layer(cfg: dict) -> tuple[int, ...]:
    """The even layers: those transformers' default `layer_types` slides for Gemma 2 and GPT-OSS."""
    return tuple(range(0, int(cfg["num_hidden_layers"]), 2))


def top_k_experts(cfg: dict, experts: int | None, source: str) -> int:
    """num_experts_per_tok, checked against the number of experts (None: no layer has experts); the experts
    compute silu only."""
    top_k = bounded(cfg["num_experts_per_tok"], "num_experts_per_tok", source, *LIMITS["num_experts"])
    if experts is not None and not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok must be between 1 and the number of experts ({experts}), got {top_k}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {cfg['hidden_act']!r}: motet's experts compute silu only")
    return top_k
