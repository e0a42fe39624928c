"""Adapters' and tenants' names, and the directories adapters may be loaded from: plain checks of strings and
paths, which `motet serve` makes on its flags (`--lora NAME=PATH`, `--lora-load-dir`) before its port answers
(motet/lora/registry.py keeps the adapters under these names)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from motet.lora.peft_config import brief
from motet.lora.peft_format import AdapterError

NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # no leading dot: hidden names are ours
# A fine-tuning job's model and checkpoints (motet/api/fine_tuning/): `ft:<base>:<tenant>:<suffix>:<job>[:ckpt-step-N]`,
# OpenAI's names, longer than an upload's and with colons; only the fine-tuning service stores them
# (motet/api/adapters/store.py refuses them as uploads' names). Within a file name's 255 bytes.
FINE_TUNED_PREFIX = "ft:"
FINE_TUNED_RE = re.compile(r"ft:[A-Za-z0-9._-][A-Za-z0-9._:-]{0,246}")


def is_adapter_name(value: str) -> bool:
    return bool(NAME_RE.fullmatch(value) or FINE_TUNED_RE.fullmatch(value))


def check_name(kind: str, value: str) -> str:
    if kind == "adapter" and isinstance(value, str) and FINE_TUNED_RE.fullmatch(value):
        return value
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise AdapterError(
            f"{kind} name {brief(value)} is invalid: use 1-64 letters, digits, '.', '_' or '-', not starting "
            "with '.'"
        )
    return value


def check_load_dirs(load_dirs: Sequence[str | Path], private: Mapping[str, str | Path]) -> tuple[Path, ...]:
    """The directories `read_server_adapter` may read from (`--lora-load-dir`), resolved. ValueError, naming
    the flags, for one that is not a directory, or that is, contains or lies inside one of the `private`
    directories holding tenants' own adapters (flag -> directory, e.g. {"--data-dir": ...}): a tenant could
    otherwise load `.../adapters/<another tenant>/<name>` and get a copy of that tenant's adapter."""
    out = []
    for d in load_dirs:
        real = Path(os.path.realpath(Path(d).expanduser()))
        if not real.is_dir():
            raise ValueError(f"--lora-load-dir {d}: not a directory")
        for flag, other in private.items():
            mine = Path(os.path.realpath(Path(other).expanduser()))
            if real.is_relative_to(mine) or mine.is_relative_to(real):
                raise ValueError(
                    f"--lora-load-dir {d} overlaps {flag} {other}, where tenants' own adapters are stored: "
                    "a tenant could load another's; keep them apart"
                )
        out.append(real)
    return tuple(out)
