"""Tensor-parallel ranks as processes: the engine's own runner is rank 0 (the driver), each other rank a worker
process on this machine holding its shard of the model and of the KV cache.

Scheduling, grammars, sampling and adapters' bookkeeping stay on the driver. Each step the driver broadcasts
one plan (the flattened inputs, the attention metadata, the LoRA segments and any adapter slot loads since
the last plan); every rank then runs the same sharded forward, meeting at its all-reduces, and the lm_head's
vocabulary columns are gathered on the driver. The transport is torch.distributed's default process group
(gloo on CPU, NCCL on CUDA), set up over TCP on the loopback.

Failure: a worker that dies makes the driver's next collective fail (gloo sees the peer's socket close),
which raises `RankFailure`: the engine stops (the server fails its requests and exits). A worker whose driver
dies sees the same on its next collective and exits; it also asks the kernel to kill it with its parent
(PR_SET_PDEATHSIG), so no rank outlives the server.
"""

from __future__ import annotations

import contextlib
import datetime
import pickle
import socket
import subprocess
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from motet.engine.config import EngineConfig
from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.engine.worker.parallel import Parallel, guard
from motet.lora.pool import AdapterPool, PoolLayout, pack
from motet.models.config import ModelConfig

# How long a collective may wait for a peer before it fails: far above any step (a peer that died is seen at
# once, as its socket closes; this bounds a peer that hangs).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.torch_device.type == "cuda" else "gloo"


