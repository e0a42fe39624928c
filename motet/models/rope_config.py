"""What config.json says of the rotary's scaling (`rope_scaling`, or transformers >= 5's `rope_parameters`),
checked as it is read: the types motet implements (motet/engine/worker/model.py: rope_inv_freq) and every field they
read, a number in its range, so that a factor of 0 or "2", a llama3 band of no width or a YaRN context of 1e9 is
one line naming the field, never a ZeroDivisionError or frequencies of inf and NaN. The ranges are transformers'
(its `_validate_*_rope_parameters`, which only warn): a factor of at least 1, high_freq_factor above
low_freq_factor, beta_fast at least beta_slow."""

from __future__ import annotations

from motet.models.declaration import ModelLoadError
from motet.models.fields import LIMITS, bounded, bounded_number

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def checked_rope_scaling(scaling, max_positions: int, source: str, key: str = "rope_scaling") -> dict | None:
    """`scaling` (None: no scaling), config.json's `key`, with each field rope_inv_freq reads checked, its numbers
    as Python's; or ModelLoadError naming the field."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{source}: {key} must be an object, got {scaling!r:.80}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: {key} type {kind!r:.40} is not supported; motet implements {', '.join(ROPE_TYPES)}"
        )
    out = dict(scaling)

    def number(field: str, **bounds) -> float:
        out[field] = bounded_number(scaling.get(field), f"{key}.{field}", source, **bounds)
        return out[field]

    def context(field: str) -> int:
        out[field] = bounded(scaling[field], f"{key}.{field}", source, *LIMITS["max_position_embeddings"])
        return out[field]

    if kind in ("linear", "llama3"):
        number("factor", at_least=1.0)
    if kind == "llama3":
        low = number("low_freq_factor", above=0.0)
        number("high_freq_factor", above=low)
        context("original_max_position_embeddings")
    if kind == "yarn":
        original = max_positions
        if scaling.get("original_max_position_embeddings") is not None:
            original = context("original_max_position_embeddings")
        if scaling.get("factor") is not None:
            number("factor", at_least=1.0)
        elif original > max_positions:  # the factor would be max_position_embeddings / original
            raise ModelLoadError(
                f"{source}: {key}.original_max_position_embeddings ({original}) is above "
                f"max_position_embeddings ({max_positions}) and no factor is given: YaRN's factor would be below 1"
            )
        for field, bounds in (
            ("attention_factor", {"above": 0.0}),
            ("beta_slow", {"above": 0.0}),
            ("mscale", {"at_least": 0.0}),
            ("mscale_all_dim", {"at_least": 0.0}),
        ):
            if scaling.get(field) is not None:
                number(field, **bounds)
        if scaling.get("beta_fast") is not None:
            number("beta_fast", at_least=out.get("beta_slow") or 1.0)
        truncate = scaling.get("truncate")  # (null: false, as transformers and rope_inv_freq read it)
        if truncate is not None and not isinstance(truncate, bool):
            raise ModelLoadError(f"{source}: {key}.truncate must be true or false, got {truncate!r:.40}")
    return out
