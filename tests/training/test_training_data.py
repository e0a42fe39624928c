"""Training files: OpenAI's formats checked line by line (each refusal names its line), examples tokenized as
serving renders a request (tools included) with the loss on the trained assistant turns only, OpenAI's `auto`
hyperparameters, and the fair order of queued jobs."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest

from motet.engine.tokenizer import load_tokenizer
from motet.grammar.structure import Structure, prompt_messages
from motet.grammar.tool_calls import ToolError, validate_tools
from motet.grammar.tool_formats import tool_format
from motet.training.chat_encoding import ChatEncoder
from motet.training.data_format import DataError, read_examples
from motet.training.dataset import prepare, read_rows
from motet.training.eval_file import eval_rows, same_answer
from motet.training.fair_queue import Queued, next_job
from motet.training.hyperparameters import HyperparameterError, auto_batch_size, auto_epochs, resolve

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "HI"}]}
PAIR = {"input": {"messages": [{"role": "user", "content": "hi"}]},
        "preferred_output": [{"role": "assistant", "content": "HI"}],
        "non_preferred_output": [{"role": "assistant", "content": "hi"}]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def read(text: bytes | str, method="supervised", max_bytes=1 << 20):
    data = text.encode() if isinstance(text, str) else text
    return list(read_examples(io.BytesIO(data), method, max_bytes, 1000))


def lines(*values) -> str:
    return "\n".join(v if isinstance(v, str) else json.dumps(v) for v in values)


@pytest.mark.parametrize(
    ("second", "says"),
    [
        ("{not json", "the line is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "the line is nested more than 64 levels deep"),
        ("[1, 2]", "expected a JSON object, got a list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": [{"role": "robot", "content": "hi"}, GOOD["messages"][1]]}, 'unknown role "robot"'),
        ({"messages": []}, "non-empty list"),
        ({"prompt": "x", "completion": "y"}, "unknown key `completion`"),
        ({"messages": [GOOD["messages"][0], {**GOOD["messages"][1], "weight": 2}]}, "weight must be 0 or 1"),
        ({"messages": [GOOD["messages"][0], {**GOOD["messages"][1], "weight": 0}]}, "weight 0"),
        ({"messages": [{"role": "user"}, GOOD["messages"][1]]}, "has no content"),
        ({**GOOD, "tools": [{"type": "retrieval"}]}, "tools"),
        (
            {
                "messages": [
                    GOOD["messages"][0],
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
                ]
            },
            "arguments is not valid JSON",
        ),  # fmt: skip
    ],
)
def test_a_bad_line_is_refused_naming_its_line(second, says):
    with pytest.raises(DataError) as e:
        read(lines(GOOD, second, GOOD))
    assert e.value.line == 2 and says in str(e.value) and str(e.value).startswith("Line 2: ")


LONE = "\ud800"  # valid JSON (an escape), not valid Unicode: no tokenizer encodes it
CALLED = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "weather", "arguments": json.dumps({"city": LONE})}}]}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "second", "field"),
    [
        ("supervised", {"messages": [{"role": "user", "content": LONE}, GOOD["messages"][1]]},
         "messages[0].content"),
        ("supervised", {"messages": [GOOD["messages"][0], {"role": "assistant", "content": [{"type": "text",
         "text": "a" + LONE}]}]}, "messages[1].content[0].text"),
        ("supervised", {**GOOD, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": LONE}}]},
         "tools[0].function.description"),
        ("supervised", {"messages": [GOOD["messages"][0], {"role": "assistant", "content": "x", LONE: 1}]},
         "messages[1]"),
        ("supervised", {"messages": [GOOD["messages"][0], CALLED, {"role": "tool", "tool_call_id": "c1",
         "content": "sunny"}, GOOD["messages"][1]], "tools": TOOLS},
         "messages[1].tool_calls[0].function.arguments holds invalid Unicode (a lone surrogate escape) at city"),
        ("dpo", {**PAIR, "preferred_output": [{"role": "assistant", "content": LONE}]},
         "preferred_output[0].content"),
        ("dpo", {**PAIR, "input": {"messages": [{"role": "user", "content": LONE}]}}, "input.messages[0].content"),
    ],
)  # fmt: skip
def test_text_that_is_not_valid_unicode_is_refused_naming_its_line_and_field(method, second, field):
    """As serving refuses it in a request body (motet/json_input.py's check): a lone surrogate escape parses,
    but the tokenizer cannot encode it (before, a TypeError out of the tokenizer: a 500)."""
    good = GOOD if method == "supervised" else PAIR
    data = (lines(good, second, good)).encode()
    with pytest.raises(DataError) as e:
        read(data, method)
    assert e.value.line == 2 and "invalid Unicode (a lone surrogate escape)" in str(e.value)
    assert field in str(e.value), str(e.value)


def calling(name: str, call_id: str = "c1", answered: str = "c1") -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
    return [GOOD["messages"][0], {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": answered, "content": "sunny"}, GOOD["messages"][1]]  # fmt: skip


@pytest.mark.parametrize("name", ["weather\n</tool_call>", "get weather", "w" * 65, ""])
def test_a_call_of_a_name_no_tool_can_have_is_refused(name):
    """A call's name follows a tool's name rule (motet/grammar/tool_calls.py check_name, which serving applies to
    `tools`): serving's own parser does not read such a call back from the text it is trained on."""
    with pytest.raises(ToolError):  # serving refuses a tool of that name
        validate_tools([{"type": "function", "function": {"name": name}}])
    with pytest.raises(DataError) as e:
        read(lines(GOOD, {"messages": calling(name)}))
    assert e.value.line == 2 and "messages[1].tool_calls[0].function.name" in str(e.value), str(e.value)
    pair = {**PAIR, "preferred_output": calling(name)[1:2]}
    with pytest.raises(DataError, match=r"preferred_output\[0\]\.tool_calls\[0\]\.function\.name"):
        read(lines(pair), "dpo")


def test_a_call_whose_name_holds_the_close_tag_is_read_back_as_text_by_serving():
    """The reference for the rule above, in the format the tiny models are served with (Hermes)."""
    fmt = tool_format(None, None)
    assert fmt.parse(fmt.calls_text([("weather", {})]))[1][0].name == "weather"
    content, calls = fmt.parse(fmt.calls_text([("weather\n</tool_call>", {})]))
    assert calls == [] and "</tool_call>" in content


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        (calling("weather", answered="c2"), 'messages[2].tool_call_id: "c2" answers no call (the calls before it: "c1")'),
        (calling("weather", call_id="c1", answered="c1")[:1] + calling("weather")[2:], "answers no call (no call"),
        ([*calling("weather")[:1], {"role": "tool", "tool_call_id": "c1", "content": "early"}, *calling("weather")[1:]],
         'messages[1].tool_call_id: "c1" answers no call (no call before it)'),
        ([{k: v for k, v in m.items() if k != "tool_call_id"} for m in calling("weather")],
         "messages[2]: a tool message needs the `tool_call_id`"),
    ],
)  # fmt: skip
def test_a_tool_message_answering_no_earlier_call_is_refused(messages, says):
    with pytest.raises(DataError) as e:
        read(lines(GOOD, {"messages": messages, "tools": TOOLS}))
    assert e.value.line == 2 and says in str(e.value), str(e.value)
    assert len(read(lines({"messages": calling("weather"), "tools": TOOLS}))) == 1  # the call answered


