"""The overlapped step (EngineConfig.overlap_output): a step's outputs are made while the next step runs.

Greedy tokens are checked against Hugging Face `generate`; the stream of outputs (deltas, stops, finish reasons,
logprobs) against the strictly sequential order of the same engine, which the rest of the suite checks against
references.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (1, 4, 9, 23)] + [[7, 8, 9] * 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("overlap"))


def engine(model_dir, overlap: bool, **kw) -> LLMEngine:
    cfg = dict(
        model=str(model_dir),
        num_kv_blocks=96,
        block_size=8,
        speculative="off",
        overlap_output="on" if overlap else "off",
    )
    return LLMEngine(EngineConfig(**{**cfg, **kw}), model_dir=model_dir)


def run(eng: LLMEngine, requests, abort_after: dict[str, int] | None = None) -> list[list[tuple]]:
    """Each step's outputs, as comparable tuples, until the engine drains."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(prompt, params, request_id=rid)
    steps, n, answers = [], 0, RequestOutputs()
    while eng.has_unfinished():
        n += 1
        for rid, at in (abort_after or {}).items():
            if n == at:
                eng.abort(rid)
        outs = answers.step(eng)
        steps.append(
            sorted(
                (
                    o.request_id,
                    o.delta,
                    tuple(o.token_ids),
                    o.finished,
                    o.finish_reason,
                    str(o.stop_reason),
                    tuple((lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs),
                )
                for o in outs
            )
        )
    return [s for s in steps if s]


def test_greedy_tokens_match_hugging_face(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    eng = engine(model_dir, overlap=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)}
    final = {}
    for step in run(eng, requests):
        for rid, _, tokens, finished, *_ in step:
            if finished:
                final[rid] = list(tokens)
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert final[f"r{i}"] == ref[0, len(prompt) :].tolist()
    assert not eng.in_flight and eng.block_manager.num_used_blocks == 0


def mixed_requests() -> dict:
    return {
        "plain": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=9)),
        "stops": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop=["a", "e", "o"])),
        "stop_ids": (
            PROMPTS[2],
            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=list(range(100, 132))),
        ),
        "min": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=7, min_tokens=5, logprobs=2)),
        "seeded": (PROMPTS[4], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=11)),
        "long": (list(range(40, 100)), SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)),
    }


def test_outputs_are_the_sequential_order_s(model_dir):
    sequential = run(engine(model_dir, overlap=False), mixed_requests())
    overlapped = run(engine(model_dir, overlap=True), mixed_requests())
    assert overlapped == sequential
    finished = {o[0]: o for step in overlapped for o in step if o[3]}
    assert set(finished) == set(mixed_requests())
    # a stop string and a stop id did end rows
    assert finished["stops"][4] == finished["stop_ids"][4] == "stop"


def test_abort_while_a_step_is_in_flight(model_dir):
    eng = engine(model_dir, overlap=True)
    # aborted just before the 4th step() call, while the third step (launched by the 3rd call) is on the device
    steps = run(eng, mixed_requests(), abort_after={"long": 4, "seeded": 4})
    reference = run(engine(model_dir, overlap=False), mixed_requests(), abort_after={"long": 4, "seeded": 4})
    others = lambda steps: [o for s in steps for o in s if o[0] not in ("long", "seeded")]  # noqa: E731
    assert others(steps) == others(reference)
    assert not any(o[3] for s in steps for o in s if o[0] in ("long", "seeded"))  # no output after the abort
    assert not eng.has_unfinished() and eng.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "make_requests", [lambda: mixed_requests(), lambda: plain_requests()], ids=["mixed", "plain"]
)
def test_abort_while_the_launched_step_reads_its_rows(model_dir, caplog, make_requests):
    """An abort that arrives while the forward thread is still preparing the launched step (the serving layer's
    disconnects land there): the row's blocks and adapter stay its own until the step lands, then go back. With
    plain requests the steps are scheduled ahead of the landing ones."""
    eng = engine(model_dir, overlap=True)
    gate, prepared, original = threading.Event(), threading.Event(), eng.runner.execute

    def held(step, lora, on_launch=None, lazy=False, mask=None, inputs=None):
        if gate.is_set():
            return original(step, lora, on_launch, lazy, mask, inputs)
        on_launch()  # step() returns: the engine's thread goes on while this step waits at the gate
        gate.wait()
        return original(step, lora, prepared.set, lazy, mask, inputs)

    eng.runner.execute = held
    gate.set()
    requests = make_requests()
    for rid, (prompt, params) in requests.items():
        eng.add_request(prompt, params, request_id=rid)
    answers = RequestOutputs()
    outputs = [answers.step(eng) for _ in range(3)]
    gate.clear()
    outputs.append(
        answers.step(eng)
    )  # launches a step that waits at the gate, before reading any block table
    seq = eng.requests["long"]
    table, used = list(seq.block_table), eng.block_manager.num_used_blocks
    assert eng.abort("long")
    assert seq.block_table == table and eng.block_manager.num_used_blocks == used  # still the step's
    gate.set()
    prepared.wait()  # (as step() does: the engine goes on once the step's inputs are built)
    while eng.has_unfinished():
        outputs.append(answers.step(eng))
    assert "failed" not in caplog.text
    assert eng.block_manager.num_used_blocks == 0 and not eng.stepping._aborted
    done = {o.request_id: o for step in outputs for o in step if o.finished}
    reference = run(engine(model_dir, overlap=False), make_requests(), abort_after={"long": 5})
    expected = {o[0]: o for step in reference for o in step if o[3]}
    assert "long" not in done and set(done) == set(expected)
    assert all(tuple(done[r].token_ids) == expected[r][2] for r in done)
    # the prefix cache holds only what was computed: the aborted prompt again gives the reference's tokens
    again = run(eng, {"long": requests["long"]})
    ref_again = run(engine(model_dir, overlap=False), {"long": requests["long"]})
    assert again == ref_again


