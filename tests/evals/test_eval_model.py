"""`motet eval` sends the model its server serves, and a run that cannot measure anything exits non-zero
(on the tiny random model: the smallest settings of the serving suite)."""

from __future__ import annotations

import json

import httpx
import pytest

from motet.evals import eval_command
from motet.evals.server import free_port
from tests.live_server import ThreadServer

SMALLEST = ["--levels", "1", "--limit", "1", "--max-tokens", "2", "--prompt-words", "4", "--concurrency", "1"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = ThreadServer("--model", str(tiny_model_dir), "--data-dir", str(tmp_path_factory.mktemp("data")),
                       "--threads", "1", "--num-kv-blocks", "64")  # fmt: skip
    yield srv
    srv.stop()


def test_server_args_model_is_the_one_measured(tiny_model_dir, tmp_path):
    """`--server-args "--model DIR"` without --model: the requests name the model that server lists (they named
    the default model's, got 404 each, and the run reported 0 done with exit status 0)."""
    out, port = tmp_path / "serving", free_port()  # issue 57: the managed server pinned to a port (--port)
    argv = ["serving", "--server-args", f"--model {tiny_model_dir} --threads 1 --num-kv-blocks 64", *SMALLEST,
            "--patterns", "identical", "--adapters", "1", "--adapter-rank", "2", "--port", str(port),
            "--out", str(out)]  # fmt: skip
    assert eval_command.main(argv) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["managed"] and run["model"] == tiny_model_dir.name  # /v1/models' id of a checkpoint dir
    assert run["base_url"] == f"http://127.0.0.1:{port}/v1"
    rows = run["results"]["levels"] + run["results"]["patterns"]  # the base model, then an adapter of it
    assert [(r["requests"], r["completed"]) for r in rows] == [(1, 1)] * 3, [r["errors"] for r in rows]


def test_server_args_gguf_file_is_the_one_measured(tiny_model_dir, tmp_path):
    """The finding's own case: `--server-args "--model FILE.gguf"`, the requests name the file's stem."""
    from tests.engine.test_gguf_model_file import GGUF_TYPES, write_gguf_file

    gguf = write_gguf_file(tiny_model_dir, tmp_path / "model" / "tiny-q4.gguf", GGUF_TYPES)
    out = tmp_path / "serving"
    argv = ["serving", "--server-args", f"--model {gguf} --threads 1 --num-kv-blocks 64", *SMALLEST,
            "--patterns", "--out", str(out)]  # fmt: skip
    assert eval_command.main(argv) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["managed"] and run["model"] == "tiny-q4"
    assert [(r["requests"], r["completed"]) for r in run["results"]["levels"]] == [(1, 1)]


def test_a_model_the_server_does_not_have_exits_non_zero(server, tmp_path, capsys):
    argv = ["serving", "--base-url", server.url, "--model", "no-such-model", *SMALLEST, "--patterns",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert eval_command.main(argv) == 2
    err = capsys.readouterr().err
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    assert "no-such-model" in err and listed in err  # what was asked for, and what to pass instead


def test_a_run_whose_requests_all_fail_exits_non_zero(server, tmp_path, capsys):
    """Every request refused (max_tokens over the tiny model's 4096-token context): the report is written,
    and the exit status says the run measured nothing."""
    out = tmp_path / "out"
    argv = ["serving", "--base-url", server.url, *SMALLEST, "--max-tokens", "5000", "--patterns",
            "--out", str(out)]  # fmt: skip
    assert eval_command.main(argv) == 1
    assert (
        "all 1 requests failed" in capsys.readouterr().err and "HTTP 400" in (out / "summary.md").read_text()
    )


def test_requests_answered_404_fail_the_run():
    """Some requests measured, others answered 404 (an adapter or route not on that server): the run did not
    measure what was asked, so `motet eval` exits 1; errors of load (429, timeouts) alone do not."""
    from motet.evals.suites import serving

    def rows(*errors):
        return {"levels": [{"requests": 2, "completed": 1, "errors": list(errors)}], "patterns": []}

    reason = serving.failure(rows('HTTP 404: b\'{"error": {"message": "model eval-a0 not found"}}\''))
    assert reason and "404" in reason and "eval-a0" in reason
    assert serving.failure(rows("HTTP 429: b'slow down'")) is None
    assert serving.failure(rows()) is None


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--base-url", "http://127.0.0.1:1", "--port", "8001"], "--port is for a server motet eval starts"),
        (["--server-args", "--port 8001"], "motet eval --port, not in --server-args"),
        (["--compare-server-args=--port=8001"], "motet eval --port, not in --server-args"),
    ],
)
def test_a_port_that_cannot_apply_is_refused(argv, says, tmp_path, capsys):
    assert eval_command.main(["serving", *argv, *SMALLEST, "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
