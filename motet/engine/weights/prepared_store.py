"""The prepared-weights cache on disk: each entry the weights of one model as a start left them ready for its step
(motet/engine/worker/prepared_weights.py says what they are), so that a later start maps them instead of reading,
requantizing and packing the checkpoint again (ServerlessLLM's loading-optimized checkpoints; llama.cpp maps its
file the same way).

An entry is a directory under the cache's root (`cache_root`: $MOTET_WEIGHTS_CACHE_DIR, else `weights/` under
$MOTET_CACHE_DIR or ~/.cache/motet, beside the native kernels and the config derived from GGUF files):

- `weights.bin`, one flat file: every tensor's bytes at 64-byte aligned offsets, mapped at a later start (a private
  mapping of the file: no copy, its pages shared with every process that maps it, resident as they are touched);
- `index.json`, written last: the entry's key, what it was made from, each tensor's offset, dtype and shape, the
  caller's layout (opaque here), the file's size, a digest of sampled pages of it, and a checksum of the index;
- `last-used`, whose modification time is the entry's last use (the bound evicts the least recently used).

The key is a sha256 over what decides the bytes: the source files' identity (`file_identity`: resolved path, size,
modification time and a sha256 of the first and last MiB: a file replaced, rewritten or touched gets a new key,
without hashing gigabytes at every start) and the caller's settings (dtype, quantization, instruction-set tier,
the kernels' ABI version, a digest of the code that prepares the weights). An entry is built in a temporary
directory beside its place and renamed into it whole: concurrent starts and interrupted ones never see half an
entry. One whose index does not parse or check, whose key is not the one asked for, or whose file's size or
sampled pages differ from the index's is removed and built again (`open` returns None).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from motet.engine.weights.model_store import cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger("motet.engine")

ROOT_ENV = "MOTET_WEIGHTS_CACHE_DIR"
FORMAT = 1  # raised when an entry's files change shape: no older entry is read
DATA, INDEX, LAST_USED = "weights.bin", "index.json", "last-used"
_TMP = ".tmp-"
_ALIGN = 64  # every tensor's offset in the data file (the packed weights' alignment)
_ENDS = 1 << 20  # bytes hashed at each end of a source file
_SAMPLE, _STRIDE = (
    64 << 10,
    16 << 20,
)  # the data file's pages checked at open: 64 KiB every 16 MiB and the end
_STALE_TMP_S = 3600  # a temporary directory older than this is an interrupted build's


def cache_root() -> Path:
    """Where the entries live: $MOTET_WEIGHTS_CACHE_DIR, else `weights` under motet's cache directory."""
    env = os.environ.get(ROOT_ENV)
    return Path(env).expanduser() if env else cache_dir() / "weights"


def file_identity(path: Path) -> dict:
    """A file's identity in a key: resolved path, size, modification time (ns) and a sha256 of its first and last
    MiB (a GGUF file's header and metadata, a safetensors file's header)."""
    path = path.resolve()
    st = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_ENDS))
        if st.st_size > _ENDS:
            f.seek(max(_ENDS, st.st_size - _ENDS))
            digest.update(f.read(_ENDS))
    return {
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ends_sha256": digest.hexdigest(),
    }