def plain_requests() -> dict:
    """Requests whose steps may be scheduled before the step before lands (EngineConfig.async_scheduling)."""
    long = list(range(40, 100))
    return {
        "greedy": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)),
        # ends on a stop id: the step already scheduled after it computes a token that is dropped
        "stop_ids": (
            PROMPTS[2],
            SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(range(100, 132))),
        ),
        "logprobs": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True)),
        "long": (long, SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)),
        "shares_prefix": (
            long[:48] + [5, 6, 7],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        ),
    }


def streams(steps) -> dict[str, list[tuple]]:
    """Each request's outputs in order (which step() call returns them may differ)."""
    out: dict[str, list[tuple]] = {}
    for step in steps:
        for o in step:
            out.setdefault(o[0], []).append(o[1:])
    return out


def test_async_scheduling_gives_the_sequential_outputs(model_dir):
    sequential = run(engine(model_dir, overlap=False), plain_requests())
    eng = engine(model_dir, overlap=True)
    ahead = run(eng, plain_requests())
    assert eng.num_steps_ahead > len(ahead) // 2  # most steps were launched before the one before landed
    assert streams(ahead) == streams(sequential)
    finished = {o[0]: o for step in ahead for o in step if o[3]}
    assert finished["stop_ids"][4] == "stop" and finished["greedy"][4] == "length"
    assert not eng.in_flight and eng.block_manager.num_used_blocks == 0
    # what the prefix cache took in while steps ran ahead is what was computed: a prompt matching it gives the
    # reference's tokens
    again = {"again": (plain_requests()["long"][0] + [9, 9], SamplingParams(temperature=0, max_tokens=8))}
    hits = eng.block_manager.prefix_hits
    assert streams(run(eng, again)) == streams(run(engine(model_dir, overlap=False), again))
    assert eng.block_manager.prefix_hits > hits


def test_async_scheduling_under_preemption(model_dir):
    """A pool too small for every row: the steps scheduled ahead preempt rows whose tokens are still pending."""
    small = dict(num_kv_blocks=13)
    sequential = run(engine(model_dir, overlap=False, **small), plain_requests())
    eng = engine(model_dir, overlap=True, **small)
    ahead = run(eng, plain_requests())
    assert eng.scheduler.num_preemptions > 0 and eng.num_steps_ahead > 0
    final = lambda steps: {o[0]: o[2:5] for s in steps for o in s if o[3]}  # noqa: E731
    assert final(ahead) == final(sequential)
    assert eng.block_manager.num_used_blocks == 0


# A JSON schema the tiny model's greedy and seeded answers end within a few dozen tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Berlin"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


