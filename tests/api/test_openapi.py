"""The OpenAPI document is generated from the registered routes: every route the app serves is in it, and
nothing else; each handler declares its operation beside it; the served document is that one, and valid."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from jsonschema import Draft202012Validator
from schemathesis.specs.openapi.definitions import OPENAPI_31
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.schemas import SchemaGenerator
from starlette.testclient import TestClient

from motet.actors.system import ServingSystem
from motet.api import app as app_module
from motet.api.app import ENDPOINTS, TEMPLATED, create_app
from motet.api.auth import Authenticator
from motet.api.completions.protocol import ChatCompletionRequest
from motet.api.openapi import Operation, document, operation
from motet.api.state import ServerState
from tests.served_app import openapi_schema

# what the app serves and the document leaves out, on purpose (each registered with include_in_schema=False)
UNDOCUMENTED = {"/openapi.json", "/", "/docs", "/static"}


@pytest.fixture(scope="module")
def app():
    """The app as `motet serve` builds it (never started: no model is loaded)."""
    system = ServingSystem(lambda: pytest.fail("the engine is never built here"), max_queue_len=1)
    return create_app(ServerState(system, ["tiny"]))


def _operations(doc: dict) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


def test_every_registered_route_is_documented_and_nothing_else(app):
    # starlette's own walk of the routes: each method of each route the schema includes, HEAD left out
    registered = {(e.http_method.upper(), e.path) for e in SchemaGenerator({}).get_endpoints(app.routes)}
    assert registered == _operations(openapi_schema())
    left_out = {r.path for r in app.routes if not getattr(r, "include_in_schema", True)}
    left_out |= {r.path for r in app.routes if not isinstance(r, Route)}  # mounts: the playground's assets
    assert left_out == UNDOCUMENTED


def test_the_served_document_is_the_generated_one(app):
    served = TestClient(app).get("/openapi.json")  # no lifespan: the route needs no model
    assert served.status_code == 200
    assert (
        served.json() == openapi_schema("tiny") == document(app.routes, "tiny")
    )  # (the served model's name)


class _Assets(HTMLParser):
    """What a page loads: its scripts' and stylesheets' URLs."""

    def __init__(self):
        super().__init__()
        self.scripts, self.styles = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"])
        if tag == "link" and a.get("rel") == "stylesheet":
            self.styles.append(a["href"])


def test_docs_is_swagger_ui_on_the_document_served_from_here_also_under_keys():
    """GET /docs (where vLLM's users look) is Swagger UI: its page and assets come from this server (no CDN: it works
    offline) under the pages' Content-Security-Policy, and read /openapi.json; with --api-keys neither needs a key."""
    system = ServingSystem(lambda: pytest.fail("the engine is never built here"), max_queue_len=1)
    client = TestClient(create_app(ServerState(system, ["tiny"], auth=Authenticator({"sk-a": "alice"}))))
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assets = _Assets()
    assets.feed(page.text)
    assert (
        assets.scripts
        and assets.styles
        and all(u.startswith("/static/") for u in assets.scripts + assets.styles)
    )
    loaded = {u: client.get(u) for u in assets.scripts + assets.styles}
    assert all(r.status_code == 200 for r in loaded.values()), {u: r.status_code for u, r in loaded.items()}
    assert all("javascript" in loaded[u].headers["content-type"] for u in assets.scripts)
    assert all(loaded[u].headers["content-type"].startswith("text/css") for u in assets.styles)
    code = "".join(r.text for u, r in loaded.items() if u in assets.scripts)
    assert "SwaggerUIBundle" in code and 'url: "/openapi.json"' in code
    assert client.get("/openapi.json").json()["openapi"] == "3.1.0"  # what Swagger UI 5 renders (4.x cannot)
    assert client.get("/v1/models").status_code in (
        401,
        503,
    )  # the API itself still wants a key (or the model)


def test_the_document_is_valid_openapi_3_1():
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in Draft202012Validator(OPENAPI_31).iter_errors(
        openapi_schema())]  # fmt: skip
    assert not errors, errors[:5]


