"""What an agent's tool round trip needs from the Hermes format (fast tests; the OpenAI Agents SDK on the real model is
tests/api/test_agents_sdk.py): tool results shown as a `tool` turn, text that is no call returned as content as written
(markup a model copies from its prompt included; whole and streamed alike), and an output ending at a call that repeats
an earlier one."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from motet.engine.detokenizer import StopChain, StopStringMatcher
from motet.engine.llm import LLM
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import StructuralTagSpec
from motet.grammar.tool_call_parser import (
    RepeatedCallStop,
    ToolCall,
    parse_tool_calls,
)
from motet.grammar.tool_calls import tool_call_structural_tag, validate_tools
from motet.grammar.tool_prompt import render_messages, template_renders_role
from tests.grammar.test_reasoning_grammar import scripted
from tests.grammar.test_tool_calls import stream
from tests.tiny_models import CHAT_TEMPLATE

# ---------------------------------------------------------------------------------------------------
# The prompt: results in a tool turn that names the tool

CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
    },
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
HISTORY = [
    {"role": "user", "content": "Weather and time in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_a", "content": "Sunny.\nWarm."},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"hour": 9}'},
    {"role": "tool", "tool_call_id": "unknown", "content": "orphan"},
]
MISTRAL_TEMPLATE = (  # refuses any role but user and assistant, as Mistral-7B-Instruct-v0.1's does
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
DROPPING_TEMPLATE = "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"


def test_results_are_a_tool_turn_naming_the_tool():
    rendered = render_messages(HISTORY, [])
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool"]
    blocks = rendered[2]["content"].split("\n</tool_response>\n")
    assert all(b.startswith("<tool_response>\n") for b in blocks) and len(blocks) == 3
    bodies = [
        json.loads(b.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")) for b in blocks
    ]
    assert bodies == [
        {"name": "get_weather", "content": "Sunny.\nWarm."},
        {"name": "get_time", "content": {"hour": 9}},  # a JSON object is shown as one
        {"content": "orphan"},  # no call with that id: no name
    ]
    assert [m["role"] for m in render_messages(HISTORY, [], tool_role="user")] == [
        "user",
        "assistant",
        "user",
    ]


def test_tool_turn_only_where_the_template_writes_one(tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_models import build_tokenizer

    hf = build_tokenizer()
    assert template_renders_role(CHAT_TEMPLATE, "tool")  # ChatML writes any role
    assert not template_renders_role(MISTRAL_TEMPLATE, "tool")  # raises on it
    assert not template_renders_role(DROPPING_TEMPLATE, "tool")  # leaves it out
    assert not template_renders_role(None, "tool")
    # The probe agrees with how transformers renders the template.
    hf.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    for template, ok in ((CHAT_TEMPLATE, True), (MISTRAL_TEMPLATE, False)):
        tok.chat_template = template
        messages = render_messages(HISTORY[:3], [], tool_role="tool")
        try:
            text = tok.apply_chat_template(messages, tokenize=False)
        except Exception:
            text = None
        assert (text is not None and "tool\n<tool_response>" in text) == ok


# ---------------------------------------------------------------------------------------------------
# Content: whatever is no call, as the model wrote it (vLLM's Hermes parser: text without a call is the content)


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# What SmolLM2-135M-Instruct wrote after a tool result (issue 48): no call, so the whole of it is the answer.
ECHOED = (
    '<tool_response>\n{"name": "get_weather", "content": "The weather in Tokyo is sunny."}\n</tool_response>'
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (ECHOED, ECHOED, []),
        ("<tool_response>\nThe weather is sunny.\n</tool_response>\nIt is sunny.", None, []),
        ("It is sunny.\n<tool_response>\nmore", None, []),
        ("Sunny.</tool_call> Warm.</tool_response>", None, []),  # stray close tags
        # Around a call: the call is read, the rest is content as written.
        (call("f", "{}") + "\n" + ECHOED + "\nDone.", ECHOED + "\nDone.", [("f", "{}")]),
        ("<tool_response>x" + call("f", "{}") + "after", "<tool_response>xafter", [("f", "{}")]),
        ("<tool_call>not json</tool_call>", None, []),
        ("a <tool_response b", None, []),
    ],
)
def test_text_that_is_no_call_is_content(text, content, calls):
    content = content or text.strip()  # None: the whole output, as vLLM returns an output without calls
    assert parse_tool_calls(text) == (content, [ToolCall(*c) for c in calls])
    assert stream(text, list(range(1, len(text)))) == (content, calls)
    assert stream(text, []) == (content, calls)


def test_outputs_without_calls_are_their_content_whole_and_streamed():
    """vLLM's rule on random outputs of markup and text with no call block: the content is the output."""
    rng = random.Random(1)
    pieces = ["Sunny", " ", "\n", "<", "</", "<tool_response>", "</tool_response>", "<tool_resp", "</tool_call>",
              "<tool_", ECHOED]  # fmt: skip
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        want = text.strip() or None
        assert parse_tool_calls(text) == (want, [])
        for _ in range(4):
            cuts = rng.sample(range(len(text) + 1), rng.randint(0, min(16, len(text) + 1)))
            assert stream(text, cuts) == (want or "", []), (text, cuts)


# ---------------------------------------------------------------------------------------------------
# Repeated calls end the output


