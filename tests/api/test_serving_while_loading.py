"""Issue 65: a server that answers within a second of its start, the model loading beside it; issue 68 item 17: no
silent stretch in the commands' start-up.

`motet serve` bound its port only once the API's modules were imported (torch, transformers, xgrammar: 11-17 s of
nothing on a busy machine) and its /health said only "the model is still loading". Now it binds once the flags and
the model's config are checked, answers /health at once with llama.cpp's 503 and the load's phase, and every other
route with 503 "Loading model" and a Retry-After until the model has loaded; a load that fails still ends the server
in one line. Each command says what it does before the engine's libraries load: read from the order of its lines
and of `python -X importtime`'s report of torch, never from a clock."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from motet.evals.server import free_port
from tests.live_server import ROOT, end

LLAMA_CPP_LOADING = {
    "message": "Loading model",
    "type": "unavailable_error",
    "code": 503,
}  # (and OpenAI's param)
TORCH_IMPORTED = re.compile(r"^import time:.*\|\s+torch(\.|$)")


def serve_cmd(model_dir, port: int, data, *flags: str, importtime: bool = False) -> list[str]:
    return [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "motet.api.cli", "serve",
            "--model", str(model_dir), "--served-model-name", "tiny", "--port", str(port), "--data-dir", str(data),
            "--threads", "1", "--max-model-len", "1024", *flags]  # fmt: skip


def test_health_answers_while_loading_with_its_progress_and_requests_wait_with_retry_after(
    tiny_model_dir, tmp_path
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(serve_cmd(tiny_model_dir, port, tmp_path / "data"), cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        first = None
        while first is None:  # the first answer the port gives
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                first = httpx.get(f"{url}/health", timeout=30)
            except httpx.TransportError:
                time.sleep(0.05)
        # the port answers before the model has loaded: /health is llama.cpp's 503, with the load's phase
        assert first.status_code == 503, first.text
        body = first.json()
        assert {k: body["error"][k] for k in LLAMA_CPP_LOADING} == LLAMA_CPP_LOADING
        assert body["status"] == "loading" and isinstance(body["phase"], str) and body["phase"]
        assert body["fraction"] is None or 0 <= body["fraction"] <= 1
        assert int(first.headers["retry-after"]) >= 1
        # a request meanwhile is refused as the openai SDK reads a 503, with when to come back
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert refused.value.status_code == 503
        assert (
            refused.value.body["message"] == "Loading model"
            and refused.value.body["type"] == "unavailable_error"
        )
        assert int(refused.value.response.headers["retry-after"]) >= 1
        phases = [body["phase"]]
        while (health := httpx.get(f"{url}/health", timeout=30)).status_code == 503:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            phases.append(health.json()["phase"])
            time.sleep(0.05)
        assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
        # once loaded, every route works: the model answers, with the SDK's own retries off
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.usage.completion_tokens >= 1
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
    finally:
        end(proc, signal.SIGTERM, 60)
        log.close()
    out = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in out
    # said what it loads and where before anything of the load, and ready after it
    assert out.index("loading tiny in ") < out.index("weights: ") < out.index(f"ready on {url}")


def test_the_first_line_comes_before_the_engines_libraries_load(tiny_model_dir, tmp_path):
    """Issue 68 item 17: 11-12 s of nothing before `motet serve`'s first weight line. Its first line (what it loads,
    where it answers) is printed before torch is imported (the imports run beside the answering port)."""
    proc = subprocess.Popen(
        serve_cmd(tiny_model_dir, free_port(), tmp_path / "data", importtime=True),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lines = lines_until(proc, TORCH_IMPORTED)
    finally:
        end(proc, signal.SIGKILL, 30)
    said = [i for i, line in enumerate(lines) if "INFO motet.server: loading tiny in " in line]
    assert said and said[0] < len(lines) - 1, lines[-20:]  # said, before torch's import line (the last read)


def lines_until(proc: subprocess.Popen, pattern: re.Pattern) -> list[str]:
    """`proc`'s stderr lines up to the first matching `pattern` (or to its end)."""
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if pattern.search(line):
            break
    return lines


