"""The Starlette app: routes, error handling, per-status request counts, and the actors' lifespan."""

from __future__ import annotations

import contextlib
import functools
import logging

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from motet.api import protocol as P
from motet.api.adapters.routes import (
    delete_adapter,
    get_adapter,
    list_adapters,
    load_lora_adapter,
    unload_lora_adapter,
    upload_adapter,
)
from motet.api.asgi import StatusRecorder
from motet.api.batches.routes import cancel_batch, create_batch, list_batches, retrieve_batch
from motet.api.completions.routes import chat_completions, completions
from motet.api.errors import APIError, echo, handle_exception, to_response
from motet.api.files.routes import delete_file, file_content, list_files, retrieve_file, upload_file
from motet.api.fine_tuning import routes as fine_tuning
from motet.api.openapi import ERRORS, document, operation
from motet.api.playground import playground_routes
from motet.api.responses.input_items import list_input_items
from motet.api.responses.routes import create_response, delete_response, get_response
from motet.api.state import ServerState, state_and_tenant
from motet.api.tokenization import detokenize, tokenize
from motet.api.usage_route import usage_route
from motet.version import __version__

log = logging.getLogger("motet.api")

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/files",
    "/v1/batches",
    "/v1/fine_tuning/jobs",
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
    "/docs",
)


# counted by route, not by path (the first whose prefix matches)
TEMPLATED = (
    "/v1/adapters/{name}",
    "/v1/responses/{response_id}",
    "/v1/models/{model_id}",
    "/v1/files/{file_id}",
    "/v1/batches/{batch_id}",
    "/v1/fine_tuning/jobs/{job_id}",
)


def guarded(handler, probe: bool = False):
    """Every failure becomes an OpenAI-shaped error response; only real bugs are 500s (and logged). A route
    that is not a `probe` (/health, /ping, /version, /metrics) answers 503 "Loading model" (with Retry-After) until
    the model has loaded."""

    @functools.wraps(handler)
    async def wrapper(request: Request) -> Response:
        try:
            if not probe:
                request.app.state.motet.check_loaded()
            return await handler(request)
        except Exception as e:
            return to_response(e)

    return wrapper


@operation(
    "200 once the model is loaded; 503 while starting (llama.cpp's body, with the load's phase and fraction) or "
    "draining",
    tag="Server",
    ok_description="ready",
    errors={503: "not ready"},
    public=True,
)
async def health(request: Request) -> Response:
    state: ServerState = request.app.state.motet
    state.check_ready(progress=True)
    return JSONResponse({"status": "ok"})


@operation("vLLM's (SageMaker's) health check: 200 when ready", tag="Server", ok_description="ready",
           errors={503: "not ready"}, public=True)  # fmt: skip
async def ping(request: Request) -> Response:
    return await health(request)


async def _model_cards(state: ServerState, tenant: str) -> list[P.ModelCard]:
    max_len = state.system.model.max_model_len  # routes answer only once the model has loaded
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


@operation("served models", tag="Models", ok=P.ModelList, ok_description="models")
async def models(request: Request) -> Response:
    state, tenant = state_and_tenant(request)
    return JSONResponse(P.ModelList(data=await _model_cards(state, tenant)).model_dump())


@operation("one of the listed models", tag="Models", ok=P.ModelCard, ok_description="the model")
async def retrieve_model(request: Request) -> Response:
    """One of the models GET /v1/models lists (an alias of the served name reads as that model)."""
    state, tenant = state_and_tenant(request)
    model_id = request.path_params["model_id"]
    cards = await _model_cards(state, tenant)
    if model_id in state.model_names:
        return JSONResponse(cards[0].model_copy(update={"id": model_id}).model_dump())
    if card := next((c for c in cards if c.id == model_id), None):
        return JSONResponse(card.model_dump())
    if not state.system.ready:  # adapters are known once the model is loaded
        state.check_ready()
    error = await state.unknown_model(tenant, model_id)
    error.type = "invalid_request_error"
    raise error


@operation("delete a model of the tenant's (an adapter: a fine-tuned model, a checkpoint, an upload)",
           tag="Models", ok_description="deleted")  # fmt: skip
async def delete_model(request: Request) -> Response:
    """OpenAI's DELETE /v1/models/{model}: the tenant's own adapters only (the base model and shared adapters stay)."""
    state, tenant = state_and_tenant(request)
    state.check_ready()
    model_id = request.path_params["model_id"]
    if model_id in state.model_names or state.adapters is None:
        raise APIError(
            403, f"the model {echo(model_id)} is the server's: it cannot be deleted", param="model"
        )
    await state.adapters.delete(tenant, model_id)
    return JSONResponse({"id": model_id, "object": "model", "deleted": True})


