"""A rank's place in tensor / expert parallelism and the collectives the sharded model calls.

Megatron's scheme: q/k/v and gate/up are split by output (heads, intermediate columns) and o/down by input,
so each attention block and each MLP ends in one all-reduce of a [tokens, hidden] partial sum; the embedding
table and the lm_head are split by vocabulary rows (a lookup all-reduced, logits gathered on rank 0). In a
mixture-of-experts layer the experts are split the same way (each expert's intermediate columns), or with
expert parallelism each rank holds whole experts and tokens travel to them by all-to-all (`Experts`). What
follows a split output is split with it (q/k/v and gate/up biases, attention sinks, norms across all heads,
whose sums of squares are all-reduced: motet/engine/worker/model.py `Attention`); a bias after a split input (o's,
the experts' down) is held by rank 0 alone, zeros elsewhere, so the all-reduce adds it once.

Collectives go through torch.distributed (gloo on CPU, NCCL on CUDA), over the default process group that
motet/engine/worker/tp_workers.py sets up; `sent_bytes` counts the payload handed to them, for the benchmark of bytes
per token. A collective that fails (a peer process died) raises `RankFailure`: the engine cannot go on
without that rank's shard.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError


def check_ranks(size: int, model: ModelConfig, expert_parallel: bool, device: torch.device) -> None:
    """`--tensor-parallel-size` against what it splits and where its ranks run, before any rank starts:
    ModelLoadError naming the flag and the limit. The model's key/value heads, one at least a rank (`heads`),
    with expert parallelism its experts, whole ones a rank (`split`); on CUDA a device a rank (rank r runs on
    cuda:r), on a CPU a core a rank at least (each rank is a process of its own, with its own threads)."""
    if size == 1:
        return
    where = Parallel(0, size, expert_parallel)
    where.heads(model)
    if expert_parallel and model.num_experts:
        where.split(model.num_experts, "the experts")
    if device.type == "cuda":
        room, what = torch.cuda.device_count(), "CUDA device(s), one a rank"
    else:
        room = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        what = (
            "core(s) this process may run on, one a rank at least (each rank a process with its own threads)"
        )
    if size > room:
        raise ModelLoadError(
            f"--tensor-parallel-size {size} is more than this machine's {room} {what}: choose at most {room}"
        )


class RankFailure(RuntimeError):
    """A tensor-parallel peer is gone: no step can complete any more (the serving process should exit)."""

    fatal = True


@dataclass
class Parallel:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    sent_bytes: int = 0  # payload bytes this rank handed to collectives

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` units that must split evenly (a mixture's experts, under expert
        parallelism)."""
        if n % self.size:
            raise ModelLoadError(
                f"expert parallelism over {self.size} ranks needs {what} divisible by {self.size}, and the "
                f"model has {n}: choose a --tensor-parallel-size that divides it"
            )
        return n // self.size

    def part(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's part of `n` units split as evenly as they go (the first n % size
        ranks one more): intermediate columns, key/value heads."""
        per, extra = divmod(n, self.size)
        return self.rank * per + min(self.rank, extra), per + (self.rank < extra)

    def heads(self, cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """(start, count) of this rank's query heads and of its key/value heads: whole groups (a KV head and
        the query heads that read it), as evenly as they split (SmolLM2-135M's 3 groups over 2 ranks: 2 + 1)."""
        kv = cfg.num_key_value_heads
        if kv < self.size:
            raise ModelLoadError(
                f"--tensor-parallel-size {self.size}: tensor parallelism splits the model's {kv} key/value heads, one "
                f"at least per rank: choose a --tensor-parallel-size of at most {kv}"
            )
        group = cfg.num_attention_heads // kv
        kv_start, kv_count = self.part(kv)
        return (kv_start * group, kv_count * group), (kv_start, kv_count)

    def vocab_rows(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows held, rows of the real vocabulary among them) of this rank's vocabulary shard:
        ceil(vocab / size) rows each, the last rank's padded with zero rows."""
        per = -(-vocab // self.size)
        start = self.rank * per
        return start, per, max(0, min(per, vocab - start))

    def token_slice(self, n: int) -> tuple[int, int]:
        """The [start, end) of `n` replicated tokens this rank dispatches to the experts (expert parallelism)."""
        per = -(-n // self.size)
        start = min(n, self.rank * per)
        return start, min(n, start + per)

    # -- collectives ----------------------------------------------------------------------------------
    def _count(self, t: torch.Tensor) -> None:
        self.sent_bytes += t.numel() * t.element_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (a no-op on one rank); returns it.

        Over a power-of-two number of ranks by recursive doubling on point-to-point sends: log2(size) rounds,
        each exchanging the whole partial with one peer and adding. A step's all-reduces are small (a few
        rows of the hidden size) and bound by latency, where gloo's own all_reduce (ring rounds over its
        pairs) measured 1.2-2.1 ms for 576 floats between two processes on this machine against 0.2 ms for
        one exchange (this 2-core VM, 2026-11-24). Each addition is of two partials, commutative, so
        every rank ends with the same bits."""
        if self.size == 1:
            return x
        self._count(x)
        if self.size & (self.size - 1):
            guard(dist.all_reduce, x)
            return x
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        other = torch.empty_like(flat)
        step = 1
        while step < self.size:
            peer = self.rank ^ step
            guard(_exchange, flat, other, peer)
            flat.add_(other)
            step <<= 1
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor | None:
        """Rank 0: the ranks' [n, cols] pieces side by side, cut to `total` columns; other ranks: None (each
        sends its piece to rank 0, point to point)."""
        if self.size == 1:
            return x[:, :total]
        x = x.contiguous()
        self._count(x)
        if self.rank != 0:
            guard(dist.send, x, 0)
            return None
        pieces = [x] + [torch.empty_like(x) for _ in range(1, self.size)]
        guard(_receive_all, pieces)
        return torch.cat(pieces, dim=1)[:, :total]

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `x` (grouped by destination, `send[r]` for rank r) exchanged: the rows each rank sent here,
        `recv[r]` from rank r, in rank order."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._count(x)
        guard(dist.all_to_all_single, out, x.contiguous(), recv, send)
        return out

    def exchange_counts(self, send: torch.Tensor) -> list[int]:
        """How many rows each rank will send here, given how many this rank sends each ([size] int64)."""
        recv = torch.empty_like(send)
        self._count(send)
        guard(dist.all_to_all_single, recv, send)
        return recv.tolist()

    def agree(self, error: str | None, size: int) -> int:
        """After each rank built its shard: raise if any rank failed (naming it), else the size every rank can
        hold (the fewest KV blocks, the smallest adapter pool)."""
        if self.size == 1:
            return size
        states: list = [None] * self.size
        guard(dist.all_gather_object, states, (error, size))
        for rank, (err, _) in enumerate(states):
            if err is not None:
                raise ModelLoadError(f"tensor-parallel rank {rank} could not load its shard: {err}")
        return min(n for _, n in states)

    # -- this rank's part of the shapes and of a LoRA adapter ------------------------------------------
    def local_shape(self, cfg: ModelConfig) -> ModelConfig:
        """The decoder's shapes on this rank: its heads and intermediate columns; the LoRA slots hold adapters cut
        to them."""
        (_, q_heads), (_, kv_heads) = self.heads(cfg)
        return dataclasses.replace(
            cfg,
            intermediate_size=self.part(cfg.intermediate_size)[1],
            num_attention_heads=q_heads,
            num_key_value_heads=kv_heads,
        )

    def layout_shape(self, cfg: ModelConfig) -> ModelConfig:
        """The largest rank's shapes (rank 0 holds the most heads and columns: `part` gives the first ranks one
        more): the geometry every rank's adapter pool shares."""
        return dataclasses.replace(self, rank=0).local_shape(cfg)

    def lora_sharder(self, cfg: ModelConfig):
        """This rank's part of one module's LoRA, as a function (module, a [r, in], b [out, r]) -> (a, b),
        S-LoRA's way: where the base projection is split by output (q, k, v, gate, up) the shrink is whole and
        the expand split with it; where it is split by input (o, down) the shrink is split with it and the
        expand whole, so each rank's delta is a partial sum that the block's all-reduce completes: no
        communication of its own."""
        q_heads, kv_heads = self.heads(cfg)
        mlp = self.part(cfg.intermediate_size)
        rows = cfg.attention.lora_rows(cfg, q_heads, kv_heads) | {
            "gate_proj": mlp,
            "up_proj": mlp,
            "down_proj": mlp,
        }

        def shard(module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if rows[module] is None:  # replicated: every rank adds the whole delta
                return a, b
            start, n = rows[module]
            if module in ROW_PARALLEL:
                return a.narrow(1, start, n), b
            return a, b.narrow(0, start, n)

        return shard


ROW_PARALLEL = ("o_proj", "down_proj")  # split by input: partial sums
SINGLE = Parallel()  # the unsharded model


def _exchange(send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
    for request in (dist.isend(send, peer), dist.irecv(recv, peer)):
        request.wait()


def _receive_all(pieces: list[torch.Tensor]) -> None:
    for request in [dist.irecv(piece, rank) for rank, piece in enumerate(pieces) if rank]:
        request.wait()


def guard(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout, ...
        raise RankFailure(f"a tensor-parallel rank failed: {e}") from e
