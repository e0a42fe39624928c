"""The child process a fine-tuning job trains in, beside the server that serves:

    python -m motet.training.worker RUN_DIR --threads N --nice N

It sets its niceness (`os.nice`; 0 by default: the server's engine rations its time) and its thread count before
anything heavy is imported, dies with the server (motet/parent_death.py), trains the run described by
RUN_DIR/run.json (motet/training/trainer.py) and tells the server what happens as JSON lines on its standard
output, one event each (the libraries' own prints go to standard error). It runs only while the server's engine
lends it the cores (motet/actors/training_lease.py): the server stops and continues the whole process
(SIGSTOP / SIGCONT), wherever it is in its step; nothing here sees it but the time. SIGUSR1 asks for a pause (a
checkpoint after the step in progress, then exit; handled once it runs); the server stops a cancelled job with
SIGKILL. The first line, {"type": "ready"}, says the pause signal is handled from then on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

RUN_SPEC = "run.json"


def main(argv=None) -> int:
    pause = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: pause.set())
    ap = argparse.ArgumentParser(prog="python -m motet.training.worker")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nice", type=int, default=0)
    args = ap.parse_args(argv)
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to standard error, never between two events

    def emit(event: dict) -> None:
        events.write(json.dumps(event) + "\n")
        events.flush()

    die_with_server()
    return run_job(args.run_dir, emit, pause.is_set, args.threads, args.nice)


def die_with_server() -> None:
    """This process ends with the server that started it, however the server ends: by SIGKILL, the one signal that
    ends it while the server's engine holds it stopped (motet/actors/training_lease.py); it has nothing to tidy (its
    checkpoints are whole or ignored)."""
    from motet.parent_death import die_with_parent

    die_with_parent(signal.SIGKILL)


def run_job(run_dir: Path, emit, pause_asked, threads: int, nice: int) -> int:
    """The job of `run_dir` trained in this process, at niceness `nice` with `threads` compute threads, its events
    given to `emit` (the first: ready); 0, or 1 when it failed (a failed event says why). Ray Train's worker runs
    it too (motet/cluster/training_jobs.py)."""
    if nice:
        os.nice(nice)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    emit({"type": "ready", "pid": os.getpid()})
    from motet.helper_process import first_line

    try:
        import torch

        torch.set_num_threads(threads)
        from motet.training.trainer import TrainingRun, train

        run = TrainingRun.of(json.loads((run_dir / RUN_SPEC).read_text()))
        outcome = train(run, emit, pause_asked)
    except Exception as e:  # the server records why; the traceback is in this process's standard error
        import traceback

        traceback.print_exc()
        emit({"type": "failed", "message": f"{type(e).__name__}: {first_line(e)}"})
        return 1
    if outcome == "paused":
        emit({"type": "paused"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