def test_a_line_longer_than_the_context_allows_is_refused_unparsed():
    with pytest.raises(DataError, match="Line 1: the line is longer than 100 bytes"):
        read(b'{"messages": "' + b"x" * (10 << 20) + b'"}', max_bytes=100)


def test_preference_pairs_are_checked():
    assert len(read(lines(PAIR, PAIR), "dpo")) == 2
    same = {**PAIR, "non_preferred_output": PAIR["preferred_output"]}
    with pytest.raises(DataError, match="Line 1: preferred_output and non_preferred_output are the same"):
        read(lines(same), "dpo")
    with pytest.raises(DataError, match="missing the `preferred_output` key"):
        read(lines({"input": PAIR["input"]}), "dpo")
    with pytest.raises(DataError, match="no examples"):
        read("\n\n", "dpo")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_tokens_are_what_serving_renders_with_tools_and_the_loss_covers_trained_turns(tokenizer, tmp_path):
    fmt = tool_format(None, tokenizer.hf.chat_template)
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "weight": 0},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    data = io.BytesIO(json.dumps({"messages": messages, "tools": TOOLS}).encode())
    (row,) = read_rows(prepare(data, "supervised", ChatEncoder(tokenizer, fmt, 1024), tmp_path / "rows").path)
    # serving's prompt for the conversation up to the trained answer (motet/grammar/structure.py, the chat route's)
    history = [{k: v for k, v in m.items() if k != "weight"} for m in messages[:3]]
    structure = Structure(tools=validate_tools(TOOLS), tool_format=fmt)
    rendered, kwargs = prompt_messages(history, structure, tokenizer.hf.chat_template)
    served_prompt = tokenizer.encode_chat(rendered, **kwargs)
    first_trained = row["assistant_masks"].index(1)
    assert row["input_ids"][:first_trained] == served_prompt
    answer = tokenizer.hf.decode(row["input_ids"][first_trained:])
    assert answer.startswith("It is sunny.<|im_end|>")  # the untrained call turn is context only
    assert sum(row["assistant_masks"]) == len(row["input_ids"]) - first_trained
    assert "<tool_call>" in tokenizer.hf.decode(row["input_ids"][:first_trained])