def offline_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-X", "importtime", "-m", "motet.api.cli", *argv]


@pytest.mark.parametrize("command", ["generate", "run-batch", "fine-tune"])
def test_each_command_says_what_it_does_before_the_engines_libraries_load(command, tiny_model_dir, tmp_path):
    """Issue 68 item 17: `motet generate` (~30 s), `motet run-batch` before its bar (~21 s) and `motet fine-tune`
    were silent while they imported their libraries and loaded: each says what it does first, then (the heartbeat,
    load_progress.py) a line at least every 5 s."""
    model = ["--model", str(tiny_model_dir)]
    if command == "generate":
        argv, first = ["generate", "--prompt", "hi", *model], "motet generate: loading "
    elif command == "run-batch":
        batch = tmp_path / "in.jsonl"
        batch.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                     "body": {"model": "tiny", "prompt": "hi", "max_tokens": 2}}) + "\n")  # fmt: skip
        argv = ["run-batch", "-i", str(batch), "-o", str(tmp_path / "out.jsonl"), *model]
        first = "motet run-batch " + str(batch) + ": loading "
    else:
        data = tmp_path / "train.jsonl"
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        data.write_text("".join(json.dumps({"messages": chat}) + "\n" for _ in range(4)))
        argv, first = (
            ["fine-tune", str(data), *model, "--threads", "1"],
            "motet fine-tune: supervised fine-tuning",
        )
    proc = subprocess.Popen(offline_cmd(*argv, "--threads", "1") if command != "fine-tune" else offline_cmd(*argv),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        lines = lines_until(proc, TORCH_IMPORTED)
    finally:
        end(proc, signal.SIGKILL, 30)
    assert TORCH_IMPORTED.search(lines[-1]), lines[-20:]  # it went on to load torch
    said = [i for i, line in enumerate(lines) if first in line]
    assert said, lines[-20:]  # ... having said what it does first


def test_fine_tune_refuses_a_bad_line_before_its_libraries_load(tiny_model_dir, tmp_path):
    """Issue 68 item 17: a bad file was refused after 31 s of silence (imported, tokenized). Its lines are read as
    the job reads them before anything loads: the refusal is the one line, and torch is never imported."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    done = subprocess.run(offline_cmd("fine-tune", str(data), "--model", str(tiny_model_dir)), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2
    said = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(said) == 1 and said[0].startswith(f"motet: error: {data}: Line 1: no assistant message"), said
    assert not any(TORCH_IMPORTED.search(line) for line in done.stderr.splitlines())


def test_a_load_that_fails_after_the_port_is_bound_ends_the_server_in_one_line(tiny_model_dir, tmp_path):
    """The weights are read once the port answers: a checkpoint whose config is sound and whose weights are not
    ends the server, non-zero, with one error line (never a 503 for ever, never a traceback)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    done = subprocess.run(serve_cmd(broken, free_port(), tmp_path / "data"), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    errors = [line for line in out.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "model.safetensors" in errors[0], out
    assert "Traceback" not in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_server_stopped_while_it_loads_ends_on_stopped(sig, tiny_model_dir, tmp_path):
    """SIGTERM (a drain: nothing can be in flight yet) or Ctrl-C while the port answers 503: the server stops, exit
    status 0, its last line `stopped`, the build under way abandoned (uvicorn once re-raised the SIGTERM it caught,
    and the process died of it without a word)."""
    port = free_port()
    proc = subprocess.Popen(serve_cmd(tiny_model_dir, port, tmp_path / "data"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        while True:
            assert proc.poll() is None
            try:
                loading = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=300)
    finally:
        end(proc, signal.SIGKILL, 30)
    assert loading.status_code in (503, 200)
    assert proc.returncode == 0, out
    assert out.strip().splitlines()[-1].endswith("INFO motet.server: stopped"), out
    assert "Traceback" not in out
