"""What config.json says of the rotary's scaling (`rope_scaling`, or transformers >= 5's `rope_parameters`),
checked as it is read: the types motet implements (motet/engine/worker/model.py: rope_inv_freq) and every field they
read, a number in its range, so that a factor of 0 or "2", a llama3 band of no width or a YaRN context of 1e9 is
one line naming the field, never a ZeroDivisionError or frequencies of inf and NaN. The ranges are transformers'
(its `_validate_*_rope_parameters`, which only warn), written with every config number's in
motet/models/fields.py REALS: a factor of at least 1; here the bounds between fields, high_freq_factor above
low_freq_factor, beta_fast at least beta_slow. LongRoPE's (Phi-3.5, Phi-4-mini; Phi-3's older "su" the same) short and
long factors: one positive number per rotated pair of dimensions."""

from __future__ import annotations

from motet.models.declaration import ModelLoadError
from motet.models.fields import LIMITS, bounded, bounded_number

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_ALIASES = {
    "su": "longrope"
}  # Phi-3's first configs' name for LongRoPE (transformers' Phi3Config renames it)


def rope_kind(scaling: dict | None) -> str:
    """The rotary's type a checked `rope_scaling` names ("default" where there is none)."""
    return (scaling or {}).get("rope_type", "default")


def longrope_original(scaling: dict | None) -> int | None:
    """LongRoPE's original context (its short factors turn positions within it), or None: another rotary."""
    return scaling["original_max_position_embeddings"] if rope_kind(scaling) == "longrope" else None


def checked_rope_scaling(
    scaling,
    max_positions: int,
    source: str,
    key: str = "rope_scaling",
    *,
    rotary_dim: int | None = None,
    original_context: int | None = None,
) -> dict | None:
    """`scaling` (None: no scaling), config.json's `key`, with each field rope_inv_freq reads checked, its numbers
    as Python's, its type under `rope_type`; or ModelLoadError naming the field. `rotary_dim`: the dimensions the
    rotary turns (LongRoPE's factors: one per pair); `original_context`: config.json's top-level
    original_max_position_embeddings, which LongRoPE takes before its own (as transformers' Phi-3 does)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: {key} must be an object, got {scaling!r:.80}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = _ALIASES.get(kind, kind)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: {key} type {kind!r:.40} is not supported; motet implements {', '.join(ROPE_TYPES)}"
        )
    out = dict(scaling, rope_type=kind)

    def number(field: str, **relative) -> float:
        """The field in its range (fields.py REALS) and above or at least another field's `relative` value."""
        out[field] = bounded_number(scaling.get(field), f"{key}.{field}", source, **relative)
        return out[field]

    def context(field: str) -> int:
        out[field] = bounded(scaling[field], f"{key}.{field}", source, *LIMITS["max_position_embeddings"])
        return out[field]

    if kind in ("linear", "llama3"):
        number("factor")
    if kind == "llama3":
        low = number("low_freq_factor")
        number("high_freq_factor", above=low)
        context("original_max_position_embeddings")
    if kind == "yarn":
        original = max_positions
        if scaling.get("original_max_position_embeddings") is not None:
            original = context("original_max_position_embeddings")
        if scaling.get("factor") is not None:
            number("factor")
        elif original > max_positions:  # the factor would be max_position_embeddings / original
            raise ModelLoadError(
                f"{source}: {key}.original_max_position_embeddings ({original}) is above "
                f"max_position_embeddings ({max_positions}) and no factor is given: YaRN's factor would be below 1"
            )
        for field in ("attention_factor", "beta_slow", "mscale", "mscale_all_dim"):
            if scaling.get(field) is not None:
                number(field)
        if scaling.get("beta_fast") is not None:
            number("beta_fast", at_least=out.get("beta_slow") or 1.0)
        truncate = scaling.get("truncate")  # (null: false, as transformers and rope_inv_freq read it)
        if truncate is not None and not isinstance(truncate, bool):
            raise ModelLoadError(f"{source}: {key}.truncate must be true or false, got {truncate!r:.40}")
    if kind == "longrope":
        field = "original_max_position_embeddings"
        if original_context is not None:  # (config.json's top level)
            out[field] = bounded(original_context, field, source, *LIMITS["max_position_embeddings"])
        elif scaling.get(field) is not None:
            context(field)
        else:
            out[field] = max_positions
        for field in ("short_factor", "long_factor"):
            factors = scaling.get(field)
            if not isinstance(factors, list) or (rotary_dim is not None and len(factors) != rotary_dim // 2):
                want = f"{rotary_dim // 2} numbers" if rotary_dim is not None else "a list of numbers"
                raise ModelLoadError(
                    f"{source}: {key}.{field} must be {want} (one per rotated pair), got {factors!r:.80}"
                )
            out[field] = [bounded_number(f, f"{key}.{field}", source) for f in factors]
        for field in ("factor", "attention_factor"):
            if scaling.get(field) is not None:
                number(field)
    return out
