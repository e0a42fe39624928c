"""Where resident adapters live for the forward pass: one buffer bounded by bytes, each adapter packed into it at
its own rank and targets, and a descriptor table that the kernels read (S-LoRA's unified adapter memory, without
the padding to a common rank or target set that fixed slots need).

An adapter is packed once, on the host (`pack`, on a loader thread), then copied into a free region of the
pool (`AdapterPool.place`, on the engine's thread); its *slot* is a row of the descriptor table:

    desc[slot] = [rank, then per module group g (MODULE_GROUPS): offset of layer 0's piece, layer stride,
                  mask of the group's modules the adapter targets]          (offset -1: no module of g)

A *piece* is one layer's weights of one group (motet/kernels/sgmv.py reads it): the targeted modules' A
stacked module after module, A [k * r, a_ld] (row i * r + j: the i-th targeted module's rank j), then each
targeted module's B transposed and scaled, BT [r, bt_ld[m]] = (B * scale)^T. So one shrink reads the whole
group's rows (one pass over x for q/k/v), the expand adds each module's columns, and the scale costs nothing
at run time. An adapter's pieces of a group follow each other layer by layer (offset + layer * stride).
Modules an adapter targets in some layers only are zero in the others.

Under tensor parallelism every rank packs its own part of an adapter into its own pool at the *same* offsets:
the geometry is the largest rank's (rank 0's), the smaller parts padded, so the driver's placement holds for
every rank.

Regions are first-fit; when none is free the least recently used adapters the caller allows are evicted until
one is (`place`). Slots and regions belong to the engine's thread; a launched step reads the pool on the device
thread, so an adapter it uses is never evicted (the caller's `evictable` says which may go).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from motet.kernels.sgmv import add_embedding_lora, add_lora
from motet.lora.adapter import AdapterError, LoRAAdapter, module_shape
from motet.models import OWN_PROJECTIONS
from motet.models.config import ModelConfig
from motet.models.projections import PROJECTION_GROUPS

# The decoder's projection groups (each one shrink and one expand; an attention's own after the others:
# the native step applies the first four), then the two outside the decoder layers, one piece each: the embedding
# (its "shrink" a lookup of the token's column of A) and the head.
DECODER_GROUPS = (*PROJECTION_GROUPS, *((m,) for m in OWN_PROJECTIONS))
EMBED, HEAD = len(DECODER_GROUPS), len(DECODER_GROUPS) + 1  # their groups' indices
MODULE_GROUPS = (*DECODER_GROUPS, ("embed_tokens",), ("lm_head",))
GROUP_OF = {modules: g for g, modules in enumerate(MODULE_GROUPS)}
MODULE_INDEX = {m: (g, i) for g, modules in enumerate(MODULE_GROUPS) for i, m in enumerate(modules)}
DESC_WIDTH = 1 + 3 * len(MODULE_GROUPS)
ALIGN = 64  # elements: every region starts on a 64-element boundary (256 bytes in fp32)
MAX_SLOTS = 16384  # descriptor rows: resident adapters at most, whatever their size


def desc_columns(group: int) -> tuple[int, int, int]:
    """The descriptor's (offset, layer stride, module mask) columns of a group."""
    return 1 + 3 * group, 2 + 3 * group, 3 + 3 * group


@dataclass(frozen=True)
class GroupGeometry:
    """A module group's piece geometry: A's row length (the modules' input width: the vocabulary for the
    embedding) and each module's BT row length (its output width), both the largest rank's under tensor
    parallelism; and its pieces: one per decoder layer, or one."""

    modules: tuple[str, ...]
    a_ld: int
    bt_ld: tuple[int, ...]
    layers: int

    def piece(self, rank: int, mask: int) -> int:
        """Elements of one layer's piece of an adapter of `rank` targeting the modules of `mask`."""
        present = [i for i in range(len(self.modules)) if mask >> i & 1]
        return rank * (len(present) * self.a_ld + sum(self.bt_ld[i] for i in present))


