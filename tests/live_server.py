"""`motet serve` as a real subprocess on a free loopback port, for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from motet.evals.server import ServerError, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


class Server:
    """`motet serve` in a subprocess; waits until /health is 200."""

    def __init__(self, tmp: Path, *args: str, env: dict | None = None, start_timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "motet.api.cli", "serve", "--port", str(self.port), *args]
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        try:
            wait_healthy(self.url, self.proc, start_timeout, self.log_path)
        except ServerError:
            self.stop()
            raise

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
