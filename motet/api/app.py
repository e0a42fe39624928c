"""The Starlette app: routes, error handling, per-status request counts, and the actors' lifespan."""

from __future__ import annotations

import contextlib
import functools
import logging

import anyio
import anyio.to_thread
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import motet
from motet.api import protocol as P
from motet.api.adapters import (
    delete_adapter,
    get_adapter,
    list_adapters,
    load_lora_adapter,
    unload_lora_adapter,
    upload_adapter,
)
from motet.api.asgi import StatusRecorder
from motet.api.batches import BatchCreateRequest, cancel_batch, create_batch, list_batches, retrieve_batch
from motet.api.errors import APIError, echo, handle_exception, to_response
from motet.api.files import delete_file, file_content, list_files, retrieve_file, upload_file
from motet.api.openai import chat_completions, completions
from motet.api.playground import playground_routes
from motet.api.response_input_items import list_input_items
from motet.api.responses import create_response, delete_response, get_response
from motet.api.responses_request import ResponsesRequest
from motet.api.state import ServerState
from motet.api.tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    detokenize,
    tokenize,
)
from motet.api.usage import usage_route

log = logging.getLogger("motet.api")

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
    "/v1/adapters",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/ping",
    "/version",
    "/tokenize",
    "/detokenize",
    "/metrics",
    "/v1/usage",
    "/openapi.json",
)


# counted by route, not by path (the first whose prefix matches)
TEMPLATED = (
    "/v1/adapters/{name}",
    "/v1/responses/{response_id}",
    "/v1/models/{model_id}",
    "/v1/files/{file_id}",
    "/v1/batches/{batch_id}",
)


def guarded(handler, probe: bool = False):
    """Every failure becomes an OpenAI-shaped error response; only real bugs are 500s (and logged). A route
    that is not a `probe` answers 503 (with Retry-After) until the model has loaded."""

    @functools.wraps(handler)
    async def wrapper(request: Request) -> Response:
        try:
            if not probe:
                request.app.state.motet.check_loaded()
            return await handler(request)
        except Exception as e:
            return to_response(e)

    return wrapper


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.motet
    state.check_ready()
    return JSONResponse({"status": "ok"})


async def _model_cards(state: ServerState, tenant: str) -> list[P.ModelCard]:
    max_len = state.system.engine.max_model_len  # routes answer only once the model has loaded
    cards = [P.ModelCard(id=state.model_name, created=state.created, max_model_len=max_len)]
    if state.adapters is not None:  # the tenant's adapters, and the shared ones
        cards += [
            P.ModelCard(
                id=a.ref.model,
                created=a.created,
                owned_by=a.owner,
                parent=state.model_name,
                max_model_len=max_len,
            )
            for a in await state.adapters.visible(tenant)
        ]
    return cards


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.motet
    tenant = state.auth.tenant(request.headers.get("authorization"))
    return JSONResponse(P.ModelList(data=await _model_cards(state, tenant)).model_dump())


async def retrieve_model(request: Request) -> Response:
    """One of the models GET /v1/models lists (an alias of the served name reads as that model)."""
    state: ServerState = request.app.state.motet
    tenant = state.auth.tenant(request.headers.get("authorization"))
    model_id = request.path_params["model_id"]
    cards = await _model_cards(state, tenant)
    if model_id in state.model_names:
        return JSONResponse(cards[0].model_copy(update={"id": model_id}).model_dump())
    if card := next((c for c in cards if c.id == model_id), None):
        return JSONResponse(card.model_dump())
    if not state.system.ready:  # adapters are known once the model is loaded
        state.check_ready()
    raise APIError(
        404, f"The model {echo(model_id)} does not exist", param="model", code="model_not_found",
        type="invalid_request_error",
    )  # fmt: skip


async def version(request: Request) -> Response:
    return JSONResponse({"version": motet.__version__})


