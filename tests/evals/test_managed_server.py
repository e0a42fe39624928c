"""The server an eval starts itself says it is still loading (issue 57: `motet eval`'s managed server was two minutes
of nothing on a busy CPU, its own log going to a file)."""

from __future__ import annotations

import httpx

from motet.evals import server
from motet.evals.server import ManagedServer, wait_healthy


def test_a_server_still_loading_says_so_with_the_time_waited(monkeypatch, capsys, tmp_path):
    loading = {"error": {"message": "Loading model", "type": "unavailable_error", "param": None, "code": 503},
               "status": "loading", "phase": "loading the weights 12/30", "fraction": 0.4}  # fmt: skip
    answers = iter([httpx.Response(503, text="not json"), httpx.Response(503, json=loading),
                    httpx.Response(503, json={"error": {}}), httpx.Response(200)])  # fmt: skip

    class Polled:  # the client wait_healthy polls /health with
        def __init__(self, timeout):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def get(self, url):
            return next(answers)

    monkeypatch.setattr(server.httpx, "Client", Polled)
    monkeypatch.setattr(server.time, "sleep", lambda s: None)
    monkeypatch.setattr(server, "WAITING_EVERY_S", 0.0)
    waited: list[tuple[float, str | None]] = []
    wait_healthy("http://127.0.0.1:1", waiting=lambda s, phase: waited.append((s, phase)))
    seconds = [s for s, _ in waited]
    assert len(waited) == 3 and seconds == sorted(seconds)  # each time /health said 503, the seconds so far
    # and the phase it named (the latest one named, once there was one)
    assert [phase for _, phase in waited] == [None, "loading the weights 12/30", "loading the weights 12/30"]

    managed = ManagedServer([], log_path=tmp_path / "server.log")
    managed._waiting(42.4, "loading the weights 12/30")
    line = capsys.readouterr().err
    assert line == (
        f"motet: waiting for the server on {managed.url} to load its model: 42 s (loading the weights 12/30); "
        f"its log: {tmp_path / 'server.log'}\n"
    )
