"""Fine-tuning jobs behind a Ray cluster: each a Ray Train run (a TorchTrainer of one worker) on a node that holds
the custom resource the operator names (`--fine-tuning-ray-resource NAME`: `ray start --resources '{"NAME": 1}'`
on that node; a local Ray that motet starts holds one unit of it itself).

The worker runs the job as the server's own child process would (motet/training/worker.py `run_job`: the same
trainer, niceness and threads) on the job's run directory, which the node must read and write at the same path
(one machine, or a file system shared at that path). Its events and the pause asked for pass through a small actor
(`_Channel`) that `RayTrainWorker` polls. A kill asks the worker's watcher thread to end its process at once: Ray
Train (no retries) then ends the run and frees what it held, the node's unit included (cancelling the task that
runs it would leave the run's placement group taken until the server's Ray job ends). The server's end takes the
run with it (its Ray job ends).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import ray

from motet.training.launch import LaunchError

POLL_S = 0.2  # how often the runner looks for the worker's events (and the worker for a kill)
KILL_GRACE_S = 30.0  # a killed run that has not ended by then (its worker never started): its task cancelled


@ray.remote(num_cpus=0)
class _Channel:
    """The events a job's worker said that the runner has not taken yet, and whether a pause or a kill was asked
    for."""

    def __init__(self):
        self.said: list[dict] = []
        self.pause = self.stop = False

    def put(self, event: dict) -> None:
        self.said.append(event)

    def take(self) -> list[dict]:
        taken, self.said = self.said, []
        return taken

    def ask_pause(self) -> None:
        self.pause = True

    def pause_asked(self) -> bool:
        return self.pause

    def ask_stop(self) -> None:
        self.stop = True

    def stop_asked(self) -> bool:
        return self.stop


def _train_loop(config: dict) -> None:
    """Ray Train's worker: the job trained here; a failure (the failed event says why) fails the run."""
    from motet.training.worker import run_job

    channel = config["channel"]

    def watch() -> None:  # a kill: this worker ends at once, and Ray Train (no retries) ends the run
        while not ray.get(channel.stop_asked.remote()):
            time.sleep(POLL_S)
        os._exit(137)

    threading.Thread(target=watch, daemon=True).start()

    def emit(event: dict) -> None:
        ray.get(channel.put.remote(event))

    def pause_asked() -> bool:
        return ray.get(channel.pause_asked.remote())

    context = ray.get_runtime_context()
    emit({"type": "placed", "where": f"a Ray Train worker on node {context.get_node_id()[:12]} "
          f"({ray.util.get_node_ip_address()}, resource {config['resource']!r})"})  # fmt: skip
    if run_job(Path(config["run_dir"]), emit, pause_asked, config["threads"], config["nice"]):
        raise RuntimeError("the fine-tuning job failed (its failed event says why)")


@ray.remote(num_cpus=0, max_retries=0)
def _fit(run_dir: str, channel, threads: int, nice: int, resource: str) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        _train_loop,
        train_loop_config={
            "run_dir": run_dir,
            "channel": channel,
            "threads": threads,
            "nice": nice,
            "resource": resource,
        },
        scaling_config=ScalingConfig(
            num_workers=1, use_gpu=False, resources_per_worker={"CPU": 0, resource: 1}
        ),
        run_config=RunConfig(
            name="fine-tuning",
            storage_path=str(Path(run_dir) / "ray_train"),
            failure_config=FailureConfig(max_failures=0),
        ),
    ).fit()


class RayTrainWorker:
    """A job's Ray Train run, as motet/training/launch.py's TrainingWorker."""

    def __init__(self, ref: ray.ObjectRef, channel):
        self.ref, self.channel = ref, channel
        self.code: int | None = None
        self.killed = False

    @classmethod
    async def start(cls, resource: str, run_dir: Path, threads: int, nice: int) -> RayTrainWorker:
        if ray.cluster_resources().get(resource, 0) < 1:
            raise LaunchError(
                f"no node of the Ray cluster holds the resource {resource!r} (--fine-tuning-ray-resource): start "
                f"one with `ray start --resources '{{\"{resource}\": 1}}'`"
            )
        channel = _Channel.remote()
        return cls(_fit.remote(str(run_dir), channel, threads, nice, resource), channel)

    def _ended(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    async def events(self) -> AsyncIterator[dict]:
        while True:
            ended = self._ended()  # (before taking: whatever it said before it ended is in this take)
            try:
                said = await anyio.to_thread.run_sync(ray.get, self.channel.take.remote())
            except ray.exceptions.RayActorError:  # killed
                return
            for event in said:
                yield event
            if ended:
                return
            if not said:
                await anyio.sleep(POLL_S)

    def pause(self) -> None:
        self.channel.ask_pause.remote()

    def kill(self) -> None:
        """The worker ends at once (its watcher exits the process); Ray Train ends the run and frees what it held.
        (Cancelling the task instead would leave the run's placement group, and so the node's unit, taken.)"""
        if not self.killed and not self._ended():
            self.killed = True
            self.channel.ask_stop.remote()

    async def wait(self) -> int:
        if self.code is None:
            timeout = KILL_GRACE_S if self.killed else None
            try:
                await anyio.to_thread.run_sync(functools.partial(ray.get, self.ref, timeout=timeout))
                self.code = 0
            except ray.exceptions.GetTimeoutError:  # killed before its worker started (waiting for the unit)
                ray.cancel(self.ref, force=True)
                self.code = -9
            except Exception:  # failed or killed (a failure's event, taken before, said why)
                self.code = -9 if self.killed else 1
            ray.kill(self.channel)
        return self.code