async def metrics(request: Request) -> Response:
    """Prometheus text; under --api-keys only an admin key reads it (it names every tenant's adapters)."""
    state: ServerState = request.app.state.motet
    state.auth.check_admin(request.headers.get("authorization"))
    if state.system.ready:
        state.metrics.refresh(state.system.stats(), state.system.engine.config.max_loras)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@functools.cache
def openapi_schema() -> dict:
    req_models = [
        P.ChatCompletionRequest,
        P.CompletionRequest,
        ResponsesRequest,
        P.LoadLoraAdapterRequest,
        P.UnloadLoraAdapterRequest,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
        BatchCreateRequest,
    ]
    resp_models = [
        P.ChatCompletionResponse,
        P.ChatCompletionChunk,
        P.CompletionResponse,
        P.ModelList,
        P.AdapterCard,
        P.AdapterList,
        P.AdapterDeleted,
        P.ErrorResponse,
    ]
    _, defs = models_json_schema(
        [(m, "validation") for m in req_models] + [(m, "serialization") for m in resp_models],
        ref_template="#/components/schemas/{model}",
    )

    def ref(m):
        return {"$ref": f"#/components/schemas/{m.__name__}"}

    def errors():
        err = {"content": {"application/json": {"schema": ref(P.ErrorResponse)}}}
        return {
            str(s): {"description": d, **err}
            for s, d in [
                (400, "bad parameter"),
                (401, "bad API key"),
                (403, "not allowed (a shared adapter)"),
                (404, "unknown model or adapter"),
                (409, "the adapter name is taken"),
                (413, "body too large"),
                (429, "queue full (see Retry-After)"),
                (500, "server error"),
                (503, "starting or draining"),
            ]
        }

    def ok(resp, description):
        return {"description": description, "content": {"application/json": {"schema": ref(resp)}}}

    def post(req, resp, summary):
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(req)}}},
                "responses": {
                    "200": {
                        "description": "the result, or SSE chunks when stream is true",
                        "content": {
                            "application/json": {"schema": ref(resp)},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **errors(),
                },
            }
        }

    def any_object(description):
        return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}

    def text_post(req, summary):
        body = {"required": True, "content": {"application/json": {"schema": ref(req)}}}
        ok_text = {"description": "done", "content": {"text/plain": {"schema": {"type": "string"}}}}
        return {"post": {"summary": summary, "requestBody": body, "responses": {"200": ok_text, **errors()}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "motet", "version": "0.1.0", "description": "OpenAI-compatible LLM serving"},
        "paths": {
            "/v1/chat/completions": post(
                P.ChatCompletionRequest, P.ChatCompletionResponse, "chat completion"
            ),
            "/v1/completions": post(P.CompletionRequest, P.CompletionResponse, "text completion"),
            "/v1/responses": {
                "post": {
                    "summary": "a model response (OpenAI Responses API): the Response object, or its typed "
                    "events when stream is true",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": ref(ResponsesRequest)}},
                    },
                    "responses": {"200": any_object("the Response"), **errors()},
                }
            },
            "/v1/responses/{response_id}": {
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "get": {
                    "summary": "a stored response",
                    "responses": {"200": any_object("the Response"), **errors()},
                },
                "delete": {
                    "summary": "delete a stored response",
                    "responses": {"200": any_object("deleted"), **errors()},
                },
            },
            "/v1/load_lora_adapter": text_post(
                P.LoadLoraAdapterRequest, "vLLM: store a server-side adapter directory"
            ),
            "/v1/unload_lora_adapter": text_post(P.UnloadLoraAdapterRequest, "vLLM: delete an adapter"),
            "/v1/models": {
                "get": {
                    "summary": "served models",
                    "responses": {
                        "200": {
                            "description": "models",
                            "content": {"application/json": {"schema": ref(P.ModelList)}},
                        }
                    },
                }
            },
            "/v1/adapters": {
                "post": {
                    "summary": "upload a LoRA adapter: form fields `name` and `files` (adapter_config.json "
                    "+ adapter_model.safetensors, or one .tar/.tar.gz/.tgz/.zip archive)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "multipart/form-data": {
                                "schema": {
                                    "type": "object",
                                    "required": ["name", "files"],
                                    "properties": {
                                        "name": {"type": "string"},
                                        "files": {
                                            "type": "array",
                                            "items": {"type": "string", "format": "binary"},
                                        },
                                    },
                                }
                            }
                        },
                    },
                    "responses": {"200": ok(P.AdapterCard, "the stored adapter"), **errors()},
                },
                "get": {
                    "summary": "the tenant's adapters and the shared ones",
                    "responses": {"200": ok(P.AdapterList, "adapters")},
                },
            },
            "/v1/adapters/{name}": {
                "parameters": [
                    {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "get": {
                    "summary": "one adapter",
                    "responses": {"200": ok(P.AdapterCard, "the adapter"), **errors()},
                },
                "delete": {
                    "summary": "delete an adapter; requests already using it finish",
                    "responses": {"200": ok(P.AdapterDeleted, "deleted"), **errors()},
                },
            },
            "/health": {
                "get": {
                    "summary": "200 once the model is loaded; 503 while starting or draining",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics; with --api-keys, an admin key only",
                    "responses": {
                        "200": {"description": "metrics"},
                        "401": {"description": "no or unknown key"},
                        "403": {"description": "not an admin key"},
                    },
                }
            },
            **_more_paths(ref, errors, any_object),
        },
        "components": {"schemas": defs.get("$defs", {})},
    }


