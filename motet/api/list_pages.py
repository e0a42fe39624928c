"""The list routes' shared query and answer (GET /v1/files, /v1/batches, /v1/fine_tuning/jobs and a job's events
and checkpoints, a response's input items): OpenAI's cursor pages, `after` an object's id and `limit` objects from
there in `order`, answered as a list object."""

from __future__ import annotations

import functools
from collections.abc import Collection

from starlette.datastructures import QueryParams

from motet.api.errors import APIError, echo
from motet.api.storage_errors import stored_call

DEFAULT_LIMIT, MAX_LIMIT = 20, 100  # OpenAI's page of a list (of files: up to 10,000, all by default)


def refuse_unknown(query: QueryParams, known: Collection[str]) -> None:
    """A 400 naming the first query parameter the route does not take."""
    for key in query:
        if key not in known:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)


def page_limit(query: QueryParams, default: int = DEFAULT_LIMIT, most: int = MAX_LIMIT) -> int:
    """`limit`, from 1 to `most` (`default` where absent)."""
    raw = query.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(400, f"limit must be an integer from 1 to {most}, not {echo(raw)}", param="limit")
    return int(raw)


def page_order(query: QueryParams) -> str:
    """`order`: "asc" or "desc" (the default, newest first)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', not {echo(order)}", param="order")
    return order


def list_object(data: list[dict], has_more: bool) -> dict:
    """OpenAI's list object of a page of objects."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


async def stored_page(query: QueryParams, failure: str, noun: str, owner: str, read, *args,
                      default_limit: int = DEFAULT_LIMIT, **filters) -> dict:  # fmt: skip
    """The list object of a cursor page that a store reads (`after` and `limit`, nothing else, in the query):
    `read(*args, after, limit, **filters)` in a worker thread gives (objects, has_more), or None where `after` names
    no `noun` of the `owner`'s (a 400); `failure` says what failed where the storage does."""
    refuse_unknown(query, ("after", "limit"))
    limit, after = page_limit(query, default_limit), query.get("after")
    page = await stored_call(failure, functools.partial(read, **filters), *args, after, limit)
    if page is None:
        raise APIError(400, f"after: no {noun} {echo(after)} of this {owner}", param="after")
    return list_object(*page)
