"""A row with no distribution to sample from (NaN logits from corrupt weights, logits a sampling parameter made
overflow, every token masked) samples no token: it fails alone with an error naming the cause, the sampler never
returns a token outside the vocabulary, and its neighbours in the step get the tokens they get without it.
Parameters that could only ever do this are refused when the request is checked (the HTTP 400s are in
tests/api/test_api_hardening.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.core.scheduler import ScheduledBatch
from motet.engine.core.sequence import Sequence
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.request_checks import RequestError, RequestLimits
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.rows import RunnerRows, SampleView, position_views
from motet.engine.worker.sampler import Sampler, SamplingFailure, outcome_error
from motet.grammar.specs import RegexSpec
from tests.engine.test_engine import hf_greedy
from tests.tiny_models import build_tiny_model

EOS = 1
GOOD_PROMPT, BAD_PROMPT, NAN_TOKEN = [5, 6, 8], [5, 6, 7], 299


def seq(prompt=(5, 6, 7), **params) -> SampleView:
    """The sampler's view of a sequence's next token, made as the runner makes it from a step's plan."""
    batch = ScheduledBatch([Sequence(list(prompt), SamplingParams(**params))], [1])
    return position_views(batch.plan()[0], RunnerRows().update(batch.plan())[0])[0]


# -- the sampler ----------------------------------------------------------------------------------------------
def test_rows_without_a_distribution_sample_no_token_and_their_neighbours_do():
    torch.manual_seed(0)
    V = 50
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS])
    logits = torch.randn(6, V)
    logits[:, [5, 6, 7]] = 20.0  # the prompt's tokens, seen: a penalty divides their positive logits
    logits[1, 9] = float("nan")  # corrupt weights
    logits[3, 11] = float("inf")
    overflow = seq(temperature=0.7)
    overflow.params.repetition_penalty = 1e-40  # (past validation: the sampler must be safe anyway)
    masked = seq(temperature=0.7, allowed_token_ids=[3, 4], stop_token_ids=[3, 4])
    masked.params.min_tokens = 2
    seqs = [seq(temperature=0), seq(temperature=0.7), seq(temperature=1.0, seed=3), seq(temperature=0), overflow,
            masked]  # fmt: skip
    out = sampler(logits, seqs)
    assert all(0 <= t < V for t in out.tokens.tolist())  # what a step launched after this one may read
    F = SamplingFailure
    want = [None, F.MODEL_NOT_FINITE, None, F.MODEL_NOT_FINITE, F.PARAMS_NOT_FINITE, F.ALL_MASKED]
    assert [e and e.failure for e in map(outcome_error, out.token_ids)] == want
    assert out.token_ids[0] == int(logits[0].argmax())
    alone = sampler(logits[2:3], seqs[2:3]).token_ids[0]  # a seeded row draws the same beside failing rows
    assert out.token_ids[2] == alone and 0 <= alone < V


# -- the engine -----------------------------------------------------------------------------------------------
def run(engine: LLMEngine, requests: dict, tamper=None) -> dict:
    """Add each (prompt, params) under its name and step to the end: name -> its last output. `tamper`: name ->
    what to do to that request's params once the engine took it (past the request checks)."""
    ids = {name: engine.add_request(prompt, params) for name, (prompt, params) in requests.items()}
    for name, fn in (tamper or {}).items():
        fn(engine.requests[ids[name]].params)
    last, answers = {}, RequestOutputs()
    while engine.has_unfinished():
        for o in answers.step(engine):
            last[o.request_id] = o
    return {name: last[rid] for name, rid in ids.items()}


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def overflowing(params: SamplingParams) -> None:
    params.repetition_penalty = 1e-40  # validation refuses it now: this is the sampler's own safety


def all_masked(params: SamplingParams) -> None:
    params.allowed_token_ids = params.stop_token_ids = [3, 4]
    params.min_tokens = 2  # (likewise refused by the request checks)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "bad, message", [(overflowing, "made its logits overflow"), (all_masked, "every token is masked")]
)
def test_a_row_that_samples_nothing_fails_alone(tiny_model_dir, tiny_hf_model, overlap, bad, message):
    cfg = EngineConfig(
        model=str(tiny_model_dir), block_size=8, num_kv_blocks=64, overlap_output="on" if overlap else "off"
    )
    engine = LLMEngine(cfg, model_dir=tiny_model_dir)
    try:
        sampled = SamplingParams(temperature=0.7, max_tokens=4)
        out = run(engine, {"bad": (BAD_PROMPT, sampled), "good": (GOOD_PROMPT, GREEDY)}, {"bad": bad})
        assert (
            out["bad"].finish_reason == "abort" and message in out["bad"].error and not out["bad"].token_ids
        )
        assert out["good"].finish_reason == "length" and out["good"].error is None
        assert out["good"].token_ids == hf_greedy(tiny_hf_model, GOOD_PROMPT, 4)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()


