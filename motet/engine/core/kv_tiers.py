"""The storage tiers behind the device's KV cache: host RAM (a bounded LRU of block tensors) and local disk (a
bounded directory of checksummed entries that outlives the process). Each stores a block under its prefix-cache
hash (motet/engine/core/block_manager.py: the chain of parent, adapter, salt and tokens) with the block's token ids,
and serves it only to a lookup with the same hash and the same tokens. The policy of what to store and when to
load is motet/engine/core/kv_connector.py's.

A disk entry is one file, a safetensors blob holding the block's tensor and, in its metadata, the model identity
(motet/engine/kv_blocks.model_identity), the hash, the token ids and a CRC-32 of the tensor's bytes. A read
checks all of them: an entry that is truncated, corrupt, or written for another model, dtype or layout is
deleted and reported missing, so its tokens are recomputed, never served from it. Entries live under
<root>/<identity>/, written to a temporary file and renamed, so a crash leaves no half entry under its name.
The byte bound covers every identity's entries under <root> (an older model's are the first to go).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from motet.engine.core.kv_blocks import KVLayout

log = logging.getLogger("motet.kv")

KV_CACHE_SUBDIR = "kv-cache"  # the disk tier's root under the server's data directory
ENTRY_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_MASK64 = (1 << 64) - 1
MAX_HEADER_BYTES = 1 << 20  # an entry's header is a few hundred bytes: more is damage
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class HostTier:
    """Blocks in host memory, least recently used first; at most `capacity_bytes` of them. The engine's thread
    alone uses it."""

    name = "ram"

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.bytes = 0

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def get(self, h: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        entry = self.entries.get(h)
        if entry is None or entry[0] != token_ids:
            return None
        self.entries.move_to_end(h)
        return entry[1]

    def put(self, h: int, token_ids: tuple[int, ...], data: torch.Tensor) -> None:
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        size = data.nbytes
        if size > self.capacity_bytes:
            return
        self.entries[h] = (token_ids, data)
        self.bytes += size
        while self.bytes > self.capacity_bytes:
            _, (_, old) = self.entries.popitem(last=False)
            self.bytes -= old.nbytes


class CorruptEntry(ValueError):
    """An entry that is not sound, or not for this model: deleted."""


class OtherBlock(ValueError):
    """A sound entry of another block under the same hash (a collision): kept, not served."""


def encode_entry(identity: str, h: int, token_ids: tuple[int, ...], data: torch.Tensor) -> bytes:
    data = data.contiguous()
    metadata = {
        "identity": identity,
        "hash": str(h),
        "tokens": json.dumps(list(token_ids)),
        "crc32": str(zlib.crc32(data.view(torch.uint8).numpy())),
    }
    return save_safetensors({"kv": data}, metadata=metadata)


def check_header(header: bytes, identity: str, h: int, token_ids: tuple[int, ...], layout: KVLayout) -> int:
    """The CRC-32 the entry's tensor bytes must have; CorruptEntry unless the header is the entry of (identity,
    h, tokens) in `layout`, OtherBlock if it is another block's under the same hash."""
    try:
        meta = json.loads(header)
        kv, info = meta["kv"], meta["__metadata__"]
        if info["identity"] != identity:
            raise CorruptEntry("written for another model, KV dtype or layout")
        if int(info["hash"]) != h:
            raise CorruptEntry("another hash's entry")
        if json.loads(info["tokens"]) != list(token_ids):
            raise OtherBlock("another block's tokens under the same hash")
        expected = {"dtype": _SAFETENSORS_DTYPES[layout.dtype], "shape": list(layout.block_shape)}
        if {k: kv[k] for k in expected} != expected or kv["data_offsets"] != [0, layout.block_bytes]:
            raise CorruptEntry(f"a tensor {kv}, expected {expected} of {layout.block_bytes} bytes")
        return int(info["crc32"])
    except (CorruptEntry, OtherBlock):
        raise
    except Exception as e:  # a malformed header: json's errors, a missing key, a wrong type alike
        raise CorruptEntry(f"unreadable header ({type(e).__name__}: {e})") from None


def read_entry_into(f, identity: str, h: int, token_ids: tuple[int, ...], layout: KVLayout, out) -> None:
    """Read an entry from the open file `f` into `out` (a contiguous tensor of the layout's block shape and
    dtype: the loader's staging memory, so no fresh memory is touched); CorruptEntry (or OtherBlock) unless it
    is whole, sound and the entry of (identity, h, tokens)."""
    header_len = int.from_bytes(f.read(8), "little")
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise CorruptEntry(f"a header of {header_len} bytes")
    header = f.read(header_len)
    if len(header) != header_len:
        raise CorruptEntry("truncated header")
    crc = check_header(header, identity, h, token_ids, layout)
    payload = out.view(torch.uint8).numpy()
    if f.readinto(payload) != layout.block_bytes or f.read(1):
        raise CorruptEntry("truncated or overlong")
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum mismatch")


def entry_name(h: int) -> str:
    return f"{h & _MASK64:016x}{ENTRY_SUFFIX}"


def entry_hash(name: str) -> int | None:
    try:
        u = int(name.removesuffix(ENTRY_SUFFIX), 16)
    except ValueError:
        return None
    return u - (1 << 64) if u >= 1 << 63 else u


