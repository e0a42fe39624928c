"""One home for adapters: a client's model name becomes an `AdapterRef` once, at the API boundary; below
it an adapter is its ref's `uid`, and this manager takes it from the disk to the pool the forward reads.

    "my-adapter" (client) --api/adapters/store.py--> AdapterRef("tenant/my-adapter", path, version)
        --AdapterManager.acquire--> uid (batches, prefix-cache hashes) --pool--> slot (the forward)

Three tiers, as LoRAX and S-LoRA keep them: the disk holds every adapter; the host cache (motet/lora/host_cache.py)
holds loaded adapters packed for the pool, within a byte bound; the pool (motet/lora/pool.py) holds the resident
ones within its byte bound, on the device. Loading never stalls a step: the serving layer loads a request's
adapter into the host cache before it queues it (`load`, off its event loop), and the engine loads any other
on a loader thread (`acquire`, `prefetch`); each step the engine copies host-cached adapters its waiting
requests need into the pool (`prefetch`, in the order they would be admitted), and the scheduler admits a
request once its adapter is resident (`ready`). A full pool evicts the least recently used adapter that no
running request uses (one only waiting requests use, if they come later in the admission order).

The uid is a stable hash of the engine name and the files' version, so a re-uploaded adapter under the same
name is another uid: its requests never reuse the old version's prefix-cache blocks, and requests already
running with the old version finish with it. Stable also across processes (replicas hash the same way).

The manager counts the requests using each version (`acquire` / `release`): while any is unfinished its host
copy is pinned (its files may be deleted meanwhile). `remove(name)` refuses new requests by that name; a
version is dropped from memory when its last request is done. Plain synchronous code on the engine's thread,
except `load` (the serving layer's threads, the loader thread) and `batch` (an overlapped engine's device
thread), which take the manager's lock.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from motet.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, LoRAAdapter, load_adapter
from motet.lora.host_cache import HostCache, HostEntry
from motet.lora.pool import AdapterPool, LoRABatch, PoolLayout, Shard, pack
from motet.models.config import ModelConfig

log = logging.getLogger("motet.adapters")
MAX_PLACEMENTS_PER_STEP = 64  # host -> pool copies one `prefetch` makes at most (a burst spreads over steps)

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


@dataclass
class AdapterStats:
    """What `/metrics` and the start-up line say of adapter memory."""

    memory_bytes: int  # the pool's bound
    resident_bytes: int
    resident: int  # adapters in the pool
    capacity: int  # adapters that fit in the pool: of the resident ones' mean size (rank-8 q/v ones if none)
    host_bytes: int  # the host cache's bytes
    host: int  # adapters in the host cache
    loading: int  # adapters being loaded from disk
    disk_loads: int  # adapters read from disk (validated and packed)
    placements: int  # host -> pool copies
    evictions: int  # adapters evicted from the pool
    hits: int  # requests whose adapter was resident when they arrived
    misses: int  # requests whose adapter was not


class AdapterManager:
    def __init__(
        self,
        base: ModelConfig,
        *,
        memory_bytes: int,
        host_bytes: int,
        max_cpu_loras: int | None = None,
        max_lora_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        layout_base: ModelConfig | None = None,
        shard: Shard | None = None,
        on_place: Callable[[int, int, int, LoRAAdapter], None] | None = None,
        background: bool = True,
    ):
        """`base` checks adapters; the pool holds `memory_bytes` of `layout_base`'s geometry (a tensor-parallel
        rank's: motet/lora/pool.py), by default `base`'s, each adapter cut to this rank's part by `shard`;
        `on_place(slot, start, uid, adapter)` hears of every placement (the other ranks mirror it). The host
        cache holds `host_bytes` (and `max_cpu_loras` adapters, where given). `background`: disk loads on a loader
        thread (False: on the caller's, for tests that step by hand)."""
        self.base, self.max_lora_rank = base, max_lora_rank
        self.device, self.dtype, self.shard, self.on_place = torch.device(device), dtype, shard, on_place
        self.layout = PoolLayout(layout_base or base)
        self.pool = AdapterPool(self.layout, memory_bytes, self.device, dtype)
        self.host = HostCache(host_bytes, max_cpu_loras)
        self.named: dict[str, AdapterRef] = {}  # names registered offline or shared by the server
        self.known: dict[int, AdapterRef] = {}  # uid -> ref, for every version loaded and not dropped
        self.removed: set[int] = set()  # versions of removed names: no new request may use them
        self.users: Counter[int] = Counter()  # uid -> unfinished requests using it
        self.failed: dict[int, str] = {}  # uid -> why its files no longer load (background loads)
        self.blocked: set[int] = set()  # adapters the latest prefetch found no room for
        self.loading: dict[int, Future] = {}
        self.disk_loads = self.hits = self.misses = 0
        # `known`, the pool and the counters: `load` runs on the serving layer's and the loader's threads, `batch`
        # on an overlapped engine's forward thread
        self._lock = threading.RLock()
        self._loader = ThreadPoolExecutor(1, "motet-adapters") if background else None

    # -- loading (thread-safe) ------------------------------------------------------------------------
    def load(self, ref: AdapterRef, adapter: LoRAAdapter | None = None) -> bool:
        """Load, validate (AdapterError naming what is wrong) and pack the adapter into the host cache, unless it
        is there or resident already (then False). Files that changed since the ref was made are another version:
        refused, never loaded under it."""
        uid = ref.uid
        if uid in self.removed:
            raise AdapterError(f"adapter {ref.model!r} was removed")
        with self._lock:
            self.known[uid] = ref
        if adapter is None:
            if uid in self.pool or uid in self.host:
                return False
            if files_version(ref.path) != ref.version:
                raise AdapterError(f"adapter {ref.model!r} was deleted or replaced")
            adapter = load_adapter(ref.path, self.base, max_rank=self.max_lora_rank, name=ref.name)
            if files_version(ref.path) != ref.version:  # replaced while we read it
                raise AdapterError(f"adapter {ref.model!r} was deleted or replaced")
        elif adapter.rank > self.max_lora_rank:
            raise AdapterError(
                f"adapter {ref.name!r} has rank {adapter.rank}, above max_lora_rank {self.max_lora_rank}"
            )
        packed = pack(adapter, self.layout, self.dtype, self.shard, pin=self.device.type == "cuda")
        if not self.pool.fits(packed):
            raise AdapterError(
                f"adapter {ref.model!r} takes {packed.nbytes / 2**20:.1f} MiB, more than the server's whole "
                f"adapter memory ({self.pool.capacity_bytes / 2**20:.1f} MiB); use a lower rank or fewer modules"
            )
        self.host.put(uid, HostEntry(packed, adapter if self.on_place is not None else None))
        with self._lock:
            self.disk_loads += 1
        return True

    def _fetch(self, uid: int) -> None:
        """Load `uid` into the host cache on the loader thread (or here, without one), once at a time."""
        if uid in self.loading or uid in self.failed or uid in self.host or uid in self.pool:
            return
        ref = self.known.get(uid)
        if ref is None:
            return
        if self._loader is None:
            self._load_reporting(ref)
            return
        self.loading[uid] = self._loader.submit(self._load_reporting, ref)

    def _load_reporting(self, ref: AdapterRef) -> None:
        try:
            self.load(ref)
        except Exception as e:  # the files changed or broke since the request was queued: its requests fail
            log.error("adapter %s no longer loads from %s: %s", ref.name, ref.path, e)
            with self._lock:
                self.failed[ref.uid] = str(e) if isinstance(e, AdapterError) else f"could not be loaded: {e}"

    def wait_for_load(self, timeout: float) -> None:
        """Wait up to `timeout` s for a background load to finish (when nothing else could run)."""
        pending = [f for f in self.loading.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)

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
        self.failed.pop(ref.uid, None)
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
        """A request starts using `ref`: its uid. Its host copy stays while the request is unfinished; an adapter
        in neither the pool nor the host cache is loaded in the background (the request waits until `ready`)."""
        uid = ref.uid
        if uid in self.removed:
            raise AdapterError(f"adapter {ref.model!r} was removed")
        if uid in self.failed:
            raise AdapterError(self.failed[uid])
        with self._lock:
            self.known[uid] = ref
            if uid in self.pool:
                self.hits += 1
            else:
                self.misses += 1
        if not self.users[uid]:
            self.host.pin(uid)
        self.users[uid] += 1
        self._fetch(uid)
        return uid

    def release(self, uid: int) -> None:
        """A request that used `uid` is gone."""
        if not uid:
            return
        self.users[uid] -= 1
        if self.users[uid] <= 0:
            del self.users[uid]
            self.host.unpin(uid)
            with self._lock:  # (a failed load is tried again by the next request: it may have been passing)
                self.failed.pop(uid, None)
            if self._superseded(uid):
                self._drop_if_unused(uid)

    def ready(self, uid: int) -> bool:
        """Whether a request of `uid` may run: its adapter is resident (the base model always is)."""
        return not uid or uid in self.pool

    def failures(self) -> dict[int, str]:
        """Adapters whose background load failed, by uid, while requests still wait for them (they cannot run)."""
        with self._lock:
            failed = {uid: msg for uid, msg in self.failed.items() if uid in self.users}
        return failed

    def prefetch(self, wanted: Iterable[int], in_use: set[int]) -> None:
        """Make the adapters `wanted` (waiting requests' adapters, in the order they would be admitted) resident:
        copy the host-cached ones into the pool, evicting the least recently used adapter no request uses, else
        one only waiting requests later in the order use, never one in `in_use` (running requests', the launched
        step's); start loading the others. Those with no room now go in `blocked`."""
        self.blocked = set()
        for uid in [u for u in self.loading if self.loading[u].done()]:
            del self.loading[uid]
        order: dict[int, int] = {}
        for uid in wanted:
            if uid and uid not in order:
                order[uid] = len(order)
        placed = 0
        for uid, rank in order.items():
            if uid in self.pool or uid in self.failed:
                continue
            entry = self.host.get(uid)
            if entry is None:
                self._fetch(uid)
                continue
            if placed == MAX_PLACEMENTS_PER_STEP:
                break
            with self._lock:
                slot = self.pool.place(uid, entry.packed, lambda u: u not in in_use and not self.users[u])
                if slot is None:  # (one only waiting requests later in the order use)
                    slot = self.pool.place(
                        uid, entry.packed, functools.partial(self._later, in_use, order, rank)
                    )
            if slot is None:
                self.blocked.add(uid)
                continue
            placed += 1
            if self.on_place is not None:
                self.on_place(slot, self.pool.region_of[uid].start, uid, entry.adapter)

    @staticmethod
    def _later(in_use: set[int], order: dict[int, int], rank: int, uid: int) -> bool:
        """Whether `uid` may leave the pool for the adapter at `rank` of the order: no running request uses it,
        and its waiting ones come later."""
        return uid not in in_use and order.get(uid, len(order)) > rank

    def _superseded(self, uid: int) -> bool:
        """A version no new request will name: its name was removed, or registered anew."""
        ref = self.known.get(uid)
        if ref is None or uid in self.removed:
            return True
        current = self.named.get(ref.name)
        return current is not None and current.uid != uid

    def _drop_if_unused(self, uid: int) -> None:
        """A version no request uses and none will: out of the host cache, first to leave the pool."""
        if not self.users[uid]:
            self.users.pop(uid, None)
            with self._lock:
                self.known.pop(uid, None)
                self.failed.pop(uid, None)
                if uid in self.pool.lru:
                    self.pool.lru.move_to_end(uid, last=False)
            self.host.pop(uid)

    # -- the step (the engine's thread, or the forward thread of an overlapped engine) ------------------
    def batch(self, adapter_ids: list[int], num_tokens: list[int]) -> LoRABatch | None:
        """The step's segments over its resident adapters; None for a batch of the base model alone.

        Consecutive sequences with the same adapter share a segment (the scheduler orders the batch by
        adapter, so there is one segment per adapter); any order is correct."""
        if not any(adapter_ids):
            return None
        with self._lock:
            uids = list(dict.fromkeys(a for a in adapter_ids if a))
            missing = [u for u in uids if u not in self.pool]
            if missing:  # the scheduler admits only requests whose adapter is resident
                raise RuntimeError(f"adapter {self.name_of(missing[0])} is not resident")
            self.pool.touch(uids)
            slot_of = {u: self.pool.slot_of[u] for u in uids}
            view = self.pool.view(uids)
        starts, slots = [0], []
        for adapter_id, n in zip(adapter_ids, num_tokens, strict=True):
            slot = slot_of[adapter_id] if adapter_id else -1
            if slots and slots[-1] == slot:
                starts[-1] += n
            else:
                slots.append(slot)
                starts.append(starts[-1] + n)
        lens = [b - a for a, b, s in zip(starts[:-1], starts[1:], slots, strict=True) if s >= 0]

        def tensor(data):
            return torch.tensor(data, dtype=torch.int32).to(self.device, non_blocking=True)

        return LoRABatch(tensor(starts), tensor(slots), max(lens), view, (starts, slots))

    # -- reporting -------------------------------------------------------------------------------------
    @property
    def num_pinned(self) -> int:
        return len(self.users)

    def loaded(self) -> tuple[int, ...]:
        """The versions it has loaded, in the device pool (first) or the host cache in front of it; a removed
        version that lingers in the pool until evicted is not one. On the engine's thread (the pool's)."""
        with self._lock:
            known, pooled = set(self.known), list(self.pool.slot_of)
        return tuple(u for u in dict.fromkeys(pooled + self.host.uids()) if u in known)

    def referenced(self) -> tuple[AdapterRef, ...]:
        """The versions it knows that requests named by reference, not registered under a name (the server's
        shared adapters are), which may be deleted where they are kept. On the engine's thread (the names')."""
        with self._lock:
            refs = list(self.known.values())
        return tuple(r for r in refs if r.name not in self.named)

    def name_of(self, uid: int) -> str:
        ref = self.known.get(uid)
        return ref.name if ref is not None else str(uid)

    def capacity(self, mean_bytes: float | None = None) -> int:
        """How many adapters of `mean_bytes` fit in the pool (default: rank-8 adapters of q_proj and v_proj, the
        PEFT default)."""
        if mean_bytes is None:
            mean_bytes = self.layout.adapter_elements(8, ("q_proj", "v_proj")) * self.pool.elem_bytes
        return min(int(self.pool.capacity_bytes // mean_bytes), self.pool.desc.shape[0])

    def stats(self) -> AdapterStats:
        pool = self.pool
        return AdapterStats(
            memory_bytes=pool.capacity_bytes,
            resident_bytes=pool.used_bytes,
            resident=len(pool),
            capacity=self.capacity(pool.used_bytes / len(pool) if len(pool) else None),
            host_bytes=self.host.nbytes,
            host=len(self.host),
            loading=sum(not f.done() for f in list(self.loading.values())),
            disk_loads=self.disk_loads,
            placements=pool.num_placed,
            evictions=pool.num_evicted,
            hits=self.hits,
            misses=self.misses,
        )
