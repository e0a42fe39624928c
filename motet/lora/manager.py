"""One home for adapters: a client's model name becomes an `AdapterRef` once, at the API boundary; below
it an adapter is its ref's `uid`, and this manager takes it to a device slot.

    "my-adapter" (client) --api/adapters.py--> AdapterRef("tenant/my-adapter", path, version)
        --AdapterManager.acquire--> uid (batches, prefix-cache hashes) --slot cache--> slot (the forward)

The uid is a stable hash of the engine name and the files' version, so a re-uploaded adapter under the same
name is another uid: its requests never reuse the old version's prefix-cache blocks, and requests already
running with the old version finish with it. Stable also across processes (replicas hash the same way).

The manager counts the requests using each version (`acquire` / `release`): while one runs, its host copy
is pinned (its files may be deleted meanwhile). `remove(name)` refuses new requests by that name; a version
is dropped from memory when its last request is done. Plain synchronous code on the engine's thread, except
`load`, which is thread-safe (the host cache has a lock) so the serving layer can load ahead of a request,
off its event loop.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from motet.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, LoRAAdapter, load_adapter
from motet.lora.base_shape import BaseShape
from motet.lora.slot_cache import LoRABatch, LoRASlotCache, Shard

VERSION_STAMP = ".motet-version"  # in a copy of an adapter's files: the version of the files it copies


def files_version(path: str | Path) -> str:
    """The version of an adapter's files: changes whenever either file is replaced or rewritten. A copy
    (a replica's, fetched from a shared store) carries its original's version in a stamp, so that its uid,
    and with it the prefix-cache hashes, are the same in every process."""
    try:
        return (Path(path) / VERSION_STAMP).read_text()
    except OSError:
        pass
    parts = []
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = os.stat(Path(path) / f)
        except OSError:
            return "missing"
        parts.append(f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
    return "/".join(parts)


@dataclass(frozen=True)
class AdapterRef:
    """An adapter as the engine knows it: its engine-wide name, where its files are, and their version."""

    name: str  # "tenant/name" for uploads, the plain name for adapters the server shares
    path: Path
    version: str = ""

    @classmethod
    def of(cls, name: str, path: str | Path) -> AdapterRef:
        """The ref of the files at `path` as they are now."""
        return cls(name, Path(path), files_version(path))

    @property
    def uid(self) -> int:
        """The adapter's id below the API: positive (0 is the base model) and stable across processes."""
        digest = hashlib.blake2b(f"{self.name}\0{self.version}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2 | 1

    @property
    def model(self) -> str:
        """The name clients use."""
        return self.name.rsplit("/", 1)[-1]


class AdapterManager:
    def __init__(
        self,
        base: BaseShape,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        slot_base: BaseShape | None = None,
        shard: Shard | None = None,
        on_load: Callable[[int, int, LoRAAdapter], None] | None = None,
    ):
        """`base` checks adapters; the slots hold `slot_base`'s shapes (a tensor-parallel rank's part of the
        model, with `shard` and `on_load`: LoRASlotCache), by default `base`'s."""
        self.base, self.max_lora_rank = base, max_lora_rank
        self.slots = LoRASlotCache(
            slot_base or base,
            fetch=self._fetch,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_lora_rank=max_lora_rank,
            device=device,
            dtype=dtype,
            shard=shard,
            on_load=on_load,
        )
        self.named: dict[str, AdapterRef] = {}  # names registered offline or shared by the server
        self.known: dict[int, AdapterRef] = {}  # uid -> ref, for every version loaded and not dropped
        self.removed: set[int] = set()  # versions of removed names: no new request may use them
        self.users: Counter[int] = Counter()  # uid -> unfinished requests using it
        self._lock = threading.Lock()  # `known`: `load` also runs on the serving layer's threads

    # -- loading (thread-safe) ------------------------------------------------------------------------
    def load(self, ref: AdapterRef, adapter: LoRAAdapter | None = None) -> LoRAAdapter:
        """The adapter's weights, loaded and validated (AdapterError naming what is wrong), host-cached.

        Files that changed since the ref was made are another version: refused, never loaded under it."""
        uid = ref.uid
        if uid in self.removed:
            raise AdapterError(f"adapter {ref.model!r} was removed")
        with self._lock:
            self.known[uid] = ref
        if adapter is None:
            cached = self.slots.cached(uid)
            if cached is not None:
                return cached
            if files_version(ref.path) != ref.version:
                raise AdapterError(f"adapter {ref.model!r} was deleted or replaced")
            adapter = load_adapter(ref.path, self.base, max_rank=self.max_lora_rank, name=ref.name)
            if files_version(ref.path) != ref.version:  # replaced while we read it
                raise AdapterError(f"adapter {ref.model!r} was deleted or replaced")
        elif adapter.rank > self.max_lora_rank:
            raise AdapterError(
                f"adapter {ref.name!r} has rank {adapter.rank}, above max_lora_rank {self.max_lora_rank}"
            )
        self.slots.put(uid, adapter)
        return adapter

    def _fetch(self, uid: int) -> LoRAAdapter:
        ref = self.known.get(uid)
        if ref is None:
            raise AdapterError(f"adapter id {uid} is not loaded")
        return self.load(ref)

    # -- names ----------------------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, adapter: LoRAAdapter | None = None) -> AdapterRef:
        """Serve the adapter at `path` under `name` (offline, and the server's shared adapters); validated
        now. Registering a name again replaces it: requests already using the old version finish with it."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
        ref = AdapterRef.of(name, path)
        if files_version(path) == "missing" and adapter is None:
            load_adapter(path, self.base, max_rank=self.max_lora_rank, name=name)  # names what is missing
        self.removed.discard(ref.uid)  # the same files registered again after a removal
        self.load(ref, adapter)
        old = self.named.get(name)
        self.named[name] = ref
        if old is not None and old.uid != ref.uid:
            self._drop_if_unused(old.uid)
        return ref

    def remove(self, name: str) -> None:
        """No new request may use `name`; requests already using any version of it finish."""
        self.named.pop(name, None)
        with self._lock:
            versions = [uid for uid, ref in self.known.items() if ref.name == name]
        for uid in versions:
            self.removed.add(uid)
            self._drop_if_unused(uid)

    def resolve(self, adapter: AdapterRef | str | None) -> AdapterRef | None:
        """A request's adapter: a ref as is, a registered name as its current ref, None for the base model."""
        if not adapter:
            return None
        if isinstance(adapter, AdapterRef):
            return adapter
        if isinstance(adapter, str) and adapter in self.named:
            return self.named[adapter]
        raise AdapterError(f"no adapter named {adapter!r} is loaded")

    # -- requests (the engine's thread) ---------------------------------------------------------------
    def acquire(self, ref: AdapterRef) -> int:
        """A request starts using `ref`: its uid; the host copy stays while the request runs."""
        self.load(ref)
        uid = ref.uid
        if not self.users[uid]:
            self.slots.pin(uid)
        self.users[uid] += 1
        return uid

    def release(self, uid: int) -> None:
        """A request that used `uid` is gone."""
        if not uid:
            return
        self.users[uid] -= 1
        if self.users[uid] <= 0:
            del self.users[uid]
            self.slots.unpin(uid)
            if self._superseded(uid):
                self._drop_if_unused(uid)

    def _superseded(self, uid: int) -> bool:
        """A version no new request will name: its name was removed, or registered anew."""
        ref = self.known.get(uid)
        if ref is None or uid in self.removed:
            return True
        current = self.named.get(ref.name)
        return current is not None and current.uid != uid

    def _drop_if_unused(self, uid: int) -> None:
        if not self.users[uid]:
            self.users.pop(uid, None)
            with self._lock:
                self.known.pop(uid, None)
            self.slots.unregister(uid)

    def batch(self, adapter_ids: list[int], num_tokens: list[int]) -> LoRABatch | None:
        """The step's segments, the adapters made resident; None for a batch of the base model alone."""
        return self.slots.batch(adapter_ids, num_tokens) if any(adapter_ids) else None

    @property
    def num_pinned(self) -> int:
        return len(self.users)

    def name_of(self, uid: int) -> str:
        ref = self.known.get(uid)
        return ref.name if ref is not None else str(uid)
