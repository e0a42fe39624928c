"""A step's inputs, built on the host from the step's plan and sent to the device: the eager step's packed
tensors and the CUDA graphs' rows (`InputBuilder`), and the input tokens still pending: async scheduling
launches step N+1 before step N's sampled tokens reach the host (motet/engine/stepping.py), so N+1 takes those
inputs from N's sampled tokens on the device (`feed_tokens`; the CUDA graphs' static buffers take them so too,
motet/engine/worker/cuda_graphs.py)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import NamedTuple

import torch

from motet.engine.core.kv_window import window_table
from motet.engine.core.step_plan import RowPlan, SampledRef, StepPlan
from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.engine.worker.rows import Row


class SampledTokens:
    """The tokens recent steps sampled, where they are on the device, by `SampledRef`: the forward thread records
    each step's as it samples them (`record`) and a later step's inputs take them from here (`where`), on that same
    thread. A pending token is read by its row's next step, one or two steps later: the latest `keep` steps' are
    kept."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self._steps: OrderedDict[int, dict[int, tuple[torch.Tensor, int]]] = OrderedDict()

    def record(self, ref: SampledRef, tokens: torch.Tensor, index: int) -> None:
        """Row `ref.row` of step `ref.step` sampled `tokens[index]`."""
        rows = self._steps.get(ref.step)
        if rows is None:
            rows = self._steps[ref.step] = {}
            while len(self._steps) > self.keep:
                self._steps.popitem(last=False)
        rows[ref.row] = (tokens, index)

    def where(self, ref: SampledRef) -> tuple[torch.Tensor, int]:
        return self._steps[ref.step][ref.row]


def decode_inputs(plan: list[RowPlan], rows: list[Row]) -> tuple[list[int], list[tuple[int, SampledRef]]]:
    """Each row's input token, at its position, and the feeds: (the input's index, where its token will be) for
    the rows whose token is still pending (sampled by the step before, not on the host yet: 0 in the list until
    `feed_tokens` writes it)."""
    ids, feeds = [], []
    for i, (p, row) in enumerate(zip(plan, rows, strict=True)):
        tokens = row.tokens
        if p.start < len(tokens):
            ids.append(tokens[p.start])
        else:
            ids.append(0)
            feeds.append((i, p.fed_by))
    return ids, feeds


def feed_tokens(
    ids: torch.Tensor, feeds: list[tuple[int, SampledRef]], sampled: SampledTokens, pinned: bool
) -> None:
    """Write the pending tokens into a step's input ids on the device, from the steps that sampled them (`sampled`,
    which the forward thread recorded as it ran the steps before): no host wait (the indices go from pinned
    memory). Usually they all come from the step before: one gather."""
    copy_sampled(ids, [(dst, sampled.where(ref)) for dst, ref in feeds], pinned)


def copy_sampled(dst: torch.Tensor, places: list[tuple[int, tuple[torch.Tensor, int]]], pinned: bool) -> None:
    """`dst[i] = tokens[j]` for each (i, (tokens, j)) of `places` (`SampledTokens.where`'s), on the device with no
    host wait (the indices go from pinned memory where `pinned`): one gather per step the tokens come from."""
    sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for i, (tokens, j) in places:
        entry = sources.get(id(tokens))
        if entry is None:
            entry = sources[id(tokens)] = (tokens, [], [])
        entry[1].append(i)
        entry[2].append(j)
    for tokens, dsts, srcs in sources.values():
        if (
            dst.device.type == "cpu" and tokens.device.type == "cpu"
        ):  # plain host memory: no tensor ops needed
            dst.numpy()[dsts] = tokens.numpy()[srcs]
            continue
        index = torch.tensor([dsts, srcs], dtype=torch.int64, pin_memory=pinned).to(
            dst.device, non_blocking=True
        )
        dst.index_copy_(0, index[0], tokens.index_select(0, index[1]))


def pending_tokens(views: list, device: torch.device) -> torch.Tensor:
    """[n] int64 on `device`: each of the sampler's views' pending token (motet/engine/worker/rows.py
    `SampleView.pending`), gathered there from the steps that sampled them; 0 where a view has none."""
    out = torch.zeros(len(views), dtype=torch.long, device=device)
    copy_sampled(
        out, [(k, v.pending) for k, v in enumerate(views) if v.pending is not None], device.type == "cuda"
    )
    return out


