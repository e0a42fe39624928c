"""The KV connector: the engine's prefix cache extended past the device, to host RAM and local disk
(motet/engine/core/kv_tiers.py), so that a prefix whose blocks were evicted, or computed before a restart, is loaded
instead of recomputed.

    save: a request finishes                                             -> its cached blocks are held and
          copied to the host on a background thread, then released; the copies go to the tiers that lack them
          (RAM at once, disk by the same thread)
          the block manager evicts cached blocks no tier holds yet         -> copied now, before their reuse
    load: a waiting request's prefix misses the device cache             -> the tiers hold its next blocks:
          take free device blocks for them and fill them on a background thread; the request waits in its
          queue, keeping its place, while other requests run; once filled they are its cached prefix

Blocks are keyed by the engine's chained prefix-cache hashes, which include the adapter and the tenant's salt
(motet/engine/core/block_manager.py), so the tiers inherit the device cache's isolation: a tenant, a cache_salt or an
adapter never reads another's blocks, and a block is served only to the same tokens. A load covers the longest
run of consecutive blocks the tiers hold; an entry that turns out unreadable ends the run there and the rest is
recomputed. The step never waits on I/O: the only wait is `wait_for_load`, which the engine calls when nothing
else could run. Plain synchronous policy, driven from the engine's thread (`poll` between steps); its two worker
threads (loads; snapshots and disk writes) stay inside this module. The blocks move through
motet/engine/core/kv_blocks.py's read_blocks / write_blocks, one call per set of blocks: under tensor parallelism
each rank would run them on its shard of the KV heads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import torch

from motet.engine.core.block_manager import Block, BlockManager
from motet.engine.core.kv_blocks import KVLayout, read_blocks, write_blocks
from motet.engine.core.kv_shared import SharedTier
from motet.engine.core.kv_tiers import DiskTier, HostTier
from motet.engine.core.sequence import Sequence

log = logging.getLogger("motet.kv")

# Load latency histogram buckets, seconds (a 4,000-token prefix is ~250 blocks of the default model).
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LOAD_CHUNK_BLOCKS = 64  # blocks copied to the device at once by a load (bounds its host staging memory)
# Blocks waiting for the disk writer, in bytes: past this a save skips the disk (the writer is behind; the
# step must not wait for it, nor memory grow without bound).
MAX_PENDING_WRITE_BYTES = 512 << 20
GiB = 1 << 30
SETTLE_TIMEOUT_S = 5.0  # the longest an engine going idle waits for its finished requests' snapshots


@dataclass(frozen=True)
class KVTierStats:
    """One tier's figures, cumulative except `blocks` and `bytes` (held now)."""

    tier: str  # "ram" | "disk" | "shared"
    capacity_bytes: int
    blocks: int
    bytes: int
    hit_tokens: int  # prompt tokens loaded from this tier instead of recomputed
    loaded_bytes: int
    saved_blocks: int
    saved_bytes: int
    dropped_entries: int  # found corrupt, truncated or foreign, deleted (their tokens recomputed)
    loads: int  # loads whose slowest source was this tier
    load_seconds_sum: float
    load_seconds_buckets: tuple[int, ...]  # cumulative counts of loads at most LOAD_BUCKETS[i] seconds


def sum_tier_stats(per_engine) -> tuple[KVTierStats, ...]:
    """Several engines' tiers (replicas), summed tier by tier."""
    by_tier: dict[str, list[KVTierStats]] = {}
    for tiers in per_engine:
        for t in tiers:
            by_tier.setdefault(t.tier, []).append(t)
    out = []
    for tier, items in by_tier.items():
        values = {}
        for f in fields(KVTierStats):
            if f.name == "tier":
                continue
            column = [getattr(t, f.name) for t in items]
            values[f.name] = (
                tuple(map(sum, zip(*column, strict=True))) if f.name.endswith("buckets") else sum(column)
            )
        out.append(KVTierStats(tier=tier, **values))
    return tuple(out)


@dataclass
class _Counters:
    hit_tokens: int = 0
    loaded_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    loads: int = 0
    load_seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_BUCKETS))

    def observe(self, seconds: float) -> None:
        self.loads += 1
        self.load_seconds_sum += seconds
        for i, le in enumerate(LOAD_BUCKETS):
            if seconds <= le:
                self.buckets[i] += 1


