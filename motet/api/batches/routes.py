"""OpenAI's Batch API routes (the store: motet/api/batches/store.py; the runner: motet/api/batches/runner.py).

POST /v1/batches                     `input_file_id` (a `batch` file of the tenant's), `endpoint`
                                     (/v1/chat/completions, /v1/completions, /v1/responses),
                                     `completion_window` ("24h"), `metadata`
GET  /v1/batches                     the tenant's batches, newest first: `after`, `limit`
GET  /v1/batches/{batch_id}
POST /v1/batches/{batch_id}/cancel   stops it: running lines are stopped, the unanswered ones answered as
                                     `batch_cancelled` in the error file, then `cancelled`

Every call is scoped to the caller's tenant (another tenant's batch reads as missing), and the batch's lines
run as that tenant.
"""

from __future__ import annotations

from pydantic import field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.api import protocol as P
from motet.api.batches.lines import ENDPOINTS, check_line_size, parse_lines
from motet.api.batches.runner import BatchRunner
from motet.api.batches.store import COMPLETION_WINDOWS, BatchStore
from motet.api.errors import APIError, echo
from motet.api.list_pages import stored_page
from motet.api.openapi import operation
from motet.api.request_body import read_json
from motet.api.state import ServerState, state_and_tenant
from motet.api.storage_errors import stored_call


class BatchCreateRequest(P._Request):
    unsupported = {"output_expires_after": ((None,), "output files are kept until deleted")}
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    _metadata = field_validator("metadata")(
        P._OpenAINoOps._metadata.__func__
    )  # OpenAI's limits, as everywhere


def _context(request: Request) -> tuple[ServerState, str, BatchRunner]:
    state, tenant = state_and_tenant(request)
    if state.batches is None:
        raise APIError(404, "this server runs no batches")
    return state, tenant, state.batches


def _no_such_batch(batch_id: str) -> APIError:
    return APIError(404, f"No such Batch object: {echo(batch_id)}", param="batch_id", code="batch_not_found")


async def _path_batch(request: Request, what: str, call) -> tuple[BatchRunner, dict]:
    """The runner, and what `call` (a BatchStore method: get, cancel) returns of the tenant's batch the path
    names; 404 where the tenant has none (`what` names a storage failure)."""
    _, tenant, runner = _context(request)
    batch_id = request.path_params["batch_id"]
    batch = await stored_call(what, call, runner.store, tenant, batch_id)
    if batch is None:
        raise _no_such_batch(batch_id)
    return runner, batch


def _check(req: BatchCreateRequest) -> None:
    if req.endpoint not in ENDPOINTS:
        raise APIError(
            400, f"endpoint must be one of {', '.join(ENDPOINTS)}, not {echo(req.endpoint)}", param="endpoint"
        )
    if req.completion_window not in COMPLETION_WINDOWS:
        windows = ", ".join(map(repr, COMPLETION_WINDOWS))
        raise APIError(
            400,
            f"completion_window must be {windows}, not {echo(req.completion_window)}",
            param="completion_window",
        )


@operation("create a batch from an uploaded file", tag="Batches", body=BatchCreateRequest,
           ok_description="the Batch", example=lambda model: {  # (the id of a file POST /v1/files answered)
               "input_file_id": "file-abc123", "endpoint": "/v1/chat/completions",
               "completion_window": "24h"})  # fmt: skip
async def create_batch(request: Request) -> Response:
    state, tenant, runner = _context(request)
    req = BatchCreateRequest.model_validate(await read_json(request, state.max_body_bytes))
    _check(req)
    stored = await stored_call(
        "the input file could not be read", runner.files.get, tenant, req.input_file_id
    )
    if stored is None:
        raise APIError(400, f"No such File object: {echo(req.input_file_id)}", param="input_file_id",
                       code="file_not_found")  # fmt: skip
    if stored.purpose != "batch":
        raise APIError(
            400,
            f"the input file's purpose is {stored.purpose!r}; a batch reads 'batch' files",
            param="input_file_id",
        )
    max_model_len = state.system.model.max_model_len

    def oversized_line() -> APIError | None:  # before anything runs: what a line may write is bounded
        with runner.files.open(stored) as f:
            return check_line_size(parse_lines(f, req.endpoint), max_model_len)

    if (refused := await stored_call("the input file could not be read", oversized_line)) is not None:
        raise refused
    batch = await stored_call(
        "the batch could not be stored",
        runner.store.create,
        tenant,
        req.endpoint,
        req.input_file_id,
        req.completion_window,
        req.metadata,
    )
    runner.start(batch["id"])
    return JSONResponse(batch)


@operation("a batch", tag="Batches", ok_description="the Batch")
async def retrieve_batch(request: Request) -> Response:
    _, batch = await _path_batch(request, "the batch could not be read", BatchStore.get)
    return JSONResponse(batch)


@operation("the tenant's batches, newest first", tag="Batches", ok_description="a list of batches",
           query={"after": str, "limit": int})  # fmt: skip
async def list_batches(request: Request) -> Response:
    _, tenant, runner = _context(request)
    failure = "the batches could not be read"
    return JSONResponse(
        await stored_page(request.query_params, failure, "batch", "tenant", runner.store.page, tenant)
    )


@operation("cancel a batch", tag="Batches", ok_description="the Batch")
async def cancel_batch(request: Request) -> Response:
    runner, batch = await _path_batch(request, "the batch could not be cancelled", BatchStore.cancel)
    if batch["status"] not in ("cancelling", "cancelled"):
        raise APIError(
            409, f"the batch is {batch['status']}: only a validating or in-progress batch can be cancelled",
            param="batch_id", code="batch_not_cancellable",
        )  # fmt: skip
    runner.cancel(batch["id"])
    return JSONResponse(batch)
