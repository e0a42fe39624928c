"""What a fine-tuning job's worker is to the runner that drives it (motet/api/fine_tuning/runner.py), wherever it
trains: a child process of the server (motet/api/fine_tuning/workers.py) or a Ray Train run
(motet/cluster/training_jobs.py).

A worker says what happens as events (dicts: motet/training/trainer.py's), takes a pause (a checkpoint after the
step in progress, then it ends) or a kill (at once), and ends with an exit code. `Launch` starts one for a job's
run directory, with its compute threads and niceness.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol


class LaunchError(Exception):
    """A worker that cannot start: the job fails with this message."""


class TrainingWorker(Protocol):
    def events(self) -> AsyncIterator[dict]: ...

    def pause(self) -> None: ...

    def kill(self) -> None: ...

    async def wait(self) -> int: ...


Launch = Callable[[Path, int, int], Awaitable[TrainingWorker]]  # (run dir, threads, niceness)
