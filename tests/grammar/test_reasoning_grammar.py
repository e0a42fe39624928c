"""Grammars under a reasoning parser: the content (the text after `</think>`, or the whole output when it does not
open `<think>`) always matches the grammar, checked with jsonschema and the tool-call parser.

A scripted sampler stands in for a model that wants to write a given text: at each step it takes, among the
tokens the engine's mask allows, the longest one that continues the script (else the tiny model's own greedy
choice), so both paths are forced through the real engine: the mask, the commit, jump-forward, speculation."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from motet.engine.llm import LLM
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.rows import PENDING
from motet.grammar.reasoning import REASONING_START, THINK, ReasoningOpening
from motet.grammar.specs import JsonSchemaSpec, StructuralTagSpec
from motet.grammar.tool_call_parser import parse_tool_calls
from motet.grammar.tool_calls import tool_call_structural_tag, validate_tools
from tests.engine.speculative.test_speculative import pair

SCHEMA = {  # no free strings: the tiny tokenizer's odd byte tokens would make them unreadable, not invalid
    "type": "object",
    "properties": {"name": {"enum": ["ab", "cd", "ef", "x"]}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
TOOLS = validate_tools([{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}])
CALL = '<tool_call>\n{"name": "f", "arguments": {"name": "ab", "ok": true}}\n</tool_call>'


class ScriptedSampler:
    """Wraps the engine's sampler: biases each scripted row towards the allowed token that continues its
    script the furthest (the logits it gets are already masked by the grammar).

    An overlapped engine (`LLMEngine._overlaps`: a core the forward pass leaves spare, as where an earlier test set
    torch to one thread) may plan a row before its previous token lands: that token is `PENDING` in its view. The
    rows are greedy, so the sampler knows it: its own last picks (the argmax of the logits it biased)."""

    def __init__(self, inner, hf, vocab_size: int):
        self.inner, self.hf = inner, hf
        self.texts = [hf.decode([t]) for t in range(vocab_size)]
        self.scripts: dict[str, str] = {}
        self.picks: dict[str, list[int]] = {}

    def output_so_far(self, seq) -> list[int]:
        ids, picks = list(seq.output_token_ids), self.picks.setdefault(seq.request_id, [])
        pending = [k for k, t in enumerate(ids) if t == PENDING]
        for k, pick in zip(pending, picks[len(picks) - len(pending) :], strict=True):
            ids[k] = pick
        return ids

    def __call__(self, logits, seqs):
        for i, seq in enumerate(seqs):
            script = self.scripts.get(seq.request_id)
            if script is None:
                continue
            done = self.hf.decode(self.output_so_far(seq))
            rest = script[len(done) :] if script.startswith(done) else ""
            allowed = (logits[i, : len(self.texts)] > float("-inf")).nonzero().flatten().tolist()
            fits = [t for t in allowed if self.texts[t] and rest.startswith(self.texts[t])]
            if fits:
                logits[i, max(fits, key=lambda t: len(self.texts[t]))] = 1e4
            self.picks[seq.request_id].append(int(logits[i].argmax()))
        return self.inner(logits, seqs)


def scripted(llm: LLM) -> ScriptedSampler:
    runner = llm.engine.runner
    if not isinstance(runner.sampler, ScriptedSampler):
        runner.sampler = ScriptedSampler(runner.sampler, llm.tokenizer.hf, llm.engine.model_config.vocab_size)
    return runner.sampler


def run_scripts(llm: LLM, scripts: list[str], spec, max_tokens: int = 48) -> list:
    sampler = scripted(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, grammar=spec, reasoning=True)
    ids = [llm.engine.add_request(llm.tokenizer.encode("Answer. "), params) for _ in scripts]
    sampler.scripts.update(zip(ids, scripts, strict=True))
    final, answers = {}, RequestOutputs()
    while len(final) < len(ids):
        for out in answers.step(llm.engine):
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "jump-forward"])
def llm(request, tiny_model_dir):
    return LLM(
        str(tiny_model_dir), num_kv_blocks=256, block_size=4, speculative="off", jump_forward=request.param
    )


def content_of(text: str) -> tuple[str | None, str]:
    return THINK.split(text, started=False)


def test_json_schema_holds_whether_or_not_the_output_thinks(llm):
    answer = '{"name": "ab", "ok": true}'
    scripts = [
        f"<think>Let me see.</think>{answer}",  # reasons, then answers
        answer,  # answers at once
        'Sure.</think>{"name": "cd", "ok": false}',  # no <think>: a later </think> must not lift the grammar
        "<thinking is fun",  # a partial <think> then something else: only <think> may follow "<th"
    ]
    thinks, direct, sneaky, partial = run_scripts(llm, scripts, JsonSchemaSpec(SCHEMA))

    assert content_of(thinks.text) == ("Let me see.", answer)
    assert content_of(direct.text) == (None, answer)
    reasoning, content = content_of(
        sneaky.text
    )  # the grammar holds from the first token: it cannot say "Sure."
    assert reasoning is None and sneaky.finish_reason == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)
    assert partial.text.startswith(REASONING_START)  # "<th" could only become <think>: it reasons


def test_tool_calls_holds_whether_or_not_the_output_thinks(llm):
    """ "<" may open both `<think>` and `<tool_call>`: the mask allows both until one of them is ruled out."""
    spec = StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=False))
    scripts = [f"<think>I will call f.</think>{CALL}", CALL, "I will call f."]
    thinks, direct, talks = run_scripts(llm, scripts, spec, max_tokens=160)
    assert content_of(thinks.text) == ("I will call f.", CALL)
    assert content_of(direct.text) == (None, CALL)
    for out in (thinks, direct, talks):
        assert out.finish_reason == "stop"
        content, calls = parse_tool_calls(content_of(out.text)[1])
        assert content is None and len(calls) == 1 and calls[0].name == "f"
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


def test_sampled_outputs_validate(tiny_model_dir):
    """The tiny random model sampled freely: whatever its first tokens, every finished content validates."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, speculative="off")
    params = [
        SamplingParams(temperature=1.0, max_tokens=48, seed=s, grammar=JsonSchemaSpec(SCHEMA), reasoning=True)
        for s in range(12)
    ]
    outs = llm.generate([llm.tokenizer.encode("x")] * len(params), params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    for out in finished:
        reasoning, content = content_of(out.text)
        jsonschema.validate(json.loads(content), SCHEMA)


def test_speculation_gives_the_plain_engines_output(tiny_model_dir):
    """A reasoning row gets no drafts while its start is undecided, then drafts as usual: greedy outputs equal
    the plain engine's."""
    off, on = pair(tiny_model_dir)
    texts = ['{"name": "ab", "ok": true} ' * 2, "<think> x", "x"]
    for spec in (
        JsonSchemaSpec(SCHEMA),
        StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=True)),
    ):
        params = SamplingParams(temperature=0, max_tokens=40, grammar=spec, reasoning=True)
        plain = off.generate([off.tokenizer.encode(t) for t in texts], params)
        spec_ = on.generate([on.tokenizer.encode(t) for t in texts], params)
        assert [o.token_ids for o in spec_] == [o.token_ids for o in plain]