class EntryFiles:
    """What the tiers of entry files (the local disk's, the replicas' shared store: motet/engine/core/kv_shared.py) do
    alike: write an entry under a temporary name and rename it, making room within the bound; read it back
    checked, and drop one that is not sound. A tier says where an entry goes (`_path`), how it writes, renames
    and opens a file (`_temporary`, `_put`, `_rename`, `_open`) and how it deletes files (`_delete`); its
    index of entries (`_sizes`, behind `_lock`) is kept here."""

    name: str
    identity: str
    layout: KVLayout
    capacity_bytes: int
    bytes: int  # of the entries in the index
    dropped: int  # entries found corrupt, truncated or foreign, deleted
    write_errors: int
    _lock: threading.Lock
    _sizes: OrderedDict  # the index: an entry's path -> its size, least recently used first

    def _add(self, path, size: int) -> None:
        """(Under the lock.) An entry in the index, as the most recently used."""
        self.bytes -= self._sizes.pop(path, 0)
        self._sizes[path] = size
        self.bytes += size

    def _forget(self, path) -> None:
        """(Under the lock.)"""
        self.bytes -= self._sizes.pop(path, 0)

    def _evict_over(self, incoming: int) -> list:
        """(Under the lock.) Take entries out of the index until `incoming` more bytes fit; the files to delete."""
        gone = []
        while self._sizes and self.bytes + incoming > self.capacity_bytes:
            path = next(iter(self._sizes))
            self._forget(path)
            gone.append(path)
        return gone

    def write(self, h: int, token_ids: tuple[int, ...], data: torch.Tensor) -> bool:
        """Store the block (on a background thread: it does file I/O). False if it could not (a full, read-only
        or unreachable store): the block stays recomputable, nothing else changes."""
        blob = encode_entry(self.identity, h, token_ids, data)
        if len(blob) > self.capacity_bytes:
            return False
        path, tmp = self._path(h), None
        try:
            tmp = self._temporary()
            self._put(tmp, blob)
            with self._lock:
                gone = self._evict_over(len(blob))
            self._delete(gone)
            self._rename(tmp, path)
        except OSError as e:
            self.write_errors += 1
            log.warning("KV %s tier: could not write %s: %s", self.name, path, e)
            if tmp is not None:
                self._delete([tmp])
            return False
        with self._lock:
            self._add(path, len(blob))
        return True

    def read(self, h: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block, or None if this tier has no sound entry for it."""
        out = torch.empty(self.layout.block_shape, dtype=self.layout.dtype)
        return out if self.read_into(h, token_ids, out) else None

    def _read_entry(self, path, h: int, token_ids: tuple[int, ...], out: torch.Tensor) -> bool:
        """Read the entry at `path` into `out`. False where it is gone (forgotten), another block's (kept), or not
        sound (deleted, and counted in `dropped`)."""
        try:
            with self._open(path) as f:
                read_entry_into(f, self.identity, h, token_ids, self.layout, out)
        except OSError:  # gone meanwhile (evicted by a writer, removed by hand or by another replica)
            with self._lock:
                self._forget(path)
            return False
        except OtherBlock:
            return False
        except CorruptEntry as e:
            log.warning("KV %s tier: dropped %s: %s", self.name, path, e)
            with self._lock:
                self._forget(path)
                self.dropped += 1
            self._delete([path])
            return False
        return True


class DiskTier(EntryFiles):
    """Blocks in files under `root`/`identity`/, at most `capacity_bytes` under `root` in all (least recently
    used evicted first; a read or a write counts as a use, kept across restarts in the files' mtimes).
    Thread-safe: the index is behind a lock, the file I/O outside it."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, identity: str, layout: KVLayout):
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.layout = layout
        self.dir = self.root / identity
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[Path, int] = OrderedDict()  # every entry under root
        self._ours: dict[int, Path] = {}  # hash -> this identity's entry
        self.bytes = 0
        self.dropped = 0  # entries found corrupt, truncated or foreign, deleted
        self.write_errors = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.root.glob("*/*"):
            try:
                if path.name.endswith(TMP_SUFFIX):  # a write cut short by a crash
                    path.unlink(missing_ok=True)
                elif path.suffix == ENTRY_SUFFIX:
                    st = path.stat()
                    found.append((st.st_mtime_ns, path, st.st_size))
            except OSError:
                continue
        for _, path, size in sorted(found):
            self._add(path, size)
        self._delete(self._evict_over(0))

    def _add(self, path: Path, size: int) -> None:
        super()._add(path, size)
        if path.parent == self.dir and (h := entry_hash(path.name)) is not None:
            self._ours[h] = path

    def _forget(self, path: Path) -> None:
        super()._forget(path)
        h = entry_hash(path.name)
        if path.parent == self.dir and self._ours.get(h) == path:
            del self._ours[h]

    def _path(self, h: int) -> Path:
        return self.dir / entry_name(h)

    def _temporary(self) -> Path:
        """A new empty file beside the entries, readable by this user alone (as the entry it becomes)."""
        with tempfile.NamedTemporaryFile(dir=self.dir, suffix=TMP_SUFFIX, delete=False) as f:
            return Path(f.name)

    @staticmethod
    def _put(tmp: Path, blob: bytes) -> None:
        tmp.write_bytes(blob)

    @staticmethod
    def _rename(tmp: Path, path: Path) -> None:
        os.replace(tmp, path)

    @staticmethod
    def _open(path: Path):
        return path.open("rb")

    @staticmethod
    def _delete(paths) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def __contains__(self, h: int) -> bool:
        with self._lock:
            return h in self._ours

    @property
    def num_entries(self) -> int:
        with self._lock:
            return len(self._ours)

    def read_into(self, h: int, token_ids: tuple[int, ...], out: torch.Tensor) -> bool:
        """Read the block into `out` (contiguous, the layout's block shape and dtype); False if this tier has no
        sound entry for it (one that is not sound is deleted)."""
        with self._lock:
            path = self._ours.get(h)
            if path is None:
                return False
            self._sizes.move_to_end(path)
        if not self._read_entry(path, h, token_ids, out):
            return False
        with contextlib.suppress(OSError):
            now = time.time_ns()
            os.utime(path, ns=(now, now))  # the LRU order survives a restart
        return True