@dataclass
class _Load:
    """A sequence's blocks on their way from the tiers: filled in order by the loader thread."""

    seq: Sequence
    block_ids: list[int]  # free device blocks taken for it (held by the load, not yet the sequence's)
    hashes: list[int]
    token_ids: list[tuple[int, ...]]
    sources: list[tuple[str, torch.Tensor | None]]  # ("ram", its tensor) or ("disk", None: read it)
    rest_blocks: int  # what the sequence needs besides, kept free for it meanwhile
    loaded: int = 0  # leading blocks filled (set by the loader thread)
    seconds: float = 0.0


def _own(data: torch.Tensor) -> list[torch.Tensor]:
    """read_blocks' blocks, each in its own memory (the RAM tier's bound counts what an entry keeps alive)."""
    return [t.clone() for t in data.unbind(0)]


def _worker(name: str) -> ThreadPoolExecutor:
    """A worker thread whose torch ops run on one core: its copies overlap the forward pass, which has the
    others (with the forward's thread count there, both wait on each other's cores: 10x slower copies on a
    busy 2-core machine). torch.set_num_threads sets the calling thread's count and the default of threads
    started later: the latter is set back."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    threads = torch.get_num_threads()
    pool.submit(torch.set_num_threads, 1).result()
    torch.set_num_threads(threads)
    return pool


@dataclass
class _Snapshot:
    """A finished request's blocks on their way to the host: held (ref counted) until copied."""

    block_ids: list[int]
    hashes: list[int]
    token_ids: list[tuple[int, ...]]
    tensors: list[torch.Tensor] = field(default_factory=list)  # set by the saver thread


class NoKVTiers:
    """The KV tiers where the config asks for none: the device's cache is all there is. A null object, so that
    the engine, the scheduler and the replicas call it as they call a KVConnector."""

    needs_landed_steps = False
    num_loading = 0
    disk = shared = None

    def save_sequence(self, seq: Sequence) -> None:
        pass

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> None:
        pass

    def flush(self) -> None:
        pass

    def wait_saved(self) -> None:
        pass

    def shared_prefix(self, block_hashes: Iterable[int]) -> int:
        return 0

    def is_loading(self, seq: Sequence) -> bool:
        return False

    def start_load(self, seq: Sequence) -> bool:
        return False

    def wait_for_load(self, timeout: float) -> None:
        pass

    def poll(self) -> None:
        pass

    def stats(self) -> tuple[KVTierStats, ...]:
        return ()

    def close(self) -> None:
        pass


