"""A bare GGUF file served as a model (`--model path/to/file.gguf`, nothing beside it), as llama.cpp serves one.

motet reads a model as a Hugging Face-style directory. For a GGUF file the small files of such a directory
(config.json, generation_config.json, the tokenizer with its chat template) are derived once from the file's
metadata (motet/engine/weights/gguf_convert.py, as `motet pull` writes them) into the cache, beside a `model.gguf`
link to the file itself: every reader of a model directory (engine, tokenizer, template helper, cluster
replicas) then takes it as it is, and the weights are never copied: `--quantization gguf`, implied for a GGUF
model, reads the projections' blocks from the file (motet/engine/weights/gguf_weights.py).

The derived directory is keyed by the file's resolved path, size and modification time (a changed file gets
fresh files; hashing gigabytes on every start would cost more than the derivation), built beside its place
and renamed into it whole, so concurrent starts and interrupted ones never see half a directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from motet.engine.weights import load_progress
from motet.models.declaration import ModelLoadError

GGUF_SUFFIX = ".gguf"
GGUF_FILE = (
    "model.gguf"  # a model directory's GGUF file: the default model's (`motet pull`), a derived one's link
)


def is_gguf_file(model: str | Path) -> bool:
    """Whether a model name or path names a GGUF file (served from its own blocks and metadata:
    motet/engine/weights/gguf_model.py), rather than a checkpoint directory or a known model name."""
    return str(model).lower().endswith(GGUF_SUFFIX) and not Path(model).expanduser().is_dir()


DERIVED_FORMAT = (
    2  # raised when what is derived changes, so that no older derivation is reused (2: ends of turn)
)
DERIVED_MARKER = ".motet-gguf"  # written last: a derived directory without it is not finished


def derived_dir(gguf_path: Path, root: Path) -> Path:
    """Where the derived files of `gguf_path` (a resolved path) live under `root`."""
    st = gguf_path.stat()
    key = json.dumps([str(gguf_path), st.st_size, st.st_mtime_ns, DERIVED_FORMAT])
    return root / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def gguf_model_dir(path: str | Path, root: Path) -> Path:
    """The model directory of a GGUF file under `root`: config and tokenizer derived from its metadata (once;
    later calls find them), `model.gguf` linking to the file. ModelLoadError for a file that is not a readable GGUF or
    holds a model motet does not serve, naming what it found and what is supported."""
    # (torch: imported where a file is derived, so that naming a model is quick)
    from motet.engine.weights.gguf_config import reader_config
    from motet.engine.weights.gguf_convert import write_hf_metadata
    from motet.engine.weights.gguf_reader import open_gguf

    path = Path(path).expanduser().resolve()
    target = derived_dir(path, root)
    if (target / DERIVED_MARKER).is_file():
        return target
    t0 = time.perf_counter()  # (seconds on a large vocabulary, before the server can listen)
    load_progress.begin(
        f"{path.name}: deriving its config, tokenizer and chat template", f"once, into {target}"
    )
    try:
        reader = open_gguf(path)
    except Exception as e:  # gguf-py's parser fails on a damaged file in many ways (ValueError, IndexError)
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    meta, config = reader_config(reader, path.name)
    del reader  # its memory map of the file
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as e:
        raise ModelLoadError(
            f"{path.name}: cannot write its config and tokenizer into {target.parent} ({e}); set "
            f"MOTET_CACHE_DIR to a writable directory"
        ) from None
    try:
        write_hf_metadata(work, meta, config)
        (work / GGUF_FILE).symlink_to(path)
        (work / DERIVED_MARKER).write_text(json.dumps({"source": str(path), "format": DERIVED_FORMAT}) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)  # mkdtemp's 0o700 otherwise
        with contextlib.suppress(OSError):  # another process renamed its own copy into place first
            os.rename(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not (target / DERIVED_MARKER).is_file():
        raise ModelLoadError(f"{path.name}: could not put its derived config and tokenizer in {target}")
    load_progress.log.info("%s: derived in %.1f s", path.name, time.perf_counter() - t0)
    return target