def _more_paths(ref, errors, any_object) -> dict:
    """The OpenAPI paths of the models, files, batches and vLLM utility routes."""

    def path_param(name: str) -> list[dict]:
        return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]

    def query(*names: str) -> list[dict]:
        types = {"limit": {"type": "integer"}}
        return [{"name": n, "in": "query", "required": False, "schema": types.get(n, {"type": "string"})}
                for n in names]  # fmt: skip

    def get(summary: str, params=(), description="the object") -> dict:
        return {"get": {"summary": summary, "parameters": list(params),
                        "responses": {"200": any_object(description), **errors()}}}  # fmt: skip

    def post_json(summary: str, body: dict, params=()) -> dict:
        return {"post": {"summary": summary, "parameters": list(params),
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {"200": any_object("the result"), **errors()}}}  # fmt: skip

    upload = {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}},
            }
        }
    }
    health = {
        "summary": "vLLM's health check: 200 when ready",
        "responses": {"200": {"description": "ready"}},
    }
    return {
        "/v1/models/{model_id}": get("one of the listed models", path_param("model_id"), "the model"),
        "/v1/responses/{response_id}/input_items": get(
            "the items a stored response was generated from (its whole conversation)",
            path_param("response_id") + query("after", "limit", "order"),
            "a list of items",
        ),
        "/v1/files": {
            "post": {
                "summary": "upload a file (purpose: batch)",
                "requestBody": {"required": True, "content": upload},
                "responses": {"200": any_object("the File"), **errors()},
            },
            **get("the tenant's files", query("after", "limit", "order", "purpose"), "a list of files"),
        },
        "/v1/files/{file_id}": {
            **get("a file", path_param("file_id"), "the File"),
            "delete": {
                "summary": "delete a file",
                "parameters": path_param("file_id"),
                "responses": {"200": any_object("deleted"), **errors()},
            },
        },
        "/v1/files/{file_id}/content": get("a file's bytes", path_param("file_id"), "the bytes"),
        "/v1/batches": {
            **post_json("create a batch from an uploaded file", ref(BatchCreateRequest)),
            **get("the tenant's batches, newest first", query("after", "limit"), "a list of batches"),
        },
        "/v1/batches/{batch_id}": get("a batch", path_param("batch_id"), "the Batch"),
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "cancel a batch",
                "parameters": path_param("batch_id"),
                "responses": {"200": any_object("the Batch"), **errors()},
            }
        },
        "/tokenize": post_json(
            "vLLM: a prompt's or chat's token ids",
            {"oneOf": [ref(TokenizeCompletionRequest), ref(TokenizeChatRequest)]},
        ),
        "/detokenize": post_json("vLLM: token ids' text", ref(DetokenizeRequest)),
        "/version": get("the server's version", description='{"version": ...}'),
        "/v1/usage": get(
            "tenants' usage in time buckets (OpenAI's usage API shape); an admin key only",
            [
                {"name": n, "in": "query", "required": n == "start_time", "schema": {"type": t}}
                for n, t in (
                    ("start_time", "integer"),
                    ("end_time", "integer"),
                    ("bucket_width", "string"),
                    ("group_by", "string"),
                    ("tenant", "string"),
                    ("model", "string"),
                    ("limit", "integer"),
                    ("page", "string"),
                )
            ],  # fmt: skip
            description="a page of buckets",
        ),
        "/ping": {"get": health, "post": health},
    }


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())