class KVConnector:
    needs_landed_steps = True  # (it saves and loads the blocks of landed steps)

    def __init__(
        self,
        kv_caches,
        block_manager: BlockManager,
        ram_bytes: int = 0,
        disk: DiskTier | None = None,
        shared: SharedTier | None = None,
    ):
        self.kv_caches = kv_caches
        self.bm = block_manager
        self.layout = KVLayout.of(kv_caches)
        self.ram = HostTier(ram_bytes) if ram_bytes > 0 else None
        self.disk = disk
        # Shared by every replica (motet/engine/core/kv_shared.py): a finished request's blocks are written through
        # to it by the saver thread, so another replica (a decode replica after this prefill one) finds them.
        self.shared = shared
        self.tiers = [t for t in (self.ram, self.disk, self.shared) if t is not None]
        self.counters = {t.name: _Counters() for t in self.tiers}
        self.loading: dict[int, _Load] = {}  # seq id -> its load under way
        self.reserved_blocks = 0  # free blocks the loading sequences will need once loaded
        self._done: queue.SimpleQueue[_Load] = queue.SimpleQueue()
        self._loader = _worker("motet-kv-load")
        self._staging: torch.Tensor | None = None  # the loader's: LOAD_CHUNK_BLOCKS blocks on the host
        self._saver = _worker("motet-kv-save")  # finished requests' snapshots, then disk writes
        self._snapshots: queue.SimpleQueue[_Snapshot] = queue.SimpleQueue()
        self._copying: set[int] = set()  # hashes whose snapshot is under way
        self._pending_writes: dict[int, int] = {}  # hash -> bytes, queued for the disk
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()  # the writer thread takes them off

    # -- save ---------------------------------------------------------------------------------------------
    def save_blocks(self, blocks: list[Block]) -> None:
        """Keep these cached blocks (their hash and tokens set) in every tier that lacks them, copying them now:
        the block manager's eviction hook, before it reuses them (they are mostly saved already, when their
        request finished)."""
        wanted = [b for b in blocks if b.hash is not None and self._missing_somewhere(b.hash)]
        if wanted:
            data = read_blocks(self.kv_caches, [b.block_id for b in wanted])
            self._keep([b.hash for b in wanted], [b.token_ids for b in wanted], _own(data))

    def save_evicted(self, blocks: list[Block]) -> None:
        """The block manager's eviction hook: a failure here loses the blocks' copies, never the allocation."""
        try:
            self.save_blocks(blocks)
        except Exception:
            log.exception("KV tiers: saving evicted blocks failed; they will be recomputed if needed")

    def save_sequence(self, seq: Sequence) -> None:
        """A finishing request's cached blocks (its prompt's and output's full blocks), copied to the host on the
        saver thread: they are held meanwhile, so nothing overwrites them, and the step does not wait."""
        blocks = [self.bm.blocks[i] for i in seq.block_table]
        wanted = [
            b
            for b in blocks
            if b.hash is not None and b.hash not in self._copying and self._missing_somewhere(b.hash)
        ]
        if not wanted:
            return
        snapshot = _Snapshot(
            [b.block_id for b in wanted], [b.hash for b in wanted], [b.token_ids for b in wanted]
        )
        self.bm.hold_blocks(snapshot.block_ids)
        self._copying.update(snapshot.hashes)
        self._saver.submit(self._snapshot, snapshot)

    def _snapshot(self, snapshot: _Snapshot) -> None:
        """On the saver thread."""
        try:
            snapshot.tensors = _own(read_blocks(self.kv_caches, snapshot.block_ids))
        except Exception:
            log.exception(
                "KV tiers: copying a finished request's blocks failed; they will be recomputed if needed"
            )
        if self.shared is not None and snapshot.tensors:
            self._write_shared(zip(snapshot.hashes, snapshot.token_ids, snapshot.tensors, strict=True))
        self._snapshots.put(snapshot)

    def _write_shared(self, entries) -> None:
        """On the saver thread: the blocks the shared tier lacks, written now (before the request's end is
        seen as saved: `wait_saved`)."""
        for h, token_ids, tensor in entries:
            try:
                if h not in self.shared and self.shared.write(h, token_ids, tensor):
                    self._count_save("shared", tensor.nbytes)
            except Exception:
                log.exception("KV shared tier: writing a block failed")

    def wait_saved(self) -> None:
        """Block until what the saver thread was given so far is done: the blocks of a request that finished
        before this call are in the shared tier then (or could not be written). Any thread."""
        self._saver.submit(lambda: None).result()

    def shared_prefix(self, block_hashes: Iterable[int]) -> int:
        """How many of the leading blocks the shared tier holds (up to the first it lacks: a load stops there too)
        once what the saver thread was given so far is written (`wait_saved`); 0 without a shared tier. Any
        thread; blocks."""
        if self.shared is None:
            return 0
        self.wait_saved()
        n = 0
        for h in block_hashes:
            if h not in self.shared:
                break
            n += 1
        return n

    def _absorb_snapshots(self) -> None:
        """Completed snapshots into the tiers; their blocks are released (on the engine's thread)."""
        while True:
            try:
                snapshot = self._snapshots.get_nowait()
            except queue.Empty:
                return
            self._copying.difference_update(snapshot.hashes)
            self.bm.release_blocks(snapshot.block_ids)
            if snapshot.tensors:
                self._keep(snapshot.hashes, snapshot.token_ids, snapshot.tensors)

    def _keep(self, hashes: list[int], token_ids: list[tuple[int, ...]], tensors: list[torch.Tensor]) -> None:
        to_disk = []
        for h, tokens, tensor in zip(hashes, token_ids, tensors, strict=True):
            if self.ram is not None and h not in self.ram:
                self.ram.put(h, tokens, tensor)
                self._count_save("ram", tensor.nbytes)
            if self._needs_disk(h) and self._queue_write(h, tensor.nbytes):
                to_disk.append((h, tokens, tensor))
        if to_disk:
            self._saver.submit(self._write, to_disk)
        if self.shared is not None and (
            to_share := [e for e in zip(hashes, token_ids, tensors, strict=True)]
        ):
            self._saver.submit(self._write_shared, to_share)  # evicted blocks (skipped where already there)

    def _missing_somewhere(self, h: int) -> bool:
        return (
            (self.ram is not None and h not in self.ram)
            or self._needs_disk(h)
            or (self.shared is not None and h not in self.shared)
        )

    def _needs_disk(self, h: int) -> bool:
        return self.disk is not None and h not in self._pending_writes and h not in self.disk

    def _queue_write(self, h: int, nbytes: int) -> bool:
        with self._pending_lock:
            if self._pending_bytes + nbytes > MAX_PENDING_WRITE_BYTES:
                return False
            self._pending_writes[h] = nbytes
            self._pending_bytes += nbytes
            return True

    def _count_save(self, tier: str, nbytes: int) -> None:
        c = self.counters[tier]
        c.saved_blocks += 1
        c.saved_bytes += nbytes

    def _write(self, entries) -> None:
        """On the saver thread."""
        for h, token_ids, tensor in entries:
            try:
                if self.disk.write(h, token_ids, tensor):
                    self._count_save("disk", tensor.nbytes)
            except Exception:
                log.exception("KV disk tier: writing a block failed")
            finally:
                with self._pending_lock:
                    self._pending_bytes -= self._pending_writes.pop(h, 0)

    def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """The engine has no request left: take in the finished requests' snapshots now (their copy is under
        way: milliseconds), so that their blocks are free, and in the tiers, while it idles rather than at its
        next step (on the engine's thread)."""
        deadline = time.monotonic() + timeout
        while self._copying and (left := deadline - time.monotonic()) > 0:
            try:
                snapshot = self._snapshots.get(timeout=left)
            except queue.Empty:
                return
            self._snapshots.put(snapshot)
            self._absorb_snapshots()

    def flush(self) -> None:
        """Wait until every finished request's blocks are in the tiers, on disk too (tests, benchmarks, shutdown;
        on the engine's thread)."""
        self._saver.submit(lambda: None).result()
        self._absorb_snapshots()
        self._saver.submit(lambda: None).result()

    # -- load ---------------------------------------------------------------------------------------------
    def is_loading(self, seq: Sequence) -> bool:
        return seq.seq_id in self.loading

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def start_load(self, seq: Sequence) -> bool:
        """After the device cache's hit (the sequence's block table): if the tiers hold the blocks that follow,
        take free device blocks for them and start filling them. True: a load is under way, the sequence must
        wait (`poll` gives it the blocks)."""
        block_manager = self.bm
        if not self.tiers or not block_manager.may_match(seq):
            return False
        bs = block_manager.block_size
        hashes = block_manager.prefix_hashes(seq)
        first = len(seq.block_table)
        sources, keys, tokens = [], [], []
        for i in range(first, len(hashes)):
            h, chunk = hashes[i], tuple(seq.token_ids[i * bs : (i + 1) * bs])
            data = self.ram.get(h, chunk) if self.ram is not None else None
            if data is not None:
                sources.append(("ram", data))
            elif self.disk is not None and h in self.disk:
                sources.append(("disk", None))
            elif self.shared is not None and h in self.shared:
                sources.append(("shared", None))
            else:
                break
            keys.append(h)
            tokens.append(chunk)
        if not sources:
            return False
        # Only when the rest of its prompt fits beside it (and beside the other loads' rests): a load must not
        # leave its sequence, or another, holding blocks it cannot run with.
        rest = block_manager.blocks_needed(seq.num_tokens) - first - len(sources)
        if len(sources) + rest > block_manager.num_free_blocks - self.reserved_blocks:
            return False
        block_ids = block_manager.take_blocks(len(sources))
        load = _Load(seq, block_ids, keys, tokens, sources, rest)
        self.reserved_blocks += rest
        self.loading[seq.seq_id] = load
        self._loader.submit(self._fill, load)
        return True

    def _fill(self, load: _Load) -> None:
        """On the loader thread: fill the load's blocks in order, up to the first entry that cannot be read,
        through the staging memory (reused: a load touches no fresh memory)."""
        t0 = time.perf_counter()
        if self._staging is None:
            shape = (LOAD_CHUNK_BLOCKS, *self.layout.block_shape)
            pin = self.kv_caches[0][0].device.type == "cuda"
            self._staging = torch.empty(shape, dtype=self.layout.dtype, pin_memory=pin)
        staged = 0
        try:
            for i, (tier, data) in enumerate(load.sources):
                if data is not None:
                    self._staging[staged].copy_(data)
                elif not self._file_tier(tier).read_into(
                    load.hashes[i], load.token_ids[i], self._staging[staged]
                ):
                    break
                staged += 1
                if staged == LOAD_CHUNK_BLOCKS:
                    staged = self._copy_in(load, staged)
            self._copy_in(load, staged)
        except Exception:
            log.exception("KV tiers: a load failed; its remaining tokens are recomputed")
        load.seconds = time.perf_counter() - t0
        self._done.put(load)

    def _file_tier(self, name: str):
        return self.shared if name == "shared" else self.disk

    def _copy_in(self, load: _Load, staged: int) -> int:
        """Copy the staged blocks to the load's next device blocks; the staging memory is free again (0)."""
        if staged:
            ids = load.block_ids[load.loaded : load.loaded + staged]
            write_blocks(self.kv_caches, ids, self._staging[:staged])
            load.loaded += staged
        return 0

    def wait_for_load(self, timeout: float) -> None:
        """Block until a load completes or `timeout` passes (when no other work could run)."""
        try:
            load = self._done.get(timeout=timeout)
        except queue.Empty:
            return
        self._done.put(load)  # poll takes it

    def poll(self) -> None:
        """Hand completed loads' blocks to their sequences, and completed snapshots to the tiers (on the engine's
        thread, between steps)."""
        self._absorb_snapshots()
        block_manager = self.bm
        while True:
            try:
                load = self._done.get_nowait()
            except queue.Empty:
                return
            self.loading.pop(load.seq.seq_id, None)
            self.reserved_blocks -= load.rest_blocks
            self._account(load)
            seq, n, bs = load.seq, load.loaded, block_manager.block_size
            if seq.is_finished:  # aborted while loading: the filled blocks still join the device cache
                for block_id, h, chunk in zip(load.block_ids[:n], load.hashes, load.token_ids, strict=False):
                    block_manager.register_block(block_id, h, chunk)
                block_manager.release_blocks(load.block_ids)
                continue
            seq.block_table.extend(load.block_ids[:n])
            block_manager.release_blocks(load.block_ids[n:])
            seq.num_computed_tokens += n * bs
            if seq.num_preemptions == 0:  # (Sequence.num_cached_tokens: its first admission's hit only)
                seq.num_cached_tokens += n * bs
            block_manager.prefix_hits += n * bs
            block_manager.cache_full_blocks(seq)

    def _account(self, load: _Load) -> None:
        tiers = [tier for tier, _ in load.sources[: load.loaded]]
        for tier in set(tiers):
            c = self.counters[tier]
            blocks = tiers.count(tier)
            c.hit_tokens += blocks * self.layout.block_size
            c.loaded_bytes += blocks * self.layout.block_bytes
        slowest = next(t for t in ("shared", "disk", "ram") if t in tiers or t == "ram")
        if tiers:
            self.counters[slowest].observe(load.seconds)

    # -- figures and shutdown -----------------------------------------------------------------------------
    def stats(self) -> tuple[KVTierStats, ...]:
        out = []
        for tier in self.tiers:
            c = self.counters[tier.name]
            held = len(tier.entries) if tier is self.ram else tier.num_entries
            out.append(
                KVTierStats(
                    tier=tier.name,
                    capacity_bytes=tier.capacity_bytes,
                    blocks=held,
                    bytes=tier.bytes,
                    hit_tokens=c.hit_tokens,
                    loaded_bytes=c.loaded_bytes,
                    saved_blocks=c.saved_blocks,
                    saved_bytes=c.saved_bytes,
                    dropped_entries=getattr(tier, "dropped", 0),
                    loads=c.loads,
                    load_seconds_sum=c.load_seconds_sum,
                    load_seconds_buckets=tuple(c.buckets),
                )
            )
        return tuple(out)

    def close(self) -> None:
        """Finish queued disk writes and stop the worker threads."""
        self.flush()
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
