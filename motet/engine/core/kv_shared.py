"""A KV tier shared by every replica: a directory, or any fsspec URL (file:///..., s3://..., ...), that all of
them read and write, as the shared adapter store is (motet/cluster/shared_adapter_store.py). A block one replica
computed is a prefix hit for all the others; it is how a prefill replica hands a prompt's KV to a decode replica
(motet/cluster/disaggregation.py).

Entries are the disk tier's (motet/engine/core/kv_tiers.py): one safetensors file per block under
<url>/<model identity>/, holding the model identity, the block's hash and token ids and a CRC-32 of its bytes,
all checked on every read; an entry that is truncated, corrupt or written for another model, dtype or KV layout
is deleted and its tokens recomputed, never served. A write goes to a temporary name and is renamed, so a reader
never sees half an entry under its name.

Unlike the local disk tier, other processes add and remove entries here: membership is asked of the store
(a stat on a local directory), not of an index. The byte bound is each writer's: a replica evicts, least
recently used first, the entries it knows of (those it found when it started, wrote or read) to keep them within
`capacity_bytes`; an entry another replica removed meanwhile is simply a miss. Thread-safe: its index is behind a
lock, the I/O outside it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections import OrderedDict

import torch

from motet.engine.core.kv_blocks import KVLayout
from motet.engine.core.kv_tiers import ENTRY_SUFFIX, TMP_SUFFIX, EntryFiles, entry_name

log = logging.getLogger("motet.kv")


class SharedTier(EntryFiles):
    name = "shared"

    def __init__(self, url: str, capacity_bytes: int, identity: str, layout: KVLayout):
        import fsspec

        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.layout = layout
        self.dir = f"{root.rstrip('/')}/{identity}"
        self.fs.makedirs(self.dir, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # path -> size, of entries this replica knows, LRU
        self.bytes = 0
        self.dropped = 0  # entries found corrupt, truncated or foreign, deleted
        self.write_errors = 0
        self._scan()

    def _scan(self) -> None:
        try:
            listing = self.fs.ls(self.dir, detail=True)
        except OSError:
            return
        found = [
            (e.get("mtime") or e.get("LastModified") or 0, e["name"], int(e.get("size") or 0))
            for e in listing
            if e["name"].endswith(ENTRY_SUFFIX)
        ]
        with self._lock:
            for _, path, size in sorted(found, key=lambda e: str(e[0])):
                self._add(path, size)

    def _path(self, h: int) -> str:
        return f"{self.dir}/{entry_name(h)}"

    def _temporary(self) -> str:
        return f"{self.dir}/.{uuid.uuid4().hex}{TMP_SUFFIX}"  # never another writer's

    def _put(self, tmp: str, blob: bytes) -> None:
        self.fs.pipe_file(tmp, blob)

    def _rename(self, tmp: str, path: str) -> None:
        self.fs.mv(tmp, path)

    def _open(self, path: str):
        return self.fs.open(path, "rb")

    def _delete(self, paths) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                self.fs.rm_file(path)

    def __contains__(self, h: int) -> bool:
        """Whether the store holds an entry under `h` (written by any replica); not yet whether it is sound."""
        try:
            return bool(self.fs.exists(self._path(h)))
        except OSError:
            return False

    @property
    def num_entries(self) -> int:
        with self._lock:
            return len(self._sizes)

    def read_into(self, h: int, token_ids: tuple[int, ...], out: torch.Tensor) -> bool:
        """Read the block into `out` (contiguous, the layout's block shape and dtype); False if the store has no
        sound entry for it (one that is not sound is deleted, for every replica)."""
        path = self._path(h)
        if not self._read_entry(path, h, token_ids, out):  # (or never written)
            return False
        with self._lock:
            self._add(path, self.fs.size(path) if path not in self._sizes else self._sizes[path])
        return True
