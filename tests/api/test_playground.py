"""The playground at `/` in a real headless Chromium (Debian's `chromium`, driven by Playwright) against a real
`motet serve` on loopback with a tiny random model.

The page is served without a key and loads nothing from outside; the key typed in is kept and sent; a chat
answer streams in (seen while the request still runs) and matches what the openai SDK gets for the same
request; Stop aborts the request on the server; an uploaded adapter is picked from /v1/models; a JSON schema
gives an answer that jsonschema validates; tools with tool_choice "required" show a call whose arguments
validate against the tool's schema, and the next message answers it as a tool result; the API's 4xx
`error.message` is shown; a reasoning model's reasoning_content is shown apart from the answer.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import Server
from tests.peft_adapters import make_adapter

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is missing: pip install -e '.[dev]'")
expect = sync_api.expect

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,  # two `motet serve` starts and a browser: well over 20 s
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no `chromium` browser: scripts/test.sh installs Debian's (scripts/install-browser.sh) where "
        "apt-get runs as root",
    ),
]
# The machine's notes for a headless Chromium that reaches nothing but the loopback server (Playwright adds
# --headless and a fresh --user-data-dir).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

MODEL, ADAPTER, KEY, ADMIN_KEY = "tiny", "ad1", "sk-play", "sk-ops"  # ADMIN_KEY reads /metrics
WAIT_MS = 120_000  # a generous bound for one answer on a loaded 2-core machine
# A test-only chat template: a system prompt holding "/think" opens the reasoning (as DeepSeek-R1's template
# does), so that a random model's output is reasoning under --reasoning-parser think.
THINK_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if messages[0]['role'] == 'system' and '/think' in messages[0]['content'] %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
# Bounded schemas: every value is an enum or a boolean, so a random model finishes the JSON within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
LIGHT = {
    "type": "object",
    "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
    "required": ["room", "on"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}}]


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("playground")
    (tmp / "keys.json").write_text(json.dumps({KEY: "alice", ADMIN_KEY: {"admin": True}}))
    model = shutil.copytree(tiny_model_dir, tmp / "tiny")
    (model / "chat_template.jinja").write_text(THINK_TEMPLATE)
    make_adapter(tiny_model_dir, tmp / ADAPTER, 1)
    return tmp


def start(dirs: Path, *args: str, data: str = "data") -> Server:
    return Server(
        dirs,
        "--model", str(dirs / "tiny"), "--served-model-name", MODEL, "--api-keys", str(dirs / "keys.json"),
        "--data-dir", str(dirs / data), "--threads", "1", "--max-model-len", "4096", "--max-num-seqs", "2",
        *args,
        start_timeout=120,
        admin_key=ADMIN_KEY,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(dirs):
    srv = start(dirs)
    files = [
        ("files", (dirs / ADAPTER / f).open("rb"))
        for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    r = httpx.post(f"{srv.url}/v1/adapters", headers=auth(), data={"name": ADAPTER}, files=files, timeout=60)
    assert r.status_code == 200, r.text
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@contextmanager
def open_page(browser, url: str, path: str = "/"):
    """A fresh browser profile on the playground (or the server's page at `path`); fails if the page throws, breaks
    its Content-Security-Policy or asks for anything elsewhere."""
    context = browser.new_context()
    page = context.new_page()
    outside, errors = [], []
    page.on("request", lambda r: r.url.startswith((url, "data:")) or outside.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: "Content Security Policy" in m.text and errors.append(m.text))  # refused
    page.goto(f"{url}{path}")
    yield page
    context.close()
    assert not outside, f"the page asked for something outside the server: {outside}"
    assert not errors, f"the page threw: {errors}"


@pytest.fixture
def page(browser, server):
    with open_page(browser, server.url) as p:
        yield p


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def log_in(page) -> None:
    page.get_by_label("API key").fill(KEY)
    page.get_by_label("API key").press("Tab")  # the change event reloads the models
    expect(page.get_by_label("Model or adapter").locator(f'option[value="{MODEL}"]')).to_have_count(1)


def settings(page, *, temperature: str = "0", max_tokens: str, mode: str = "text", system: str = "") -> None:
    page.get_by_label("Temperature").fill(temperature)
    page.get_by_label("Max tokens").fill(max_tokens)
    page.get_by_label("System prompt").fill(system)
    page.get_by_label("Output").select_option(mode)


def send(page, text: str):
    """Types `text` and presses Enter; returns the assistant message the answer goes into."""
    answers = page.locator("article.assistant")
    n = answers.count()
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_label("Message", exact=True).press("Enter")
    return answers.nth(n)


def finished(answer, how: str | re.Pattern = re.compile(".")):
    expect(answer).to_have_attribute("data-finished", how, timeout=WAIT_MS)
    return answer


def alert(page) -> str:
    expect(page.get_by_role("alert")).to_be_visible()
    return page.get_by_role("alert").inner_text()


def api_error(server: Server, method: str, path: str, **kw) -> str:
    """The API's own error.message for a request: what the page must show."""
    r = httpx.request(method, f"{server.url}{path}", timeout=60, **kw)
    assert 400 <= r.status_code < 500, r.text
    return f"Error {r.status_code}: {r.json()['error']['message']}"


def metric(server: Server, name: str) -> float:
    return server.metrics()[name]


# -- the page and the key -------------------------------------------------------------------------------------
def test_page_is_served_without_a_key_and_keeps_the_key(server, page):
    r = httpx.get(f"{server.url}/", timeout=10)  # no key: the page holds no data
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401  # the API still needs one

    assert alert(page) == api_error(server, "GET", "/v1/models")  # no key yet: the API's 401, shown
    log_in(page)
    expect(page.get_by_role("alert")).to_be_hidden()
    models = httpx.get(f"{server.url}/v1/models", headers=auth(), timeout=10).json()["data"]
    options = page.get_by_label("Model or adapter").locator("option")
    assert options.evaluate_all("os => os.map(o => o.value)") == [m["id"] for m in models]
    assert ADAPTER in [m["id"] for m in models]

    page.reload()  # the key stays in this browser, and is sent again
    expect(page.get_by_label("API key")).to_have_value(KEY)
    expect(page.get_by_label("Model or adapter").locator("option")).to_have_count(len(models))


# -- chat -----------------------------------------------------------------------------------------------------
# Records every text an answer's content shows (textContent replaces the text node, so each record keeps the
# text of its moment) and, when asked, presses Stop as soon as the first text shows: a user's click, without
# the latency of driving the browser from here (a tiny model writes 3,000 tokens in a few seconds).
WATCH_ANSWERS = """stopAtFirstText => {
  window.shown = [];
  new MutationObserver(records => {
    for (const r of records) {
      if (!r.target.matches('article.assistant .content')) continue;
      for (const node of r.addedNodes) {
        const stop = document.getElementById('stop');
        window.shown.push({text: node.textContent, stopEnabled: !stop.disabled});
        if (stopAtFirstText && node.textContent) { stopAtFirstText = false; stop.click(); }
      }
    }
  }).observe(document.getElementById('messages'), {childList: true, subtree: true});
}"""


def test_the_api_docs_render_from_this_server_alone(server, browser):
    """/docs is Swagger UI on the server's OpenAPI 3.1 document, its assets all from the server (no CDN), within the
    page's Content-Security-Policy, with no key: each route's operation is listed, and "Authorize" takes a key."""
    with open_page(browser, server.url, "/docs") as page:
        ops = page.locator(".opblock-summary-path")
        expect(ops.filter(has_text="/v1/chat/completions")).to_have_count(1, timeout=WAIT_MS)
        documented = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
        shown = {p.replace("\u200b", "") for p in ops.all_inner_texts()}  # (word-break hints in long paths)
        assert shown == set(documented)
        expect(page.locator("button.authorize")).to_be_visible()


def test_an_answer_streams_in_and_matches_the_api(server, page):
    log_in(page)
    settings(page, max_tokens="16")
    page.evaluate(WATCH_ANSWERS, False)
    box = page.get_by_label("Message", exact=True)
    box.fill("line one")
    box.press("Shift+Enter")  # a new line, not a send
    box.press_sequentially("line two")
    assert page.locator("article").count() == 0
    box.press("Enter")
    expect(page.locator("article.user .content")).to_have_text("line one\nline two")
    answer = finished(page.locator("article.assistant").last)

    messages = [{"role": "user", "content": "line one\nline two"}]
    ref = sdk(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    text = ref.choices[0].message.content
    assert answer.locator(".content").text_content() == text
    assert answer.get_attribute("data-finished") == ref.choices[0].finish_reason
    expect(answer.locator(".meta")).to_contain_text(f"{ref.usage.completion_tokens} completion tokens")
    # Rendered piece by piece: growing prefixes of the answer, one per streamed delta.
    shown = [s["text"] for s in page.evaluate("window.shown")]
    assert len(shown) > 1 and shown[-1] == text
    assert all(text.startswith(s) for s in shown)


def test_stop_aborts_the_streaming_request(server, page):
    log_in(page)
    settings(page, max_tokens="3000")  # far more than what streams in before Stop
    completed = metric(server, "motet_e2e_request_latency_seconds_count")
    page.evaluate(WATCH_ANSWERS, True)
    answer = finished(send(page, "Count to a thousand"), "stopped")
    expect(answer.locator(".meta")).to_have_text("stopped")
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    first = page.evaluate("window.shown.find(s => s.text)")
    assert first["stopEnabled"], "Stop was not enabled while the answer streamed in"
    assert answer.locator(".content").text_content().startswith(first["text"])  # what streamed in stays

    # The server let go of the request without finishing it (a finished one is counted in e2e latency).
    deadline = time.monotonic() + 60
    while metric(server, "motet_num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "motet_num_requests_running") == 0
    assert metric(server, "motet_e2e_request_latency_seconds_count") == completed, (
        "the request ran to its end"
    )

    page.get_by_label("Max tokens").fill("16")
    answer = finished(send(page, "And now?"))  # the conversation goes on after a stop
    assert answer.get_attribute("data-finished") in ("length", "stop")


# -- adapters, schemas, tools ------------------------------------------------------------------------------------
def test_an_adapter_with_a_json_schema_answers_valid_json(server, page):
    log_in(page)
    page.get_by_label("Model or adapter").select_option(ADAPTER)
    settings(page, max_tokens="64", mode="schema")
    page.get_by_label("JSON schema").fill(json.dumps(SCHEMA))
    answer = finished(send(page, "Is it sunny in Paris?"), "stop")
    expect(answer.get_by_role("heading", name=ADAPTER)).to_be_visible()
    shown = answer.locator(".content").text_content()
    jsonschema.validate(json.loads(shown), SCHEMA)

    ref = sdk(server).chat.completions.create(
        model=ADAPTER,
        messages=[{"role": "user", "content": "Is it sunny in Paris?"}],
        temperature=0,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "playground", "schema": SCHEMA}},
    )
    assert shown == ref.choices[0].message.content  # the page sent the adapter and the schema


def test_required_tools_show_the_call_and_take_its_result(server, page):
    log_in(page)
    settings(page, max_tokens="128", mode="tools")
    page.get_by_label("Tools (a JSON list of OpenAI function tools)").fill(json.dumps(TOOLS))
    page.get_by_label("Tool choice").select_option("required")
    page.get_by_label("Parallel tool calls").uncheck()
    answer = finished(send(page, "Turn on the kitchen light"), "tool_calls")

    call = answer.get_by_role("region", name="Tool call")
    expect(call).to_have_count(1)
    expect(call.get_by_role("heading")).to_have_text("set_light")
    jsonschema.validate(json.loads(call.locator("pre").text_content()), LIGHT)

    box = page.get_by_label("Message", exact=True)
    expect(box).to_have_attribute("placeholder", re.compile("result of set_light"))
    answer = finished(send(page, '{"ok": true}'))  # the next message answers the call
    expect(page.locator("article.tool h2")).to_have_text("Tool result: set_light")
    expect(page.get_by_role("alert")).to_be_hidden()
    assert answer.get_attribute("data-finished") in ("tool_calls", "stop", "length")


# -- errors ---------------------------------------------------------------------------------------------------
def test_the_apis_4xx_message_is_shown(server, page):
    log_in(page)
    settings(page, temperature="7", max_tokens="8")
    send(page, "hello")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "temperature": 7}
    assert alert(page) == api_error(server, "POST", "/v1/chat/completions", json=body, headers=auth())
    assert page.locator("article").count() == 0  # nothing half-sent stays in the conversation
    expect(page.get_by_label("Message", exact=True)).to_have_value("hello")  # kept, to send again

    page.get_by_label("Temperature").fill("")
    page.get_by_label("Output").select_option("schema")
    page.get_by_label("JSON schema").fill("{not json")
    page.get_by_label("Message", exact=True).press("Enter")
    assert alert(page).startswith("The JSON schema is not valid JSON")

    page.get_by_label("Output").select_option("text")
    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_label("Message", exact=True).press("Enter")
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert alert(page) == api_error(server, "POST", "/v1/chat/completions", json=body, headers=wrong)


# -- reasoning ------------------------------------------------------------------------------------------------
def test_reasoning_content_is_shown_apart_from_the_answer(dirs, browser):
    think = start(dirs, "--reasoning-parser", "think", data="think-data")
    try:
        with open_page(browser, think.url) as page:
            log_in(page)
            settings(page, max_tokens="12", system="/think")
            answer = finished(send(page, "hello"))
            reasoning = answer.locator("details.reasoning")
            expect(reasoning).to_be_visible()
            expect(reasoning.locator("summary")).to_have_text("Reasoning")

            messages = [{"role": "system", "content": "/think"}, {"role": "user", "content": "hello"}]
            ref = sdk(think).chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=12
            )
            assert ref.choices[0].message.model_extra["reasoning_content"]
            assert (
                reasoning.locator(".reasoning-text").text_content()
                == ref.choices[0].message.reasoning_content
            )
            assert answer.locator(".content").text_content() == (ref.choices[0].message.content or "")
    finally:
        think.stop()