def test_each_operation_has_a_summary_a_known_tag_and_its_models():
    doc = openapi_schema()
    tags = {t["name"] for t in doc["tags"]}
    schemas = doc["components"]["schemas"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert op["summary"] and set(op["tags"]) <= tags, (method, path)
            params = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert params == set(path.replace("}", "{").split("{")[1::2]), (method, path)
            assert "200" in op["responses"], (method, path)
    for name in ("ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk", "CompletionRequest",
                 "ResponsesRequest", "BatchCreateRequest", "TokenizeChatRequest", "ModelList", "ErrorResponse"):  # fmt: skip
        assert name in schemas, name
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert doc["paths"]["/health"]["get"]["security"] == []  # probes need no key


def test_each_documented_path_is_counted_under_its_own_endpoint_label():
    for path in openapi_schema()["paths"]:
        assert path in ENDPOINTS or any(path.startswith(t.split("{")[0]) for t in TEMPLATED), path


def test_a_route_without_a_declaration_cannot_be_documented():
    async def undeclared(request):
        raise AssertionError

    with pytest.raises(LookupError, match="declares no @operation"):
        document([Route("/v1/new", undeclared, methods=["GET"])], "tiny")
    document(
        [Route("/v1/new", undeclared, methods=["GET"], include_in_schema=False)], "tiny"
    )  # left out on purpose


def test_declarations_travel_with_the_guarded_handler():
    @operation("a thing", tag="Server", query={"limit": int}, errors=(400,))
    async def thing(request):
        raise AssertionError

    route = Route("/thing/{n:int}", app_module.guarded(thing), methods=["GET", "POST"])
    doc = document(Starlette(routes=[route]).routes, "tiny")
    assert set(doc["paths"]["/thing/{n}"]) == {"get", "post"}
    op = doc["paths"]["/thing/{n}"]["get"]
    assert [(p["name"], p["in"], p["schema"]["type"]) for p in op["parameters"]] == [
        ("n", "path", "integer"),
        ("limit", "query", "integer"),
    ]
    assert set(op["responses"]) == {"200", "400"}
    with pytest.raises(ValueError, match="unknown OpenAPI tag"):
        Operation("x", tag="Nope")


# What a route that names a resource answers its example with on a fresh server: the resource is missing (the
# example's shape passes: never a 422 or an unknown field), naming what to make first.
NAMES_A_RESOURCE = {  # path -> (status, the error's field, its value)
    "/v1/batches": (400, "code", "file_not_found"),  # upload the batch's file first (POST /v1/files)
    "/v1/fine_tuning/jobs": (
        400,
        "code",
        "file_not_found",
    ),  # upload the training file first (purpose fine-tune)
    "/v1/load_lora_adapter": (403, "param", "lora_path"),  # no directory is read without --lora-load-dir
    "/v1/unload_lora_adapter": (404, "code", "adapter_not_found"),  # load or upload it first
}


def test_each_json_bodys_example_runs_as_shown(tiny_model_dir, tmp_path):
    """Issue 57: /docs' "Try it out" sent every optional field as null, with `"model": "string"` and
    `messages: [{"additionalProp1": {}}]`: a 400. Each JSON body's example in the served /openapi.json names
    the served model and runs as shown: sent as-is (httpx on loopback, `motet serve`'s own app and flags), the
    inference and tokenization routes answer 200 (chat and completions parse as the openai SDK's types)."""
    import httpx
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from tests.live_server import ThreadServer

    srv = ThreadServer("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--data-dir",
                       str(tmp_path / "data"), "--threads", "1", "--num-kv-blocks", "64")  # fmt: skip
    try:
        client = httpx.Client(base_url=srv.url, timeout=120)
        doc = client.get("/openapi.json").json()
        answers = {}
        for path, item in doc["paths"].items():
            body = item.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                continue
            example = body["example"]
            assert example.get("model", "tiny") == "tiny", (path, example)
            r = client.post(path, json=example)
            answers[path] = r
            if path in NAMES_A_RESOURCE:
                status, field, value = NAMES_A_RESOURCE[path]
                assert r.status_code == status and r.json()["error"][field] == value, (path, r.text)
            else:
                assert r.status_code == 200, (path, example, r.text)
        assert set(answers) >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize",
                                "/detokenize", *NAMES_A_RESOURCE}, answers  # fmt: skip
        ChatCompletion.model_validate(answers["/v1/chat/completions"].json())
        Completion.model_validate(answers["/v1/completions"].json())
    finally:
        srv.stop()


def test_a_json_body_without_an_example_cannot_be_declared():
    with pytest.raises(ValueError, match="declares an example"):
        Operation("x", tag="Chat", body=ChatCompletionRequest)