class PoolLayout:
    """The pool's geometry for a base model (a tensor-parallel run: its largest rank's part of every module)."""

    def __init__(self, base: ModelConfig):
        self.num_layers = base.num_hidden_layers
        self.groups = tuple(
            GroupGeometry(
                modules,
                module_shape(base, modules[0])[0],
                tuple(module_shape(base, m)[1] for m in modules),
                self.num_layers if modules in DECODER_GROUPS else 1,
            )
            for modules in MODULE_GROUPS
        )

    def adapter_elements(self, rank: int, modules: Iterable[str]) -> int:
        """Elements an adapter of `rank` on `modules` (in every layer) takes in the pool."""
        masks = [0] * len(MODULE_GROUPS)
        for m in modules:
            g, i = MODULE_INDEX[m]
            masks[g] |= 1 << i
        return _aligned(sum(geo.layers * geo.piece(rank, masks[g]) for g, geo in enumerate(self.groups)))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class PackedAdapter:
    """An adapter in the pool's layout, on the host: `data` is copied into a region as is."""

    data: torch.Tensor  # [elements], the pool's dtype
    rank: int
    groups: tuple[tuple[int, int, int] | None, ...]  # per group: (offset in data, layer stride, module mask)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def desc_row(self, start: int) -> list[int]:
        """Its descriptor once placed at element `start` of the pool."""
        row = [self.rank]
        for group in self.groups:
            row += [-1, 0, 0] if group is None else [start + group[0], group[1], group[2]]
        return row


Shard = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def pack(
    adapter: LoRAAdapter,
    layout: PoolLayout,
    dtype: torch.dtype,
    shard: Shard | None = None,
    pin: bool = False,
) -> PackedAdapter:
    """`adapter` in the pool's layout (this rank's part, with `shard`), in `dtype`; `pin`: in page-locked
    memory (a CUDA pool's copies are then asynchronous)."""
    r = adapter.rank
    masks = [0] * len(MODULE_GROUPS)
    for _, module in adapter.weights:
        g, i = MODULE_INDEX[module]
        masks[g] |= 1 << i
    groups, total = [], 0
    for g, geo in enumerate(layout.groups):
        if not masks[g]:
            groups.append(None)
            continue
        stride = geo.piece(r, masks[g])
        groups.append((total, stride, masks[g]))
        total += layout.groups[g].layers * stride
    total = _aligned(total)
    buf = torch.zeros(total, dtype=torch.float32)
    for (layer, module), (a, b, scale) in adapter.weights.items():
        if shard is not None:
            if MODULE_INDEX[module][0] >= len(DECODER_GROUPS):
                raise AdapterError(
                    f"LoRA on {module} is not supported with tensor parallelism yet; target the decoder layers' "
                    "projections only"
                )
            a, b = shard(module, a, b)
        g, i = MODULE_INDEX[module]
        geo, (offset, stride, mask) = layout.groups[g], groups[g]
        present = [j for j in range(len(geo.modules)) if mask >> j & 1]
        k, pos = len(present), present.index(i)
        base = offset + layer * stride
        A = buf[base : base + k * r * geo.a_ld].view(k * r, geo.a_ld)
        A[pos * r : pos * r + a.shape[0], : a.shape[1]] = a
        bt = base + k * r * geo.a_ld + r * sum(geo.bt_ld[j] for j in present[:pos])
        BT = buf[bt : bt + r * geo.bt_ld[i]].view(r, geo.bt_ld[i])
        BT[: b.shape[1], : b.shape[0]] = b.t() * scale  # the scale folded in, in fp32, rounded once
    data = buf.to(dtype)
    return PackedAdapter(data.pin_memory() if pin else data, r, tuple(groups))


@dataclass
class _Region:
    start: int
    size: int
    uid: int


