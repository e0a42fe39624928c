"""vLLM's request extras over HTTP, each against a reference: `motet serve` on loopback (tests/live_server.py) with
a tiny random model whose tokenizer adds a BOS token, driven by the openai SDK (`extra_body`, as vLLM's users
send them) and httpx; references are Hugging Face's tokenizer and chat templates, HF transformers' logits
and greedy generation.
"""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from tests.engine.test_engine import hf_greedy
from tests.live_server import ThreadServer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

USER = [{"role": "user", "content": "Paris is the capital of"}]
PREFILL = [*USER, {"role": "assistant", "content": "The quick brown"}]
TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }} [{{ flavour }}]\n{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that adds BOS to a text (as Llama's do), so add_special_tokens shows."""
    d = tmp_path_factory.mktemp("tiny-bos") / "model"
    shutil.copytree(tiny_model_dir, d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    bos = tok.token_to_id("<|im_start|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", bos)]
    )
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    srv = ThreadServer(  # float32: prompt logprobs within 1e-4 of transformers' fp32 model's
        "--model", str(model_dir), "--data-dir", str(data), "--max-model-len", "256",
        "--trust-request-chat-template", "--served-model-name", "tiny", "--dtype", "float32",
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def untrusting(model_dir, tmp_path_factory):
    srv = ThreadServer("--model", str(model_dir), "--data-dir", str(tmp_path_factory.mktemp("data2")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": "tiny", **body}, timeout=120, **kw)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, param: str, match: str = "") -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err
    return err


def chat(server, **body) -> dict:
    return ok(post(server, "chat/completions", {"messages": USER, "max_tokens": 4, "temperature": 0, **body}))


def rendered_ids(tok, messages, **kw) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)


# -- chat prompt -------------------------------------------------------------------------------------------
def test_continue_final_message_is_hfs(server, tok):
    body = dict(
        messages=PREFILL, add_generation_prompt=False, continue_final_message=True, return_token_ids=True
    )
    r = chat(server, **body)
    assert r["prompt_token_ids"] == rendered_ids(tok, PREFILL, continue_final_message=True)
    closed = rendered_ids(tok, PREFILL)  # the plain rendering closes the assistant message
    assert r["prompt_token_ids"] != closed and len(r["prompt_token_ids"]) < len(closed)
    # add_generation_prompt is true unless set to false: the two cannot both hold (400, as vLLM)
    refused(post(server, "chat/completions", {"messages": PREFILL, "continue_final_message": True}),
            "continue_final_message", "add_generation_prompt")  # fmt: skip


def test_add_generation_prompt_false_is_hfs(server, tok):
    r = chat(server, add_generation_prompt=False, return_token_ids=True)
    assert r["prompt_token_ids"] == rendered_ids(tok, USER, add_generation_prompt=False)
    assert r["choices"][0]["message"]["role"] == "user"  # vLLM: the last message's role goes on
    r = chat(server, return_token_ids=True)
    assert r["prompt_token_ids"] == rendered_ids(tok, USER, add_generation_prompt=True)


def test_add_special_tokens(server, tok):
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    r = chat(server, add_special_tokens=True, return_token_ids=True)
    assert (
        r["prompt_token_ids"]
        == tok.encode(text, add_special_tokens=True)
        == [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
    )
    body = {"prompt": "The quick brown fox", "max_tokens": 1, "return_token_ids": True}
    with_bos = ok(post(server, "completions", body))["choices"][0]["prompt_token_ids"]
    without = ok(post(server, "completions", {**body, "add_special_tokens": False}))["choices"][0][
        "prompt_token_ids"
    ]
    assert with_bos == tok.encode(body["prompt"]) and without == tok.encode(
        body["prompt"], add_special_tokens=False
    )
    assert with_bos == [tok.bos_token_id] + without


def test_chat_echo_prepends_the_continued_message(server, client):
    body = dict(messages=PREFILL, add_generation_prompt=False, continue_final_message=True)
    plain = chat(server, **body, max_tokens=6)["choices"][0]["message"]["content"]
    echoed = chat(server, **body, max_tokens=6, echo=True)
    assert echoed["choices"][0]["message"]["content"] == PREFILL[-1]["content"] + plain
    assert echoed["choices"][0]["message"]["role"] == "assistant"
    # vLLM: echo asks for the prompt's logprobs too (one entry per prompt token, none for the first)
    assert (
        echoed["prompt_logprobs"][0] is None
        and len(echoed["prompt_logprobs"]) == echoed["usage"]["prompt_tokens"]
    )
    stream = client.chat.completions.create(
        model="tiny", stream=True, max_tokens=6, temperature=0, messages=PREFILL,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )  # fmt: skip
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == PREFILL[-1]["content"] + plain
    )
    # the last message is the user's, the answer the assistant's: nothing to echo (vLLM)
    assert (
        chat(server, echo=True)["choices"][0]["message"]["content"]
        == chat(server)["choices"][0]["message"]["content"]
    )


# -- logprobs, token ids -----------------------------------------------------------------------------------
def check_prompt_logprobs(entries: list, prompt: list[int], hf, k: int) -> None:
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        want, token = ref[t - 1], prompt[t]
        entry = {int(i): v for i, v in entries[t].items()}
        assert entry[token]["logprob"] == pytest.approx(want[token].item(), abs=1e-4)
        assert entry[token]["rank"] == int((want > want[token]).sum()) + 1
        top = want.topk(k).indices.tolist()
        assert set(top) <= set(entry) and set(entry) <= {*top, token}
        assert [entry[i]["rank"] for i in top] == list(range(1, k + 1))


def test_prompt_logprobs_match_hf(server, tiny_hf_model, tok):  # (model_dir has the tiny weights)
    r = chat(server, prompt_logprobs=2, return_token_ids=True)
    check_prompt_logprobs(r["prompt_logprobs"], r["prompt_token_ids"], tiny_hf_model, 2)
    c = ok(
        post(server, "completions", {"prompt": "The quick brown fox", "max_tokens": 2, "prompt_logprobs": 3})
    )
    check_prompt_logprobs(
        c["choices"][0]["prompt_logprobs"], tok.encode("The quick brown fox"), tiny_hf_model, 3
    )
    assert c["choices"][0]["prompt_logprobs"][1][str(tok.encode("The quick brown fox")[1])]["decoded_token"]
    refused(
        post(server, "completions", {"prompt": "x", "prompt_logprobs": 2, "stream": True}), "prompt_logprobs"
    )
    refused(post(server, "completions", {"prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs")


def test_return_token_ids_are_the_tokenizers(server, client, tok):
    r = client.completions.create(
        model="tiny", prompt="Paris is", max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.prompt_token_ids == tok.encode("Paris is")
    assert len(choice.token_ids) == r.usage.completion_tokens == 8
    assert tok.decode(choice.token_ids) == choice.text
    c = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    assert c.prompt_token_ids == rendered_ids(tok, USER, add_generation_prompt=True)
    assert tok.decode(c.choices[0].token_ids) == c.choices[0].message.content
    # streamed: the prompt's ids on a choice's first chunk, each chunk's own ids after
    stream = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[0].prompt_token_ids == c.prompt_token_ids
    assert [t for ch in chunks for t in ch.choices[0].token_ids] == c.choices[0].token_ids
    stream = client.completions.create(
        model="tiny",
        prompt="Paris is",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [ch.choices[0] for ch in stream]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    assert [t for ch in chunks for t in ch.token_ids] == choice.token_ids


def test_return_tokens_as_token_ids(server, client):
    body = dict(return_token_ids=True, return_tokens_as_token_ids=True)
    r = chat(server, logprobs=True, top_logprobs=2, **body)
    content = r["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
    assert all(top["token"].startswith("token_id:") for e in content for top in e["top_logprobs"])
    c = ok(post(server, "completions", {"prompt": "Paris", "max_tokens": 4, "logprobs": 2, **body}))[
        "choices"
    ][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(key.startswith("token_id:") for top in c["logprobs"]["top_logprobs"] for key in top)


# -- sampling masks, truncation ----------------------------------------------------------------------------
def test_allowed_token_ids_and_bad_words(server, tok):
    allowed = tok.encode(" the brown fox jumps", add_special_tokens=False)
    r = chat(server, max_tokens=12, allowed_token_ids=allowed, return_token_ids=True)
    assert set(r["choices"][0]["token_ids"]) <= set(allowed)
    free = chat(server, max_tokens=12, return_token_ids=True)["choices"][0]["token_ids"]
    word = tok.decode(free[2:4])
    banned = tok.encode(word.lstrip(), add_special_tokens=False)
    out = chat(server, max_tokens=12, bad_words=[word], return_token_ids=True)["choices"][0]["token_ids"]
    assert not any(out[i : i + len(banned)] == banned for i in range(len(out)))
    refused(
        post(server, "chat/completions", {"messages": USER, "allowed_token_ids": [10**6]}),
        "allowed_token_ids",
    )
    refused(
        post(server, "chat/completions", {"messages": USER, "allowed_token_ids": []}), "allowed_token_ids"
    )
    refused(post(server, "chat/completions", {"messages": USER, "bad_words": [" "]}), "bad_words")


def test_truncate_prompt_tokens_keeps_the_last_ones(server, tiny_hf_model, tok):
    prompt = [(i * 7) % 300 + 3 for i in range(50)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    c = ok(post(server, "completions", {**body, "truncate_prompt_tokens": 20}))
    assert c["usage"]["prompt_tokens"] == 20 and c["choices"][0]["prompt_token_ids"] == prompt[-20:]
    assert c["choices"][0]["token_ids"] == hf_greedy(tiny_hf_model, prompt[-20:], 6)
    # -1: as many as fit beside the completion (256 - 6), so all 50 here; past that, a 400 naming it
    assert (
        ok(post(server, "completions", {**body, "truncate_prompt_tokens": -1}))["usage"]["prompt_tokens"]
        == 50
    )
    refused(post(server, "completions", {**body, "truncate_prompt_tokens": 251}), "truncate_prompt_tokens")
    refused(post(server, "completions", {**body, "truncate_prompt_tokens": 0}), "truncate_prompt_tokens")
    # a text longer than the 256-token context is read when it is to be cut to its last tokens
    text = "The quick brown fox jumps over the lazy dog. " * 400
    refused(post(server, "completions", {"prompt": text, "max_tokens": 1}), "prompt")
    c = ok(
        post(
            server,
            "completions",
            {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 30, "return_token_ids": True},
        )
    )
    assert c["choices"][0]["prompt_token_ids"] == tok.encode(text)[-30:]
    # chat: the rendered prompt's last tokens
    r = chat(server, truncate_prompt_tokens=5, return_token_ids=True)
    assert r["prompt_token_ids"] == rendered_ids(tok, USER, add_generation_prompt=True)[-5:]


# -- streams, ids ------------------------------------------------------------------------------------------
def test_continuous_usage_stats(client):
    for n in (1, 2):
        stream = client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=6, temperature=0.7, seed=1, n=n, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        chunks = list(stream)
        *per_chunk, last = chunks
        assert all(c.usage is not None and c.choices for c in per_chunk) and not last.choices
        seen = {i: 0 for i in range(n)}
        for c in per_chunk:
            i = c.choices[0].index
            seen[i] += len(c.choices[0].token_ids)
            assert c.usage.completion_tokens == seen[i]  # this choice's tokens so far
            assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        assert last.usage.completion_tokens == sum(seen.values()) == 6 * n
    stream = client.completions.create(
        model="tiny", prompt="Paris", max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    usages = [c.usage.completion_tokens for c in stream]
    assert usages[:-1] == sorted(usages[:-1]) and usages[-2] == usages[-1] == 5


def test_request_id_names_the_response(server, client):
    r = post(server, "chat/completions", {"messages": USER, "max_tokens": 2, "request_id": "my-req-7"})
    assert ok(r)["id"] == "chatcmpl-my-req-7" and r.headers["x-request-id"] == "my-req-7"
    r = post(
        server,
        "completions",
        {"prompt": "x", "max_tokens": 2, "request_id": "b"},
        headers={"X-Request-Id": "h"},
    )
    assert ok(r)["id"] == "cmpl-h" and r.headers["x-request-id"] == "h"  # the header wins, as in vLLM
    c = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, extra_body={"request_id": "sdk"}
    )
    assert c.id == "chatcmpl-sdk"
    refused(post(server, "chat/completions", {"messages": USER, "request_id": "é"}), "request_id")
    refused(post(server, "chat/completions", {"messages": USER, "request_id": "x" * 300}), "request_id")
    # two requests with one id (two clients, say) run side by side, each to its own end
    results = [None, None]

    def run(i):
        results[i] = post(server, "completions", {"prompt": [3 + i] * 5, "max_tokens": 30, "temperature": 0,
                                                  "ignore_eos": True, "request_id": "same", "return_token_ids": True})  # fmt: skip

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [ok(r)["choices"][0] for r in results]
    assert [o["prompt_token_ids"] for o in outs] == [[3] * 5, [4] * 5]
    assert all(len(o["token_ids"]) == 30 for o in outs)


# -- a request's chat template ----------------------------------------------------------------------------
def test_chat_template_is_refused_without_the_flag(untrusting):
    body = {"model": "tiny", "messages": USER, "chat_template": TEMPLATE}
    r = httpx.post(
        f"{untrusting.url}/v1/chat/completions", json={**body, "model": untrusting.state.model_name}
    )
    err = refused(r, "chat_template", "--trust-request-chat-template")
    assert "Refused request with untrusted chat template" in err["message"]  # vLLM's words
    body = {
        "messages": USER,
        "chat_template_kwargs": {"chat_template": TEMPLATE},
        "model": untrusting.state.model_name,
    }
    refused(httpx.post(f"{untrusting.url}/v1/chat/completions", json=body), "chat_template_kwargs",
            "--trust-request-chat-template")  # fmt: skip


def test_chat_template_is_honoured_with_the_flag(server, tok):
    kw = {"flavour": "vanilla"}
    r = chat(server, chat_template=TEMPLATE, chat_template_kwargs=kw, return_token_ids=True)
    assert r["prompt_token_ids"] == rendered_ids(
        tok, USER, chat_template=TEMPLATE, add_generation_prompt=True, **kw
    )
    assert "[vanilla]" in tok.decode(r["prompt_token_ids"])
    r = chat(server, chat_template_kwargs={"chat_template": TEMPLATE, **kw}, return_token_ids=True)
    assert r["prompt_token_ids"] == rendered_ids(tok, USER, chat_template=TEMPLATE, **kw)
    # continue_final_message with the request's template: HF's rendering of it
    r = chat(server, messages=PREFILL, chat_template=TEMPLATE, chat_template_kwargs=kw, add_generation_prompt=False,
             continue_final_message=True, return_token_ids=True)  # fmt: skip
    assert r["prompt_token_ids"] == rendered_ids(
        tok, PREFILL, chat_template=TEMPLATE, continue_final_message=True, **kw
    )
    # the parameters of the rendering itself are the request's own fields
    body = {"messages": USER, "chat_template": TEMPLATE, "chat_template_kwargs": {"tokenize": True}}
    refused(post(server, "chat/completions", body), "chat_template_kwargs", "tokenize")


@pytest.mark.parametrize(
    "template, code",
    [
        ("{{ 'x' * 10**10 }}", None),  # 10 GB: over the helper's memory
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", None),  # time
        ("{{ 'hello ' * 100000 }}", "context_length_exceeded"),  # 600 kB: more than a 256-token prompt
        ("{{ raise_exception('no system prompt here') }}", None),
        ("{% for m in messages %}{{ m.content", None),  # not a template
    ],
)
def test_a_requests_template_stays_within_bounds(server, template, code):
    err = refused(
        post(server, "chat/completions", {"messages": USER, "chat_template": template}), "chat_template"
    )
    assert err["code"] == code
    assert chat(server)["choices"]  # still serving, the helper too
    assert chat(server, chat_template=TEMPLATE, chat_template_kwargs={"flavour": "x"})["choices"]


def test_a_requests_template_renders_only_in_its_helper_with_tool_results_too(server):
    """A history with a tool result makes the server ask whether the template writes a `tool` turn: that is
    asked of the model's own template only; a request's template stays in its bounded helper (refused there)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    body = {"messages": messages, "chat_template": "{{ 'x' * 10**10 }}"}
    assert refused(post(server, "chat/completions", body), "chat_template")["code"] is None
    assert chat(server)["choices"]


def test_openapi_lists_the_extras(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    chat_fields = schema["ChatCompletionRequest"]["properties"]
    for field in ("continue_final_message", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
                  "prompt_logprobs", "return_token_ids", "request_id", "chat_template", "echo"):  # fmt: skip
        assert field in chat_fields, field
    assert json.dumps(schema["StreamOptions"]).count("continuous_usage_stats") == 1
