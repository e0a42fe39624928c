"""OpenAI's Files API, for the Batch API's input and output files and fine-tuning's examples and results (the store:
motet/api/files/store.py).

POST   /v1/files                    multipart: `file`, and `purpose` ("batch" or "fine-tune")
GET    /v1/files                    the tenant's files: `after`, `limit`, `order`, `purpose`
GET    /v1/files/{file_id}          the File object
GET    /v1/files/{file_id}/content  its bytes
DELETE /v1/files/{file_id}

Every call is scoped to the caller's tenant: another tenant's file reads as missing (404). An upload larger
than `--files-max-bytes` is refused with 413 while it is read (nothing is kept), and one past the tenant's
`--files-max-bytes-per-tenant` with 400 `storage_quota_exceeded`.
"""

from __future__ import annotations

import anyio.to_thread
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from motet.api.errors import APIError, echo
from motet.api.files.store import FileQuotaExceeded, FileStore, FileTooLarge, StoredFile
from motet.api.list_pages import list_object, page_limit, page_order, refuse_unknown
from motet.api.openapi import FILE, operation
from motet.api.request_body import bounded_form
from motet.api.state import ServerState, state_and_tenant
from motet.api.storage_errors import stored_call

# what an upload may be for: a batch's input, a fine-tuning job's examples (the server writes batch_output and
# fine-tune-results files itself)
PURPOSES = ("batch", "fine-tune")
MAX_LIST = 10_000  # OpenAI's largest page of files
_CHUNK = 1 << 20


def _context(request: Request) -> tuple[ServerState, str, FileStore]:
    state, tenant = state_and_tenant(request)
    if state.files is None:
        raise APIError(404, "this server stores no files")
    return state, tenant, state.files


def no_such_file(file_id: str, param: str = "file_id") -> APIError:
    return APIError(404, f"No such File object: {echo(file_id)}", param=param, code="file_not_found")


async def _found(store: FileStore, tenant: str, file_id: str) -> StoredFile:
    stored = await stored_call("the file could not be read", store.get, tenant, file_id)
    if stored is None:
        raise no_such_file(file_id)
    return stored


def _too_large(store: FileStore) -> APIError:
    return APIError(
        413,
        f"the file is larger than the server's limit of {store.max_file_bytes} bytes per file (--files-max-bytes)",
        param="file",
        code="file_too_large",
    )


@operation("upload a file (purpose: batch, fine-tune)", tag="Files",
           form={"file": FILE, "purpose": {"type": "string"}}, ok_description="the File")  # fmt: skip
async def upload_file(request: Request) -> Response:
    _, tenant, store = _context(request)
    too_large = _too_large(store)
    async with bounded_form(request, store.max_file_bytes, too_large, max_files=1, max_fields=4) as form:
        for key in form:
            if key not in ("file", "purpose"):
                if key.startswith("expires_after"):
                    raise APIError(400, "expires_after: files are kept until deleted", param="expires_after")
                raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)
        upload, purpose = form.get("file"), form.get("purpose")
        if purpose not in PURPOSES:
            raise APIError(
                400,
                f"purpose must be one of {', '.join(map(repr, PURPOSES))}, not {echo(purpose)}",
                param="purpose",
            )
        if not isinstance(upload, UploadFile):
            raise APIError(400, "the form needs the file as its `file` part", param="file")
        try:
            stored = await stored_call(
                "the file could not be stored",
                store.upload,
                tenant,
                upload.filename or "file",
                purpose,
                upload.file,
            )
        except FileTooLarge:
            raise _too_large(store) from None
        except FileQuotaExceeded as e:
            raise APIError(400, str(e), param="file", code="storage_quota_exceeded") from None
    return JSONResponse(stored.object())


@operation("the tenant's files", tag="Files", ok_description="a list of files",
           query={"after": str, "limit": int, "order": str, "purpose": str})  # fmt: skip
async def list_files(request: Request) -> Response:
    _, tenant, store = _context(request)
    q = request.query_params
    refuse_unknown(q, ("after", "limit", "order", "purpose"))
    order, limit, after = page_order(q), page_limit(q, MAX_LIST, MAX_LIST), q.get("after")
    page = await stored_call(
        "the files could not be read", store.page, tenant, after, limit, order, q.get("purpose")
    )
    if page is None:
        raise no_such_file(after, "after")
    files, more = page
    return JSONResponse(list_object([f.object() for f in files], more))


@operation("a file", tag="Files", ok_description="the File")
async def retrieve_file(request: Request) -> Response:
    _, tenant, store = _context(request)
    return JSONResponse((await _found(store, tenant, request.path_params["file_id"])).object())


@operation("a file's bytes", tag="Files", ok_description="the bytes", ok_media="application/octet-stream")
async def file_content(request: Request) -> Response:
    _, tenant, store = _context(request)
    stored = await _found(store, tenant, request.path_params["file_id"])
    handle = await stored_call(
        "the file could not be read", store.open, stored
    )  # open: a delete cannot cut it

    async def chunks():
        try:
            while chunk := await anyio.to_thread.run_sync(handle.read, _CHUNK):
                yield chunk
        finally:
            handle.close()

    return StreamingResponse(
        chunks(),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(stored.bytes),
            "Content-Disposition": f'attachment; filename="{stored.id}"',
        },
    )


@operation("delete a file", tag="Files", ok_description="deleted")
async def delete_file(request: Request) -> Response:
    _, tenant, store = _context(request)
    file_id = request.path_params["file_id"]
    if not await stored_call("the file could not be deleted", store.delete, tenant, file_id):
        raise no_such_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