def cut_at_repeat(text: str) -> tuple[str, bool]:
    """The reference: the text up to the first call block equal to an earlier one, or a later block that is no
    JSON object between its tags (blocks as the parser delimits them: to `</tool_call>`, unless the next
    `<tool_call>` comes first)."""
    seen, pos = set(), 0
    while (begin := text.find("<tool_call>", pos)) >= 0:
        close = text.find("</tool_call>", begin + 1)
        reopen = text.find("<tool_call>", begin + 1)
        if close < 0 or 0 <= reopen < close:
            pos = reopen if reopen >= 0 else len(text)
            continue
        block = text[begin : close + len("</tool_call>")]
        try:
            whole = isinstance(json.loads(text[begin + len("<tool_call>") : close]), dict)
        except ValueError:
            whole = False
        if block in seen or seen and not whole:
            return text[:begin], True
        seen.add(block)
        pos = close + len("</tool_call>")
    return text, False


def run_stop(matcher, text: str, cuts: list[int]) -> tuple[str, bool]:
    out, prev = [], 0
    for cut in [*sorted(cuts), len(text)]:
        piece, stopped = matcher.feed(text[prev:cut])
        out.append(piece)
        prev = cut
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


A, B = call("get_weather", '{"city": "Tokyo"}'), call("get_weather", '{"city": "Osaka"}')
REPEATS = [
    A + "\n" + A + "\n" + A,
    "Let me check.\n" + A + "\n" + B + "\n" + A + " after",
    A + "\n" + A[:-3],  # a repeat cut short: no stop, everything released
    A + "\n" + A.replace("Tokyo", "Tokyo2"),
    A + "<tool_call>" + A,  # a block cut short by the next is no call
    A.replace("</tool_call>", "") + "\n" + A + "\n" + A,
    "no calls at all <tool_",
    # what SmolLM2 wrote for tool_choice "required": a second call ended from inside its argument string, the
    # model then writing on inside that string
    A
    + '\n<tool_call>\n{"name": "get_weather", "arguments": { "city": "}}\n</tool_call>\nYou can use the json',
    '<tool_call>\n{"name": "get_weather", "arguments": { "city": "}}\n</tool_call>\n' + A,  # first: released
]


@pytest.mark.parametrize("text", REPEATS)
def test_repeated_call_ends_the_output(text):
    want = cut_at_repeat(text)
    assert run_stop(RepeatedCallStop(), text, []) == want
    assert run_stop(RepeatedCallStop(), text, list(range(1, len(text)))) == want
    rng = random.Random(text)
    for _ in range(100):
        cuts = rng.sample(range(len(text) + 1), rng.randint(1, min(10, len(text) + 1)))
        assert run_stop(RepeatedCallStop(), text, cuts) == want


def test_a_later_call_is_held_until_whole():
    stop = RepeatedCallStop()
    assert stop.feed(A + "\n") == (A + "\n", False)  # the first call passes at once
    assert stop.feed(B[:30]) == ("", False)  # may be the same call again, or no call
    assert stop.feed(B[30:50]) == ("", False)  # differs, not whole yet
    assert stop.feed(B[50:] + "\n" + A) == (B + "\n", True)  # whole: released; then a repeat


def test_chained_with_stop_strings():
    text = A + "\nDone. STOP " + A
    chain = StopChain(StopStringMatcher(["STOP"]), RepeatedCallStop())
    assert run_stop(chain, text, [5, 40]) == (A + "\nDone. ", True)
    assert chain.matched == "STOP"
    chain = StopChain(StopStringMatcher(["never"]), RepeatedCallStop())
    assert run_stop(chain, text, [7]) == (A + "\nDone. STOP ", True)
    assert chain.matched is None


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Tokyo", "Osaka"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = validate_tools([{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}])


def test_engine_ends_a_required_output_at_its_repeated_call(tiny_model_dir):
    """A model that repeats its parallel call ends at the first repeat (its script would run to max_tokens)."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=1024, block_size=4, speculative="off")
    sampler = scripted(llm)
    spec = StructuralTagSpec(tool_call_structural_tag(TOOLS, "required", parallel=True))
    a = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
    b = a.replace("Tokyo", "Osaka")
    ids = {}
    for name, script in {"loop": "\n".join([a] * 6), "two": "\n".join([a, b, a, b])}.items():
        for stop in (False, True):
            params = SamplingParams(
                temperature=0, max_tokens=300, grammar=spec, stop_on_repeated_tool_call=stop
            )
            ids[name, stop] = llm.engine.add_request(llm.tokenizer.encode("Call."), params)
            sampler.scripts[ids[name, stop]] = script
    final, answers = {}, RequestOutputs()
    while len(final) < len(ids):
        final |= {o.request_id: o for o in answers.step(llm.engine) if o.finished}
    outs = {key: final[rid] for key, rid in ids.items()}
    assert outs["loop", False].finish_reason == "length"  # without: the calls go on to max_tokens
    assert (outs["loop", True].text, outs["loop", True].finish_reason) == (a + "\n", "stop")
    assert (outs["two", True].text, outs["two", True].finish_reason) == (a + "\n" + b + "\n", "stop")
    for out in outs.values():
        for c in parse_tool_calls(out.text)[1]:
            jsonschema.validate(json.loads(c.arguments), SCHEMA)
