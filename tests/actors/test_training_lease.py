"""The serving engine's lease of the cores (motet/actors/training_lease.py) on real processes: a worker runs only
while it holds the lease (the kernel's own thread states, /proc, are the reference), stopped before each step; a
stopped worker still takes a pause when it next runs, dies of SIGKILL and dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from motet.actors.training_lease import TrainingLease
from motet.training.compute_share import SLICE_S

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(sys.platform != "linux", reason="Linux's /proc and pidfds"),
]

ROOT = Path(__file__).resolve().parents[2]
# A worker's stand-in: three busy threads, and a pause (SIGUSR1) that writes a file.
SPINNER = """
import pathlib, signal, sys, threading
def spin():
    while True:
        pass
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
signal.signal(signal.SIGUSR1, lambda *_: pathlib.Path(sys.argv[1]).write_text("paused"))
print("ready", flush=True)
spin()
"""


@pytest.fixture
def anyio_backend():
    return "asyncio"


def states(pid: int) -> set[str]:
    """The kernel's state of each of the process's threads."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out.add(stat[stat.rindex(")") + 2])
    return out


def running(pid: int, timeout: float = 10) -> bool:
    """The process runs again (a thread not stopped) within `timeout`."""
    deadline = time.monotonic() + timeout
    while states(pid) <= {"T"}:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def spinners(tmp_path):
    procs = []

    def start(name: str = "w") -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", SPINNER, str(tmp_path / name)], stdout=subprocess.PIPE)
        assert proc.stdout.readline() == b"ready\n"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


async def join(lease: TrainingLease, proc: subprocess.Popen, tenant: str = "alice") -> bool:
    async with lease.starting(tenant) as joined:
        return joined(proc.pid)


def overlaps(trace, kinds=("train", "start")) -> list:
    steps = [(a, b) for kind, a, b in trace if kind == "step"]
    return [(k, a, b) for k, a, b in trace if k in kinds for s, e in steps if a < e and s < b]


async def test_a_worker_runs_only_while_it_holds_the_lease(spinners):
    lease = TrainingLease(0.25)
    lease.trace = []
    worker = spinners()
    assert await join(lease, worker) and states(worker.pid) == {"T"}  # stopped as it joins
    settled = []
    # serving idle: the worker holds the cores until the next step
    assert lease.between_steps(lambda: settled.append(1)) is None
    assert running(worker.pid)
    lease.step_starts()  # a request came: stopped before the step
    assert states(worker.pid) == {"T"}
    start = lease.clock()
    time.sleep(0.05)  # the step (as the executor runs it)
    lease.record_step(start, lease.clock())
    lease.step_ends(busy=True)
    # serving busy: a slice (its share of the step's time), back once the worker is stopped again
    assert lease.between_steps(lambda: settled.append(1)) is None
    assert states(worker.pid) == {"T"} and settled == [1]  # (the engine's forward pass settled first)
    kinds = [kind for kind, _, _ in lease.trace]
    assert kinds == ["start", "train", "step", "train"], lease.trace
    assert lease.trace[-1][2] - lease.trace[-1][1] >= SLICE_S
    assert not overlaps(lease.trace)
    assert lease.held_s(worker.pid) > 0 and lease.workers == 1
    lease.leave(worker.pid)
    assert lease.workers == 0 and lease.between_steps(lambda: None) is None
    assert states(worker.pid) == {"T"}  # (left: never signalled again)


async def test_a_stopped_worker_takes_its_pause_when_it_runs_and_dies_of_sigkill(spinners, tmp_path):
    lease = TrainingLease(0.25)
    worker = spinners()
    await join(lease, worker)
    worker.send_signal(signal.SIGUSR1)  # a pause asked while it is stopped: handled once it runs
    time.sleep(0.3)
    assert not (tmp_path / "w").exists() and states(worker.pid) == {"T"}
    lease.between_steps(lambda: None)  # (idle: it runs)
    deadline = time.monotonic() + 10
    while not (tmp_path / "w").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lease.step_starts()
    assert states(worker.pid) == {"T"}
    worker.kill()  # a cancel: SIGKILL ends it stopped
    assert worker.wait(timeout=10) == -signal.SIGKILL
    lease.step_ends(busy=False)
    lease.leave(worker.pid)


def spin_when_ready(ready) -> None:
    """A stand-in worker, forked as motet/api/fine_tuning/workers.py forks one: it spins once it says ready."""
    from motet.training.worker import die_with_fork_server

    die_with_fork_server()
    ready.send("ready")
    while True:
        pass


def test_a_stopped_worker_dies_with_its_server(tmp_path):
    """The server's end (however it ends: here SIGKILL) takes a stopped worker with it, through the fork server it
    was forked from: its parent-death signal is SIGKILL, the one signal a stopped process dies of (the kernel leaves
    any other pending until it is continued)."""
    parent = """
import multiprocessing, os, signal, time
from pathlib import Path
forks = multiprocessing.get_context("forkserver")
ready, sender = forks.Pipe(duplex=False)
from tests.actors.test_training_lease import spin_when_ready
child = forks.Process(target=spin_when_ready, args=(sender,), daemon=True)
child.start()
assert ready.recv() == "ready"
os.kill(child.pid, signal.SIGSTOP)
while not all(Path(f"/proc/{child.pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
              for t in os.listdir(f"/proc/{child.pid}/task")):
    time.sleep(0.01)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    out = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and states(child) - {"Z", "X"}:
        assert time.monotonic() < deadline, states(child)
        time.sleep(0.01)


async def test_workers_take_turns_while_serving_is_idle(spinners):
    now = [0.0]
    lease = TrainingLease(0.25, clock=lambda: now[0])
    a, b = spinners("a"), spinners("b")
    await join(lease, a, "alice")
    await join(lease, b, "bob")
    assert lease.between_steps(lambda: None) == lease.policy.turn_s  # one at a time, in turns
    assert running(a.pid) and states(b.pid) == {"T"}
    now[0] += lease.policy.turn_s
    lease.between_steps(lambda: None)
    assert running(b.pid) and states(a.pid) == {"T"}
    assert lease.fraction(a.pid) == 0.5 and lease.held_s(a.pid) == lease.policy.turn_s
    lease.leave(b.pid)  # b ends: a goes on
    assert lease.between_steps(lambda: None) is None
    assert running(a.pid)


async def test_on_a_gpu_the_lease_leaves_workers_alone(spinners):
    lease = TrainingLease(0.25)
    lease.shares_cores = False  # (the executor's, for an engine on a GPU: training runs on the CPU)
    worker = spinners()
    assert not await join(lease, worker)
    assert lease.between_steps(lambda: None) is None and running(worker.pid, timeout=1)
