"""How a declaration reads config.json's fields: each one checked as it is read (its type, a finite number, its
range) and refused in one line naming it (ModelLoadError), never a traceback or a value the decoder cannot use
(a config or GGUF file is input)."""

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
    and below 1), or ModelLoadError naming it and them. Finite in float32: the model computes in float32 or
    bfloat16 (float32's range), where 1e39, finite in float64, is inf and its products NaN."""
    if is_number(value) and math.isfinite(value) and not finite_in_float32(float(value)):
        raise ModelLoadError(
            f"{source}: {name} must be finite in float32 (motet computes in float32 or bfloat16: at most about "
            f"3.4e38 in size), got {value!r:.80}"
        )
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
