"""A server started by the eval harness (motet/evals/server.py) dies with it, however the harness dies, and the
harness starts it without forking its own address space (motet/parent_death.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

HARNESS = textwrap.dedent(
    """
    import sys, time
    from motet.evals.server import ManagedServer
    server = ManagedServer(["--max-model-len", "256"], model=sys.argv[1], start_timeout=300).__enter__()
    print(server.proc.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_its_killed_harness(tiny_model_dir):
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tiny_model_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        server_pid = int(harness.stdout.readline())
        server = psutil.Process(server_pid)
        assert server.is_running()
        harness.send_signal(signal.SIGKILL)  # no cleanup of its own: only the death signal stops the server
        harness.wait(10)
        deadline = time.monotonic() + 30
        while server.is_running() and server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    finally:
        harness.kill()
        harness.wait()
