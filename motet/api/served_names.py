"""What `motet serve` and `motet run-batch` serve, named from their flags: the names requests may give the base
model (`--served-model-name`, else the model's own name) and the adapters shared by every tenant (`--lora`)."""

from __future__ import annotations

import os
from pathlib import Path


def served_names(args, config) -> list[str]:
    """The names requests may give the base model as: the first is the served one, the rest aliases."""
    from motet.engine.weights.gguf_model import is_gguf_file
    from motet.engine.weights.model_store import DEFAULT_MODEL_ALIASES

    names = list(args.served_model_name or [])
    path = Path(os.path.abspath(Path(config.model).expanduser()))
    if config.model in DEFAULT_MODEL_ALIASES:
        names += [config.model, *(n for n in DEFAULT_MODEL_ALIASES if n != config.model)]
    elif path.exists():
        # a local checkpoint is served by its name (a GGUF file by its stem, llama.cpp's habit), not its path:
        # tenants see the model's name, not the operator's file system; the path stays an alias
        names += [path.stem if is_gguf_file(config.model) else path.name, config.model]
    else:
        names.append(config.model)
    return list(dict.fromkeys(names))


def shared_loras(specs: list[str] | None, model_names: list[str]) -> dict[str, Path]:
    """`--lora NAME=PATH` flags -> {name: directory}; the adapters are validated when the engine starts."""
    from motet.lora.names import check_name

    loras: dict[str, Path] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora {spec!r}: expected NAME=PATH")
        check_name("--lora adapter", name)
        if name in loras or name in model_names:
            raise ValueError(f"--lora {spec!r}: the name {name!r} is already taken")
        loras[name] = Path(path).expanduser()
        if not loras[name].is_dir():
            raise ValueError(f"--lora {spec!r}: {path} is not a PEFT adapter directory")
    return loras
