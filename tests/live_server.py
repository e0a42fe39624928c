"""`motet serve` on a free loopback port, for the integration tests: as a process of its own (Server: forked from the
worker's pre-imported zygote, tests/server_zygote.py, where its environment allows, else a fresh interpreter), or in
a thread of the test process (ThreadServer: the same flags, state and uvicorn server `motet serve` builds)."""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil

from motet.evals.server import ServerError, free_port, wait_healthy
from tests.server_zygote import ForkedProcess, fork, forkable, training_socket

ROOT = Path(__file__).resolve().parents[1]


def assert_chat_prompt_ids(url: str, model: str, messages: list[dict], want: list[int]):
    """The server at `url` encodes the chat as `want` (the reference's ids), through /tokenize and a chat
    completion's prompt tokens (the openai SDK's parsing); the SDK's client, for more requests."""
    r = httpx.post(f"{url}/tokenize", json={"model": model, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == len(want)
    return client


def keys_file(tmp: Path, keys: dict) -> str:
    """`--api-keys`' file (key -> tenant, or -> {"admin": true}) written in tmp; its path, for the flag."""
    path = tmp / "keys.json"
    path.write_text(json.dumps(keys))
    return str(path)


def end(proc: subprocess.Popen | ForkedProcess, sig: int, timeout: float) -> None:
    """Sends `sig` to a server still running and waits for it to exit; kills it if it takes over `timeout`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The zygote's environment: the worker's as tests/conftest.py leaves it, whichever test starts the zygote (one that
# changed HOME for itself, say)
WORKER_ENV = dict(os.environ)


class _Zygote:
    """This worker's tests/server_zygote.py, started on first use with the worker's starting environment."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="motet-zygote-")
        self.socket_path = os.path.join(self.dir, "socket")
        self.env = WORKER_ENV
        self.children: list[tuple[int, str]] = []  # (pid, module) of each process forked
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.server_zygote", self.socket_path],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env,
        )  # fmt: skip
        if self.proc.stdout.readline() != b"ready\n":
            raise RuntimeError("tests/server_zygote.py did not start")
        atexit.register(self.stop)

    def stop(self) -> None:
        self.proc.stdin.close()  # (it kills any server still running, then exits)
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def serves(self, env: dict) -> bool:
        """Whether a process with `env` may be forked from it (tests/server_zygote.py's forkable)."""
        return forkable(env, self.env)

    def start(
        self,
        module: str,
        argv: list[str],
        env: dict,
        log,
        new_session: bool = False,
        stdin: bytes = b"",
        training_branch: bool = False,
    ) -> ForkedProcess:
        log = getattr(log, "name", os.devnull) if log is not None else None  # (subprocess.DEVNULL: no log)
        request = {"module": module, "argv": argv, "env": env, "cwd": str(ROOT), "log": log,
                   "new_session": new_session, "stdin": base64.b64encode(stdin).decode(),
                   "training_branch": training_branch}  # fmt: skip
        forked = fork(self.socket_path, request)
        self.children.append((forked.pid, module))
        return forked

    def running(self, module: str) -> list[psutil.Process]:
        """Its children still running `module`."""
        alive = []
        for pid in (pid for pid, name in self.children if name == module):
            with contextlib.suppress(psutil.Error):  # (gone)
                p = psutil.Process(pid)
                if p.ppid() == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:  # (not a reused pid)
                    alive.append(p)
        return alive


_zygote: _Zygote | None = None


def zygote_for(env: dict) -> _Zygote | None:
    """This worker's zygote (started on first use) where a process with `env` may be forked from it
    (MOTET_TEST_ZYGOTE=0: never)."""
    global _zygote
    if os.environ.get("MOTET_TEST_ZYGOTE", "1") == "0":
        return None
    if _zygote is None:
        _zygote = _Zygote()
    return _zygote if _zygote.serves(env) else None


def training_branch_for(env: dict) -> str | None:
    """The socket of this worker's zygote's training branch (tests/server_zygote.py) where a process with `env`
    may fork its fine-tuning fork server from it, else None."""
    zygote = zygote_for(env)
    return training_socket(zygote.socket_path) if zygote is not None else None


# Whether the servers the benchmarks start in the test process (ManagedServer: tests/conftest.py) fork their
# fine-tuning fork server from the zygote's training branch: a test of a benchmark that measures a server's process
# tree (benchmarks/process_memory.py) turns it off, so that the tree holds the jobs.
BENCHMARK_SERVERS_USE_THE_TRAINING_BRANCH = True


def start_cli(
    argv: list[str], env: dict, log, new_session: bool = False, training_branch: bool = False
) -> subprocess.Popen | ForkedProcess:
    """`python -m motet.api.cli ARGV` with `env`, its output to `log` (an open file, or subprocess.DEVNULL), in a
    session of its own if `new_session`: forked from this worker's zygote where it may be, else a new
    interpreter. With `training_branch`, a server forked from the zygote forks its fine-tuning fork server from
    the zygote's training branch (tests/server_zygote.py): the jobs' processes are not the server's descendants."""
    if zygote := zygote_for(env):
        return zygote.start("motet.api.cli", argv, env, log, new_session, training_branch=training_branch)
    cmd = [sys.executable, "-m", "motet.api.cli", *argv]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session
    )