def test_prompt_that_opened_think_waits_for_its_end(tiny_model_dir):
    """A template that already wrote `<think>` (DeepSeek-R1's): the output starts inside the reasoning."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, speculative="off")
    sampler = scripted(llm)
    params = SamplingParams(temperature=0, max_tokens=48, grammar=JsonSchemaSpec(SCHEMA), reasoning=True)
    rid = llm.engine.add_request(llm.tokenizer.encode("Answer. <think>\n"), params)
    sampler.scripts[rid] = 'Free text.</think>{"name": "x", "ok": true}'
    out, answers = None, RequestOutputs()
    while out is None or not out.finished:
        out = next((o for o in answers.step(llm.engine) if o.request_id == rid), out)
    assert THINK.split(out.text, started=True) == ("Free text.", '{"name": "x", "ok": true}')


def test_reasoning_opening_tokens(tiny_model_dir):
    """Against the tokenizer's own decoding: the tokens that continue `<think>` from each progress."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, speculative="off")
    hf = llm.tokenizer.hf
    opening = ReasoningOpening(llm.engine.grammar_tokenizer.decoded_vocab)
    special = set(hf.all_special_ids)
    for k in range(len(REASONING_START)):
        want = set()
        for t in range(len(hf)):
            text = REASONING_START[:k] + hf.decode([t])
            if (
                t not in special
                and len(text) > k
                and (REASONING_START.startswith(text) or text.startswith(REASONING_START))
            ):
                want.add(t)
        assert set(opening.tokens(REASONING_START[:k].encode())) == want, k
        assert want  # the byte-level vocabulary spells <think> from any point


