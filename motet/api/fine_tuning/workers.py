"""A fine-tuning job's worker as a child process of the server (motet/training/launch.py's TrainingWorker; behind a
Ray cluster, motet/cluster/training_jobs.py's RayTrainWorker is the other one): `python -m motet.training.worker`,
its events its standard output's lines, SIGUSR1 its pause, SIGKILL its cancel. Its `pid` joins the serving engine's
lease of the cores (motet/actors/training_lease.py), which stops and continues the process: a pause asked while it
is stopped is handled when it next holds the cores; SIGKILL ends it stopped or not."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

from motet.parent_death import child_env


class LocalWorker:
    """The job's child process (it dies with the server: motet/parent_death.py); its log is RUN_DIR/worker.log."""

    def __init__(self, proc: Process):
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, run_dir: Path, threads: int, nice: int) -> LocalWorker:
        cmd = [sys.executable, "-m", "motet.training.worker", str(run_dir), "--threads", str(threads), "--nice",
               str(nice)]  # fmt: skip
        env = {**child_env(), "OMP_NUM_THREADS": str(threads)}
        with open(run_dir / "worker.log", "ab") as stderr:
            return cls(await anyio.open_process(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env))

    async def events(self) -> AsyncIterator[dict]:
        buffer = ""
        async for chunk in TextReceiveStream(self.proc.stdout):
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)

    def pause(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # (exited, not yet reaped)
                self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def wait(self) -> int:
        return await self.proc.wait()