def sampler_requests() -> dict:
    """Requests whose sampling reads their output so far (penalties, bad_words, min_tokens, a seed's draw) or whose
    ending reads their text (stop strings), beside plain ones."""
    return {
        "rep": (
            PROMPTS[0],
            SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        ),
        "freq": (
            PROMPTS[2],
            SamplingParams(
                temperature=0, max_tokens=20, frequency_penalty=0.8, presence_penalty=0.5, ignore_eos=True
            ),
        ),
        # ".." is the tiny tokenizer's [16, 16], "isis" [273, 273]: tokens their plain answers repeat
        "bad_words": (
            PROMPTS[2],
            SamplingParams(temperature=0, max_tokens=14, bad_words=["..", "isis"], ignore_eos=True),
        ),
        "min": (PROMPTS[4], SamplingParams(temperature=0, max_tokens=12, min_tokens=9)),
        "seeded": (PROMPTS[4], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14)),
        "stops": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, stop=["a", "e", "o"])),
        "plain": (PROMPTS[3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
    }


def grammar_requests() -> dict:
    """Requests constrained by a JSON schema, greedy and seeded, beside plain ones."""
    from motet.grammar.specs import JsonSchemaSpec

    return {
        "json": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, grammar=JsonSchemaSpec(SCHEMA))),
        "json_seeded": (
            PROMPTS[3],
            SamplingParams(temperature=0.8, seed=3, max_tokens=40, grammar=JsonSchemaSpec(SCHEMA)),
        ),
        "json_penalized": (
            PROMPTS[2],
            SamplingParams(
                temperature=0, max_tokens=40, frequency_penalty=0.5, grammar=JsonSchemaSpec(SCHEMA)
            ),
        ),
        "plain": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    }


@pytest.mark.parametrize("make_requests", [sampler_requests, grammar_requests], ids=["sampler", "grammar"])
def test_rows_the_sampler_or_a_grammar_reads_are_scheduled_ahead(model_dir, make_requests):
    """Penalties, bad_words, min_tokens and a seed's draw count a row's pending token where it is (on the device);
    a grammar's mask of a step scheduled ahead is filled once the step before lands, while the step runs; a row a
    stop string or its grammar ends drops the token its next step computed: those steps are scheduled ahead, and
    the outputs are the sequential engine's."""
    import jsonschema

    sequential = run(engine(model_dir, overlap=False), make_requests())
    eng = engine(model_dir, overlap=True)
    ahead = run(eng, make_requests())
    assert eng.num_steps_ahead > len(ahead) // 2
    assert streams(ahead) == streams(sequential)
    finished = {o[0]: o for step in ahead for o in step if o[3]}
    assert set(finished) == set(make_requests())
    text = {rid: "".join(o[0] for o in outs) for rid, outs in streams(ahead).items()}
    for rid in [r for r in finished if r.startswith("json")]:  # (a grammar's answer, whole and the schema's)
        assert finished[rid][4] == "stop"
        jsonschema.validate(json.loads(text[rid]), SCHEMA)
    if "bad_words" in finished:  # (the banned sequences never appear, the plain answer had them)
        tokens = finished["bad_words"][2]
        assert not any(tokens[i : i + 2] in ((16, 16), (273, 273)) for i in range(len(tokens) - 1))
    assert not eng.in_flight and eng.block_manager.num_used_blocks == 0


def test_rows_whose_next_step_needs_their_token_wait_for_it(model_dir):
    """A grammar whose phase moves with the output's text (a reasoning format: its mask's kind and whether the stop
    tokens are held follow the text) and jump-forward (tokens the grammar forces come before the next sampled one)
    need the landed token: the next step waits for it. So does every step with async scheduling off."""
    from motet.grammar.specs import JsonSchemaSpec

    reasoning = SamplingParams(
        temperature=0, max_tokens=12, reasoning="deepseek_r1", grammar=JsonSchemaSpec(SCHEMA)
    )
    thinks = {"reasoning": (PROMPTS[1], reasoning)}  # (DeepSeek-R1's output starts inside its reasoning)
    eng = engine(model_dir, overlap=True)
    steps = run(eng, thinks)
    assert eng.num_steps_ahead == 0
    assert streams(steps) == streams(run(engine(model_dir, overlap=False), thinks))
    jumps = {"json": grammar_requests()["json"]}
    eng = engine(model_dir, overlap=True, jump_forward=True)
    steps = run(eng, jumps)
    assert eng.num_steps_ahead == 0
    assert streams(steps) == streams(run(engine(model_dir, overlap=False, jump_forward=True), jumps))
    eng = engine(model_dir, overlap=True, async_scheduling=False)
    run(eng, plain_requests())
    assert eng.num_steps_ahead == 0


