"""GET /v1/responses/{id}/input_items: the items a stored response was generated from, as OpenAI lists them; and
`read_response`, a tenant's stored response as the Responses routes read it (404 where there is none).

What it lists: everything the model was shown as items for that response, which for a response that continued
another (`previous_response_id`) is the whole conversation before it, each earlier turn's input and output
items, then the response's own input (OpenAI describes the list as "the items used to generate this
response", and its items include output messages and function calls of earlier turns). `instructions` are no
item and are not listed; reasoning items are never shown to the model again (motet/api/responses/items.py
`model_visible`), so they are not listed either.

Items are returned in OpenAI's item shapes (a message's string content becomes one `input_text` /
`output_text` part) with an `id` and a `status`. An earlier turn's output items keep the ids its Response
gave them; an item whose id was not stored (input items, and the output of a turn deleted since, which keeps
only what the model sees) gets one derived from its response and place: the same on every call, so the
`after` cursor pages through the list.
"""

from __future__ import annotations

import hashlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.api.errors import APIError, echo
from motet.api.list_pages import list_object, page_limit, page_order, refuse_unknown
from motet.api.openapi import operation
from motet.api.responses.store import ResponseStore, Turn
from motet.api.state import ServerState, state_and_tenant
from motet.api.storage_errors import stored_call

MAX_ECHOED_ID_CHARS = 80  # ids are `resp_` and 32 hex digits: a longer one is not echoed whole


def not_found(response_id: str, param: str, status: int = 404) -> APIError:
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    shown = (
        response_id if len(response_id) <= MAX_ECHOED_ID_CHARS else response_id[:MAX_ECHOED_ID_CHARS] + "..."
    )
    return APIError(status, f"No response found with id '{shown}'.", param=param, code=code)


async def read_response(state: ServerState, tenant: str, response_id: str, read):
    """What `read` (a ResponseStore method: `get`, the Response; `turns`, its conversation) returns of the
    tenant's stored response `response_id`; 404 where there is none (or the server stores none)."""
    found = None
    if state.responses is not None:
        found = await stored_call(
            "the response could not be read", read, state.responses, tenant, response_id
        )
    if found is None:
        raise not_found(response_id, "response_id")
    return found


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
_QUERY = ("after", "limit", "order", "include", "include[]")


def _item_id(item: dict, response_id: str, where: str) -> str:
    prefix = _ID_PREFIXES.get(item.get("type"), "item")
    digest = hashlib.sha256(f"{response_id}:{where}".encode()).hexdigest()[:32]
    return f"{prefix}_{digest}"


def _shaped(item: dict, response_id: str, where: str) -> dict:
    """One stored item in the shape OpenAI returns it: an id, a status, content as parts."""
    out = dict(item)
    if out.get("type") == "message":
        assistant = out.get("role") == "assistant"
        if isinstance(out.get("content"), str):
            kind = "output_text" if assistant else "input_text"
            out["content"] = [{"type": kind, "text": out["content"]}]
        out["content"] = [
            {**p, "annotations": p.get("annotations", [])} if p.get("type") == "output_text" else p
            for p in out.get("content") or []
            if isinstance(p, dict)
        ]
    out.setdefault("id", _item_id(item, response_id, where))
    out.setdefault("status", "completed")
    return out


def conversation_items(turns: list[Turn]) -> list[dict]:
    """The items the last turn was generated from, oldest first."""
    items: list[dict] = []
    for n, turn in enumerate(turns):
        items += [_shaped(it, turn.response_id, f"input:{i}") for i, it in enumerate(turn.input)]
        if n < len(turns) - 1:  # an earlier turn's output is input to the later ones
            items += [
                _shaped(it, turn.response_id, f"output:{i}")
                for i, it in enumerate(turn.output)
                if isinstance(it, dict) and it.get("type") != "reasoning"
            ]
    return items


def _params(request: Request) -> tuple[str | None, int, str]:
    q = request.query_params
    refuse_unknown(q, _QUERY)
    include = [v for key in ("include", "include[]") for v in q.getlist(key) if v]
    if include:  # what they would add (logprobs, encrypted reasoning, images) is not stored
        raise APIError(
            400,
            f"include: {echo(include[0])} is not available: stored items keep only what the model is shown",
            param="include",
        )
    order = page_order(q)
    return q.get("after"), page_limit(q), order


@operation("the items a stored response was generated from (its whole conversation)", tag="Responses",
           ok_description="a list of items", query={"after": str, "limit": int, "order": str})  # fmt: skip
async def list_input_items(request: Request) -> Response:
    state, tenant = state_and_tenant(request)
    after, limit, order = _params(request)
    turns = await read_response(state, tenant, request.path_params["response_id"], ResponseStore.turns)
    items = conversation_items(turns)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise APIError(
                400, f"after: no item {echo(after)} among this response's input items", param="after"
            )
        items = items[ids.index(after) + 1 :]
    return JSONResponse(list_object(items[:limit], len(items) > limit))