def forked_running(module: str) -> list[psutil.Process]:
    """The processes running `module` that this worker's zygote forked and that still run."""
    return _zygote.running(module) if _zygote is not None else []


def forked_rank(arguments: bytes) -> ForkedProcess | None:
    """An in-process engine's tensor-parallel rank (motet/engine/worker/tp_workers.py's start_rank) forked from
    this worker's zygote, or None where it may not be."""
    env = dict(os.environ)
    if zygote := zygote_for(env):
        return zygote.start("motet.engine.worker.tp_rank", [], env, None, stdin=arguments)
    return None


class Server:
    """`motet serve` in a subprocess; waits until /health is 200."""

    def __init__(
        self,
        tmp: Path,
        *args: str,
        env: dict | None = None,
        start_timeout: float = 300,
        admin_key: str | None = None,
    ):
        self.admin_key = admin_key  # what metrics() reads /metrics with (under --api-keys)
        # metrics()'s client, kept: tests poll it (a client a call built its TLS context each time, ~45 ms of CPU)
        self._http = httpx.Client(timeout=10)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        argv = ["serve", "--port", str(self.port), *args]
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        # (its fine-tuning jobs' processes forked from the zygote's training branch, tests/server_zygote.py)
        self.proc = start_cli(argv, {**os.environ, **(env or {})}, self.log, training_branch=True)
        try:
            wait_healthy(self.url, self.proc, start_timeout, self.log_path)
        except ServerError:
            self.stop()
            raise

    def client(self, key: str) -> httpx.Client:
        """An HTTP client of this server's that sends `key` (a tenant's, under --api-keys) with every request."""
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=300)

    def metrics_text(self) -> str:
        """/metrics as Prometheus text (read with admin_key where one is given)."""
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        r = self._http.get(f"{self.url}/metrics", headers=headers)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.metrics_text().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> None:
        end(self.proc, signal.SIGINT, 30)
        self.log.close()
        self._http.close()


def tiny_server(model_dir: Path, tmp: Path, *flags: str, data: str = "data", name: str = "tiny") -> Server:
    """`motet serve` of a tiny model as `name` under --api-keys (tmp/keys.json), its data in tmp/`data`, on one
    thread with 1,024 tokens a sequence, and `flags`."""
    return Server(
        tmp,
        "--model", str(model_dir), "--served-model-name", name, "--api-keys", str(tmp / "keys.json"),
        "--data-dir", str(tmp / data), "--threads", "1", "--max-model-len", "1024", *flags,
        start_timeout=120,
    )  # fmt: skip


class ThreadServer:
    """`motet serve ARGS` (parsed by its own parser) on uvicorn in a thread; waits until /health is 200."""

    def __init__(self, *args: str, start_timeout: float = 120):
        from motet.api.cli import build_parser, engine_config
        from motet.api.server import api_app, build_state, uvicorn_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        parsed = build_parser().parse_args(
            ["serve", "--port", str(self.port), "--log-level", "warning", *args]
        )
        self.state = build_state(parsed, engine_config(parsed))
        self.server = uvicorn_server(parsed, api_app(parsed, self.state), self.state)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        with httpx.Client(timeout=5) as client:  # one for every poll (see Server._http)
            while True:
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or not self.thread.is_alive():
                    self.stop()
                    raise ServerError(f"the server on port {self.port} did not become healthy")
                time.sleep(0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
