"""A tensor-parallel worker process's main: join the process group, build this rank's shard, run the driver's
plans (motet/engine/worker/tp_workers.py says how the ranks work together)."""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import sys

import torch.distributed as dist

from motet.engine.config import EngineConfig
from motet.engine.worker.model_runner import ModelRunner
from motet.engine.worker.parallel import Parallel, RankFailure
from motet.engine.worker.tp_workers import init_rank, rank_config, serve_plans
from motet.models.config import ModelConfig
from motet.parent_death import die_with_current_parent

log = logging.getLogger("motet.tp")


def worker_main(
    rank: int, size: int, port: int, model_dir: str, model_config: ModelConfig, config: EngineConfig
) -> None:
    """A worker rank: build the shard, then run plans until told to stop or the driver is gone."""
    die_with_current_parent(signal.SIGKILL)  # no orphaned rank after a crash of the server
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the driver stops us
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    init_rank(rank, size, port, config)
    parallel = Parallel(rank, size, config.enable_expert_parallel)
    try:
        runner = ModelRunner(model_dir, model_config, rank_config(config, rank), parallel=parallel)
    except Exception:  # the driver has heard why (Parallel.agree) and reports it: nothing to serve
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        return
    try:
        serve_plans(runner)
    except RankFailure:
        log.warning("the driver is gone: rank %d exits", rank)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(*pickle.loads(sys.stdin.buffer.read()))
