"""The engine's output is deltas only (motet/engine/outputs.py): each step's new tokens, logprobs and text, held to
transformers' greedy tokens and its tokenizer's text; merged or accumulated, they are the whole answer."""

from __future__ import annotations

import pickle

import torch
from transformers import AutoTokenizer

from motet.actors.serving_errors import EngineFailure
from motet.engine.llm import LLM
from motet.engine.outputs import OutputDelta, RequestOutputs
from motet.engine.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 9]
N = 6


def test_a_step_gives_only_what_is_new(tiny_model_dir, tiny_hf_model):
    expected = tiny_hf_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False
    )[0, len(PROMPT) :].tolist()
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(expected, skip_special_tokens=True)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, speculative="off")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    rid = engine.add_request(PROMPT, params)
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == rid]
    assert [d.token_ids for d in deltas] == [[t] for t in expected]  # one new token a step, no more
    assert [[lp.token_id for lp in d.logprobs] for d in deltas] == [[t] for t in expected]
    assert "".join(d.text for d in deltas) == text
    # prompt logprobs once, with the first delta: one per prompt token after the first
    assert len(deltas[0].prompt_logprobs) == len(PROMPT) - 1
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert [d.finished for d in deltas] == [False] * (N - 1) + [True]
    assert deltas[-1].finish_reason == "length" and deltas[-1].timings is not None
    assert all(d.timings is None for d in deltas[:-1])

    # a slow reader's merged delta, and the accumulated answer, are the whole output
    merged = OutputDelta.merge(deltas)
    assert (merged.token_ids, merged.text, merged.finish_reason) == (expected, text, "length")
    assert merged.prompt_logprobs == deltas[0].prompt_logprobs and merged.timings == deltas[-1].timings
    answers = RequestOutputs()
    answers.track(rid, PROMPT)
    (answer,) = answers.add([merged])
    (offline,) = llm.generate([PROMPT], params)
    for out in (answer, offline):
        assert (out.prompt_token_ids, out.token_ids, out.text, out.finished) == (PROMPT, expected, text, True)
        assert [lp.token_id for lp in out.logprobs] == expected
        assert len(out.prompt_logprobs) == len(PROMPT) - 1


def test_a_delta_crosses_a_process_boundary_unchanged():
    """Under Ray (motet/cluster/) a replica's deltas are pickled to the ingress: the record comes back whole, a
    failure's ServingError with it."""
    delta = OutputDelta("r", "ab", [1, 2], finished=True, finish_reason="stop", num_cached_tokens=16)
    assert pickle.loads(pickle.dumps(delta)) == delta
    failed = pickle.loads(pickle.dumps(OutputDelta("r", finished=True, error=EngineFailure("boom"))))
    assert isinstance(failed.error, EngineFailure) and str(failed.error) == "boom" and failed.last
