"""A fine-tuning job on the serving engine's clock (motet/actors/training_lease.py), on a real served tiny model
with a real job beside a stream of requests: the worker never runs while the engine steps (the executor's own
monotonic trace of both), it still trains and says that it waits for compute, its `estimated_finish` is set from its
first step, and a worker held stopped by busy serving still pauses, resumes and cancels."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest

from motet.training.worker import NAME
from tests.api.test_fine_tuning_api import KEYS, chat, client, jsonl, upload, wait
from tests.live_server import ThreadServer, keys_file

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux's /proc")
PAUSED = "The job is paused: it goes on from here when resumed"
WAITING = "Waiting for compute: serving is busy; training gets 25% of the machine"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fine-tuning-compute")
    keys_file(tmp, KEYS)
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--api-keys", str(tmp / "keys.json"),
        "--data-dir", str(tmp / "data"), "--threads", "1", "--max-model-len", "1024", "--dtype", "float32",
    )  # fmt: skip
    srv.lease = srv.state.fine_tuning.settings.lease
    yield srv
    srv.stop()


class Stream:
    """Chat requests back to back from `clients` threads (a tenant's), until the block ends. Each client's answers
    are of their own length, so that the clients do not fall into step: answers that all end in one step leave the
    engine idle while every client sends its next request, and an idle engine gives the worker the cores."""

    def __init__(self, server, clients: int):
        self.c = client(server, "ke")
        self.stop = threading.Event()
        self.answers = self.errors = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                self.c.chat.completions.create(model="tiny", max_tokens=24 + 7 * i, temperature=0,
                                               messages=[{"role": "user", "content": f"count {i} {n}"}],
                                               extra_body={"ignore_eos": True})  # fmt: skip
                self.answers += 1
            except openai.APIError:
                self.errors += 1
            n += 1

    def __enter__(self) -> Stream:
        self.start = time.monotonic()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        self.end = time.monotonic()


def messages(c, job_id: str) -> list[str]:
    return [e.message for e in c.fine_tuning.jobs.list_events(job_id, limit=100)]


def wait_for_event(c, job_id: str, message: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while message not in messages(c, job_id):
        assert time.monotonic() < deadline, messages(c, job_id)
        time.sleep(0.1)


def thread_states(pid: int) -> set[str]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            out.add(stat[stat.rindex(")") + 2])
    return out


def worker_process() -> psutil.Process:
    """The job's worker: a process of this one's named `motet-training` (forked from its fork server; one job at a
    time; a worker that has exited and is not reaped yet is none)."""

    def worker(p: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return p.status() != psutil.STATUS_ZOMBIE and p.name() == NAME.decode()
        return False

    deadline = time.monotonic() + 60
    while not (found := [p for p in psutil.Process().children(recursive=True) if worker(p)]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (one,) = found
    return one


def wait_gone(worker: psutil.Process, timeout: float = 60) -> None:
    """The worker has exited (not reaped here: its exit status is the server's to read)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:  # (reaped between the two questions)
            return
        assert time.monotonic() < deadline
        time.sleep(0.02)


def wait_stopped(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while thread_states(pid) != {"T"}:
        assert time.monotonic() < deadline, thread_states(pid)
        time.sleep(0.02)


def test_a_job_trains_beside_serving_and_never_while_the_engine_steps(server):
    lease = server.lease
    lease.trace = []
    c = client(server, "ka")
    data = jsonl(chat(i) for i in range(8))
    job = c.fine_tuning.jobs.create(training_file=upload(c, data).id, model="tiny", seed=1,
                                    hyperparameters={"n_epochs": 40, "batch_size": 2})  # fmt: skip
    wait_for_event(c, job.id, "Fine-tuning job started")
    with Stream(server, 4) as stream:
        deadline = time.monotonic() + 300
        while not [e for e in c.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # from its first step, when it should end: its pace over its share
        assert c.fine_tuning.jobs.retrieve(job.id).estimated_finish is not None
        # serving stays busy until the job says it waits for it (or ends without saying so): its remaining steps
        # then run with the cores to itself, not a quarter of them beside a stream that has shown what it shows
        while WAITING not in messages(c, job.id) and c.fine_tuning.jobs.retrieve(job.id).status == "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
    job = wait(c, job.id)
    assert job.status == "succeeded", job.error
    assert stream.answers > 0 and stream.errors == 0
    said = messages(c, job.id)
    assert WAITING in said, said
    trace = list(lease.trace)
    steps = sorted((a, b) for kind, a, b in trace if kind == "step")
    held = [(kind, a, b) for kind, a, b in trace if kind in ("train", "start")]
    assert steps and held
    # at no moment did the worker run while the engine stepped
    assert [(k, a, b) for k, a, b in held for s, e in steps if a < e and s < b] == []
    # and it trained in slices between the steps of a busy engine
    between = [(a, b) for k, a, b in held if k == "train" and stream.start < a and b < stream.end]
    assert len(between) >= 3


def test_a_stopped_worker_pauses_resumes_and_cancels(server):
    """With no share while serving is busy, the stream of requests holds the worker stopped: a pause is taken once
    serving is idle, and a cancel ends it at once, serving still busy."""
    lease = server.lease
    c = client(server, "kb")
    job = c.fine_tuning.jobs.create(training_file=upload(c).id, model="tiny", seed=2,
                                    hyperparameters={"n_epochs": 50, "batch_size": 1})  # fmt: skip
    wait_for_event(c, job.id, "Fine-tuning job started")
    worker = worker_process()
    lease.policy.share = 0.0
    try:
        with Stream(server, 4):
            wait_stopped(worker.pid)
            assert c.fine_tuning.jobs.pause(job.id).status == "paused"
            time.sleep(1)
            assert PAUSED not in messages(c, job.id) and thread_states(worker.pid) == {"T"}
        wait_for_event(c, job.id, PAUSED)  # serving idle: the worker runs, and takes its pause
        wait_gone(worker)
        assert c.fine_tuning.jobs.resume(job.id).status == "queued"
        wait_for_event(c, job.id, "Fine-tuning job started")
        worker = worker_process()
        with Stream(server, 4):
            wait_stopped(worker.pid)
            assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
            wait_gone(worker)
    finally:
        lease.policy.share = 0.25
    assert c.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    assert lease.workers == 0
