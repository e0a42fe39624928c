"""Speculative decoding on the real default model, where drafts are accepted often (copied values, forced
keys): greedy output with and without it is the same under JSON schemas and tool-call grammars."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from grammar.specs import JsonSchemaSpec, StructuralTagSpec
from grammar.tool_calls import tool_call_structural_tag, validate_tools

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
    [
        {
            "name": "send_email",
            "description": "Send an email",
            "parameters": {
                "type": "dict",
                "properties": {"to": {"type": "string"}, "subject": {"type": "string"}},
                "required": ["to", "subject"],
            },
        }
    ]
)


def test_grammars_greedy_equal_with_and_without_speculation(default_model_dir):
    off = LLM(str(default_model_dir), num_kv_blocks=512, speculative="off")
    on = LLM(str(default_model_dir), num_kv_blocks=512, speculative="ngram")
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
