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
Prefill and mixed steps run eagerly. Graphs are captured lazily, on a key's first step.
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
        # token ids, positions and KV slots in one buffer: a step fills the three with one transfer
        self.per_token = torch.zeros(3, B, dtype=torch.int64, **opts)
        self.input_ids, self.positions, self.slot_mapping = self.per_token
        self.slot_mapping.fill_(-1)
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
        self.graphs[key], self.outputs[key] = self._record(
            lambda: self.forward(self.input_ids[:b], self.positions[:b], meta, lora)
        )

    def _record(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """`step` captured as a CUDA graph over the static buffers, and the tensor its replays write."""
        # Warm up outside the graph (Triton compiles, cuBLAS picks its kernels) on a side stream.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        seq_lens: list[int],
        lora: LoRABatch | None = None,
        on_launch=None,
    ) -> torch.Tensor:
        """Hidden states [n, d] of a decode step of n sequences (one token each); `on_launch()` is called once
        the graph is replayed (its work queued on the device)."""
        n = len(input_ids)
        b = bucket_for(n, self.sizes)
        width = max(len(t) for t in tables)
        pad = b - n
        # Three transfers from pinned host memory, queued without waiting for the device (a copy from pageable
        # memory would make the host wait for it). Padding rows: token 0 at position 0, KV write skipped, 1 key.
        pinned = self.device.type == "cuda"
        per_token = [input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad]
        self.per_token[:, :b].copy_(
            torch.tensor(per_token, dtype=torch.int64, pin_memory=pinned), non_blocking=True
        )
        lens = torch.tensor(seq_lens + [1] * pad, dtype=torch.int32, pin_memory=pinned)
        self.seq_lens[:b].copy_(lens, non_blocking=True)
        rows = [t if len(t) == width else t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
        rows = torch.tensor(rows, dtype=torch.int32, pin_memory=pinned)
        self.block_tables[:b, :width].copy_(rows, non_blocking=True)
        if lora is not None:  # segment slots -> token slots, on the device (output_size: no sync)
            counts = (lora.seg_starts[1:] - lora.seg_starts[:-1]).long()
            self.token_slots[:n].copy_(torch.repeat_interleave(lora.seg_slots, counts, output_size=n))
            self.token_slots[n:b].fill_(-1)
        key = (b, *self._signature(lora))
        if key not in self.graphs:
            self._capture(key, lora)
        self.graphs[key].replay()
        self.replays += 1
        if on_launch is not None:
            on_launch()
        return self.outputs[key][:n]
