"""A simulated engine replica for the routing simulation: a block-LRU prefix cache, an adapter LRU, and the
service-time model fitted to measured step times (benchmarks/routing_fit.py).

A request's prefill waits for the replica's earlier prefills (first come, first served) and runs in steps of
at most `max_num_batched_tokens` tokens that also carry one token per decoding row, so decoding rows slow it
down; its reply then decodes one token per step alongside the others. The replica records what it caches and
evicts (blocks, adapters) since its last report, as a real replica reports them to the router.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

from benchmarks.routing_fit import ServiceModel, attention_pairs
from benchmarks.routing_trace import TraceRequest


@dataclass
class Served:
    ttft_s: float
    hit_tokens: int
    adapter_loaded: bool
    finish: float


class SimReplica:
    def __init__(self, model: ServiceModel, kv_blocks: int, adapter_slots: int):
        self.model, self.kv_blocks, self.adapter_slots = model, kv_blocks, adapter_slots
        self.blocks: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.adapters: OrderedDict[int, None] = OrderedDict()
        self.block_changes: dict[int, bool] = {}  # since the last report: hash -> held now
        self.adapter_changes: dict[int, bool] = {}
        self.prefill_free_at = 0.0
        self.decoding: list[float] = []  # finish times (heap)
        self.outstanding = 0  # requests routed here and not finished (the simulation keeps it)
        self.work_s = 0.0  # modelled busy time
        self.served = 0

    def _rows_at(self, t: float) -> int:
        while self.decoding and self.decoding[0] <= t:
            heapq.heappop(self.decoding)
        return len(self.decoding)

    def cached_prefix(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def serve(self, req: TraceRequest, now: float) -> Served:
        m, bs = self.model, self.model.block_size
        start = max(now, self.prefill_free_at)
        rows = self._rows_at(start)
        while rows >= m.max_num_seqs:  # no room: wait for the next reply to finish
            start = heapq.heappop(self.decoding)
            rows -= 1
        hit = self.cached_prefix(req.block_hashes)
        for h in req.block_hashes[:hit]:
            self.blocks.move_to_end(h)
        hit_tokens = hit * bs
        uncached = req.prompt_tokens - hit_tokens
        loaded = bool(req.adapter) and req.adapter not in self.adapters
        if req.adapter:
            self._touch(self.adapters, self.adapter_changes, req.adapter, self.adapter_slots)
        chunks = math.ceil(uncached / max(1, m.max_num_batched_tokens - rows))
        prefill = (m.adapter_load_s if loaded else 0.0) + chunks * m.step_s(rows, rows)
        prefill += m.token_s * uncached + m.attention_s * attention_pairs(uncached, hit_tokens)
        end = start + prefill
        self.prefill_free_at = end
        context = req.prompt_tokens + req.output_tokens / 2
        per_token = m.step_s(rows + 1, rows + 1) + m.attention_s * context * (rows + 1)
        finish = end + req.output_tokens * per_token
        heapq.heappush(self.decoding, finish)
        self.work_s += prefill + req.output_tokens * per_token / (rows + 1)
        self.served += 1
        for h in req.cache_hashes:
            self._touch(self.blocks, self.block_changes, h, self.kv_blocks)
        return Served(end - now, hit_tokens, loaded, finish)

    @staticmethod
    def _touch(lru: OrderedDict, changes: dict, key: int, capacity: int) -> None:
        if key in lru:
            lru.move_to_end(key)
            return
        lru[key] = None
        changes[key] = True
        while len(lru) > capacity:
            old, _ = lru.popitem(last=False)
            changes[old] = False

    def take_changes(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """What it cached, evicted, loaded and dropped since the last call (its report)."""
        bc, ac = self.block_changes, self.adapter_changes
        self.block_changes, self.adapter_changes = {}, {}
        return (
            [h for h, held in bc.items() if held],
            [h for h, held in bc.items() if not held],
            [a for a, held in ac.items() if held],
            [a for a, held in ac.items() if not held],
        )