class CountRequests:
    """Pure ASGI middleware: requests by endpoint and status (streaming responses too)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = StatusRecorder(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            path = scope["path"]
            endpoint = next((e for e in TEMPLATED if path.startswith(e.split("{")[0])), None)
            endpoint = path if path in ENDPOINTS else endpoint or "other"
            self.state.metrics.requests.labels(endpoint, str(sent.status)).inc()


def _reason(e: BaseException) -> str:
    """One line: the innermost cause, as the operator should read it."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"


def create_app(state: ServerState) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with anyio.create_task_group() as tg:

            async def run_system():
                try:
                    await state.system.run()
                except Exception as e:  # start-up failed: /health says why; the server decides to exit
                    log.error("the serving system failed: %s", _reason(e))
                    log.debug("the serving system failed", exc_info=e)
                    state.fatal = e

            tg.start_soon(run_system)
            if state.batches is not None:  # batches run beside live traffic, through this same app
                tg.start_soon(state.batches.run, app)
            try:
                yield
            finally:
                with anyio.move_on_after(10, shield=True):
                    await state.system.stop()
                if state.usage is not None:  # what was counted since the last flush is written now
                    await anyio.to_thread.run_sync(state.usage.close)
                for stop in state.on_stop:
                    await anyio.to_thread.run_sync(stop)
                tg.cancel_scope.cancel()

    routes = [
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/responses", guarded(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", guarded(delete_response), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", guarded(list_input_items), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", guarded(retrieve_model), methods=["GET"]),
        Route("/v1/files", guarded(upload_file), methods=["POST"]),
        Route("/v1/files", guarded(list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", guarded(retrieve_file), methods=["GET"]),
        Route("/v1/files/{file_id}", guarded(delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", guarded(file_content), methods=["GET"]),
        Route("/v1/batches", guarded(create_batch), methods=["POST"]),
        Route("/v1/batches", guarded(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", guarded(retrieve_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", guarded(cancel_batch), methods=["POST"]),
        Route("/v1/adapters", guarded(upload_adapter), methods=["POST"]),
        Route("/v1/adapters", guarded(list_adapters), methods=["GET"]),
        Route("/v1/adapters/{name}", guarded(get_adapter), methods=["GET"]),
        Route("/v1/adapters/{name}", guarded(delete_adapter), methods=["DELETE"]),
        Route("/v1/load_lora_adapter", guarded(load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", guarded(unload_lora_adapter), methods=["POST"]),
        Route("/health", guarded(health, probe=True), methods=["GET"]),
        Route(
            "/ping", guarded(health, probe=True), methods=["GET", "POST"]
        ),  # vLLM's (SageMaker's) health check
        Route("/version", guarded(version, probe=True), methods=["GET"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/v1/usage", guarded(usage_route), methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *playground_routes(),  # the chat page at /
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: handle_exception})
    app.state.motet = state
    app.add_middleware(CountRequests, state=state)
    return app


__all__ = ["create_app", "APIError"]
