"""`GET /v1/usage`: an admin reads the tenants' usage (motet/api/usage.py's store) in the shape of OpenAI's usage
API, a page of time buckets."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.api.errors import APIError
from motet.api.openapi import operation
from motet.api.sqlite_store import StorageFailure
from motet.api.usage import BUCKETS, GROUPS, LIMITS, MAX_TIME


def _int_param(request: Request, name: str, default: int | None, low: int, high: int, what: str) -> int:
    """The query's integer `name` (`what` it is, for the error), `low` to `high`: the store's and SQLite's
    integers hold any of them."""
    value = request.query_params.get(name)
    if value is None:
        if default is None:
            raise APIError(400, f"{name} is required ({what})", param=name)
        return default
    try:
        number = int(value)
    except ValueError:
        raise APIError(400, f"{name} must be an integer ({what}), not {value[:40]!r}", param=name) from None
    if not low <= number <= high:
        raise APIError(400, f"{name} must be {what}, {low} to {high}; got {value[:40]}", param=name)
    return number


def _time_param(request: Request, name: str, default: int | None = None) -> int:
    return _int_param(request, name, default, 0, MAX_TIME, "a unix time in seconds")


@operation(
    "tenants' usage in time buckets (OpenAI's usage API shape); an admin key only", tag="Usage",
    ok_description="a page of buckets", required_query=("start_time",),
    query={"start_time": int, "end_time": int, "bucket_width": str, "group_by": str, "tenant": str,
           "model": str, "limit": int, "page": str},
)  # fmt: skip
async def usage_route(request: Request) -> Response:
    """GET /v1/usage: an admin key's (OpenAI's usage API shape, a page of time buckets)."""
    import anyio.to_thread

    state = request.app.state.motet
    state.auth.check_admin(request.headers.get("authorization"), "GET /v1/usage")
    if state.usage is None:
        raise APIError(404, "usage is not recorded by this server")
    q = request.query_params
    width_name = q.get("bucket_width", "1d")
    if width_name not in BUCKETS:
        raise APIError(400, f"bucket_width must be one of {', '.join(BUCKETS)}", param="bucket_width")
    width = BUCKETS[width_name]
    default_limit, max_limit = LIMITS[width_name]
    start = _time_param(request, "start_time")
    # (exclusive: by default the current second is in, and with it the current minute's counts, even at :00)
    end = _time_param(request, "end_time", int(time.time()) + 1)
    limit = _int_param(request, "limit", default_limit, 1, max_limit, f"the buckets a page for {width_name}")
    first = start
    if q.get("page") is not None:
        not_given = APIError(400, "page is not one this route gave (next_page)", param="page")
        try:
            first = _time_param(request, "page")
        except APIError:
            raise not_given from None
        if first < start or first >= end or (first - start) % width:
            raise not_given
    if end <= start:
        raise APIError(400, "end_time must be after start_time", param="end_time")
    groups = tuple(g for item in q.getlist("group_by") for g in item.split(",") if g)
    if bad := [g for g in groups if g not in GROUPS]:
        raise APIError(400, f"group_by {bad[0]!r} is not one of {', '.join(GROUPS)}", param="group_by")
    groups = tuple(dict.fromkeys(groups))
    last = min(end, first + limit * width)
    try:
        found = await anyio.to_thread.run_sync(
            state.usage.buckets, first, last, width, groups, q.get("tenant"), q.get("model")
        )
    except StorageFailure as e:
        raise APIError(503, f"the usage records could not be read: {e.cause}") from None
    data = [
        {"object": "bucket", "start_time": b, "end_time": min(b + width, end), "results": found.get(b, [])}
        for b in range(first, last, width)
    ]
    more = last < end
    return JSONResponse(
        {"object": "page", "data": data, "has_more": more, "next_page": str(last) if more else None}
    )
