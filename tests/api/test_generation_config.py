"""A model's generation_config.json sampling defaults (vLLM's `--generation-config` and
`--override-generation-config`): a request that omits a field gets the model's value, one that sets it keeps
its own. `motet serve` on loopback (tests/live_server.py) with a tiny random model; the reference is HF
transformers' greedy generation."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from motet.api.generation_config import GenerationConfigError, sampling_defaults
from tests.engine.test_engine import hf_greedy
from tests.live_server import ThreadServer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def greedy_model(tiny_model_dir, tmp_path_factory):
    """The tiny model whose authors recommend greedy decoding, 5 new tokens at most."""
    d = tmp_path_factory.mktemp("tiny-gen") / "model"
    shutil.copytree(tiny_model_dir, d)
    gen = (
        json.loads((d / "generation_config.json").read_text())
        if (d / "generation_config.json").exists()
        else {}
    )
    gen |= {"temperature": 0.0, "max_new_tokens": 5, "top_k": 0}
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def complete(srv, **body) -> dict:
    r = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "ignore_eos": True, "return_token_ids": True, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def served(greedy_model, tmp_path_factory):
    def start(*flags: str) -> ThreadServer:
        return ThreadServer(
            "--model", str(greedy_model), "--served-model-name", "tiny", "--max-model-len", "256",
            "--data-dir", str(tmp_path_factory.mktemp("data")), *flags,
        )  # fmt: skip

    servers: dict[tuple, ThreadServer] = {}

    def get(*flags: str) -> ThreadServer:
        if flags not in servers:
            servers[flags] = start(*flags)
        return servers[flags]

    yield get
    for srv in servers.values():
        srv.stop()


def test_omitted_fields_take_the_models_defaults(served, tiny_hf_model):
    srv = served()
    want = hf_greedy(tiny_hf_model, PROMPT, 5)
    for seed in (1, 2):  # temperature 0 from the config: greedy, whatever the seed
        assert complete(srv, seed=seed)["token_ids"] == want  # and max_new_tokens 5 as max_tokens
    chat = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
        timeout=120,
    ).json()
    assert chat["usage"]["completion_tokens"] == 5


def test_a_requests_own_fields_win(served, tiny_hf_model):
    srv = served()
    assert complete(srv, max_tokens=3)["token_ids"] == hf_greedy(tiny_hf_model, PROMPT, 3)
    sampled = {tuple(complete(srv, temperature=2.0, seed=s)["token_ids"]) for s in range(4)}
    assert len(sampled) > 1  # the request's temperature, not the config's 0


def test_override_and_vllm_defaults(served, tiny_hf_model):
    over = served("--override-generation-config", '{"max_new_tokens": 7}')
    assert complete(over)["token_ids"] == hf_greedy(
        tiny_hf_model, PROMPT, 7
    )  # temperature 0 still from the file
    plain = served("--generation-config", "vllm")
    assert len(complete(plain, temperature=0)["token_ids"]) == 16  # OpenAI's completions default


def test_omitted_penalties_take_the_files(served):
    """frequency_penalty and presence_penalty (OpenAI's, which the default model's file carries) are defaults too:
    a request that omits them samples as one that sends the file's value."""
    penalized = served("--override-generation-config", '{"frequency_penalty": 2.0, "presence_penalty": 1.5}')
    plain = served("--generation-config", "vllm")
    sent = complete(plain, temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=1.5)[
        "token_ids"
    ]
    unpenalized = complete(plain, temperature=0, max_tokens=24)["token_ids"]
    assert sent != unpenalized  # the tiny model repeats itself: the penalties change its greedy output
    assert complete(penalized, max_tokens=24)["token_ids"] == sent
    assert (
        complete(penalized, max_tokens=24, frequency_penalty=0, presence_penalty=0)["token_ids"]
        == unpenalized
    )


def test_bad_values_are_refused_at_start_up(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(GenerationConfigError, match="temperature must be a number"):
        sampling_defaults("auto", tmp_path)
    with pytest.raises(GenerationConfigError, match="top_p 1.5 is out of range"):
        sampling_defaults("vllm", tmp_path, {"top_p": 1.5})
    # the bounds a request's own repetition_penalty has (a default outside them would refuse every request)
    with pytest.raises(GenerationConfigError, match="repetition_penalty 1e-300 is out of range"):
        sampling_defaults("vllm", tmp_path, {"repetition_penalty": 1e-300})
    with pytest.raises(GenerationConfigError, match="frequency_penalty 2.5 is out of range"):
        sampling_defaults("vllm", tmp_path, {"frequency_penalty": 2.5})  # OpenAI's [-2, 2], as a request's
    assert sampling_defaults("vllm", tmp_path, {"frequency_penalty": 1, "presence_penalty": -0.5}) == {
        "frequency_penalty": 1,
        "presence_penalty": -0.5,
    }
    with pytest.raises(GenerationConfigError, match="unknown key 'temprature'"):
        sampling_defaults("vllm", tmp_path, {"temprature": 0.5})
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path / "nowhere"), tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.2, "top_p": 0.9, "do_sample": True})
    )
    assert sampling_defaults("auto", tmp_path) == {"temperature": 0.2, "top_p": 0.9}
