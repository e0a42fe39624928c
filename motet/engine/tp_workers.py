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
import logging
import pickle
import socket
import subprocess
import sys
from typing import Any

import torch.distributed as dist

from motet.engine.config import EngineConfig, ModelConfig
from motet.engine.parallel import Parallel, guard

log = logging.getLogger("motet.tp")

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
    from dataclasses import replace

    return replace(config, device=f"cuda:{rank}")


class WorkerGroup:
    """The driver's side: starts ranks 1..size-1, joins them in the process group as rank 0, sends plans."""

    def __init__(self, model_dir, model_config: ModelConfig, config: EngineConfig):
        size = config.tensor_parallel_size
        port = _free_port()
        # Fresh interpreters running motet/engine/tp_rank.py (not multiprocessing's spawn, which re-imports the
        # caller's __main__: a script or a test runner), each reading its arguments pickled from stdin.
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "motet.engine.tp_rank"], stdin=subprocess.PIPE, start_new_session=False
            )
            proc.stdin.write(pickle.dumps((rank, size, port, str(model_dir), model_config, config)))
            proc.stdin.close()
            self.procs.append(proc)
        try:
            init_rank(0, size, port, config)
        except Exception:
            self.kill()
            raise
        self.parallel = Parallel(0, size, config.enable_expert_parallel)
        self.closed = False

    def send(self, plan: dict[str, Any]) -> None:
        """Broadcast one plan to every worker."""
        guard(dist.broadcast_object_list, [plan], src=0)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.send({"op": "stop"})
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

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [rank for rank, proc in enumerate(self.procs, start=1) if proc.poll() is not None]


def receive_plan() -> dict[str, Any]:
    box: list[Any] = [None]
    guard(dist.broadcast_object_list, box, src=0)
    return box[0]
