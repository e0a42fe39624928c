"""Grammar-constrained generation in the engine, on the real default model.

Outputs are checked against references (jsonschema, Python's `re`), and constrained requests are run
beside unconstrained ones, adapters, preemption and the prefix cache to show they do not disturb each
other.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import ChoiceSpec, JsonSchemaSpec, RegexSpec, StructuralTagSpec
from motet.grammar.tool_call_parser import parse_tool_calls
from motet.grammar.tool_calls import tool_call_structural_tag, validate_tools
from tests.grammar.test_tool_calls import bfcl_tool

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "city"],
}
UNIT = {"type": "string", "enum": ["c", "f"]}
TOOLS = validate_tools(
    [bfcl_tool("get_weather", "Current weather of a city", city={"type": "string"}, unit=UNIT)]
)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), num_kv_blocks=512)


def prompts(llm, n: int, what: str = "Describe person number {i} as JSON.") -> list[list[int]]:
    return [llm.tokenizer.encode_chat([{"role": "user", "content": what.format(i=i)}]) for i in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 64), **kw)


def test_constrained_and_free_rows_in_one_batch(llm):
    ps = prompts(llm, 8)
    params = [greedy(grammar=JsonSchemaSpec(PERSON)) if i % 2 == 0 else greedy() for i in range(8)]
    mixed = llm.generate(ps, params)
    free_alone = llm.generate(ps[1::2], greedy())
    for i, out in enumerate(mixed):
        if i % 2 == 0:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), PERSON)
        else:  # unconstrained rows are left alone by the masks of their neighbours
            assert out.token_ids == free_alone[i // 2].token_ids
    # Seeded sampling under a grammar is still reproducible inside a different batch.
    seeded = greedy(grammar=JsonSchemaSpec(PERSON), seed=7)
    seeded.temperature = 0.9
    a = llm.generate(ps[:1], seeded)[0]
    b = llm.generate(ps[:3], [seeded, greedy(), greedy()])[0]
    assert a.token_ids == b.token_ids
    jsonschema.validate(json.loads(a.text), PERSON)


def test_regex_choice_and_sampling_follow_the_grammar(llm):
    ps = prompts(llm, 6, "Give me code number {i}.")
    pattern = r"[A-Z]{2}-[0-9]{3,5}"
    outs = llm.generate(
        ps,
        [
            SamplingParams(temperature=1.0, seed=i, max_tokens=16, grammar=RegexSpec(pattern))
            for i in range(6)
        ],
    )
    for out in outs:
        assert re.fullmatch(pattern, out.text), out.text
    choices = ("yes", "no", "maybe later")
    for out in llm.generate(ps, greedy(grammar=ChoiceSpec(choices), max_tokens=8)):
        assert out.text in choices


def test_preempted_constrained_requests_finish_as_with_ample_memory(default_model_dir, llm):
    ps = prompts(llm, 8)
    params = greedy(grammar=JsonSchemaSpec(PERSON), max_tokens=48)
    ample = llm.generate(ps, params)
    small = LLM(str(default_model_dir), num_kv_blocks=12, block_size=16)
    tight = small.generate(ps, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


def test_grammar_with_lora_adapters_in_the_same_batch(llm, tmp_path):
    from motet.evals.lora_bench import write_random_adapter

    path = write_random_adapter(tmp_path / "a", llm.engine.model_config, rank=8, seed=3)
    llm.add_lora("rand", path)
    ps = prompts(llm, 4)
    json_params = greedy(grammar=JsonSchemaSpec(PERSON), max_tokens=40)
    params = [json_params, greedy(max_tokens=8), json_params, greedy(max_tokens=8)]
    adapters = ["rand", "rand", None, None]
    outs = llm.generate(ps, params, adapters=adapters)
    for i in (0, 2):
        jsonschema.validate(json.loads(outs[i].text), PERSON)
    alone = llm.generate(ps[:1], params[0], adapters=["rand"])[0]
    assert alone.token_ids == outs[0].token_ids


def test_prefix_cache_serves_constrained_requests(llm):
    p = llm.tokenizer.encode_chat(
        [
            {"role": "system", "content": "You write JSON. " * 40},
            {"role": "user", "content": "A person, please."},
        ]
    )
    first, second = llm.generate([p, p], greedy(grammar=JsonSchemaSpec(PERSON)))
    again = llm.generate([p], greedy(grammar=JsonSchemaSpec(PERSON)))[0]
    assert again.num_cached_tokens >= len(p) - 16  # every full block of the prompt
    assert again.token_ids == first.token_ids == second.token_ids


def test_tool_call_grammar_and_jump_forward(default_model_dir, llm):
    tag = StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=False))
    ps = prompts(llm, 4, "What is the weather in city number {i}?")
    jump = LLM(str(default_model_dir), num_kv_blocks=256, jump_forward=True)
    before = jump.engine.stats().grammar.jump_forward_tokens
    outs = jump.generate(ps, greedy(grammar=tag, max_tokens=60))
    stats = jump.engine.stats().grammar
    assert stats.jump_forward_tokens - before >= 4 * 8  # the '<tool_call>\n{"name": ...' opening
    for out in outs:
        content, calls = parse_tool_calls(out.text)
        assert content is None and len(calls) == 1 and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0].parameters)

    for out in llm.generate(ps, greedy(grammar=tag, max_tokens=60)):  # the default: no jump-forward
        _, calls = parse_tool_calls(out.text)
        jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0].parameters)
    assert llm.engine.stats().grammar.jump_forward_tokens == 0
