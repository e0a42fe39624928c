"""Per-tenant LoRA adapters over HTTP (the store behind them: motet/api/adapters/store.py).

POST   /v1/adapters         multipart form: `name`, and the adapter as `files` parts: adapter_config.json
                            and adapter_model.safetensors, or one .tar / .tar.gz / .tgz / .zip archive
GET    /v1/adapters         the tenant's adapters, and the shared ones
GET    /v1/adapters/{name}
DELETE /v1/adapters/{name}  requests already using it finish with it

and vLLM's adapter management, for the scripts written against it (same store, same tenant scope):

POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: an adapter directory on the server, from under
                              the operator's --lora-load-dir directories only
POST /v1/unload_lora_adapter  {"lora_name"}
"""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from motet.api.adapters import protocol as P
from motet.api.adapters.store import ARCHIVES, Adapter, AdapterStore
from motet.api.errors import APIError
from motet.api.openapi import FILE, operation
from motet.api.request_body import bounded_form, read_json
from motet.api.state import ServerState
from motet.lora.adapter import PICKLED_SUFFIXES, pickle_refusal
from motet.lora.registry import FILES


# -- handlers ---------------------------------------------------------------------------------------------
def _context(request: Request) -> tuple[ServerState, AdapterStore, str]:
    state: ServerState = request.app.state.motet
    state.check_ready()
    tenant = state.auth.tenant(request.headers.get("authorization"))
    if state.adapters is None:
        raise APIError(404, "this server does not store adapters")
    return state, state.adapters, tenant


def card(state: ServerState, a: Adapter) -> P.AdapterCard:
    return P.AdapterCard(
        id=a.ref.model, created=a.created, owned_by=a.owner, parent=state.model_name, size_bytes=a.size_bytes
    )


async def read_upload(request: Request, max_bytes: int) -> tuple[str, dict[str, bytes]]:
    """The form's `name` and its files (filename -> bytes); a body much over `max_bytes` is a 413."""
    too_large = APIError(
        413,
        f"the upload is larger than the adapter size limit of {max_bytes} bytes",
        code="adapter_too_large",
    )
    async with bounded_form(request, max_bytes, too_large, max_files=8, max_fields=8) as form:
        name = form.get("name")
        files: dict[str, bytes] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if value.filename in files:
                    raise APIError(400, f"file {value.filename!r} is uploaded twice", param=key)
                files[value.filename or ""] = await value.read()
    if not isinstance(name, str) or not name:
        raise APIError(400, "the form needs a `name` field: the adapter's name", param="name")
    if not files:
        raise APIError(
            400,
            f"the form needs the adapter as `files` parts: {' and '.join(FILES)}, or one "
            f"{'/'.join(ARCHIVES)} archive",
            param="files",
        )
    if pickled := [f for f in files if f.lower().endswith(PICKLED_SUFFIXES)]:
        raise APIError(400, str(pickle_refusal(pickled[0])), param="files")
    return name, files


@operation(
    "upload a LoRA adapter: form fields `name` and `files` (adapter_config.json + adapter_model.safetensors, "
    "or one .tar/.tar.gz/.tgz/.zip archive)",
    tag="Adapters", form={"name": {"type": "string"}, "files": {"type": "array", "items": FILE}},
    ok=P.AdapterCard, ok_description="the stored adapter",
)  # fmt: skip
async def upload_adapter(request: Request) -> Response:
    state, store, tenant = _context(request)
    name, files = await read_upload(request, store.max_bytes)
    adapter = await store.save(tenant, name, files)
    return JSONResponse(card(state, adapter).model_dump())


@operation("the tenant's adapters and the shared ones", tag="Adapters", ok=P.AdapterList,
           ok_description="adapters")  # fmt: skip
async def list_adapters(request: Request) -> Response:
    state, store, tenant = _context(request)
    cards = [card(state, a) for a in await store.visible(tenant)]
    return JSONResponse(P.AdapterList(data=cards).model_dump())


@operation("one adapter", tag="Adapters", ok=P.AdapterCard, ok_description="the adapter")
async def get_adapter(request: Request) -> Response:
    state, store, tenant = _context(request)
    adapter = await store.get(tenant, request.path_params["name"])
    return JSONResponse(card(state, adapter).model_dump())


@operation("delete an adapter; requests already using it finish", tag="Adapters", ok=P.AdapterDeleted,
           ok_description="deleted")  # fmt: skip
async def delete_adapter(request: Request) -> Response:
    state, store, tenant = _context(request)
    name = request.path_params["name"]
    await store.delete(tenant, name)
    return JSONResponse(P.AdapterDeleted(id=name).model_dump())


@operation("vLLM: store a server-side adapter directory", tag="Adapters", body=P.LoadLoraAdapterRequest,
           ok_media="text/plain", ok_description="done", example=lambda model: {
               "lora_name": "my-adapter", "lora_path": "/adapters/my-adapter"})  # fmt: skip
async def load_lora_adapter(request: Request) -> Response:
    state, store, tenant = _context(request)
    req = P.LoadLoraAdapterRequest.model_validate(await read_json(request, state.max_body_bytes))
    await store.load_from(tenant, req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@operation("vLLM: delete an adapter", tag="Adapters", body=P.UnloadLoraAdapterRequest, ok_media="text/plain",
           ok_description="done", example=lambda model: {"lora_name": "my-adapter"})  # fmt: skip
async def unload_lora_adapter(request: Request) -> Response:
    state, store, tenant = _context(request)
    req = P.UnloadLoraAdapterRequest.model_validate(await read_json(request, state.max_body_bytes))
    await store.delete(tenant, req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
