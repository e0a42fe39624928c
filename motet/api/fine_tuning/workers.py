"""A fine-tuning job's worker as a process of this machine (motet/training/launch.py's TrainingWorker; behind a Ray
cluster, motet/cluster/training_jobs.py's RayTrainWorker is the other one): forked from a fork server that has the
training libraries imported (multiprocessing's forkserver, its preload motet/training/preload.py), its events
sent on a pipe, SIGUSR1 its pause, SIGKILL its cancel. Its `pid` joins the serving engine's lease of the cores
(motet/actors/training_lease.py), which stops and continues the process: a pause asked while it is stopped is
handled when it next holds the cores; SIGKILL ends it stopped or not.

The fork server starts with the first job and stays: torch, transformers, PEFT and TRL (~350 MiB, seconds of one
core) are imported once per server, not once per job, and every worker shares their pages. It exits with the server
(its end of a pipe closes), and a worker with it (motet/training/worker.py)."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.util  # (its exit handler joins the workers: ours, registered after it, runs first)
import os
import signal
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from motet.training.worker import forked_main

PRELOAD = "motet.training.preload"
_FORKS = multiprocessing.get_context("forkserver")
_LIVE: weakref.WeakSet[LocalWorker] = weakref.WeakSet()


class LocalWorker:
    """The job's process; its log is RUN_DIR/worker.log."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, events):
        self.proc = proc
        self._events = events
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, run_dir: Path, threads: int, nice: int) -> LocalWorker:
        # (in a thread: the first start waits for the fork server's imports)
        return await anyio.to_thread.run_sync(cls._fork, run_dir.resolve(), threads, nice)

    @classmethod
    def _fork(cls, run_dir: Path, threads: int, nice: int) -> LocalWorker:
        _FORKS.set_forkserver_preload(["__main__", PRELOAD])  # (multiprocessing's default and ours)
        events, sender = _FORKS.Pipe(duplex=False)
        args = (str(run_dir), threads, nice, sender, str(run_dir / "worker.log"))
        proc = _FORKS.Process(target=forked_main, args=args, name=f"fine-tuning {run_dir.name}", daemon=True)
        proc.start()
        sender.close()  # (the worker holds the other end: its exit is the events' end)
        return cls(proc, events)

    async def events(self) -> AsyncIterator[dict]:
        while True:
            await anyio.wait_readable(self._events.fileno())
            try:
                event = self._events.recv()
            except (EOFError, OSError):
                return
            yield event

    def _signal(self, sig: int) -> None:
        if self.proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # (exited, not yet reaped)
                os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        self._signal(signal.SIGUSR1)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    async def wait(self) -> int:
        await anyio.wait_readable(self.proc.sentinel)
        self.proc.join()
        self._events.close()
        return self.proc.exitcode


@atexit.register
def _kill_workers() -> None:
    """At the server's exit, its workers are killed before multiprocessing joins them (its own handler asks a
    daemon to end with SIGTERM, which a worker the lease holds stopped never receives)."""
    for worker in list(_LIVE):
        worker.kill()
