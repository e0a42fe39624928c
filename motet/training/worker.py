"""The process a fine-tuning job trains in, beside the server that serves: forked from a fork server that has the
training libraries imported (motet/api/fine_tuning/workers.py; `forked_main` is what runs in it).

It sets its niceness (`os.nice`; 0 by default: the server's engine rations its time) and its thread count before
it computes, dies with the server (through the fork server, which exits with it), trains the run described by
RUN_DIR/run.json (motet/training/trainer.py) and tells the server what happens as events, one dict each, on its
connection (the libraries' own prints go to RUN_DIR's log). It runs only while the server's engine lends it the
cores (motet/actors/training_lease.py): the server stops and continues the whole process (SIGSTOP / SIGCONT),
wherever it is in its step; nothing here sees it but the time. SIGUSR1 asks for a pause (a checkpoint after the
step in progress, then exit; handled once it runs); the server stops a cancelled job with SIGKILL. The first
event, {"type": "ready"}, says the pause signal is handled from then on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from motet.parent_death import die_with_current_parent

RUN_SPEC = "run.json"
NAME = b"motet-training"  # the worker's process name (`ps -e`, `top`, psutil's name()): its fork server's is python


def forked_main(run_dir: str, threads: int, nice: int, events, log_path: str) -> None:
    """The worker, forked from the fork server: its events sent on the `events` connection, its standard output and
    error appended to `log_path`; exits with run_job's code."""
    pause = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: pause.set())
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    die_with_fork_server()
    _name_process()
    code = run_job(Path(run_dir), events.send, pause.is_set, threads, nice)
    events.close()
    sys.exit(code)


def die_with_fork_server() -> None:
    """This process ends with the fork server it was forked from, and so with the server (the fork server exits when
    the server's end of its pipe closes), however the server ends: by SIGKILL, the one signal that ends it while
    the server's engine holds it stopped (motet/actors/training_lease.py); it has nothing to tidy (its checkpoints
    are whole or ignored)."""
    from multiprocessing import forkserver

    # multiprocessing hands each child a copy of the server's end of that pipe (so that the child could fork from
    # the same server): kept, the fork server would outlive the server for as long as this worker lives (stopped
    # by the lease: forever). CPython's name for it, 3.8 to 3.14.
    if (alive := getattr(forkserver._forkserver, "_forkserver_alive_fd", None)) is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    die_with_current_parent(signal.SIGKILL)


def _name_process() -> None:
    """NAME for this process and the threads it starts later (Linux's PR_SET_NAME; elsewhere nothing)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, NAME)  # PR_SET_NAME


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
