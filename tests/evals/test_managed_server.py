"""The server an eval starts itself says it is still loading (issue 57: `motet eval`'s managed server was two minutes
of nothing on a busy CPU, its own log going to a file)."""

from __future__ import annotations

import httpx

from motet.evals import server
from motet.evals.server import ManagedServer, wait_healthy


def test_a_server_still_loading_says_so_with_the_time_waited(monkeypatch, capsys, tmp_path):
    answers = iter([503, 503, 503, 200])
    monkeypatch.setattr(server.httpx, "get", lambda url, timeout: httpx.Response(next(answers)))
    monkeypatch.setattr(server.time, "sleep", lambda s: None)
    monkeypatch.setattr(server, "WAITING_EVERY_S", 0.0)
    waited: list[float] = []
    wait_healthy("http://127.0.0.1:1", waiting=waited.append)
    assert len(waited) == 3 and waited == sorted(waited)  # each time /health said 503, the seconds so far

    managed = ManagedServer([], log_path=tmp_path / "server.log")
    managed._waiting(42.4)
    line = capsys.readouterr().err
    assert (
        line
        == f"motet: waiting for the server on {managed.url} to load its model: 42 s; its log: {tmp_path / 'server.log'}\n"
    )
