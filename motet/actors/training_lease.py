"""The serving engine's lease of the machine's cores to fine-tuning workers: a worker's process runs only while it
holds the lease, and never while the engine steps, so that the machine runs at most `--threads` compute threads
(serving's, or one worker's: a worker uses as many).

The engine's thread (motet/actors/executor.py) is the one owner of the cores. Before each step it stops the worker
that holds them: SIGSTOP, the whole process at once (all its threads, wherever it is in its training step), and it
waits until the kernel shows every thread stopped. Between two steps it grants them by the policy
(motet/training/compute_share.py): while serving is busy a slice (SIGCONT, the slice's time, SIGSTOP: the next step
waits for it), while serving is idle until the next step (turns where several workers wait). The runner
(motet/api/fine_tuning/runner.py) starts each local worker inside `starting()` (no step runs meanwhile, and the
worker is stopped before the next one: it runs when granted) and has it `leave` once it has ended; from the event
loop. Every step and every time a worker held the cores can be traced (`trace`), in one monotonic clock.

Signals go through a pidfd (Linux), so no other process is ever signalled once the worker has exited and its pid is
reused. A stopped worker still dies at once of SIGKILL (cancel) and of its parent-death signal (SIGTERM, whose
default action ends even a stopped process: motet/parent_death.py); a pause (SIGUSR1) is handled when it next holds
the cores.

On a GPU, serving steps on the device and the workers train on the CPU: nothing is shared, and the lease leaves the
workers alone (`shares_cores`, set once the engine knows its device).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.to_thread

from motet.training.compute_share import ComputeSample, TrainingShare

log = logging.getLogger("motet.training_lease")

STOP_WAIT_S = 2.0  # a worker whose threads are not all stopped by then is let be (logged)
_STOPPED = "TtZX"  # /proc's states of a thread that runs no more: stopped, traced, zombie, dead


class _Process:
    """A worker's process, signalled through its pidfd where the system has them."""

    def __init__(self, pid: int):
        self.pid = pid
        self.held_s = 0.0  # the cores held, in all
        self.gone = False
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.gone = True
        except (AttributeError, OSError):  # (no pidfds here: the pid itself)
            pass

    def signal(self, sig: int) -> bool:
        if self.gone:
            return False
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            self.gone = True
            return False
        return True

    def stop(self) -> None:
        """SIGSTOP, and back once every thread of the process has stopped (or it exited)."""
        if not self.signal(signal.SIGSTOP):
            return
        deadline = time.monotonic() + STOP_WAIT_S
        while not self._stopped():
            if time.monotonic() > deadline:
                log.warning(
                    "fine-tuning worker %d: not all its threads stopped in %gs", self.pid, STOP_WAIT_S
                )
                return
            time.sleep(0.0002)

    def cont(self) -> None:
        self.signal(signal.SIGCONT)

    def exited(self) -> bool:
        if self.gone:
            return True
        if self.fd is not None and select.select([self.fd], [], [], 0)[0]:  # (readable once it exited)
            self.gone = True
        return self.gone

    def _stopped(self) -> bool:
        if self.exited():
            return True
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except FileNotFoundError:
            return True
        except OSError:  # (no /proc here: the signal is all there is)
            return True
        for tid in tids:
            try:
                stat = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text()
            except OSError:  # (the thread ended)
                continue
            if stat[stat.rindex(")") + 2] not in _STOPPED:
                return False
        return True

    def cpu(self) -> tuple[float, float] | None:
        """Seconds its threads ran on a CPU and waited for one while runnable, summed (Linux's schedstat)."""
        ran = queued = 0
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        for tid in tids:
            try:
                fields = Path(f"/proc/{self.pid}/task/{tid}/schedstat").read_text().split()
            except OSError:
                continue
            ran, queued = ran + int(fields[0]), queued + int(fields[1])
        return ran / 1e9, queued / 1e9

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.gone = True