class HostInputs(NamedTuple):
    """An eager step's inputs packed on the host (pinned on CUDA), for `InputBuilder.to_device` to send in two
    transfers. `feeds`: (input index, SampledRef) for the rows whose input token is pending."""

    # int64 [3, tokens]: input ids (0 where pending), positions, KV slots (and the window layers' slots)
    per_token: torch.Tensor
    # int32: the block tables [rows, width] flattened, query_start_loc [rows + 1], seq_lens (and the window
    # layers' tables)
    per_seq: torch.Tensor
    width: int
    qsl: list[int]
    max_query_len: int
    max_seq_len: int
    feeds: list


class GraphRows(NamedTuple):
    """A decode step's rows as `DecodeGraphs.run_rows` takes them, and the rows' offsets in its output."""

    rows: list[list[int]]
    starts: list[int]
    slots: list[list[int]]
    tables: list[list[int]]
    qsl: list[int]
    feeds: list


class InputBuilder:
    """A step's inputs, built on the host from the batch's rows and snapshots (`host`; `graph_rows` for a decode
    step the CUDA graphs replay), then sent to the device (`to_device`). With a window pool
    (motet/engine/core/kv_window.py) the sliding-window layers' slots and tables come after the others'.

    The positions the model reads are its rotary tables' rows: a token's position, but under LongRoPE
    (`long_rope`: the original context and where the rows of the long factors below it begin,
    motet/engine/worker/model.py's RotaryEmbedding) a token below the original context of a sequence that turns
    by the long factors (`CacheScope.long_rope`) reads the long factors' row. Only prompt chunks carry such tokens
    (a decode token of such a sequence is past the original context)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        window: int | None,
        window_chunk: int,
        long_rope: tuple[int, int] | None = None,
    ):
        self.block_size = block_size
        self.device = device
        self.window = window
        self.window_chunk = window_chunk
        self.long_rope = long_rope
        self.sampled = SampledTokens()  # where the steps' sampled tokens are, for the steps after them

    def host(self, plan: StepPlan, rows: list[Row]) -> HostInputs:
        """The step's inputs from its plan and the runner's copies of its rows (`rows`, in its order)."""
        if all(p.num_new_tokens == 1 for p in plan):
            return self._decode(plan, rows)
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens, tables, feeds = [], [], [], [0], [], [], []
        for p, row in zip(plan, rows, strict=True):
            n, start = p.num_new_tokens, p.start
            own = n - len(p.drafts)
            known = row.tokens[start : start + own]
            input_ids.extend(known)
            if len(known) < own:  # its last token is still pending (async scheduling): fed on the device
                feeds.append((len(input_ids), p.fed_by))
                input_ids.append(0)
            input_ids.extend(p.drafts)  # verified after the row's last token (none: not drafting)
            positions.extend(range(start, start + n))
            table = row.table
            slots.extend(table[q // bs] * bs + q % bs for q in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        return self._pack(
            input_ids,
            positions,
            slots,
            tables,
            qsl,
            seq_lens,
            max(p.num_new_tokens for p in plan),
            feeds,
            rows,
            self._rope_rows(plan, positions, qsl),
        )

    def _rope_rows(self, plan: list[RowPlan], positions: list[int], qsl: list[int]) -> list[int] | None:
        """The rotary tables' rows of a prompt step's tokens where any differs from its position (LongRoPE's
        long-factor sequences' tokens below the original context), else None."""
        if self.long_rope is None:
            return None
        original, long_rows = self.long_rope
        rope_rows = None
        for i, p in enumerate(plan):
            if not p.long_rope or p.start >= original:
                continue
            rope_rows = rope_rows or list(positions)
            first = qsl[i]
            for t in range(first, min(qsl[i + 1], first + original - p.start)):
                rope_rows[t] += long_rows
        return rope_rows

    def _decode(self, plan: list[RowPlan], rows: list[Row]) -> HostInputs:
        """`host` of a step where every row adds one token (no drafts): the common step, in fewer passes."""
        bs = self.block_size
        positions = [p.start for p in plan]
        input_ids, feeds = decode_inputs(plan, rows)
        tables = [row.table for row in rows]
        slots = [t[q // bs] * bs + q % bs for t, q in zip(tables, positions, strict=True)]
        width = max(map(len, tables))
        tables = [t if len(t) == width else t + [0] * (width - len(t)) for t in tables]
        seq_lens = [q + 1 for q in positions]
        qsl = list(range(len(plan) + 1))
        return self._pack(input_ids, positions, slots, tables, qsl, seq_lens, 1, feeds, rows)

    def _pack(
        self, input_ids, positions, slots, tables, qsl, seq_lens, max_query_len, feeds, rows, rope_rows=None
    ) -> HostInputs:
        """Host lists (tables already padded to one width) packed by dtype, in pinned memory on CUDA; with a
        window pool, the sliding-window layers' slots and tables after the others'. The model reads the rotary at
        `rope_rows` where given, else at the positions."""
        pinned = self.device.type == "cuda"
        width = len(tables[0]) if tables else 0
        per_token, per_seq = (
            [input_ids, positions if rope_rows is None else rope_rows, slots],
            [*itertools.chain.from_iterable(tables), *qsl, *seq_lens],
        )
        if self.window:
            # a ring holds a window and one chunk of at most window_chunk tokens (the scheduler keeps to it)
            assert max_query_len <= self.window_chunk, (
                f"a chunk of {max_query_len} tokens past a window pool's"
            )
            bs = self.block_size
            rings = [window_table(row.window, width) for row in rows]
            owner = itertools.chain.from_iterable(
                itertools.repeat(ring, qsl[i + 1] - qsl[i]) for i, ring in enumerate(rings)
            )
            per_token.append([ring[p // bs] * bs + p % bs for ring, p in zip(owner, positions, strict=True)])
            per_seq += itertools.chain.from_iterable(rings)
        per_token = torch.tensor(per_token, dtype=torch.int64, pin_memory=pinned)
        per_seq = torch.tensor(per_seq, dtype=torch.int32, pin_memory=pinned)
        return HostInputs(per_token, per_seq, width, qsl, max_query_len, max(seq_lens), feeds)

    def to_device(self, plan: HostInputs):
        """The step's input tensors on the device, in two transfers from pinned memory on CUDA (none makes the host
        wait for the device), the pending tokens fed from the steps that sampled them: (ids, positions, the
        attention metadata, the rows' offsets)."""
        ids, pos, slot_mapping, *window_slots = plan.per_token.to(self.device, non_blocking=True)
        if plan.feeds:
            feed_tokens(ids, plan.feeds, self.sampled, self.device.type == "cuda")
        per_seq = plan.per_seq.to(self.device, non_blocking=True)
        n, width = len(plan.qsl) - 1, plan.width
        block_tables, query_start_loc, lens, *window_tables = per_seq.split(
            (n * width, n + 1, n, n * width) if self.window else (n * width, n + 1, n)
        )
        meta = _meta(slot_mapping, block_tables.view(n, width), query_start_loc, lens, plan)
        if self.window:
            meta.window = _meta(window_slots[0], window_tables[0].view(n, width), query_start_loc, lens, plan)
        return ids, pos, meta, plan.qsl

    def graph_rows(self, plan: StepPlan, rows: list[Row], fits) -> GraphRows | None:
        """A decode step's rows (every row one new token, and the drafts it verifies, if any) as its bucket's graph
        takes them; None: it runs eagerly (a prompt chunk, or too large for the graphs: `fits(rows, width,
        query, position)` says)."""
        if not plan or any(p.num_new_tokens != 1 + len(p.drafts) or not p.samples for p in plan):
            return None
        tables = [row.table for row in rows]
        pos = [p.start for p in plan]
        if not fits(len(plan), max(map(len, tables)), max(p.num_new_tokens for p in plan), max(pos)):
            return None
        bs, inputs, slots, qsl = self.block_size, [], [], [0]
        firsts, feeds = decode_inputs(plan, rows)
        for p, table, q, first in zip(plan, tables, pos, firsts, strict=True):
            inputs.append([first, *p.drafts])
            slots.append([table[x // bs] * bs + x % bs for x in range(q, q + len(inputs[-1]))])
            qsl.append(qsl[-1] + len(inputs[-1]))
        return GraphRows(inputs, pos, slots, tables, qsl, feeds)

    def padding_token(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, None]:
        """A step's inputs for one token at position 0 that reads block 0 and writes no KV (slot -1)."""

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor([-1], torch.int64),
            block_tables=tensor([[0]], torch.int32),
            query_start_loc=tensor([0, 1], torch.int32),
            seq_lens=tensor([1], torch.int32),
            max_query_len=1,
            max_seq_len=1,
        )
        return tensor([0], torch.int64), tensor([0], torch.int64), meta, None


def _meta(slot_mapping, block_tables, query_start_loc, seq_lens, plan: HostInputs) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        max_query_len=plan.max_query_len,
        max_seq_len=plan.max_seq_len,
    )