class AdapterPool:
    """Resident adapters: `capacity_bytes` of `dtype` on `device`, and their descriptors."""

    def __init__(
        self,
        layout: PoolLayout,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_slots: int = MAX_SLOTS,
    ):
        self.layout, self.device, self.dtype = layout, torch.device(device), dtype
        elem = torch.tensor([], dtype=dtype).element_size()
        self.capacity = capacity_bytes // elem // ALIGN * ALIGN  # elements
        self.elem_bytes = elem
        # On a CPU the pages are touched only as adapters are written: the resident set grows with use.
        self.data = torch.empty(self.capacity, dtype=dtype, device=self.device)
        self.desc = torch.zeros(max_slots, DESC_WIDTH, dtype=torch.int64, device=self.device)
        self.rows: list[list[int] | None] = [None] * max_slots  # the descriptors, on the host
        self.regions: list[_Region] = []  # by start
        self.slot_of: dict[int, int] = {}  # resident adapter -> its slot
        self.region_of: dict[int, _Region] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident adapters, least recently used first
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.used = 0  # elements in regions
        self.num_placed = self.num_evicted = 0

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.elem_bytes

    @property
    def used_bytes(self) -> int:
        return self.used * self.elem_bytes

    def __contains__(self, uid: int) -> bool:
        return uid in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def touch(self, uids: Iterable[int]) -> None:
        """These adapters were used now (the LRU order)."""
        for uid in uids:
            if uid in self.lru:
                self.lru.move_to_end(uid)

    def fits(self, packed: PackedAdapter) -> bool:
        """Whether `packed` could ever be placed (the empty pool holds it)."""
        return packed.data.numel() <= self.capacity

    def place(self, uid: int, packed: PackedAdapter, evictable: Callable[[int], bool]) -> int | None:
        """Make `uid` resident (no-op if it is); its slot, or None where the adapters `evictable` allows to go
        cannot make room. Evicts least recently used first."""
        if uid in self.slot_of:
            self.lru.move_to_end(uid)
            return self.slot_of[uid]
        size = packed.data.numel()
        start = self._gap(size) if self.free_slots else None
        if start is None:
            victims = [u for u in self.lru if evictable(u)]
            room = self.capacity - self.used + sum(self.region_of[v].size for v in victims)
            if room < size or (not self.free_slots and not victims):
                return None
            for victim in victims:
                self.evict(victim)
                start = self._gap(size)
                if start is not None and self.free_slots:
                    break
            else:
                return None
        slot = self.free_slots.pop()
        self.data[start : start + size].copy_(packed.data, non_blocking=True)
        row = packed.desc_row(start)
        self.desc[slot].copy_(torch.tensor(row, dtype=torch.int64), non_blocking=False)
        self.rows[slot] = row
        region = _Region(start, size, uid)
        bisect.insort(self.regions, region, key=lambda r: r.start)
        self.slot_of[uid], self.region_of[uid] = slot, region
        self.lru[uid] = None
        self.used += size
        self.num_placed += 1
        return slot

    def evict(self, uid: int) -> None:
        """Forget a resident adapter (its region and slot are free for the next placement)."""
        slot = self.slot_of.pop(uid, None)
        if slot is None:
            return
        region = self.region_of.pop(uid)
        self.regions.pop(bisect.bisect_left(self.regions, region.start, key=lambda r: r.start))
        self.used -= region.size
        self.rows[slot] = None
        self.free_slots.append(slot)
        self.lru.pop(uid, None)
        self.num_evicted += 1

    def _gap(self, size: int) -> int | None:
        """The first free range of `size` elements, by start."""
        at = 0
        for region in self.regions:
            if region.start - at >= size:
                return at
            at = region.start + region.size
        return at if self.capacity - at >= size else None

    def put_at(self, slot: int, start: int, uid: int, packed: PackedAdapter) -> None:
        """Write `packed` at a given place (another rank's placement, mirrored: motet/engine/worker/model_runner.py);
        whatever held that slot or range before is forgotten."""
        for old in [u for u, s in self.slot_of.items() if s == slot]:
            self.evict(old)
        for old in [
            r.uid for r in self.regions if r.start < start + packed.data.numel() and start < r.start + r.size
        ]:
            self.evict(old)
        size = packed.data.numel()
        self.data[start : start + size].copy_(packed.data, non_blocking=True)
        row = packed.desc_row(start)
        self.desc[slot].copy_(torch.tensor(row, dtype=torch.int64))
        self.rows[slot] = row
        if slot in self.free_slots:
            self.free_slots.remove(slot)
        region = _Region(start, size, uid)
        bisect.insort(self.regions, region, key=lambda r: r.start)
        self.slot_of[uid], self.region_of[uid] = slot, region
        self.lru[uid] = None
        self.used += size

    def view(self, uids: Iterable[int]) -> PoolView:
        """What a step over these resident adapters reads."""
        return self.view_slots([self.slot_of[u] for u in uids])

    def view_slots(self, slots: Iterable[int]) -> PoolView:
        """What a step over the adapters in these slots reads."""
        rows = {s: self.rows[s] for s in slots}
        groups = frozenset(
            g for g in range(len(MODULE_GROUPS)) for row in rows.values() if row[desc_columns(g)[0]] >= 0
        )
        return PoolView(self, max((row[0] for row in rows.values()), default=0), groups, rows)

    def segments(self, seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int) -> LoRABatch:
        """The LoRABatch of given segments over the pool as it is (another rank's plan, mirrored; its slots read
        back from `seg_slots`, on the host)."""
        return LoRABatch(
            seg_starts, seg_slots, max_seg_len, self.view_slots({s for s in seg_slots.tolist() if s >= 0})
        )