def init_rank(rank: int, size: int, port: int, config: EngineConfig) -> None:
    dist.init_process_group(
        _backend(config),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A rank's engine config: on CUDA each rank has its own device."""
    if config.torch_device.type != "cuda":
        return config
    return replace(config, device=f"cuda:{rank}")


def start_rank(arguments: bytes) -> subprocess.Popen:
    """A worker rank's process: a fresh interpreter running motet/engine/worker/tp_rank.py (not multiprocessing's
    spawn, which re-imports the caller's __main__: a script or a test runner), reading its `arguments`, pickled,
    from stdin."""
    proc = subprocess.Popen([sys.executable, "-m", "motet.engine.worker.tp_rank"], stdin=subprocess.PIPE)
    proc.stdin.write(arguments)
    proc.stdin.close()
    return proc


class WorkerGroup:
    """The driver's side: starts ranks 1..size-1, joins them in the process group as rank 0, sends plans."""

    needs_landed_steps = True  # (the ranks run the driver's plans as its steps land)

    def __init__(self, model_dir, model_config: ModelConfig, config: EngineConfig):
        size = config.tensor_parallel_size
        port = _free_port()
        self.procs = [
            start_rank(pickle.dumps((rank, size, port, str(model_dir), model_config, config)))
            for rank in range(1, size)
        ]
        try:
            init_rank(0, size, port, config)
        except Exception:
            self.kill()
            raise
        self.parallel = Parallel(0, size, config.enable_expert_parallel)
        self.closed = False
        # adapter placements the workers have not seen: (slot, start, uid, adapter)
        self.pending_loads: list[tuple[int, int, int, object]] = []

    def note_lora_placement(self, slot: int, start: int, uid: int, adapter) -> None:
        """An adapter the driver placed in its pool: the workers pack their parts at the same place with the
        next plan."""
        self.pending_loads.append((slot, start, uid, adapter))

    def send(self, op: str, scalars=(), tensors=(), extra: dict | None = None) -> None:
        """Broadcast one plan to every worker (send_plan), with the adapter slot loads they have not seen yet."""
        if self.pending_loads:
            extra = {**(extra or {}), "loads": self.pending_loads}
            self.pending_loads = []
        send_plan(op, scalars, tensors, extra)

    def send_forward(self, ids, positions, meta: AttentionMetadata, lora) -> None:
        """The step's forward pass, once, to every other rank."""
        segments = [lora.seg_starts, lora.seg_slots] if lora is not None else []
        window = [meta.window.slot_mapping, meta.window.block_tables] if meta.window is not None else []
        self.send(
            "forward",
            [meta.max_query_len, meta.max_seq_len, lora.max_seg_len if lora is not None else -1],
            [ids, positions, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens]
            + window
            + segments,
        )

    def send_logits(self, rows: list[int]) -> None:
        """The logits of these rows of the latest forward's hidden states."""
        self.send("logits", tensors=[torch.tensor(rows, dtype=torch.int64)])

    def send_logits_of(self, hidden: torch.Tensor) -> None:
        """The logits of these hidden states."""
        self.send("logits_of", extra={"hidden": hidden})

    def close(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.send("stop")
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


class NoWorkers:
    """The broadcast of a runner that has no ranks to tell: on one rank, or a worker rank (which receives)."""

    needs_landed_steps = False

    def send_forward(self, ids, positions, meta, lora) -> None:
        pass

    def send_logits(self, rows) -> None:
        pass

    def send_logits_of(self, hidden) -> None:
        pass


NO_WORKERS = NoWorkers()


def serve_plans(runner) -> None:
    """A worker rank's loop: run the driver's plans on its `runner` (a ModelRunner made with its `parallel`)
    until the driver says stop."""
    layout = PoolLayout(runner.lora_layout_shape)
    pool = AdapterPool(layout, runner.adapter_memory_bytes, runner.device, runner.dtype)
    steps, hidden = runner.steps, None
    while True:
        op, scalars, tensors, extra = receive_plan()
        for slot, start, uid, adapter in (extra or {}).get("loads", ()):
            pool.put_at(slot, start, uid, pack(adapter, layout, runner.dtype, runner.lora_sharder))
        tensors = [t.to(runner.device) for t in tensors]
        if op == "stop":
            return
        if op == "forward":
            max_query_len, max_seq_len, max_seg_len = scalars
            ids, pos, slot_mapping, tables, qsl, seq_lens, *segments = tensors
            meta = AttentionMetadata(
                tables, qsl, seq_lens, max_query_len, max_seq_len, slot_mapping=slot_mapping
            )
            if runner.window:  # the window layers' slots and tables come next
                (window_slots, window_tables), segments = segments[:2], segments[2:]
                meta.window = replace(meta, block_tables=window_tables, slot_mapping=window_slots)
            lora = pool.segments(*segments, max_seg_len) if segments else None
            hidden = steps.forward(ids, pos, meta, lora)
        elif op == "logits":
            steps.logits(hidden[tensors[0]])
        elif op == "logits_of":
            steps.logits(extra["hidden"].to(runner.device))


# A plan on the wire: a fixed header of int64s (the op, its scalars, each tensor's rows, columns (-1: a vector)
# and dtype), then the tensors' values as one int64 tensor, then, only when the plan carries one, a pickled
# extra (adapter slot loads, hidden states): a step's plan costs two small broadcasts and no pickling.
OPS = ("stop", "forward", "logits", "logits_of")
HEADER = 64
WIRE_DTYPES = (torch.int64, torch.int32)


def _wire_device() -> torch.device:
    """Where the collectives' tensors must be: NCCL's on this rank's GPU, gloo's on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_plan(op: str, scalars=(), tensors=(), extra: dict | None = None) -> None:
    device = _wire_device()
    shapes = []
    for t in tensors:
        shapes += [t.shape[0], t.shape[1] if t.dim() == 2 else -1, WIRE_DTYPES.index(t.dtype)]
    fields = [OPS.index(op), len(scalars), len(tensors), int(extra is not None), *scalars, *shapes]
    if len(fields) > HEADER:
        raise ValueError(f"a plan of {len(fields)} header fields (at most {HEADER})")
    header = torch.full((HEADER,), -1, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    guard(dist.broadcast, header.to(device), src=0)
    if tensors:
        guard(dist.broadcast, torch.cat([t.reshape(-1).to(device, torch.int64) for t in tensors]), src=0)
    if extra is not None:
        guard(dist.broadcast_object_list, [extra], src=0)


def receive_plan() -> tuple[str, list[int], list[torch.Tensor], dict | None]:
    """(op, scalars, tensors, extra) of the driver's next plan."""
    device = _wire_device()
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    guard(dist.broadcast, header, src=0)
    fields = header.tolist()
    op, n_scalars, n_tensors, has_extra = fields[:4]
    scalars = fields[4 : 4 + n_scalars]
    shapes = [fields[4 + n_scalars + 3 * i : 7 + n_scalars + 3 * i] for i in range(n_tensors)]
    tensors = []
    if shapes:
        sizes = [rows * (cols if cols >= 0 else 1) for rows, cols, _ in shapes]
        payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
        guard(dist.broadcast, payload, src=0)
        for (rows, cols, dtype), part in zip(shapes, payload.split(sizes), strict=True):
            part = part.to(WIRE_DTYPES[dtype])
            tensors.append(part.view(rows, cols) if cols >= 0 else part)
    extra = None
    if has_extra:
        box: list[Any] = [None]
        guard(dist.broadcast_object_list, box, src=0)
        extra = box[0]
    return OPS[op], scalars, tensors, extra
