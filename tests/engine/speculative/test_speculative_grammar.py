"""Speculative decoding under grammars on a tiny random model: JSON schemas and tool calls give the plain
engine's greedy output (the grammar's forced tokens and prompt lookup both drafting), and the bitmask at
every draft position is the one the plain path would apply there, also when `</think>` sits inside the
draft window."""

from __future__ import annotations

import json

import pytest
import torch

from motet.engine.detokenizer import IncrementalDetokenizer
from motet.engine.guided import GuidedDecoding
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.speculative.grammar_drafts import activation_index, check_drafts, fill_draft_bitmask
from motet.grammar.backend import allocate_bitmask
from motet.grammar.specs import JsonSchemaSpec, StructuralTagSpec
from motet.grammar.tool_calls import tool_call_structural_tag, validate_tools
from tests.engine.speculative.test_speculative import pair
from tests.grammar.test_tool_calls import bfcl_tool

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tokens": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tokens", "ok"],
}
TOOLS = validate_tools([bfcl_tool("add", "Add two numbers", a={"type": "integer"}, b={"type": "integer"})])


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return pair(tiny_model_dir)


def prompts(llm: LLM) -> list[list[int]]:
    texts = [
        '{"name": "motet", "tokens": [1, 2, 3], "ok": true} ' * 2,
        "def add(a, b):\n    return a + b\n",
        "x",
    ]
    return [llm.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_json_schema_greedy_is_the_plain_engines(engines, backend):
    off, on = engines
    params = SamplingParams(
        temperature=0, max_tokens=48, grammar=JsonSchemaSpec(SCHEMA), grammar_backend=backend
    )
    before = on.engine.stats().speculative
    plain, spec = off.generate(prompts(off), params), on.generate(prompts(on), params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    after = on.engine.stats().speculative
    assert after.accepted_tokens > before.accepted_tokens
    if backend == "xgrammar":  # outlines finds no forced strings; its drafts are prompt lookup's
        assert after.grammar_hits > before.grammar_hits
    for out in spec:
        if out.finish_reason == "stop":
            json.loads(out.text)


def test_history_drafts_under_a_grammar_are_the_plain_engines(tiny_model_dir):
    """The second round of requests drafts from the first round's outputs, walked under the grammar."""
    off, on = pair(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=48, grammar=JsonSchemaSpec(SCHEMA))
    texts = ["a", "b", "c", "d"]
    for round_ in (texts[:2], texts[2:]):
        ids = [on.tokenizer.encode(t) for t in round_]
        plain, spec = off.generate(ids, params), on.generate(ids, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert on.engine.stats().speculative.history_hits > 0


def test_tool_call_grammar_greedy_is_the_plain_engines(engines):
    off, on = engines
    tag = StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=False))
    for reasoning in (False, True):
        params = SamplingParams(temperature=0, max_tokens=60, grammar=tag, reasoning=reasoning)
        plain, spec = off.generate(prompts(off), params), on.generate(prompts(on), params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert on.engine.stats().speculative.accepted_tokens > 0


@pytest.mark.parametrize(
    "draft_text", ['hmm</think>{"name": "a", "tokens": [1]', '</think>{"na', "plain thinking"]
)
def test_draft_masks_are_the_plain_paths_masks(engines, draft_text):
    """Position j of a draft window is masked as the plain path masks the token after drafts[:j]: not at all
    before `</think>` has appeared, then by the matcher advanced through the drafts since."""
    _, on = engines
    engine = on.engine
    grammar = engine.compile_grammar(JsonSchemaSpec(SCHEMA))
    hf = engine.tokenizer.hf
    prompt = hf.encode("Think first. ")
    drafts = hf.encode(draft_text)
    vocab = engine.model_config.vocab_size

    detok = IncrementalDetokenizer(hf, prompt)
    guided = GuidedDecoding(
        grammar.matcher(), engine.reasoning_opening_of(("<think>",)), reasoning_started=True, peek=detok.peek
    )
    first = activation_index(guided, drafts)
    assert check_drafts(guided, drafts, first) == drafts  # valid JSON after </think>: all kept
    spec = allocate_bitmask(len(drafts) + 1, vocab)
    fill_draft_bitmask(spec, guided, drafts, first, 0)

    # The plain path: token by token, masking where the constraint is on, then accepting and observing.
    ref_guided, ref_detok = (
        GuidedDecoding(grammar.matcher(), engine.reasoning_opening_of(("<think>",)), reasoning_started=True),
        IncrementalDetokenizer(hf, prompt),
    )
    ref = allocate_bitmask(len(drafts) + 1, vocab)
    masked = []
    for j in range(len(drafts) + 1):
        if ref_guided.active:
            ref_guided.matcher.fill_bitmask(ref, j)
            masked.append(j)
        if j < len(drafts):
            assert ref_guided.accept(drafts[j])
            ref_guided.observe_text(ref_detok.push(drafts[j]))
    assert masked == list(range(first, len(drafts) + 1))
    assert torch.equal(spec[masked], ref[masked])
    assert ("</think>" in draft_text) == bool(masked)
    # The matcher is back where it was: the engine's commit advances it by the accepted tokens only.
    again = allocate_bitmask(1, vocab)
    fresh = allocate_bitmask(1, vocab)
    guided.matcher.fill_bitmask(again, 0)
    grammar.matcher().fill_bitmask(fresh, 0)
    assert torch.equal(again, fresh) and not guided.active