@pytest.mark.parametrize(
    "fmt, script, sneaky",
    [
        (  # DeepSeek-R1: the output begins inside its reasoning, with no <think> written
            "deepseek_r1",
            'Free text.</think>{"name": "x", "ok": true}',
            "Free text.</think>Sure.",
        ),
        (
            "granite",
            'Here is my thought process: Free text. Here is my response:{"name": "x", "ok": true}',
            "Here is my thought process: Free text. Here is my response: Sure.",
        ),
        (  # GPT-OSS: the answer (the final channel) is what the grammar holds, as vLLM's gate does
            "openai_gptoss",
            '<|channel|>analysis<|message|>Free text.<|end|><|start|>assistant<|channel|>final<|message|>{"name": "x", '
            '"ok": true}',
            "<|channel|>analysis<|message|>Free text.<|end|><|start|>assistant<|channel|>final<|message|>Sure.",
        ),
    ],
)
def test_each_format_holds_its_content(tiny_model_dir, fmt, script, sneaky):
    """The formats' reasoning is free, their content (after the format's end) follows the grammar: a script that
    writes JSON there is kept, one that writes text there is held to JSON."""
    from motet.grammar.reasoning import reasoning_format

    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=4, speculative="off")
    sampler = scripted(llm)
    params = SamplingParams(temperature=0, max_tokens=120, grammar=JsonSchemaSpec(SCHEMA), reasoning=fmt)
    ids = [llm.engine.add_request(llm.tokenizer.encode("Answer. "), params) for _ in (script, sneaky)]
    sampler.scripts.update(zip(ids, (script, sneaky), strict=True))
    final, answers = {}, RequestOutputs()
    while len(final) < len(ids):
        for out in answers.step(llm.engine):
            if out.finished:
                final[out.request_id] = out
    kept, held = final[ids[0]], final[ids[1]]
    assert kept.text == script and kept.finish_reason == "stop"
    split = reasoning_format(fmt).split
    for out in (kept, held):
        reasoning, content = split(out.text)
        assert reasoning is not None and "Free text." in reasoning
        jsonschema.validate(json.loads(content), SCHEMA)


def test_reasoning_opening_tokens_of_two_tags(tiny_model_dir):
    """Granite's two spellings of its opening ("Here is" / "Here's"): against the tokenizer's own decoding, the
    tokens that continue either from what is written, and which of them complete one."""
    from motet.grammar.reasoning import GRANITE

    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, speculative="off")
    hf = llm.tokenizer.hf
    opening = ReasoningOpening(llm.engine.grammar_tokenizer.decoded_vocab, GRANITE.starts)
    special = set(hf.all_special_ids)
    texts = {t: hf.decode([t]) for t in range(len(hf)) if t not in special}
    for written in ("", "Here", "Here'", "Here is my thought", "Here's my thought process"):
        want, completing = set(), set()
        for t, piece in texts.items():
            text = written + piece
            if len(text) > len(written):
                if any(tag.startswith(text) for tag in GRANITE.starts):
                    want.add(t)
                if any(text.startswith(tag) for tag in GRANITE.starts):
                    want.add(t)
                    completing.add(t)
        assert set(opening.tokens(written.encode())) == want, written
        assert {t for t in want if opening.complete(opening.advance(written.encode(), t))} == completing, (
            written
        )
        assert want


