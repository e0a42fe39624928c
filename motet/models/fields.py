"""How a declaration reads config.json's fields: each one checked as it is read (its type, a finite number, its
range) and refused in one line naming it (ModelLoadError), never a traceback or a value the decoder cannot use
(a config or GGUF file is input). The ranges of its numbers are here: integers' in LIMITS (or given where read),
real numbers' in REALS, each read by name; the activations it computes in HIDDEN_ACTS."""

from __future__ import annotations

import json
import math
import numbers
import struct

from motet.models.declaration import ModelLoadError

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


# config.json's activation names (transformers' ACT2FN) -> the one motet computes for it (ModelConfig.hidden_act:
# motet/kernels/activation.py GATED in the eager decoder, cpu_native.ACTIVATIONS in the native step); the
# names of one function are its spellings (gelu_new and gelu_fast: GELU's tanh form as gelu_pytorch_tanh
# computes it). Another name is refused by name.
HIDDEN_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}


def hidden_act(cfg: dict, field: str, default: str, source: str) -> str:
    """The activation config.json's `field` names (`default` where unsaid), by motet's name; ModelLoadError naming
    the field and its value for one motet does not compute."""
    name = cfg.get(field)
    name = default if name is None else name
    if not isinstance(name, str) or name not in HIDDEN_ACTS:
        raise ModelLoadError(
            f"{source}: {field} {name!r:.60} is not an activation motet computes; it computes "
            f"{', '.join(HIDDEN_ACTS)}"
        )
    return HIDDEN_ACTS[name]


def finite_in_float32(x: float) -> bool:
    """Whether `x` rounds to a finite float32."""
    try:
        struct.pack("<f", x)
    except OverflowError:
        return False
    return True


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


# A factor that scales the activations (a multiplier, or a divisor) stays within [1 / MAX_SCALE, MAX_SCALE]: the
# trained models' are within [0.007, 256], and a residual stream of activations up to ~1e4 times 1e6 still
# squares (RMSNorm) within float32's range (3.4e38), where DeepSeek's routed_scaling_factor of 1e38, finite in
# float32, made every logit NaN.
MAX_SCALE = 1e6
SCALE = {"at_least": 1 / MAX_SCALE, "at_most": MAX_SCALE}

# Every real number a config.json field holds, with its range, by the field's name (a nested field's last part:
# rope_scaling.factor is "factor"): `bounded_number` reads each one against its range here (a field's reader adds
# only its bounds relative to another field's, as a llama3 band's high_freq_factor above its low_freq_factor).
# Integers' ranges: LIMITS.
REALS: dict[str, dict[str, float]] = {
    "rms_norm_eps": {"above": 0.0, "below": 1.0},
    # the rotary's bases: below 1 a pair turns faster than one radian a position (near 0 its frequencies
    # overflow float32)
    "rope_theta": {"at_least": 1.0},
    "rope_local_base_freq": {"at_least": 1.0},
    "partial_rotary_factor": {"above": 0.0, "at_most": 1.0},
    # rope_scaling's (transformers' _validate_*_rope_parameters' ranges)
    "factor": {"at_least": 1.0},
    "low_freq_factor": {"above": 0.0},
    "high_freq_factor": {"above": 0.0},
    "beta_slow": {"above": 0.0},
    "beta_fast": {"above": 0.0},
    "short_factor": {"above": 0.0},
    "long_factor": {"above": 0.0},
    "attention_factor": SCALE,
    "mscale": {"at_least": 0.0, "at_most": MAX_SCALE},  # (0: none, as transformers' yarn_get_mscale reads it)
    "mscale_all_dim": {"at_least": 0.0, "at_most": MAX_SCALE},
    # the families' scales of the activations
    "routed_scaling_factor": SCALE,
    "embedding_multiplier": SCALE,
    "attention_multiplier": SCALE,
    "residual_multiplier": SCALE,
    "logits_scaling": SCALE,
    "query_pre_attn_scalar": SCALE,
    "attn_logit_softcapping": SCALE,
    "final_logit_softcapping": SCALE,
    "swiglu_alpha": SCALE,
    "swiglu_limit": SCALE,
}
_BOUNDS = (  # (word, test, the tighter of two such bounds)
    ("above", float.__gt__, max),
    ("at_least", float.__ge__, max),
    ("below", float.__lt__, min),
    ("at_most", float.__le__, min),
)


def bounded_number(value, name: str, source: str, **relative: float) -> float:
    """A finite number from config.json within its range (REALS, by `name`'s last part) and the `relative` bounds
    given (above, at_least, below, at_most: another field's value), or ModelLoadError naming it and them. Finite in
    float32: the model computes in float32 or bfloat16 (float32's range), where 1e39, finite in float64, is inf
    and its products NaN."""
    if is_number(value) and math.isfinite(value) and not finite_in_float32(float(value)):
        raise ModelLoadError(
            f"{source}: {name} must be finite in float32 (motet computes in float32 or bfloat16: at most about "
            f"3.4e38 in size), got {value!r:.80}"
        )
    own = REALS[name.rsplit(".", 1)[-1]]
    bounds = []
    for word, test, tighter in _BOUNDS:
        limits = [b[word] for b in (own, relative) if b.get(word) is not None]
        if limits:
            bounds.append((word.replace("_", " "), tighter(limits), test))
    if (
        is_number(value)
        and math.isfinite(value)
        and all(test(float(value), limit) for _, limit, test in bounds)
    ):
        return float(value)
    what = " and ".join(f"{word} {limit:g}" for word, limit, _ in bounds)
    what = "a positive number" if what == "above 0" else f"a number {what}".rstrip()
    raise ModelLoadError(f"{source}: {name} must be {what}, got {value!r:.80}")


def flag(cfg: dict, name: str, source: str, default: bool) -> bool:
    """A true / false field of config.json (null: the default); a string such as "false" is refused, not read as
    true."""
    value = cfg.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {name} must be true or false, got {value!r}")
    return value


# Switches of config.json (any family's) that change the arithmetic where true, which motet does not compute:
# refused by name where true (their transformers default is false).
NOT_COMPUTED_WHEN_TRUE = {
    "mlp_bias": "motet's MLPs have no biases",
    "use_bidirectional_attention": "motet's attention is causal (each position attends to those before it)",
}


def refuse_what_is_not_computed(cfg: dict, source: str) -> None:
    """ModelLoadError naming the first of NOT_COMPUTED_WHEN_TRUE that config.json sets true."""
    for name, why in NOT_COMPUTED_WHEN_TRUE.items():
        if flag(cfg, name, source, False):
            raise ModelLoadError(f"{source}: {name} true: {why}")


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
    """num_experts_per_tok, checked against the number of experts (None: no layer has experts)."""
    top_k = bounded(cfg["num_experts_per_tok"], "num_experts_per_tok", source, *LIMITS["num_experts"])
    if experts is not None and not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok must be between 1 and the number of experts ({experts}), got {top_k}"
        )
    return top_k