@operation("the server's version", tag="Server", ok_description='{"version": ...}', public=True)
async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


@operation(
    "Prometheus metrics; with --api-keys, an admin key only",
    tag="Server",
    ok_description="metrics",
    ok_media="text/plain",
    errors={401: "no or unknown key", 403: "not an admin key", 503: ERRORS[503]},
)
async def metrics(request: Request) -> Response:
    """Prometheus text; under --api-keys only an admin key reads it (it names every tenant's adapters)."""
    state: ServerState = request.app.state.motet
    state.auth.check_admin(request.headers.get("authorization"), "GET /metrics")
    if state.system.ready:
        state.metrics.refresh(state.system.stats(), state.system.model.max_loras)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def routes() -> list:
    """What the app serves: each route family's handlers declare their OpenAPI operation beside them."""
    return [
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/responses", guarded(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(get_response), methods=["GET"]),
        Route("/v1/responses/{response_id}", guarded(delete_response), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", guarded(list_input_items), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", guarded(retrieve_model), methods=["GET"]),
        Route("/v1/models/{model_id:path}", guarded(delete_model), methods=["DELETE"]),
        Route("/v1/files", guarded(upload_file), methods=["POST"]),
        Route("/v1/files", guarded(list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", guarded(retrieve_file), methods=["GET"]),
        Route("/v1/files/{file_id}", guarded(delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", guarded(file_content), methods=["GET"]),
        Route("/v1/batches", guarded(create_batch), methods=["POST"]),
        Route("/v1/batches", guarded(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", guarded(retrieve_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", guarded(cancel_batch), methods=["POST"]),
        *fine_tuning_routes(),
        Route("/v1/adapters", guarded(upload_adapter), methods=["POST"]),
        Route("/v1/adapters", guarded(list_adapters), methods=["GET"]),
        Route("/v1/adapters/{name}", guarded(get_adapter), methods=["GET"]),
        Route("/v1/adapters/{name}", guarded(delete_adapter), methods=["DELETE"]),
        Route("/v1/load_lora_adapter", guarded(load_lora_adapter), methods=["POST"]),
        Route("/v1/unload_lora_adapter", guarded(unload_lora_adapter), methods=["POST"]),
        Route("/health", guarded(health, probe=True), methods=["GET"]),
        Route("/ping", guarded(ping, probe=True), methods=["GET", "POST"]),
        Route("/version", guarded(version, probe=True), methods=["GET"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
        Route("/metrics", guarded(metrics, probe=True), methods=["GET"]),  # (its figures while loading too)
        Route("/v1/usage", guarded(usage_route), methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False),
        *playground_routes(),  # the chat page at /, the API docs at /docs
    ]


def fine_tuning_routes() -> list[Route]:
    jobs, job = "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{job_id}"
    return [
        Route(jobs, guarded(fine_tuning.create_job), methods=["POST"]),
        Route(jobs, guarded(fine_tuning.list_jobs), methods=["GET"]),
        Route(job, guarded(fine_tuning.retrieve_job), methods=["GET"]),
        Route(f"{job}/cancel", guarded(fine_tuning.cancel_job), methods=["POST"]),
        Route(f"{job}/pause", guarded(fine_tuning.pause_job), methods=["POST"]),
        Route(f"{job}/resume", guarded(fine_tuning.resume_job), methods=["POST"]),
        Route(f"{job}/events", guarded(fine_tuning.list_events), methods=["GET"]),
        Route(f"{job}/checkpoints", guarded(fine_tuning.list_checkpoints), methods=["GET"]),
    ]


async def openapi(request: Request) -> Response:
    """The document of the routes this app serves, its examples naming the served model (generated once)."""
    app = request.app
    if getattr(app.state, "openapi", None) is None:
        app.state.openapi = document(app.routes, app.state.motet.model_name)
    return JSONResponse(app.state.openapi)


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
            if state.fine_tuning is not None:  # fine-tuning jobs train beside it, in processes of their own
                # (those a restart cut short are queued again before the server answers: no client reads one as
                # running after the restart)
                await state.fine_tuning.recover()
                tg.start_soon(state.fine_tuning.run, app, fine_tuning.run_files)
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

    app = Starlette(routes=routes(), lifespan=lifespan, exception_handlers={HTTPException: handle_exception})
    app.state.motet = state
    app.add_middleware(CountRequests, state=state)
    return app


__all__ = ["create_app", "APIError"]
