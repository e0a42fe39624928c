"""The routes clients reach for beyond chat, each with the client that calls it, against a real `motet serve` on
a tiny random model: `client.models.retrieve`, `client.responses.input_items.list` (the openai SDK), and vLLM's
/tokenize, /detokenize (token ids checked against the HF tokenizer), /version and /ping (`requests`).
"""

from __future__ import annotations

from importlib.metadata import version

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.live_server import Server, keys_file
from tests.peft_adapters import make_adapter

MODEL = "tiny"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-routes")
    srv = Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys_file(tmp, KEYS),
        "--data-dir", str(tmp / "data"), "--threads", "1", "--max-model-len", "1024", "--max-num-seqs", "4",
        start_timeout=120,
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def sdk(server: Server, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def post(server: Server, path: str, body: dict, key: str | None = "sk-alice") -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- models.retrieve ---------------------------------------------------------------------------------------------
def test_models_retrieve_returns_what_the_list_lists(server, tiny_model_dir, tmp_path):
    alice, bob = sdk(server), sdk(server, "sk-bob")
    adapter = make_adapter(tiny_model_dir, tmp_path / "a1", seed=1)
    files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir()) if p.is_file()]
    r = requests.post(f"{server.url}/v1/adapters", data={"name": "a1"}, files=files,
                      headers={"Authorization": "Bearer sk-alice"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text

    listed = {m.id: m for m in alice.models.list()}
    assert set(listed) == {MODEL, "a1"}
    for model_id, card in listed.items():
        assert alice.models.retrieve(model_id) == card  # the SDK's Model objects, field for field

    for client, missing in ((bob, "a1"), (alice, "nope"), (alice, "org/nope")):  # bob's view has no a1
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(missing)
        assert e.value.status_code == 404
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        sdk(server, "sk-nobody").models.retrieve(MODEL)


# -- responses.input_items.list -------------------------------------------------------------------------------
def test_input_items_list_the_conversation_the_model_saw(server):
    alice = sdk(server)
    r1 = alice.responses.create(model=MODEL, input="first question", instructions="be brief",
                                max_output_tokens=6, temperature=0)  # fmt: skip
    r2 = alice.responses.create(
        model=MODEL,
        previous_response_id=r1.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "second question"}]}],
        max_output_tokens=6,
        temperature=0,
    )

    page = alice.responses.input_items.list(r2.id)  # OpenAI's default order: newest first
    assert page.object == "list" and page.has_more is False
    assert [type(i).__name__ for i in page.data] == [
        "ResponseInputMessageItem", "ResponseOutputMessage", "ResponseInputMessageItem",
    ]  # fmt: skip
    newest, answer, oldest = page.data
    assert newest.content[0].text == "second question" and newest.role == "user"
    assert answer.content[0].text == r1.output_text and answer.role == "assistant"  # r1's own output
    assert oldest.content[0].text == "first question"
    assert page.first_id == newest.id and page.last_id == oldest.id

    asc = alice.responses.input_items.list(r2.id, order="asc")
    assert [i.id for i in asc.data] == [i.id for i in reversed(page.data)]
    paged = list(alice.responses.input_items.list(r2.id, limit=1))  # the SDK follows `after` page by page
    assert [i.id for i in paged] == [i.id for i in page.data]
    after = alice.responses.input_items.list(r2.id, after=newest.id)
    assert [i.id for i in after.data] == [answer.id, oldest.id]

    first = alice.responses.input_items.list(r1.id)
    assert [i.content[0].text for i in first.data] == ["first question"]
    assert first.data[0].id == oldest.id  # the same item, the same id, from either response

    assert answer.id == r1.output[0].id  # r1's output item, as r1 returned it

    alice.responses.delete(r1.id)  # r2 continues from r1: its conversation still reads whole
    texts = [i.content[0].text for i in alice.responses.input_items.list(r2.id).data]
    assert texts == ["second question", r1.output_text, "first question"]
    with pytest.raises(openai.NotFoundError):
        alice.responses.input_items.list(r1.id)


def test_input_items_with_tool_calls(server):
    alice = sdk(server)
    tool = {"type": "function", "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}  # fmt: skip
    r1 = alice.responses.create(model=MODEL, input="add 1", tools=[tool], tool_choice="required",
                                max_tool_calls=1, max_output_tokens=40, temperature=0)  # fmt: skip
    (call,) = [item for item in r1.output if item.type == "function_call"]
    r2 = alice.responses.create(
        model=MODEL,
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "2"}],
        max_output_tokens=4,
    )
    items = alice.responses.input_items.list(r2.id, order="asc").data
    assert [type(i).__name__ for i in items] == [
        "ResponseInputMessageItem", "ResponseFunctionToolCallItem", "ResponseFunctionToolCallOutputItem",
    ]  # fmt: skip
    assert (items[1].id, items[1].call_id, items[1].arguments) == (call.id, call.call_id, call.arguments)
    assert (items[2].call_id, items[2].output) == (call.call_id, "2")