@dataclass(frozen=True)
class PoolView:
    """A step's view of the pool: its adapters' largest rank, the groups some of them target, their descriptors
    on the host (the torch path reads them there: no device sync)."""

    pool: AdapterPool
    max_rank: int
    groups: frozenset[int]
    rows: dict[int, list[int]] = field(hash=False, compare=False)


@dataclass
class LoRABatch:
    """A step's adapter segments: token rows seg_starts[i]:seg_starts[i+1] use slot seg_slots[i] (-1: none)."""

    seg_starts: torch.Tensor  # [n+1] int32, on the device
    seg_slots: torch.Tensor  # [n] int32
    max_seg_len: int
    weights: PoolView
    # the segments on the host, where the batch was made there (the output head's rows are picked by them)
    host: tuple[list[int], list[int]] | None = None

    @property
    def head(self) -> bool:
        """Whether some adapter of the step targets the output head."""
        return HEAD in self.weights.groups

    def rows(self, rows: list[int]) -> LoRABatch:
        """The batch over some of its token rows (those the step computes logits for), each its own segment."""
        if self.host is None:
            raise ValueError("the segments of a batch made on the device are not known on the host")
        starts, slots = self.host
        picked = [slots[bisect.bisect_right(starts, r) - 1] for r in rows]
        device = self.seg_starts.device
        return LoRABatch(
            torch.arange(len(rows) + 1, dtype=torch.int32).to(device, non_blocking=True),
            torch.tensor(picked, dtype=torch.int32).to(device, non_blocking=True),
            1,
            self.weights,
            (list(range(len(rows) + 1)), picked),
        )

    def targets(self, modules: tuple[str, ...]) -> bool:
        """Whether some adapter of the step targets this module group (in some layer)."""
        return GROUP_OF[modules] in self.weights.groups

    def of_row(self, row: int, n: int) -> LoRABatch:
        """A batch of `n` rows that all take the adapter of this step's token row `row` (a latent attention's
        cached context of that row's sequence, expanded)."""
        starts, slots = self.host or (self.seg_starts.tolist(), self.seg_slots.tolist())
        slot = slots[bisect.bisect_right(starts, row) - 1]
        device = self.seg_starts.device
        seg_starts = torch.tensor([0, n], dtype=torch.int32, device=device)
        seg_slots = torch.tensor([slot], dtype=torch.int32, device=device)
        return LoRABatch(seg_starts, seg_slots, n, self.weights, ([0, n], [slot]))

    def add_embedding(self, x: torch.Tensor, input_ids: torch.Tensor) -> None:
        """x (the tokens' embeddings) += each token's embedding delta, in place: B @ A[:, token] * scale."""
        if EMBED not in self.weights.groups:
            return
        pool, geo = self.weights.pool, self.weights.pool.layout.groups[EMBED]
        add_embedding_lora(
            x, input_ids, pool.data, pool.desc, self.seg_starts, self.seg_slots, group=EMBED, a_ld=geo.a_ld,
            bt_ld=geo.bt_ld, max_rank=self.weights.max_rank, max_seg_len=self.max_seg_len, rows=self.weights.rows,
        )  # fmt: skip

    def add_head(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """logits (of this batch's rows) += each row's output head delta of its hidden state, in place."""
        if self.head:
            self.add(logits, hidden, 0, MODULE_GROUPS[HEAD], (logits.shape[1],))

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, modules: tuple[str, ...], sizes) -> None:
        """y += each row's adapter delta of x, in place, for a group of modules that read x (MODULE_GROUPS)
        and write `sizes` adjacent columns of y each: one shrink and one expand for the group."""
        g = GROUP_OF.get(modules)
        if g is None:
            raise ValueError(f"{modules} is not a module group; LoRA groups are {MODULE_GROUPS}")
        if g not in self.weights.groups:  # no adapter of the step targets these modules
            return
        pool, geo = self.weights.pool, self.weights.pool.layout.groups[g]
        if len(sizes) != len(geo.modules) or any(s > ld for s, ld in zip(sizes, geo.bt_ld, strict=True)):
            raise ValueError(f"layer {layer} {modules}: output sizes {tuple(sizes)} do not fit {geo.bt_ld}")
        add_lora(
            y,
            x,
            pool.data,
            pool.desc,
            self.seg_starts,
            self.seg_slots,
            group=g,
            layer=layer,
            a_ld=geo.a_ld,
            bt_ld=geo.bt_ld,
            sizes=tuple(sizes),
            max_rank=self.weights.max_rank,
            max_seg_len=self.max_seg_len,
            rows=self.weights.rows,
        )