class TrainingLease:
    """Who computes: the engine (its steps) or one worker (a `TrainingShare` of `share` decides which, and how
    long). Thread-safe: the engine's thread calls `step_starts`, `step_ends` and `between_steps`; the runner the
    rest."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic):
        self.policy = TrainingShare(share)
        self.clock = clock
        self.shares_cores = True  # False on a GPU (the executor says, once the engine is built)
        self.wake: Callable[[], None] = lambda: (
            None
        )  # the engine's thread looks at the lease again (the executor's)
        # (kind, start, end): "step" (the engine computed), "train" (a worker held the cores), "start" (a worker was
        # started); recorded while a list (a test's)
        self.trace: list[tuple[str, float, float]] | None = None
        self.busy_s = 0.0  # serving was busy, in all
        self._lock = threading.Lock()
        self._steps = threading.Lock()  # held while the engine steps, and while a worker is started
        self._procs: dict[int, _Process] = {}
        self._running: _Process | None = None
        self._ran_from = 0.0
        self._busy = False
        self._mark = clock()

    # -- the runner's side (the event loop) ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def starting(self, tenant: str) -> AsyncIterator[Callable[[int], bool]]:
        """Around a worker's start: no step runs meanwhile. Gives `join(pid)`: the worker stopped, then waiting
        for the cores (False: the lease does not share them, and the worker runs freely)."""
        await anyio.to_thread.run_sync(self._steps.acquire)  # (not abandoned: acquired, it is released below)
        t0 = self.clock()
        joined: list[int] = []

        def join(pid: int) -> bool:
            if not self.shares_cores:
                return False
            process = _Process(pid)
            process.stop()
            with self._lock:
                self._procs[pid] = process
                self.policy.join(pid, tenant)
            joined.append(pid)
            return True

        try:
            yield join
        finally:
            self._record("start", t0, self.clock())
            self._steps.release()
            if joined:
                self.wake()

    def leave(self, pid: int) -> None:
        """The worker has ended (or is being killed): it holds the cores no more."""
        with self._lock:
            process = self._procs.pop(pid, None)
            if process is None:
                return
            self._account()
            if self._running is process:
                self._running = None
                self._record("train", self._ran_from, self.clock())
            self.policy.leave(pid)
            process.close()
        self.wake()

    @property
    def workers(self) -> int:
        """Workers on the lease (holding the cores or waiting for them)."""
        with self._lock:
            return len(self.policy)

    def held_s(self, pid: int) -> float:
        """How long the worker has held the cores, in all."""
        with self._lock:
            self._account()
            process = self._procs.get(pid)
            return process.held_s if process is not None else 0.0

    def fraction(self, pid: int, busy: bool | None = None) -> float:
        """The share of the machine's time the worker can expect (the policy's) while serving is busy, or idle, or
        (None) as it is now."""
        with self._lock:
            return self.policy.fraction(pid, self._busy if busy is None else busy)

    def sample(self, pid: int) -> ComputeSample | None:
        """The worker's compute so far (None once it left)."""
        with self._lock:
            self._account()
            process = self._procs.get(pid)
            if process is None:
                return None
            at, held, busy = self._mark, process.held_s, self.busy_s
        cpu = process.cpu()
        return ComputeSample(at, held, busy, *(cpu or (None, None)))

    # -- the engine's thread ------------------------------------------------------------------------------------
    def step_starts(self) -> None:
        """Before a step: the cores are serving's (the worker holding them stopped)."""
        self._steps.acquire()
        with self._lock:
            self._account()
            if self._running is not None:
                self._stop_running()
            self._busy = True

    def step_ends(self, busy: bool) -> None:
        """After a step; `busy`: the engine has requests left."""
        with self._lock:
            self._account()
            self._busy = busy
            if not busy:
                self.policy.idle()
        self._steps.release()

    def record_step(self, start: float, end: float) -> None:
        self._record("step", start, end)

    def between_steps(self, settle: Callable[[], None]) -> float | None:
        """Between two steps (the engine's thread has nothing queued): a worker holds the cores if the policy says
        so: for a slice now (back once it is stopped again), or until the next step while serving is idle. The
        seconds after which to ask again (None: at the next step). `settle` returns once the engine computes
        nothing (its forward pass in flight done)."""
        if not self.shares_cores:
            return None
        with self._lock:
            self._account()
            holder = self.policy.holder()
            if not self._busy:  # idle: a worker holds the cores until the next step (in turns)
                if self._running is not None and self._running.pid != holder:
                    self._stop_running()
                if holder is not None and self._running is None:
                    self._run(self._procs[holder])
                return self.policy.turn_s if len(self.policy) > 1 else None
            length = self.policy.slice()
            if holder is None or not length:
                return None
        settle()
        with self._lock:
            if (process := self._procs.get(holder)) is None:  # (it left meanwhile)
                return None
            self._account()
            self._run(process)
        time.sleep(length)
        with self._lock:
            self._account()
            if self._running is process:
                self._stop_running()
        return None

    # -- inside the lock ---------------------------------------------------------------------------------------
    def _account(self) -> None:
        """The time since the last account: the running worker's, else serving's while busy."""
        now = self.clock()
        seconds, self._mark = now - self._mark, now
        if self._busy:
            self.busy_s += seconds
        if self._running is not None:
            self._running.held_s += seconds
            self.policy.held(self._running.pid, seconds, self._busy)
        elif self._busy:
            self.policy.served(seconds)

    def _run(self, process: _Process) -> None:
        self._ran_from = self.clock()
        process.cont()
        self._running = process

    def _stop_running(self) -> None:
        process = self._running
        process.stop()
        self._account()  # (until it stopped: its time)
        self._running = None
        self._record("train", self._ran_from, self._mark)

    def _record(self, kind: str, start: float, end: float) -> None:
        if self.trace is not None:
            self.trace.append((kind, start, end))
