"""Speculative decoding through the API on a tiny random model: the CLI flag reaches the engine, a request
may opt out with the same output, and /metrics shows acceptance."""

from __future__ import annotations

import re

import pytest

from motet.actors.system import ServingSystem
from motet.api.cli import build_parser, engine_config
from motet.api.state import ServerState
from motet.engine.llm_engine import LLMEngine
from tests.served_app import served_app


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir), "--num-kv-blocks", "128", "--speculative", "ngram"]
    )
    cfg = engine_config(args)
    assert cfg.speculative == "ngram"
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir), max_queue_len=16)
    with served_app(ServerState(system, ["tiny"])) as c:
        yield c


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def test_opt_out_gives_the_same_text_and_metrics_show_acceptance(client):
    body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    spec = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    m = client.get("/metrics").text
    drafted = metric(m, "motet_spec_draft_tokens")
    assert drafted > 0 and metric(m, "motet_spec_accepted_tokens") > 0
    assert (
        0 < metric(m, "motet_spec_acceptance_rate") <= 1 and metric(m, "motet_spec_mean_accepted_length") > 1
    )
    assert all(
        f'motet_spec_proposer_hit_rate{{proposer="{p}"}}' in m for p in ("ngram", "grammar", "history")
    )
    plain = client.post("/v1/completions", json={**body, "speculative": False}).json()["choices"][0]["text"]
    assert plain == spec
    assert metric(client.get("/metrics").text, "motet_spec_draft_tokens") == drafted  # it drafted nothing
