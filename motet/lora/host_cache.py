"""Loaded adapters on the host, in front of the disk: packed for the pool (motet/lora/pool.py), least recently
used first, bounded by bytes (and by a count where the operator sets one). Pinned adapters (some unfinished
request uses them: their files may be deleted meanwhile) are never evicted, so the cache may exceed its
bound by those. Safe from any thread: the serving layer fills it off its event loop, the loader thread in
the background, the engine's thread reads it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from motet.lora.adapter import LoRAAdapter
from motet.lora.pool import PackedAdapter


@dataclass
class HostEntry:
    packed: PackedAdapter  # what the pool copies
    adapter: LoRAAdapter | None  # the factors themselves, where other ranks pack their own parts of them

    @property
    def nbytes(self) -> int:
        raw = (
            0
            if self.adapter is None
            else sum(a.nbytes + b.nbytes for a, b, _ in self.adapter.weights.values())
        )
        return self.packed.nbytes + raw


class HostCache:
    def __init__(self, max_bytes: int, max_entries: int | None = None):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        self.nbytes = 0
        self._lock = threading.Lock()

    def __contains__(self, uid: int) -> bool:
        return uid in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def uids(self) -> list[int]:
        """The adapters it holds, least recently used first (a copy: the cache changes on other threads)."""
        with self._lock:
            return list(self.entries)

    def put(self, uid: int, entry: HostEntry) -> None:
        with self._lock:
            old = self.entries.pop(uid, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self.entries[uid] = entry
            self.nbytes += entry.nbytes
            self._evict(keep=uid)  # (the engine is about to copy it: never dropped as it comes in)

    def get(self, uid: int) -> HostEntry | None:
        with self._lock:
            entry = self.entries.get(uid)
            if entry is not None:
                self.entries.move_to_end(uid)
            return entry

    def pop(self, uid: int) -> None:
        with self._lock:
            self.pinned.discard(uid)
            entry = self.entries.pop(uid, None)
            if entry is not None:
                self.nbytes -= entry.nbytes

    def pin(self, uid: int) -> None:
        with self._lock:
            self.pinned.add(uid)

    def unpin(self, uid: int) -> None:
        with self._lock:
            self.pinned.discard(uid)
            self._evict()

    def _evict(self, keep: int | None = None) -> None:
        """Least recently used first, skipping pinned entries (and `keep`), until both bounds hold (or only those
        are left)."""

        def over() -> bool:
            count = self.max_entries is not None and len(self.entries) > self.max_entries
            return self.nbytes > self.max_bytes or count

        for uid in [u for u in self.entries if u not in self.pinned and u != keep]:
            if not over():
                break
            self.nbytes -= self.entries.pop(uid).nbytes
