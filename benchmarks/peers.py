"""What the CPU serving peers' benchmarks share (benchmarks/llamacpp.py, benchmarks/vllm_cpu.py): a peer's
server as a subprocess on loopback (or one already running, at --peer-url), the streamed chat requests both sides
get, one level's measurement, and a row of motet's figures against the peer's."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks import chat_body
from motet.evals.server import ServerError, free_port, wait_healthy
from motet.evals.serving_bench import make_prompts, run_level, summarize


class PeerServer:
    """A peer's OpenAI-compatible server on a free loopback port (`self.port`, set before `cmd` is built): its
    command's output in `log`, healthy within `start_timeout` seconds, stopped (SIGTERM, then its whole process
    group killed) on exit. Subclasses set `cmd` (and `env`, default: this process's)."""

    cmd: list
    env: dict | None = None

    def __init__(self, log: Path, start_timeout: float, stop_timeout: float = 30):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.log, self.start_timeout, self.stop_timeout = log, start_timeout, stop_timeout
        self.proc = None
        self._log = None

    def __enter__(self):
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log, "w")  # noqa: SIM115 (closed in __exit__)
        print("+", " ".join(str(c) for c in self.cmd), flush=True)
        self.proc = subprocess.Popen([str(c) for c in self.cmd], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=self.log.parent, start_new_session=True)  # fmt: skip
        try:
            wait_healthy(self.url, self.proc, self.start_timeout, self.log)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()


class RunningPeer:
    """A peer server already running at `url` (--peer-url): used as a PeerServer is, never started or stopped
    here. The benchmarks' smoke tests point it at a second `motet serve`, where the peer is not installed."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.base_url = f"{self.url}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


PEER_URL_HELP = (
    "an OpenAI-compatible server of the same weights, serving them under the model directory's name, already "
    "running at this URL: the peer, instead of installing and starting one"
)


def chat_requests(n: int, max_tokens: int, prompt_words: int, seed: int, models: list[dict], **extra) -> list:
    """n streamed chat requests (EOS ignored, greedy) on make_prompts' texts; request i carries
    models[i % len(models)]'s fields (model, lora) and `extra` (response_format)."""
    out = []
    for i, prompt in enumerate(make_prompts(n, prompt_words, seed)):
        fields = dict(models[i % len(models)])
        body = chat_body(fields.pop("model"), f"Continue this text: {prompt}", max_tokens, **fields, **extra)
        out.append(("/chat/completions", body))
    return out


def measure(url: str, requests: list, concurrency: int) -> dict:
    """One level: `requests` against `url` with at most `concurrency` in flight; any failure raises."""
    records, duration = asyncio.run(run_level(url, requests, concurrency))
    res = summarize(records, duration, concurrency)
    if res["failed"]:
        raise RuntimeError(f"{res['failed']} requests failed at {url}: {res['errors']}")
    return res


def peer_row(peer: str, m: dict, theirs: dict, **label) -> dict:
    """motet's figures `m` against the peer's `theirs` at one load (`label`: its name, e.g. clients=8)."""
    p50 = lambda r, k: (r[k] or {}).get("p50")  # noqa: E731
    return {**label, "motet": m, peer: theirs,
            "ratio_tokens_per_s": m["output_token_throughput"] / theirs["output_token_throughput"],
            "tpot_p50_ms": (1e3 * p50(m, "tpot_s"), 1e3 * p50(theirs, "tpot_s")),
            "ttft_p50_ms": (1e3 * p50(m, "ttft_s"), 1e3 * p50(theirs, "ttft_s"))}  # fmt: skip


def run_main(main) -> None:
    """A peer benchmark's entry point: a server that would not start, a failed build or install step, or a failed
    request ends it with one line."""
    try:
        main()
    except (ServerError, subprocess.CalledProcessError, RuntimeError) as e:
        sys.exit(f"error: {e}")
