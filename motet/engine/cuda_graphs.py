"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket; eager stays the reference.

A decode step (every sequence adds one token, no adapter) launches ~10 kernels per layer; at small batch
the GPU waits on Python and the launches. `DecodeGraphs` captures the model's forward once per bucket
(1, 2, 4, 8, 16, 32, 64, 128, 256, ... up to `max_batch`) over static input buffers; a step of n
sequences copies its inputs into the first n rows of the smallest bucket >= n and replays. Padding rows
are sequences of one token at position 0 reading block 0 whose KV write is skipped (slot -1: the
Triton write kernel skips it on the device), so they never touch the cache; their hidden rows are dropped.

LoRA decode steps replay too: in the graph every token is its own SGMV segment (seg_starts = 0..n, its
slot from the step's segments, expanded on the device; padding rows -1), so the launch grid is fixed; the
graph reads the slot cache's stacks in place (they are allocated once and reloaded in place), so one graph
serves every step whose adapters use the same modules and padded rank: graphs are keyed by (bucket, that
signature).

On CUDA whenever `EngineConfig.compile_step` is set (the default; `--no-compile` turns it off).
Prefill and mixed steps run eagerly. The base model's graphs are captured at start-up (`capture_all`, from the
runner's warm-up, before the server says it is ready); LoRA graphs on a key's first step, since they depend
on the adapters' modules and ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from motet.engine.model import AttentionMetadata
from motet.lora.slot_cache import LoRABatch


def buckets(max_batch: int) -> list[int]:
    """Powers of two up to `max_batch`, and `max_batch` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n rows (None: more rows than the largest)."""
    return next((b for b in sizes if b >= n), None)


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, LoRABatch | None], torch.Tensor],
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
    ):
        """`forward(input_ids, positions, meta, lora)` -> hidden [n, d]: the model over the runner's KV cache."""
        self.forward = forward
        self.sizes = buckets(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.device = device
        B, W = self.sizes[-1], max_blocks_per_seq
        opts = dict(device=device)
        self.input_ids = torch.zeros(B, dtype=torch.int64, **opts)
        self.positions = torch.zeros(B, dtype=torch.int64, **opts)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, **opts)
        self.block_tables = torch.zeros(B, W, dtype=torch.int32, **opts)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, **opts)  # one token per sequence
        self.seq_lens = torch.ones(B, dtype=torch.int32, **opts)
        self.token_slots = torch.full((B,), -1, dtype=torch.int32, **opts)  # LoRA: each token's slot
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self._signatures: dict[int, tuple[list, tuple]] = {}  # id(weights) -> (weights, signature)
        self.pool = None
        self.replays = 0

    def fits(self, n: int, width: int) -> bool:
        return n <= self.sizes[-1] and width <= self.max_blocks_per_seq

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            max_query_len=1,
            max_seq_len=self.max_seq_len,  # a hint only: the Triton kernel reads lengths on the device
        )

    def _signature(self, lora: LoRABatch | None) -> tuple:
        """What a LoRA graph depends on besides the stacks' contents: modules, padded rank, storage."""
        if lora is None:
            return ()
        hit = self._signatures.get(id(lora.weights))
        if hit is None or hit[0] is not lora.weights:
            if len(self._signatures) > 64:  # the slot cache makes new views after each load: keep a few
                self._signatures.clear()
            mods = tuple(
                (i, m, A.shape[1], A.data_ptr())
                for i, layer in enumerate(lora.weights)
                for m, (A, _, _) in layer.items()
            )
            hit = self._signatures[id(lora.weights)] = (lora.weights, mods)
        return hit[1]

    def _capture(self, key: tuple, lora: LoRABatch | None) -> None:
        b = key[0]
        meta = self._meta(b)
        if lora is not None:  # every token its own segment: a grid that does not depend on the step
            lora = LoRABatch(self.query_start_loc[: b + 1], self.token_slots[:b], 1, lora.weights)
        # Warm up outside the graph (Triton compiles, cuBLAS picks its kernels) on a side stream.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(self.input_ids[:b], self.positions[:b], meta, lora)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(self.input_ids[:b], self.positions[:b], meta, lora)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key], self.outputs[key] = graph, out

    def capture_all(self) -> None:
        """Capture the base model's graph of every bucket now, largest first (as vLLM: the smaller graphs then
        fit in the memory pool the larger ones made). The buffers hold padding rows (slot -1: no KV write), so
        capturing writes nothing to the cache."""
        for b in reversed(self.sizes):
            if (b,) not in self.graphs:
                self._capture((b,), None)

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [n, d] of a decode step of n sequences (one token each)."""
        n = len(input_ids)
        b = bucket_for(n, self.sizes)
        width = max(len(t) for t in tables)
        pad = b - n
        # One host->device copy per buffer; padding rows: token 0 at position 0, KV write skipped, 1 key.
        self.input_ids[:b].copy_(torch.tensor(input_ids + [0] * pad, dtype=torch.int64))
        self.positions[:b].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64))
        self.slot_mapping[:b].copy_(torch.tensor(slots + [-1] * pad, dtype=torch.int64))
        self.seq_lens[:b].copy_(torch.tensor(seq_lens + [1] * pad, dtype=torch.int32))
        rows = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
        self.block_tables[:b, :width].copy_(torch.tensor(rows, dtype=torch.int32))
        if lora is not None:  # segment slots -> token slots, on the device (output_size: no sync)
            counts = (lora.seg_starts[1:] - lora.seg_starts[:-1]).long()
            self.token_slots[:n].copy_(torch.repeat_interleave(lora.seg_slots, counts, output_size=n))
            self.token_slots[n:b].fill_(-1)
        key = (b, *self._signature(lora))
        if key not in self.graphs:
            self._capture(key, lora)
        self.graphs[key].replay()
        self.replays += 1
        return self.outputs[key][:n]
