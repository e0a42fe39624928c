"""`motet serve --tensor-parallel-size 2` on the real default model (its 3 key/value heads split 2 + 1): the
openai SDK gets what one rank gives; a rank killed under load ends every request with a clean error and the
server exits, leaving no process behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import openai
import psutil
import pytest

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from tests.live_server import Server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def workers_of(pid: int) -> list[psutil.Process]:
    return [
        p for p in psutil.Process(pid).children() if "motet.engine.worker.tp_rank" in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def one_rank_texts(default_model_dir):
    with LLM(str(default_model_dir), num_kv_blocks=256) as llm:
        params = SamplingParams(temperature=0, max_tokens=24)
        return [o.text for o in llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], params)]


def test_two_ranks_answer_the_openai_sdk_as_one_rank_does(default_model_dir, one_rank_texts, tmp_path):
    # float32, as the one rank: two ranks' partial sums added in another order part from one rank's in bf16
    server = Server(
        tmp_path,
        "--tensor-parallel-size",
        "2",
        "--threads",
        "1",
        "--num-kv-blocks",
        "256",
        "--dtype",
        "float32",
    )
    try:
        assert len(workers_of(server.proc.pid)) == 1
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together on both ranks
            outs = list(
                pool.map(
                    lambda p: client.completions.create(  # greedy, no penalty: as the offline one rank's
                        model=MODEL, prompt=p, max_tokens=24, temperature=0, frequency_penalty=0
                    ),
                    PROMPTS,
                )
            )
        assert [o.choices[0].text for o in outs] == one_rank_texts
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
        )
        assert chat.choices[0].message.content
    finally:
        server.stop()
    assert server.proc.returncode is not None


def test_a_rank_killed_under_load_ends_requests_cleanly_and_the_server_exits(default_model_dir, tmp_path):
    server = Server(tmp_path, "--tensor-parallel-size", "2", "--threads", "1", "--num-kv-blocks", "256")
    try:
        (worker,) = workers_of(server.proc.pid)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        def long_stream(i: int) -> str:
            try:
                stream = client.completions.create(
                    model=MODEL,
                    prompt=f"Count to {100 + i}:",
                    max_tokens=400,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                chunks = sum(1 for _ in stream)
                return f"finished after {chunks} chunks"
            except (openai.APIError, openai.APIConnectionError) as e:
                return f"error: {type(e).__name__}: {e}"

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(long_stream, i) for i in range(4)]
            # kill the worker once every stream has produced tokens
            first = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert first.choices[0].text is not None
            os.kill(worker.pid, signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
        assert all(r.startswith("error:") for r in results), results
        assert server.proc.wait(timeout=60) != 0  # exits (non-zero: a supervisor restarts it)
        log = server.log_path.read_text()
        assert "tensor-parallel rank failed" in log
    finally:
        server.stop()
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
