"""A model's sampling defaults: what a request that omits temperature, top_p, ... gets (vLLM's
`--generation-config` / `--override-generation-config`).

The checkpoint's `generation_config.json` carries its authors' recommended sampling; a request's own fields
always win, and a field neither sets keeps the OpenAI default (temperature 1, top_p 1, ...). The keys read
are vLLM's: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (a request's default
max_tokens; without it a request may run to the end of the context); and OpenAI's frequency_penalty and
presence_penalty, which vLLM does not read from the file (the default model's file carries a frequency_penalty:
motet/engine/weights/model_store.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from motet import json_input
from motet.engine.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

# generation_config.json key -> the request field it defaults, and its bounds (low, high, low inclusive)
KEYS = {
    "temperature": ("temperature", 0.0, 2.0, True),  # the API's own bounds
    "top_p": ("top_p", 0.0, 1.0, False),
    "top_k": ("top_k", 0, math.inf, True),
    "min_p": ("min_p", 0.0, 1.0, True),
    "repetition_penalty": ("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, True),
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0, True),  # OpenAI's bounds, as a request's
    "presence_penalty": ("presence_penalty", -2.0, 2.0, True),
    "max_new_tokens": ("max_tokens", 1, math.inf, True),
}
INTEGER_KEYS = {"top_k", "max_new_tokens"}
MAX_FILE_BYTES = 1 << 20  # a generation_config.json (a few hundred bytes in the wild)


class GenerationConfigError(ValueError):
    pass


def override_object(value) -> dict:
    """`--override-generation-config`'s JSON (parsed by its flag type, motet/flag_types.py `json_text`): an
    object of the keys above."""
    if not isinstance(value, dict):
        raise ValueError("a JSON object is expected, such as '{\"temperature\": 0.5}'")
    return value


def _checked(raw: dict, where: str) -> dict:
    """The sampling keys of a generation config as request defaults; anything else in it is not ours."""
    out = {}
    for key, (field, low, high, low_inclusive) in KEYS.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        ok_type = isinstance(value, int) if key in INTEGER_KEYS else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type or not math.isfinite(value):
            kind = "an integer" if key in INTEGER_KEYS else "a number"
            raise GenerationConfigError(f"{where}: {key} must be {kind}, not {value!r}")
        if value < low or (value == low and not low_inclusive) or value > high:
            raise GenerationConfigError(f"{where}: {key} {value!r} is out of range")
        if key == "top_k" and value == 0:
            continue  # 0 and -1 both mean off
        out[field] = value
    return out


def sampling_defaults(source: str, model_dir: str | Path, override: dict | None = None) -> dict:
    """The request defaults: from `model_dir` (`source` "auto"), none ("vllm": the OpenAI defaults), or a
    folder holding a generation_config.json; then `override` on top. Keys are request fields."""
    if source == "vllm":
        raw, where = {}, "--generation-config vllm"
    else:
        folder = Path(model_dir) if source == "auto" else Path(source).expanduser()
        path = folder / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise GenerationConfigError(
                f"--generation-config {source}: no generation_config.json in that folder"
            )
        try:  # a regular file, bounded in size and nesting (motet/json_input.py)
            raw = json_input.load_file(path, MAX_FILE_BYTES) if path.exists() else {}
        except ValueError as e:
            raise GenerationConfigError(f"{path}: not readable JSON ({e})") from None
        if not isinstance(raw, dict):
            raise GenerationConfigError(f"{path}: not a JSON object")
        where = str(path)
    unknown = sorted(set(override or {}) - set(KEYS))
    if unknown:
        raise GenerationConfigError(
            f"--override-generation-config: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})"
        )
    return _checked(raw, where) | _checked(override or {}, "--override-generation-config")