def test_close_waits_for_the_launched_step(model_dir):
    eng = engine(model_dir, overlap=True)
    eng.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=30), request_id="r")
    eng.step()
    assert eng.in_flight
    eng.close()
    assert eng.stepping._inflight[1].done()


def test_flush_commits_the_launched_step_before_steps_by_hand(model_dir):
    eng = engine(model_dir, overlap=True)
    eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), request_id="r")
    eng.step()
    with pytest.raises(RuntimeError, match="in flight"):
        eng.schedule()  # the launched step's tokens are not appended yet
    (out,) = eng.flush()
    assert len(out.token_ids) == 1 and not eng.in_flight  # (a delta: the step's one new token)
    while eng.has_unfinished():  # by hand, as benchmarks drive it
        batch = eng.schedule()
        eng.commit(batch, eng.execute(batch))
    assert len(eng.requests) == 0


def test_auto_overlaps_where_a_core_is_spare(model_dir, monkeypatch):
    """ "auto": on CUDA, or where the CPU has more cores than the forward pass's threads; never on a CPU whose
    every core runs the forward pass (the outputs' Python would take one from it)."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert not engine(
        model_dir, overlap=False, overlap_output="auto", num_threads=2, device="cpu"
    )._overlaps()
    assert engine(model_dir, overlap=False, overlap_output="auto", num_threads=1, device="cpu")._overlaps()
    assert engine(model_dir, overlap=False, overlap_output="on", num_threads=2)._overlaps()
    if torch.cuda.is_available():  # the host's Python never takes the device's place
        assert engine(
            model_dir, overlap=False, overlap_output="auto", num_threads=2, device="cuda"
        )._overlaps()
    with pytest.raises(ValueError, match="overlap_output"):
        EngineConfig(overlap_output="yes")


@pytest.mark.parametrize(
    "make_requests", [lambda: mixed_requests(), lambda: plain_requests()], ids=["mixed", "plain"]
)
def test_the_forward_thread_is_given_values_only(model_dir, monkeypatch, caplog, make_requests):
    """The overlapped engine's forward thread reads nothing of the engine's step state: each launch hands it one
    ForwardCall (the runner, the step's plan, its LoRA segments, its grammar mask, its inputs), none of whose fields is
    the engine, the scheduler's batch or a live Sequence, and whose plan holds values only. A row failing in the
    forward pass is still found (bisected on the engine's thread as its step lands): the others' outputs are the
    sequential engine's, the steps scheduled before the failing one landed (which ran without its tokens) run
    again once it has."""
    from motet.engine.core.scheduler import ScheduledBatch
    from motet.engine.core.sequence import Sequence
    from motet.engine.worker.model_runner import ForwardCall, ModelRunner

    eng = engine(model_dir, overlap=True)
    submitted = []
    submit = eng.stepping._thread.submit

    def record(fn, *args, **kw):
        submitted.append((fn, args, kw))
        return submit(fn, *args, **kw)

    monkeypatch.setattr(eng.stepping._thread, "submit", record)
    broken = []  # the request whose row raises in the forward pass
    execute = ModelRunner.execute

    def failing(self, step, *args, **kw):
        if any(row.request_id in broken for row in step):
            raise RuntimeError("this row's forward pass failed")
        return execute(self, step, *args, **kw)

    monkeypatch.setattr(ModelRunner, "execute", failing)
    requests = make_requests()
    broken.append("long")
    steps = run(eng, requests)
    assert submitted
    for fn, args, kw in submitted:
        call = fn.__self__
        assert isinstance(call, ForwardCall) and fn.__func__ is ForwardCall.run
        fields = [call.runner, call.step, call.lora, call.mask, call.inputs, *args, *kw.values()]
        assert not any(isinstance(f, (LLMEngine, ScheduledBatch, Sequence)) for f in fields)
        assert not any(isinstance(getattr(row, f.name), (LLMEngine, ScheduledBatch, Sequence))
                       for row in call.step for f in dataclasses.fields(row))  # fmt: skip
    assert "request long failed in the forward pass" in caplog.text
    reference = run(engine(model_dir, overlap=False), make_requests())
    others = lambda steps: [o for s in steps for o in s if o[0] != "long"]  # noqa: E731
    assert others(steps) == others(reference)