def entry_key(source: list[dict], settings: dict) -> str:
    """The key of an entry made from `source` (file identities) with `settings`."""
    blob = json.dumps({"format": FORMAT, "source": source, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class EntryInfo:
    """An entry as `motet cache ls` lists it."""

    key: str
    path: Path
    label: str
    nbytes: int
    last_used: float
    source: list[str]
    settings: dict


class Entry:
    """An entry mapped: its index and its tensors, views of the mapped file (zero-copy)."""

    def __init__(self, path: Path, index: dict, data: torch.Tensor):
        self.path, self.index, self._data = path, index, data

    @property
    def key(self) -> str:
        return self.index["key"]

    @property
    def nbytes(self) -> int:
        return self.index["bytes"]

    @property
    def layout(self) -> dict:
        return self.index["layout"]

    def names(self) -> list[str]:
        return list(self.index["tensors"])

    def tensor(self, name: str) -> torch.Tensor:
        import torch

        offset, dtype, shape = self.index["tensors"][name]
        dtype = getattr(torch, dtype)
        n = dtype.itemsize * _prod(shape)
        return self._data[offset : offset + n].view(dtype).view(shape)


class Writer:
    """An entry being written: tensors appended to its data file, then `finish` writes the index and renames the
    directory into place (and keeps the cache within its bound)."""

    def __init__(self, store: PreparedStore, key: str, label: str, source: list[dict], settings: dict):
        self.store, self.key, self.label, self.source, self.settings = store, key, label, source, settings
        store.root.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix=f"{_TMP}{label}-", dir=store.root))
        self._file = open(self.work / DATA, "wb")  # noqa: SIM115 (closed by finish / abandon)
        self._tensors: dict[str, list] = {}
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """`tensor`'s bytes appended (64-byte aligned), read back by `Entry.tensor(name)`."""
        import torch

        t = tensor.detach().contiguous()
        pad = -self._size % _ALIGN
        if pad:
            self._file.write(b"\0" * pad)
        offset = self._size + pad
        raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        self._file.write(memoryview(raw.numpy()))
        self._size = offset + raw.numel()
        self._tensors[name] = [offset, str(t.dtype).removeprefix("torch."), list(t.shape)]

    @property
    def nbytes(self) -> int:
        return self._size

    def finish(self, layout: dict) -> Path:
        """The entry's directory, in place (another start's, where one put the same entry there first)."""
        self._file.close()
        index = {
            "format": FORMAT,
            "key": self.key,
            "label": self.label,
            "created": time.time(),
            "source": self.source,
            "settings": self.settings,
            "bytes": self._size,
            "samples": _sampled_digest(self.work / DATA, self._size),
            "tensors": self._tensors,
            "layout": layout,
        }
        index["checksum"] = _checksum(index)
        (self.work / INDEX).write_text(json.dumps(index) + "\n")
        (self.work / LAST_USED).touch()
        os.chmod(self.work, 0o777 & ~_umask())  # (mkdtemp's 0o700 otherwise)
        target = self.store.path(self.key, self.label)
        try:
            os.rename(self.work, target)
        except OSError:  # another start renamed its own copy into place first
            shutil.rmtree(self.work, ignore_errors=True)
        self.store.prune(keep=self.key)
        return target

    def abandon(self) -> None:
        self._file.close()
        shutil.rmtree(self.work, ignore_errors=True)


