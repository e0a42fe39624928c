"""Speculative decoding on the real default model, where drafts are accepted often (copied values, forced
keys, earlier outputs): greedy output with and without it is the same under JSON schemas and tool-call
grammars, with drafts from the history of earlier requests, and with `</think>` inside a draft window."""

from __future__ import annotations

import json

import pytest

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import JsonSchemaSpec, StructuralTagSpec
from motet.grammar.tool_calls import tool_call_structural_tag, validate_tools
from tests.grammar.test_tool_calls import bfcl_tool

pytestmark = pytest.mark.slow

DOC = (
    "Customer record 1042. The customer Dalia Silva wrote to us from Porto using the address "
    "dalia.silva@example.com. She ordered 3 packs of green tea, to be shipped to 12 Harbour Street, Porto."
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "email": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "email", "city"],
}
TOOLS = validate_tools(
    [bfcl_tool("send_email", "Send an email", to={"type": "string"}, subject={"type": "string"})]
)


@pytest.fixture(scope="module")
def engines(default_model_dir):
    off = LLM(str(default_model_dir), num_kv_blocks=512, speculative="off")
    on = LLM(str(default_model_dir), num_kv_blocks=512, speculative="ngram")
    return off, on


def test_grammars_greedy_equal_with_and_without_speculation(engines):
    off, on = engines
    chat = lambda text: off.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    cases = [
        (chat(f"{DOC}\n\nExtract the name, email and city as JSON."), JsonSchemaSpec(SCHEMA)),
        (
            chat(f"{DOC}\n\nEmail the customer that the tea has shipped."),
            StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=False)),
        ),
    ]
    for prompt, grammar in cases:
        params = SamplingParams(temperature=0, max_tokens=96, grammar=grammar)
        a, b = off.generate([prompt], params)[0], on.generate([prompt], params)[0]
        assert b.token_ids == a.token_ids and b.text == a.text
    stats = on.engine.stats().speculative
    assert stats.grammar_hits > 0 and stats.accepted_tokens > 0


def test_drafts_from_earlier_outputs_under_a_schema(engines):
    """Extractions from other documents teach the history the keys in the model's own tokenization; later
    extractions draft from it and still give the plain output."""
    off, on = engines
    chat = lambda text: off.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    people = [
        ("Alice Martin", "Lyon"),
        ("Bruno Okafor", "Osaka"),
        ("Chen Novak", "Porto"),
        ("Ivan Berg", "Turin"),
    ]
    params = SamplingParams(temperature=0, max_tokens=64, grammar=JsonSchemaSpec(SCHEMA))
    before = on.engine.stats().speculative.history_hits
    for name, city in people:
        email = name.lower().replace(" ", ".") + "@example.com"
        doc = f"The customer {name} wrote to us from {city} using the address {email}."
        prompt = chat(f"{doc}\n\nExtract the name, email and city as JSON.")
        a, b = off.generate([prompt], params)[0], on.generate([prompt], params)[0]
        assert b.token_ids == a.token_ids
        json.loads(b.text)
    assert on.engine.stats().speculative.history_hits > before


def test_think_end_inside_a_draft_window(engines):
    """The model copies a reasoning text and its JSON answer from the prompt, so prompt lookup drafts run
    across `</think>`: the constraint switches on at the right token and the output is the plain one."""
    off, on = engines
    tok = on.tokenizer.hf
    answer = 'The user wants the city. The city is Porto.</think>{"city": "Porto"}'
    prompt = tok.encode((answer + "\n") * 3 + answer[:10])
    grammar = JsonSchemaSpec(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    )
    params = SamplingParams(temperature=0, max_tokens=48, grammar=grammar, reasoning=True)
    windows = []  # (committed text, drafts' text) of every verified window
    forward_call = on.engine.forward_call  # every step's forward is made here, overlapped or not

    def spy(batch, *args, **kwargs):
        for seq in batch.seqs:
            if seq.draft_token_ids:
                windows.append((tok.decode(seq.output_token_ids), tok.decode(seq.draft_token_ids)))
        return forward_call(batch, *args, **kwargs)

    on.engine.forward_call = spy
    try:
        a, b = off.generate([prompt], params)[0], on.generate([prompt], params)[0]
    finally:
        del on.engine.forward_call
    assert b.token_ids == a.token_ids and b.text == a.text
    assert any("</think>" not in done and "</think>{" in done + drafts for done, drafts in windows), windows
    assert json.loads(b.text.split("</think>", 1)[1]) == {"city": "Porto"}
