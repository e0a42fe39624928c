"""The playground: a static chat page at `/` (and its assets under /static) that calls the same API.

The page holds no data, so serving it needs no API key; the requests it makes carry the key the user gives.
Its Content-Security-Policy lets it load and call nothing but this server.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


class SecuredStaticFiles(StaticFiles):
    """The page's assets with the page's headers: `/static/index.html` is the page too, and must not be
    framed or load from elsewhere either."""

    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def playground_routes() -> list:
    return [
        Route("/", index, methods=["GET", "HEAD"], include_in_schema=False),
        Mount("/static", SecuredStaticFiles(directory=STATIC_DIR), name="static"),
    ]