def test_input_items_scoped_to_the_tenant_and_refusing_what_it_cannot_honour(server):
    alice, bob = sdk(server), sdk(server, "sk-bob")
    r = alice.responses.create(model=MODEL, input="hello", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):  # another tenant's response reads as missing
        bob.responses.input_items.list(r.id)
    for kwargs, param in (({"include": ["message.output_text.logprobs"]}, "include"), ({"limit": 0}, "limit"),
                          ({"limit": 101}, "limit"), ({"after": "msg_nope"}, "after")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            alice.responses.input_items.list(r.id, **kwargs)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.input_items.list(r.id, extra_query={"before": "x"})
    assert e.value.body["param"] == "before"


# -- /tokenize, /detokenize ---------------------------------------------------------------------------------------
def test_tokenize_completion_form_matches_hf(server, hf_tokenizer):
    prompt = "Paris is the capital of France; Ünïcödé 東京 🎵"
    for add_special in (True, False):
        r = post(server, "/tokenize", {"model": MODEL, "prompt": prompt, "add_special_tokens": add_special,
                                       "return_token_strs": True})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        ids = hf_tokenizer.encode(prompt, add_special_tokens=add_special)
        assert body == {
            "count": len(ids),
            "max_model_len": 1024,
            "tokens": ids,
            "token_strs": hf_tokenizer.convert_ids_to_tokens(ids),
        }
    assert post(server, "/tokenize", {"prompt": prompt}).json()["token_strs"] is None  # model is optional


def test_tokenize_chat_form_matches_hf_and_the_chat_route(server, hf_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2?"}]
    for add_generation_prompt in (True, False):
        r = post(server, "/tokenize", {"model": MODEL, "messages": messages,
                                       "add_generation_prompt": add_generation_prompt})  # fmt: skip
        assert r.status_code == 200, r.text
        expected = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        assert r.json()["tokens"] == list(expected)

    prefill = [*messages, {"role": "assistant", "content": "The answer is"}]
    r = post(server, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                   "continue_final_message": True})  # fmt: skip
    text = hf_tokenizer.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    assert r.json()["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(r.json()["tokens"]).endswith("The answer is")

    # With tools (this template has no tool format: they are written into the prompt as the chat route
    # does), the count is the prompt the chat route gives the model.
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
    counted = post(server, "/tokenize", {"messages": messages, "tools": tools}).json()["count"]
    chat = sdk(server).chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=1)
    assert counted == chat.usage.prompt_tokens


def test_detokenize_matches_hf(server, hf_tokenizer):
    ids = hf_tokenizer.encode("<|im_start|>user\nThe quick brown fox 🎶<|im_end|>", add_special_tokens=False)
    r = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf_tokenizer.decode(ids, skip_special_tokens=False)}
    round_trip = post(server, "/tokenize", {"prompt": r.json()["prompt"], "add_special_tokens": False})
    assert round_trip.json()["tokens"] == ids


def test_tokenize_errors(server):
    assert error(post(server, "/detokenize", {"tokens": [0, 10**6]}), 400)["param"] == "tokens"
    assert error(post(server, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens"
    assert error(post(server, "/detokenize", {"tokens": ["1"]}), 400)["param"] == "tokens.0"
    assert error(post(server, "/tokenize", {"prompt": "x", "nope": 1}), 400)["param"] == "nope"
    assert error(post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                            "chat_template": "{{ 1 }}"}), 400)["param"] == "chat_template"  # fmt: skip
    assert error(post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                            "continue_final_message": True}), 400)["param"] == "continue_final_message"  # fmt: skip
    assert error(post(server, "/tokenize", {"model": "nope", "prompt": "x"}), 404)["param"] == "model"
    assert error(post(server, "/tokenize", {"prompt": "x"}, key=None), 401)["code"] == "invalid_api_key"
    assert error(post(server, "/detokenize", {"tokens": [1]}, key="sk-nobody"), 401)


# -- /version, /ping ----------------------------------------------------------------------------------------------
def test_version_and_ping(server):
    r = requests.get(f"{server.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": version("motet")}
    for method in ("GET", "POST"):
        r = requests.request(method, f"{server.url}/ping", timeout=10)
        assert r.status_code == 200, r.text
