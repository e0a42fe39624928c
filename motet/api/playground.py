"""The server's pages: the playground, a static chat page at `/` that calls the same API, and the API's docs at
`/docs` (Swagger UI on /openapi.json, as vLLM's users find them), with their assets under /static.

The pages hold no data, so serving them needs no API key; the requests they make carry the key the user gives
(the docs' "Authorize"). Their Content-Security-Policy lets them load and call nothing but this server: Swagger UI
is vendored (static/swagger-ui/), never fetched from a CDN, so the docs work offline too.
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


async def docs(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "docs.html", headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


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
        Route("/docs", docs, methods=["GET", "HEAD"], include_in_schema=False),
        Mount("/static", SecuredStaticFiles(directory=STATIC_DIR), name="static"),
    ]
