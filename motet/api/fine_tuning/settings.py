"""The fine-tuning runner's settings, which `motet serve`'s `--fine-tuning-*` flags set (flags.py): plain values,
read by the parser before the API's modules are imported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from motet.actors.training_lease import TrainingLease
    from motet.training.launch import Launch


@dataclass
class RunnerSettings:
    max_running: int = 1  # jobs training at once (--fine-tuning-max-running)
    threads: int = 1  # each worker's compute threads (--fine-tuning-threads)
    nice: int | None = None  # each worker's niceness (--fine-tuning-nice; None: LEASED_NICE or UNLEASED_NICE)
    # where a job trains: None, a child process of the server (workers.py's LocalWorker); behind Ray, Ray Train
    # (motet/cluster/training_jobs.py)
    launch: Launch | None = None
    # the serving engine's lease of its cores (None: the workers run freely)
    lease: TrainingLease | None = None