# ---------------------------------------------------------------------------------------------------
# A forced call's reasoning is bounded (SamplingParams.bound_reasoning)

REQUIRED = StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=False))
ENDLESS = "and so on " * 20  # a thought that never ends (200 tokens)


def the_call(text: str, started: bool = False):
    """The one call of an output's content (after its reasoning), checked against the tool's schema."""
    reasoning, content = THINK.split(text, started)
    rest, calls = parse_tool_calls(content)
    assert rest is None and len(calls) == 1 and calls[0].name == "f", text
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    return reasoning


def tokens_to_end(hf, token_ids: list[int]) -> int:
    """How many output tokens it took to write `</think>`."""
    return next(i + 1 for i in range(len(token_ids)) if "</think>" in hf.decode(token_ids[: i + 1]))


def test_forced_call_ends_a_reasoning_that_would_not(llm):
    """A model that reasons on and on writes no call (without a bound: to max_tokens); bounded, its reasoning is
    cut at half of max_tokens by a forced `</think>`, then the grammar holds the call. A reasoning that ends in
    time is left as the model wrote it; a prompt that opened `<think>` is bounded alike."""
    # 200 tokens: half for the reasoning, the rest for `</think>` and the call (the model picks its whitespace)
    free = SamplingParams(temperature=0, max_tokens=200, grammar=REQUIRED, reasoning=True)
    bounded = dataclasses.replace(free, bound_reasoning=True)
    in_time = f"<think>I will call f.</think>{CALL}"
    runs = [  # (prompt, script, params): one batch
        ("Answer. ", "<think>" + ENDLESS, free),
        ("Answer. ", "<think>" + ENDLESS, bounded),
        ("Answer. ", in_time, bounded),
        ("Answer. <think>\n", ENDLESS, bounded),
    ]
    sampler = scripted(llm)
    ids = []
    for prompt, script, params in runs:
        ids.append(llm.engine.add_request(llm.tokenizer.encode(prompt), params))
        sampler.scripts[ids[-1]] = script
    final, answers = {}, RequestOutputs()
    while len(final) < len(ids):
        final |= {o.request_id: o for o in answers.step(llm.engine) if o.finished}
    endless, cut, kept, opened = (final[i] for i in ids)

    assert endless.finish_reason == "length" and parse_tool_calls(content_of(endless.text)[1])[1] == []
    assert kept.text == in_time and kept.finish_reason == "stop"
    hf = llm.tokenizer.hf
    for out, started in ((cut, False), (opened, True)):
        assert out.finish_reason == "stop"
        assert ENDLESS.startswith(the_call(out.text, started))  # the reasoning as written, up to the cut
        assert tokens_to_end(hf, out.token_ids) <= 100 + len("</think>")  # one token a character at worst
    assert tokens_to_end(hf, cut.token_ids) > 100  # cut at the budget, not before


def test_bounded_reasoning_under_speculation(tiny_model_dir):
    """The random model reasoning freely from a prompt that opened `<think>`: its end forced, then its call; drafts
    never cross the forced end, so greedy outputs equal the plain engine's."""
    off, on = pair(tiny_model_dir)
    params = SamplingParams(
        temperature=0, max_tokens=200, grammar=REQUIRED, reasoning=True, bound_reasoning=True
    )
    prompts = ["<think>", "x y <think>"]
    plain = off.generate([off.tokenizer.encode(p) for p in prompts], params)
    spec_ = on.generate([on.tokenizer.encode(p) for p in prompts], params)
    assert [o.token_ids for o in spec_] == [o.token_ids for o in plain]
    for out in plain:
        assert out.finish_reason == "stop"
        the_call(out.text, started=True)