class PreparedStore:
    """The entries under `root`, at most `max_bytes` of them (least recently used evicted first)."""

    def __init__(self, root: Path | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.max_bytes = max_bytes

    def path(self, key: str, label: str) -> Path:
        return self.root / f"{_safe(label)}-{key[:20]}"

    def _find(self, key: str) -> Path | None:
        found = list(self.root.glob(f"*-{key[:20]}")) if self.root.is_dir() else []
        return next((p for p in found if not p.name.startswith(_TMP)), None)

    def open(self, key: str) -> Entry | None:
        """The entry of `key`, mapped, its use recorded; None where there is none, or where it is stale or
        corrupt (then removed, to be built again)."""
        path = self._find(key)
        if path is None:
            return None
        try:
            index = json.loads((path / INDEX).read_text())
            problem = _check_index(index, key)
            data = None
            if problem is None:
                data, problem = _map(path / DATA, index)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem is not None:
            log.warning("prepared weights %s: %s; removed, to be prepared again", path.name, problem)
            shutil.rmtree(path, ignore_errors=True)
            return None
        with contextlib.suppress(OSError):
            (path / LAST_USED).touch()
        return Entry(path, index, data)

    def writer(self, key: str, label: str, source: list[dict], settings: dict) -> Writer:
        return Writer(self, key, label, source, settings)

    def entries(self) -> list[EntryInfo]:
        """Every finished entry, the most recently used first (an unreadable one listed with what is known)."""
        out = []
        for path in self.root.iterdir() if self.root.is_dir() else []:
            if path.name.startswith(_TMP) or not path.is_dir():
                continue
            try:
                index = json.loads((path / INDEX).read_text())
                key, label, settings = index["key"], index["label"], index["settings"]
                source = [s["path"] for s in index["source"]]
            except (OSError, ValueError, KeyError, TypeError):
                key, label, settings, source = path.name.rpartition("-")[2], path.name, {}, []
            out.append(EntryInfo(key, path, label, _du(path), _last_used(path), source, settings))
        return sorted(out, key=lambda e: -e.last_used)

    def remove(self, key: str | None = None) -> list[EntryInfo]:
        """Remove the entry whose key begins with `key` (every entry: None, and interrupted builds); the removed."""
        removed = [e for e in self.entries() if key is None or e.key.startswith(key)]
        for e in removed:
            shutil.rmtree(e.path, ignore_errors=True)
        if key is None and self.root.is_dir():
            for tmp in self.root.glob(f"{_TMP}*"):
                shutil.rmtree(tmp, ignore_errors=True)
        return removed

    def prune(self, keep: str | None = None) -> None:
        """Evict the least recently used entries (never `keep`'s) until the cache is within its bound; remove
        interrupted builds' directories."""
        now = time.time()
        for tmp in self.root.glob(f"{_TMP}*"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    shutil.rmtree(tmp, ignore_errors=True)
        if self.max_bytes is None:
            return
        entries = self.entries()
        total = sum(e.nbytes for e in entries)
        for e in reversed(entries):  # the least recently used first
            if total <= self.max_bytes:
                break
            if e.key == keep:
                continue
            shutil.rmtree(e.path, ignore_errors=True)
            total -= e.nbytes
            log.info(
                "prepared weights %s evicted (the cache's bound: %.1f GiB)",
                e.path.name,
                self.max_bytes / 2**30,
            )


def _check_index(index: dict, key: str) -> str | None:
    """What is wrong with an entry's index for `key`, or None."""
    if not isinstance(index, dict) or index.get("checksum") != _checksum(index):
        return "its index fails its checksum"
    if index.get("format") != FORMAT:
        return f"format {index.get('format')}, not {FORMAT}"
    if index.get("key") != key:
        return "its index holds another key"
    return None


def _map(path: Path, index: dict) -> tuple[torch.Tensor | None, str | None]:
    """The data file mapped (private, read ahead), or what is wrong with it."""
    import torch

    size = path.stat().st_size
    if size != index["bytes"]:
        return None, f"its data file holds {size} bytes, its index says {index['bytes']}"
    if size == 0:
        return torch.empty(0, dtype=torch.uint8), None
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: never written back
    if hasattr(mmap, "MADV_WILLNEED"):
        mapped.madvise(mmap.MADV_WILLNEED)
    if _sampled_digest(mapped, size) != index["samples"]:
        mapped.close()
        return None, "its data differs from its index's digest"
    return torch.frombuffer(mapped, dtype=torch.uint8), None


def _sampled_digest(source: Path | mmap.mmap, size: int) -> str:
    """A sha256 of 64 KiB every 16 MiB of the data and its last 64 KiB: a truncated, zeroed or overwritten file
    is caught at open without reading all of it."""
    digest = hashlib.sha256(str(size).encode())
    starts = [*range(0, size, _STRIDE), max(0, size - _SAMPLE)]
    if isinstance(source, mmap.mmap):
        for s in starts:
            digest.update(source[s : s + _SAMPLE])
        return digest.hexdigest()
    with open(source, "rb") as f:
        for s in starts:
            f.seek(s)
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def _checksum(index: dict) -> str:
    body = {k: v for k, v in index.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)[:60] or "model"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _last_used(path: Path) -> float:
    for name in (LAST_USED, INDEX):
        with contextlib.suppress(OSError):
            return (path / name).stat().st_mtime
    return 0.0


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
