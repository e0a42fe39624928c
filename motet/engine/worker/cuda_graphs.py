"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket; eager stays the reference.

A decode step (every sequence adds one token, no adapter) launches 9 kernels per layer; at small batch
the GPU waits on Python and the launches. `DecodeGraphs` captures the model's forward once per bucket
(1, 2, 4, 8, 16, 32, 64, 128, 256, ... up to `max_batch`) over static input buffers; a step of n
sequences copies its inputs into the first n rows of the smallest bucket >= n and replays. Padding rows
are sequences of one token at position 0 reading block 0 whose KV write is skipped (slot -1: the
Triton write kernel skips it on the device), so they never touch the cache; their hidden rows are dropped.

LoRA decode steps replay too: in the graph every token is its own SGMV segment (seg_starts = 0..n, its
slot from the step's segments, expanded on the device; padding rows -1), so the launch grid is fixed; the
kernels read the adapter pool's descriptors and weights as they are at the replay (motet/lora/pool.py: the pool
is allocated once), so one graph serves every step whose adapters target the same module groups within the same
rank tile: graphs are keyed by (bucket, that signature).

On CUDA whenever `EngineConfig.compile_step` is set (the default; `--no-compile` turns it off).
Prefill and mixed steps run eagerly. The base model's graphs are captured at start-up (`capture_all`, from the
runner's warm-up, before the server says it is ready); LoRA graphs on a key's first step, since they depend
on the adapters' modules and ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.engine.worker.step_inputs import feed_tokens
from motet.lora.pool import LoRABatch, PoolView


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
        max_query: int = 1,
        eager_targets: tuple[str, ...] = (),
    ):
        """`forward(input_ids, positions, meta, lora)` -> hidden [n, d]: the model over the runner's KV cache.
        `max_query`: the most tokens a row brings (1 + the most drafts it verifies). `eager_targets`: a module
        group whose adapters no graph can replay (a latent attention's kv_b_proj: its delta is applied to each
        sequence's expanded context, sized on the host); a step with one runs the same padded inputs eagerly."""
        self.forward = forward
        self.eager_targets = eager_targets
        self.sizes = buckets(max_batch)
        self.query_sizes = buckets(max_query)  # tokens per row: 1 (decode), or a verification's 1 + drafts
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        B, W, T = self.sizes[-1], max_blocks_per_seq, self.sizes[-1] * max_query
        opts = dict(device=device)
        # token ids, positions and KV slots in one buffer: a step fills the three with one transfer
        self.per_token = torch.zeros(3, T, dtype=torch.int64, **opts)
        self.input_ids, self.positions, self.slot_mapping = self.per_token
        self.slot_mapping.fill_(-1)
        self.block_tables = torch.zeros(B, W, dtype=torch.int32, **opts)
        self.token_starts = torch.arange(T + 1, dtype=torch.int32, **opts)  # one token per segment (LoRA)
        # each row's first token, per tokens-per-row q: rows of q tokens
        self.row_starts = {q: torch.arange(B + 1, dtype=torch.int32, **opts) * q for q in self.query_sizes}
        self.seq_lens = torch.ones(B, dtype=torch.int32, **opts)
        self.token_slots = torch.full((T,), -1, dtype=torch.int32, **opts)  # LoRA: each token's slot
        self.row_index = torch.zeros(
            T, dtype=torch.int64, **opts
        )  # the real tokens among a step's padded rows
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.pool = None
        self.replays = 0

    def fits(self, n: int, width: int, query: int = 1, end: int = 0) -> bool:
        """Whether n rows of at most `query` tokens, with tables of `width` blocks, whose padded rows reach
        position `end` at most, replay from a graph."""
        q = bucket_for(query, self.query_sizes)
        return (
            n <= self.sizes[-1]
            and width <= self.max_blocks_per_seq
            and q is not None
            and end + q <= self.max_seq_len  # (a padded row's keys stay within the table's width)
        )

    def _meta(self, b: int, q: int = 1) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: b * q],
            block_tables=self.block_tables[:b],
            query_start_loc=self.row_starts[q][: b + 1],
            seq_lens=self.seq_lens[:b],
            max_query_len=q,
            max_seq_len=self.max_seq_len,  # a hint only: the Triton kernel reads lengths on the device
        )

    @staticmethod
    def _signature(lora: LoRABatch | None) -> tuple:
        """What a LoRA graph depends on besides the pool's contents (the kernels read the descriptors and the
        weights as they are at the replay): the groups some adapter targets, and the rank tile."""
        if lora is None:
            return ()
        return (tuple(sorted(lora.weights.groups)), rank_tile(lora.weights.max_rank))

    def _step(self, b: int, q: int, lora: LoRABatch | None) -> Callable[[], torch.Tensor]:
        """The forward over the first b rows of q tokens of the static buffers."""
        meta, t = self._meta(b, q), b * q
        if lora is not None:  # every token its own segment: a grid that does not depend on the step
            w = lora.weights
            view = PoolView(w.pool, rank_tile(w.max_rank), w.groups, {})
            lora = LoRABatch(self.token_starts[: t + 1], self.token_slots[:t], 1, view)
        return lambda: self.forward(self.input_ids[:t], self.positions[:t], meta, lora)

    def _capture(self, key: tuple, lora: LoRABatch | None) -> None:
        self.graphs[key], self.outputs[key] = self._record(self._step(key[0], key[1], lora))

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

    def capture_all(self) -> None:
        """Capture the base model's graph of every bucket (rows, tokens per row) now, largest first (as vLLM: the smaller graphs then
        fit in the memory pool the larger ones made). The buffers hold padding rows (slot -1: no KV write), so
        capturing writes nothing to the cache."""
        for b in reversed(self.sizes):
            for q in reversed(self.query_sizes):  # verification rows' sizes too, when the engine speculates
                if (b, q) not in self.graphs:
                    self._capture((b, q), None)

    def run_rows(
        self,
        rows: list[list[int]],
        starts: list[int],
        slots: list[list[int]],
        tables: list[list[int]],
        lora: LoRABatch | None = None,
        on_launch=None,
        feeds=(),
        sampled=None,
    ) -> torch.Tensor:
        """Hidden states [sum of the rows' tokens, d] of a step whose row i brings tokens `rows[i]` at positions
        `starts[i]`, `starts[i]` + 1, ... into KV slots `slots[i]` (a decode row one token, a verification row
        its token and its drafts), every earlier position of the row being in the cache. Rows are padded to the
        bucket's q tokens (pads after the real ones, so causal attention keeps them out of the real tokens'
        sums; no KV write) and the batch to its bucket's b rows; the real tokens' hidden states come back in
        order. `feeds`: (row index, SampledRef) for the rows whose first token is pending, found in `sampled`
        (motet/engine/worker/step_inputs.py)."""
        n = len(rows)
        b, q = bucket_for(n, self.sizes), bucket_for(max(map(len, rows)), self.query_sizes)
        width = max(len(t) for t in tables)
        pinned = self.device.type == "cuda"
        if q == 1:
            ids, pos, kv_slots, real = [r[0] for r in rows], list(starts), [s[0] for s in slots], range(n)
        else:
            ids, pos, kv_slots, real = [], [], [], []
            for i, (row, start, row_slots) in enumerate(zip(rows, starts, slots, strict=True)):
                pad = q - len(row)
                ids += row + [0] * pad
                pos += list(range(start, start + len(row))) + [0] * pad
                kv_slots += row_slots + [-1] * pad
                real += range(i * q, i * q + len(row))
        t = b * q
        pad_tokens = t - len(ids)  # the padding rows': token 0 at position 0, KV write skipped, q keys
        per_token = [ids + [0] * pad_tokens, pos + [0] * pad_tokens, kv_slots + [-1] * pad_tokens]
        # Transfers from pinned host memory, queued without waiting for the device (a copy from pageable
        # memory would make the host wait for it).
        self.per_token[:, :t].copy_(
            torch.tensor(per_token, dtype=torch.int64, pin_memory=pinned), non_blocking=True
        )
        if feeds:  # a row's first token is at i * q
            feed_tokens(self.per_token[0], [(i * q, ref) for i, ref in feeds], sampled, pinned)
        # a row's keys: every earlier position and its q padded tokens (the last query sits at seq_len - 1)
        lens = torch.tensor([s + q for s in starts] + [q] * (b - n), dtype=torch.int32, pin_memory=pinned)
        self.seq_lens[:b].copy_(lens, non_blocking=True)
        table_rows = [r if len(r) == width else r + [0] * (width - len(r)) for r in tables]
        table_rows = torch.tensor(table_rows + [[0] * width] * (b - n), dtype=torch.int32, pin_memory=pinned)
        self.block_tables[:b, :width].copy_(table_rows, non_blocking=True)
        gather = q > 1
        if gather:
            index = torch.tensor(real, dtype=torch.int64, pin_memory=pinned)
            self.row_index[: len(real)].copy_(index, non_blocking=True)
        if lora is not None:  # segment slots -> token slots, on the device (output_size: no sync)
            counts = (lora.seg_starts[1:] - lora.seg_starts[:-1]).long()
            token_slots = torch.repeat_interleave(lora.seg_slots, counts, output_size=len(real))
            if gather:
                self.token_slots[:t].fill_(-1)
                self.token_slots.index_copy_(0, self.row_index[: len(real)], token_slots)
            else:
                self.token_slots[:n].copy_(token_slots)
                self.token_slots[n:t].fill_(-1)
        if lora is not None and self.eager_targets and lora.targets(self.eager_targets):
            if on_launch is not None:
                on_launch()
            out = self._step(b, q, lora)()
        else:
            key = (b, q, *self._signature(lora))
            if key not in self.graphs:
                self._capture(key, lora)
            self.graphs[key].replay()
            self.replays += 1
            if on_launch is not None:
                on_launch()
            out = self.outputs[key]
        return out[self.row_index[: len(real)]] if gather else out[:n]


def rank_tile(rank: int) -> int:
    """The rank a LoRA graph is captured for: the next power of two, 8 at least (one graph serves every step
    whose adapters' ranks are at most that)."""
    return max(8, 1 << max(0, rank - 1).bit_length())
