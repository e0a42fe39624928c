"""A `motet serve` subprocess for an eval run: started on a free loopback port, stopped on exit.

Used as a context manager, so the server goes away however the run ends (a finished suite, an error,
Ctrl-C). Its log goes to a file (the report directory's server log), so the eval's progress bars stay
readable; when the server fails to start, the log's tail is in the error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from motet.parent_death import child_env

ROOT = Path(__file__).resolve().parents[2]


WAITING_EVERY_S = 10.0  # how often a start-up that is still loading says so


class ServerError(RuntimeError):
    """The server did not come up (it exited, or was not ready in time)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout: float = 600,
    log: Path | None = None,
    waiting: Callable[[float, str | None], None] | None = None,
):
    """Poll `url`/health until it answers 200; fail early if `proc` exits. `waiting` is called with the seconds
    waited so far every WAITING_EVERY_S of them, and the start-up's phase as /health's 503 said it (None before the
    port answers)."""
    start = time.monotonic()
    deadline, told = start + timeout, start
    phase = None
    # one client for every poll: a client made a poll (httpx.get) built its TLS context each time, ~45 ms of CPU,
    # a tenth of a core taken from the server starting beside it
    with httpx.Client(timeout=2) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise ServerError(f"the server exited with status {proc.returncode}{_tail(log)}")
            try:
                r = client.get(f"{url}/health")
                if r.status_code == 200:
                    return
                phase = _phase(r) or phase
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now > deadline:
                raise ServerError(f"the server at {url} was not ready after {timeout:.0f} s{_tail(log)}")
            if waiting is not None and now - told >= WAITING_EVERY_S:
                told = now
                waiting(now - start, phase)
            time.sleep(0.5)


def _phase(response: httpx.Response) -> str | None:
    """The start-up's phase a 503 from /health names (motet/api/starting.py `loading_body`), if it names one."""
    try:
        phase = response.json().get("phase")
    except (ValueError, AttributeError):
        return None
    return phase if isinstance(phase, str) else None


def _tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.is_file():
        return ""
    return "; its log ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


class ManagedServer:
    """`python -m motet.api.cli serve --port P ... *server_args`; `url` is the root, `base_url` adds /v1.

    Uploaded adapters go to a fresh temporary --data-dir unless the server args name one, so an eval run
    never touches the user's adapter store.
    """

    def __init__(
        self,
        server_args: list[str],
        model: str | None = None,
        log_path: Path | None = None,
        start_timeout: float = 600,
        port: int | None = None,
    ):
        self.server_args, self.model, self.log_path = list(server_args), model, log_path
        self.start_timeout = start_timeout
        self.port = port or free_port()  # (a port given may be taken: serve then says so, and start fails)
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "motet.api.cli", "serve", "--port", str(self.port)]
        if "--log-level" not in self.server_args:
            cmd += ["--log-level", "warning"]
        if self.model and "--model" not in self.server_args:
            cmd += ["--model", self.model]
        if "--data-dir" not in self.server_args:
            self._tmp = tempfile.TemporaryDirectory(prefix="motet-eval-")
            cmd += ["--data-dir", self._tmp.name]
        return cmd + self.server_args

    def start(self) -> ManagedServer:
        cmd = self.command()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = self.launch(cmd, self._log or subprocess.DEVNULL)
        try:
            wait_healthy(self.url, self.proc, self.start_timeout, self.log_path, self._waiting)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self, cmd: list[str], out) -> subprocess.Popen:
        """`cmd`'s process, its output to `out`, in its own session: a Ctrl-C in the terminal reaches only us, and
        we stop the server in order. (The tests fork theirs from a process that has imported what it imports:
        tests/server_zygote.py.)"""
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),  # it dies with us (motet/parent_death.py)
        )

    def _waiting(self, seconds: float, phase: str | None = None) -> None:
        """A line on stderr while the server loads its model (a minute or two on a busy CPU), whose own log goes
        to a file: the seconds so far, and the phase its /health names."""
        at = f" ({phase})" if phase else ""
        where = f"; its log: {self.log_path}" if self.log_path is not None else ""
        print(
            f"motet: waiting for the server on {self.url} to load its model: {seconds:.0f} s{at}{where}",
            file=sys.stderr,
        )

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains what is in flight (nothing, normally), then exits
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