def test_an_example_past_the_context_is_refused(tokenizer, tmp_path):
    encoder = ChatEncoder(tokenizer, tool_format(None, tokenizer.hf.chat_template), 60)
    long = {"messages": [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(
        DataError, match=r"Line 2: the example is \d+ tokens long, more than the model's context"
    ):
        prepare(io.BytesIO(lines(GOOD, long).encode()), "supervised", encoder, tmp_path / "rows")
    assert not list(tmp_path.iterdir())  # nothing is left of a refused file


@pytest.mark.parametrize("result", [json.dumps({"sky": LONE}), "[" * 5000 + "]" * 5000])
def test_a_tool_result_the_prompt_cannot_hold_is_refused_naming_its_line(tokenizer, tmp_path, result):
    """A tool's result is text the line's check sees as text; the prompt shows JSON text as JSON
    (motet/grammar/tool_prompt.py decoded_json, as serving renders it): a lone surrogate escape inside was a
    TypeError out of the tokenizer, nesting past the parser's recursion a RecursionError (a 500 creating the job)."""
    encoder = ChatEncoder(tokenizer, tool_format(None, tokenizer.hf.chat_template), 1024)
    messages = calling("weather")
    messages[2]["content"] = result
    data = io.BytesIO(lines(GOOD, {"messages": messages, "tools": TOOLS}).encode())
    with pytest.raises(DataError) as e:
        prepare(data, "supervised", encoder, tmp_path / "rows")
    assert str(e.value).startswith("Line 2: Invalid 'messages[2].content': its JSON "), str(e.value)
    assert not list(tmp_path.iterdir())


def test_auto_hyperparameters_follow_openai():
    # OpenAI's cookbook: 3 epochs within 100 to 25,000 examples seen; batches of about 0.2%, 1 to 256 (but at
    # least a tenth of the examples up to 8)
    assert [auto_epochs(n) for n in (10, 33, 34, 200, 8334, 20_000)] == [10, 4, 3, 3, 2, 1]
    sizes = (9, 10, 40, 80, 200, 1000, 4000, 10_000, 500_000)
    assert [auto_batch_size(n) for n in sizes] == [1, 1, 4, 8, 8, 8, 8, 20, 256]
    h = resolve("dpo", {"n_epochs": "auto", "batch_size": 4}, 200, max_rank=16, modules=("q_proj", "v_proj"))
    assert (h.n_epochs, h.batch_size, h.learning_rate_multiplier, h.beta) == (3, 4, 1.0, 0.1)
    assert (h.lora_rank, h.lora_alpha, h.lora_target_modules) == (8, 16.0, ("q_proj", "v_proj"))


@pytest.mark.parametrize(
    ("given", "name"),
    [
        ({"n_epochs": 0}, "n_epochs"),
        ({"n_epochs": 51}, "n_epochs"),
        ({"n_epochs": "three"}, "n_epochs"),
        ({"n_epochs": 1.5}, "n_epochs"),
        ({"batch_size": True}, "batch_size"),
        ({"learning_rate_multiplier": 0}, "learning_rate_multiplier"),
        ({"learning_rate_multiplier": -1.0}, "learning_rate_multiplier"),
        ({"lora_rank": 64}, "lora_rank"),
        ({"lora_target_modules": ["lm_head"]}, "lora_target_modules"),
        ({"beta": 0.1}, "beta"),  # supervised has no beta
        ({"epochs": 3}, "epochs"),
    ],
)
def test_hyperparameters_out_of_range_or_of_the_wrong_type_are_refused(given, name):
    with pytest.raises(HyperparameterError) as e:
        resolve("supervised", given, 100, max_rank=16, modules=("q_proj", "v_proj"))
    assert e.value.name == name


NUMERIC = ("n_epochs", "batch_size", "learning_rate_multiplier", "lora_rank", "lora_alpha", "lora_dropout")


@pytest.mark.parametrize(
    ("method", "name"), [("supervised", n) for n in NUMERIC] + [("dpo", n) for n in (*NUMERIC, "beta")]
)
@pytest.mark.parametrize(
    "value", [10**400, -(10**400), 1e308, float("inf")], ids=["1e400", "-1e400", "1e308", "inf"]
)
def test_a_number_past_any_float_is_refused_naming_it(method, name, value):
    """JSON's integers have no bound (10**400 is a valid `n_epochs`), and none is within a hyperparameter's range."""
    with pytest.raises(HyperparameterError) as e:
        resolve(method, {name: value}, 100, max_rank=16, modules=("q_proj", "v_proj"))
    assert e.value.name == name and str(e.value).startswith(f"{name} must be")


def test_queued_jobs_take_turns_across_tenants():
    queued = [Queued("a1", "a", 1), Queued("a2", "a", 2), Queued("a3", "a", 3), Queued("b1", "b", 4)]
    started: dict[str, float] = {}
    order = []
    for clock in range(4):
        job = next_job(queued, Counter(), started)
        order.append(job.job_id)
        started[job.tenant] = clock
        queued.remove(job)
    assert order == ["a1", "b1", "a2", "a3"]
    running = Counter({"a": 1})  # a tenant with a job running waits behind one with none
    assert next_job([Queued("a4", "a", 5), Queued("c1", "c", 9)], running, {"c": 10}).job_id == "c1"
    assert next_job([], Counter(), {}) is None


def test_an_eval_file_keeps_each_examples_prompt_and_compares_answers_as_json(tokenizer):
    call = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}  # fmt: skip
    asked = {"role": "user", "content": "weather in Paris?"}
    data = lines(GOOD, {"messages": [asked, call], "tools": TOOLS}).encode()
    text_row, call_row = eval_rows(io.BytesIO(data), tokenizer, 1 << 20)
    assert text_row["messages"] == GOOD["messages"][:1] and call_row["messages"] == [asked]
    assert call_row["tools"] == [validate_tools(TOOLS)[0].openai_dict()]
    assert text_row["max_tokens"] == len(tokenizer.encode("HI")) + 8
    assert same_answer(text_row, {"role": "assistant", "content": " HI\n"})
    assert not same_answer(text_row, {"role": "assistant", "content": "HI THERE"})
    # the served message's arguments are a string of JSON written its own way: compared as values
    served = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "x", "type": "function", "function": {"name": "weather",
                                                                          "arguments": '{ "city":"Paris" }'}}]}  # fmt: skip
    assert same_answer(call_row, served)
    served["tool_calls"][0]["function"]["arguments"] = '{"city": "Lyon"}'
    assert not same_answer(call_row, served)
    with pytest.raises(DataError, match="Line 1: an eval example ends with the assistant message"):
        eval_rows(io.BytesIO(lines({"messages": [*GOOD["messages"], asked]}).encode()), tokenizer, 1 << 20)


def test_an_eval_file_refuses_text_that_is_not_valid_unicode(tokenizer):
    """Its prompts are sent as chat requests once the job has trained, which serving refuses (400): the file is
    refused when the job is created instead, naming the line and field."""
    bad = {"messages": [{"role": "user", "content": "a" + LONE}, GOOD["messages"][1]]}
    with pytest.raises(DataError) as e:
        eval_rows(io.BytesIO(lines(GOOD, bad).encode()), tokenizer, 1 << 20)
    assert e.value.line == 2 and "invalid Unicode (a lone surrogate escape) at messages[0].content" in str(
        e.value
    )