@pytest.mark.parametrize("speculative", ["ngram", "off"])
def test_a_grammar_whose_next_tokens_min_tokens_all_bans_ends_matching(tiny_model_dir, speculative):
    """Not a failure: the output matches the grammar so far and ends there (with speculation the grammar's forced
    token is a draft, verified beside the position that has nothing left: the draft lands, then the row ends)."""
    cfg = EngineConfig(model=str(tiny_model_dir), block_size=8, num_kv_blocks=64, speculative=speculative)
    engine = LLMEngine(cfg, model_dir=tiny_model_dir)
    try:
        for temperature in (0, 0.7):
            params = SamplingParams(
                temperature=temperature, max_tokens=8, min_tokens=6, grammar=RegexSpec("ab")
            )
            out = run(engine, {"r": (BAD_PROMPT, params)})["r"]
            assert (out.finish_reason, out.text, out.error) == ("stop", "ab", None)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def nan_model_dir(tmp_path_factory):
    """A tiny checkpoint whose embedding of one token is NaN: any request that reads it has NaN logits."""
    path = build_tiny_model(tmp_path_factory.mktemp("nan-weights"), tied=False)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_nan_weights_fail_only_the_requests_they_reach(nan_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(nan_model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(
        EngineConfig(model=str(nan_model_dir), block_size=8, num_kv_blocks=8), model_dir=nan_model_dir
    )
    try:
        sampled = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True)
        out = run(engine, {"greedy": ([5, NAN_TOKEN, 7], GREEDY), "sampled": ([6, NAN_TOKEN], sampled),
                           "good": (GOOD_PROMPT, GREEDY)})  # fmt: skip
        for name in ("greedy", "sampled"):
            assert out[name].finish_reason == "abort" and "not finite" in out[name].error, out[name]
        assert out["good"].token_ids == hf_greedy(hf, GOOD_PROMPT, 4)
        # the failed requests' KV blocks go back to the pool and serve the next requests
        after = run(engine, {f"next{i}": ([9, 10 + i, 11], GREEDY) for i in range(3)})
        assert [o.token_ids for o in after.values()] == [hf_greedy(hf, [9, 10 + i, 11], 4) for i in range(3)]
    finally:
        engine.close()


# -- what the request checks refuse ---------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 0.09, 0.0, 10.5])
def test_repetition_penalty_out_of_range_names_it(penalty):
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.1, 10.0\]"):
        SamplingParams(repetition_penalty=penalty)
    SamplingParams(repetition_penalty=0.1)
    SamplingParams(repetition_penalty=10)


def test_allowed_tokens_that_min_tokens_or_bad_words_all_ban_are_refused():
    limits = RequestLimits(vocab_size=100, max_model_len=64, max_kv_tokens=64, eos_token_ids=frozenset({2}))

    def check(**params):
        limits.check_params(SamplingParams(max_tokens=8, **params))

    for params in (
        dict(allowed_token_ids=[3, 4], stop_token_ids=[3, 4], min_tokens=2),
        dict(allowed_token_ids=[2], min_tokens=1, ignore_eos=True),  # min_tokens bans EOS even then
        dict(allowed_token_ids=[2, 3], stop_token_ids=[3], min_tokens=1),
    ):
        with pytest.raises(RequestError, match="min_tokens") as e:
            check(**params)
        assert e.value.param == "allowed_token_ids"
    with pytest.raises(RequestError, match="bad_words"):  # a one-token bad word is banned everywhere
        limits.check_params(SamplingParams(allowed_token_ids=[7], bad_words=["x"], bad_words_token_ids=[[7]]))
    check(allowed_token_ids=[3, 4], stop_token_ids=[3, 4])  # no minimum: a stop token may come first
    check(allowed_token_ids=[3, 4, 5], stop_token_ids=[3, 4], min_tokens=2)  # 5 until the minimum
    check(allowed_token_ids=[7, 8], bad_words=["x"], bad_words_token_ids=[[7], [9, 8]])
