"""Where loaded adapters live on their way to the forward pass, and the per-step segment metadata.

host LRU of loaded `LoRAAdapter`s (`max_cpu_loras`, pinned ones never evicted) -> device slots
(`max_loras`): per layer and *module group* (the modules that read one input: q/k/v, gate/up; o and down
alone) one set of stacks in the model's dtype, in motet/kernels/sgmv.py's layout: A [S, n * R, in] (the
group's modules concatenated along the rank, rank-major), B [S, sum of their outputs, R] (each module's at
its columns of the fused output), scales [n, S] fp32; every adapter zero-padded to R = `max_lora_rank` and
zero in the modules it does not target. So a linear layer adds every row's delta with one shrink of its
input and one expand into its fused output, mixing adapters, ranks and target sets; each module's own
stacks stay reachable as views (`LayerStacks[module]`).

Adapters are keyed by uid (motet/lora/manager.py, which decides what to load, pin and drop). Each step
`LoRASlotCache.batch` makes the batch's adapters resident (evicting the least recently used slot not in
the batch: the scheduler keeps a step's distinct adapters within `max_loras`, so this always fits) and
returns the `LoRABatch` the model applies; an adapter missing from the host cache is fetched through the
manager. Slots belong to the engine's thread; the host cache is also safe from another thread (a lock).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from motet.kernels.sgmv import add_lora
from motet.lora.adapter import LoRAAdapter, module_shape
from motet.lora.base_shape import BaseShape

# One module's A [S, R, in], B [S, out, R], scales [S]
Stacks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# A rank's part of a module's (A [r, in], B [out, r]) under tensor parallelism (motet/engine/parallel.py)
Shard = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# Modules that read the same input, in the order of their columns in the model's fused output (qkv_proj,
# gate_up_proj; o_proj and down_proj alone): each group is one shrink and one expand.
MODULE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass(frozen=True)
class GroupStacks:
    """One layer's stacks of a module group (the layout of motet/kernels/sgmv.py): A [S, n * r, in] rank-major
    (row j * n + m: module m's rank j), B [S, sum(sizes), r], scales [n, S] fp32; `active[m]`: whether the
    expand of module m runs (a module no adapter of the step targets only adds zeros)."""

    A: torch.Tensor
    B: torch.Tensor
    scales: torch.Tensor
    sizes: tuple[int, ...]  # each module's output columns
    active: tuple[bool, ...]

    def module(self, m: int) -> Stacks:
        """Module m's own stacks as views: A [S, r, in] (row stride n * in), B [S, out_m, r], scales [S]."""
        n = len(self.sizes)
        S, rows, k = self.A.shape
        col = sum(self.sizes[:m])
        return self.A.view(S, rows // n, n, k)[:, :, m], self.B[:, col : col + self.sizes[m]], self.scales[m]

    def cut(self, rank: int, active: tuple[bool, ...]) -> GroupStacks:
        """Views of the first `rank` ranks of every module (a slice: the rows are rank-major)."""
        n = len(self.sizes)
        return GroupStacks(self.A[:, : n * rank], self.B[:, :, :rank], self.scales, self.sizes, active)


class LayerStacks(Mapping[str, Stacks]):
    """A layer's adapter stacks: per module group (`groups`, what the model applies) and, as a mapping, per
    module (views into them; only the active modules: those some adapter of the step targets)."""

    def __init__(self, groups: dict[tuple[str, ...], GroupStacks]):
        self.groups = groups
        self._modules = {
            m: g.module(i) for modules, g in groups.items() for i, m in enumerate(modules) if g.active[i]
        }

    def __getitem__(self, module: str) -> Stacks:
        return self._modules[module]

    def __iter__(self):
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


@dataclass
class LoRABatch:
    """A step's adapter segments: token rows seg_starts[i]:seg_starts[i+1] use slot seg_slots[i] (-1: none)."""

    seg_starts: torch.Tensor  # [n+1] int32, on the device
    seg_slots: torch.Tensor  # [n] int32
    max_seg_len: int
    weights: list[LayerStacks]  # per layer (groups and modules some adapter of the step targets)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, modules: tuple[str, ...], sizes) -> None:
        """y += each row's adapter delta of x, in place, for a group of modules that read x (MODULE_GROUPS)
        and write `sizes` adjacent columns of y each: one shrink and one expand for the group."""
        group = self.weights[layer].groups.get(modules)
        if group is None:  # no adapter of the step targets these modules (or they are no group: refused)
            if modules not in MODULE_GROUPS:
                raise ValueError(f"{modules} is not a module group; LoRA groups are {MODULE_GROUPS}")
            return
        if tuple(sizes) != group.sizes:
            raise ValueError(
                f"layer {layer} {modules}: output sizes {tuple(sizes)}, the stacks' {group.sizes}"
            )
        add_lora(
            y,
            x,
            group.A,
            group.B,
            group.scales,
            self.seg_starts,
            self.seg_slots,
            sizes=group.sizes,
            active=group.active,
            max_seg_len=self.max_seg_len,
        )


class LoRASlotCache:
    def __init__(
        self,
        base: BaseShape,
        *,
        fetch: Callable[[int], LoRAAdapter],
        max_loras: int = 8,
        max_cpu_loras: int = 32,
        max_lora_rank: int = 64,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        shard: Shard | None = None,
        on_load: Callable[[int, int, LoRAAdapter], None] | None = None,
    ):
        """`base`: the shapes the slots hold (a tensor-parallel rank's: its heads and intermediate columns);
        `shard` cuts each adapter module to them; `on_load(slot, adapter_id, adapter)` hears of every slot
        load (the other ranks mirror it)."""
        self.base = base
        self.shard, self.on_load = shard, on_load
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = max_loras, max_cpu_loras, max_lora_rank
        self.device, self.dtype = torch.device(device), dtype
        self.fetch = fetch  # uid -> its LoRAAdapter, loaded (for one not in the host cache)
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first
        self.pinned: set[int] = set()  # in use by unfinished requests: their host copy is never evicted
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.slot_rank = [0] * max_loras
        self.slot_modules: list[set[tuple[int, str]]] = [set() for _ in range(max_loras)]
        self.stacks: list[LayerStacks] | None = None  # allocated on the first load
        self.num_loads = 0  # slot loads (host -> device copies), for tests and metrics
        self._views: dict[frozenset[int], list[LayerStacks]] = {}  # per set of slots
        # The host cache and `resident`: the engine's thread pins, unpins and unregisters while a launched step
        # makes its adapters resident on the device thread (an overlapped step); reentrant for activate's fetch.
        self._lock = threading.RLock()

    # -- the host cache ----------------------------------------------------------------------------------
    def put(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        if adapter_id <= 0:
            raise ValueError(f"adapter ids are positive, got {adapter_id}")
        with self._lock:
            self._cache(adapter_id, adapter)

    def cached(self, adapter_id: int) -> LoRAAdapter | None:
        with self._lock:
            adapter = self.cpu.get(adapter_id)
            if adapter is not None:
                self.cpu.move_to_end(adapter_id)
            return adapter

    def unregister(self, adapter_id: int) -> None:
        """Forget an adapter: its host copy and its slot (the slot's stale weights are never read again)."""
        with self._lock:
            self.cpu.pop(adapter_id, None)
            self.pinned.discard(adapter_id)
            self.resident.pop(adapter_id, None)

    def get_cpu(self, adapter_id: int) -> LoRAAdapter:
        """The loaded adapter, from the host cache or else fetched (AdapterError if it no longer loads)."""
        adapter = self.cached(adapter_id)
        return adapter if adapter is not None else self.fetch(adapter_id)

    def pin(self, adapter_id: int) -> None:
        """Keep the host copy while requests use the adapter: its files may be deleted meanwhile."""
        with self._lock:
            self.pinned.add(adapter_id)

    def unpin(self, adapter_id: int) -> None:
        with self._lock:
            self.pinned.discard(adapter_id)
            self._evict()

    def _cache(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        self.cpu[adapter_id] = adapter
        self.cpu.move_to_end(adapter_id)
        self._evict()

    def _evict(self) -> None:
        """Least recently used first, skipping pinned adapters (the cache may exceed its size by those)."""
        unpinned = [i for i in self.cpu if i not in self.pinned]
        for victim in unpinned[: max(0, len(self.cpu) - self.max_cpu_loras)]:
            del self.cpu[victim]

    # -- device slots ------------------------------------------------------------------------------------
    def activate(self, adapter_ids) -> dict[int, int]:
        """Make these adapters resident (never evicting one of them); returns adapter id -> slot."""
        wanted = list(dict.fromkeys(adapter_ids))
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, but only max_loras={self.max_loras} slots")
        with self._lock:
            for adapter_id in wanted:
                if adapter_id not in self.resident:
                    self._load(adapter_id, self._free_slot(wanted))
                self.resident.move_to_end(adapter_id)
            return {a: self.resident[a] for a in wanted}

    def _free_slot(self, keep) -> int:
        used = set(self.resident.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(a for a in self.resident if a not in keep)  # least recently used outside the batch
        return self.resident.pop(victim)

    def _load(self, adapter_id: int, slot: int) -> None:
        adapter = self.get_cpu(adapter_id)
        self.write_slot(slot, adapter_id, adapter)
        if self.on_load is not None:
            self.on_load(slot, adapter_id, adapter)

    @torch.no_grad()
    def write_slot(self, slot: int, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (whatever held it before)."""
        for previous in [a for a, s in self.resident.items() if s == slot]:
            del self.resident[previous]
        if self.stacks is None:
            self.stacks = self._allocate()
        for layer, module in self.slot_modules[slot]:  # clear what the previous tenant of the slot wrote
            for t in self.stacks[layer][module]:
                t[slot].zero_()
        for (layer, module), (a, b, scale) in adapter.weights.items():
            if self.shard is not None:
                a, b = self.shard(module, a, b)
            A, B, scales = self.stacks[layer][module]
            r = a.shape[0]
            A[slot, :r].copy_(a)
            B[slot, :, :r].copy_(b)
            scales[slot] = scale
        self.slot_modules[slot] = set(adapter.weights)
        self.slot_rank[slot] = adapter.rank
        self.resident[adapter_id] = slot
        self.num_loads += 1
        self._views.clear()

    def _allocate(self) -> list[LayerStacks]:
        S, R = self.max_loras, self.max_lora_rank
        opts = dict(device=self.device, dtype=self.dtype)
        stacks = []
        for _ in range(self.base.num_hidden_layers):
            groups = {}
            for modules in MODULE_GROUPS:
                n_in = module_shape(self.base, modules[0])[0]
                sizes = tuple(module_shape(self.base, m)[1] for m in modules)
                groups[modules] = GroupStacks(
                    torch.zeros(S, len(modules) * R, n_in, **opts),
                    torch.zeros(S, sum(sizes), R, **opts),
                    torch.zeros(len(modules), S, device=self.device, dtype=torch.float32),
                    sizes,
                    (True,) * len(modules),
                )
            stacks.append(LayerStacks(groups))
        return stacks

    def _weights(self, slots: frozenset[int]) -> list[LayerStacks]:
        """The stacks the batch needs: groups with a module some of its adapters target, cut to their largest
        rank, those modules active."""
        if slots not in self._views:
            r = max(self.slot_rank[s] for s in slots)
            used = set().union(*(self.slot_modules[s] for s in slots))
            views = []
            for i, layer in enumerate(self.stacks):
                groups = {}
                for modules, group in layer.groups.items():
                    active = tuple((i, m) in used for m in modules)
                    if any(active):
                        groups[modules] = group.cut(r, active)
                views.append(LayerStacks(groups))
            self._views[slots] = views
        return self._views[slots]

    def batch(self, adapter_ids: list[int], num_tokens: list[int]) -> LoRABatch:
        """Segments for a step whose sequence i has `num_tokens[i]` rows and adapter `adapter_ids[i]` (0: none).

        Consecutive sequences with the same adapter share a segment (the scheduler orders the batch by
        adapter, so there is one segment per adapter); any order is correct.
        """
        slot_of = self.activate(a for a in adapter_ids if a)
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

        return LoRABatch(tensor(starts), tensor(slots), max(lens), self._weights(frozenset(slot_of.values())))

    def segments(self, seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_seg_len: int) -> LoRABatch:
        """The LoRABatch of given segments over the slots as they are (another rank's plan, mirrored; its slots
        read back from `seg_slots`, on the host)."""
        slots = frozenset(s for s in seg_slots.tolist() if s >= 0)
        return LoRABatch(seg_starts, seg_slots, max_seg_len, self._weights(slots))
