"""The OpenAPI document, generated from what the app registers.

Each handler declares its operation once, beside it, with `@operation(...)`: a summary, its tag (the route
family), its request model (or a multipart form), its response model, its query parameters. `document(routes)`
walks the app's Starlette routes (their paths, path parameters and methods) and asks pydantic for the models'
JSON schemas, so a route cannot be served without appearing in the document, nor documented without being
served. A route the document leaves out says so where it is registered (`include_in_schema=False`).

A JSON body's route also declares an `example`: a body that runs as shown, given the served model's name (the
document is made for the server that serves it). /docs' "Try it out" starts from it; without one, Swagger UI
makes a body of every field, optional ones as null and strings as "string", which the server refuses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from motet.api import protocol as P
from motet.version import __version__

# The route families, in the document's order.
TAGS = {
    "Chat": "chat completions (OpenAI)",
    "Completions": "text completions (OpenAI)",
    "Responses": "the Responses API (OpenAI): model responses, stored and chained",
    "Models": "the base model and the adapters a tenant can name",
    "Files": "files for batches and fine-tuning (OpenAI)",
    "Batches": "batches of requests run beside live traffic (OpenAI)",
    "Fine-tuning": "fine-tuning jobs: a tenant's examples in, its adapter served (OpenAI)",
    "Adapters": "a tenant's LoRA adapters, and vLLM's adapter routes",
    "Tokenization": "vLLM's tokenize and detokenize",
    "Usage": "tenants' usage (OpenAI's usage API shape)",
    "Server": "health, version and metrics",
}

# What every failure answers with (an OpenAI-shaped error) and the statuses a route may give.
ERRORS = {
    400: "bad parameter",
    401: "bad API key",
    403: "not allowed (a shared adapter)",
    404: "unknown model or adapter",
    409: "the adapter name is taken",
    413: "body too large",
    429: "queue full (see Retry-After)",
    500: "server error",
    503: "starting or draining",
}

FILE = {"type": "string", "format": "binary"}  # a multipart form's file field


@dataclass
class Operation:
    """One route's entry in the document: `body` its request model (several: any one of them) or `form` a
    multipart form's fields (all required); `ok` the 200 answer's model (none: a JSON object), or `ok_media`
    another media type; `stream` the SSE chunks' model when the body asks for a stream; `query` its query
    parameters' types; `errors` the error statuses it may answer (all of ERRORS by default; a dict gives its
    own descriptions); `public` when it needs no API key; `example` the body /docs offers, made from the
    served model's name (one that runs as shown; a route that names a resource, a file or an adapter,
    names one the tenant would have made first). A handler's docstring is the description."""

    summary: str
    tag: str
    body: type[BaseModel] | tuple[type[BaseModel], ...] = ()
    form: dict[str, dict] | None = None
    ok: type[BaseModel] | None = None
    ok_description: str = "the result"
    ok_media: str = "application/json"
    stream: type[BaseModel] | None = None
    query: dict[str, Any] = field(default_factory=dict)
    required_query: tuple[str, ...] = ()
    errors: Sequence[int] | dict[int, str] = tuple(ERRORS)
    public: bool = False
    example: Callable[[str], dict] | None = None

    def __post_init__(self):
        if self.tag not in TAGS:
            raise ValueError(f"unknown OpenAPI tag {self.tag!r}: add it to motet.api.openapi.TAGS")
        if not isinstance(self.body, tuple):
            self.body = (self.body,)
        if not isinstance(self.errors, dict):
            self.errors = {status: ERRORS[status] for status in self.errors}
        if self.body and self.example is None:
            raise ValueError(f"{self.summary!r}: a JSON body's route declares an example (a body that runs)")

    def models(self) -> list[tuple[type[BaseModel], str]]:
        """The models whose JSON schemas the document holds, each with pydantic's mode for it."""
        answers = [m for m in (self.ok, self.stream) if m is not None]
        return [(m, "validation") for m in self.body] + [(m, "serialization") for m in answers]


def operation(summary: str, **declared):
    """Declare the handler's operation (the fields of `Operation`) beside it."""
    op = Operation(summary, **declared)

    def declare(handler):
        handler.openapi = op  # functools.wraps (guarded) carries it onto the registered endpoint
        return handler

    return declare


def documented(routes: Sequence[BaseRoute]) -> list[tuple[str, str, Route]]:
    """(path, method, route) of each route the document shows: every `Route` not registered with
    `include_in_schema=False`, each of its methods but HEAD (Starlette answers HEAD for every GET)."""
    out = []
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        path = re.sub(r"{(\w+):\w+}", r"{\1}", route.path)  # /v1/models/{model_id:path} -> {model_id}
        out += [(path, method.lower(), route) for method in sorted(route.methods or ()) if method != "HEAD"]
    return out


def _declared(route: Route) -> Operation:
    op = getattr(route.endpoint, "openapi", None)
    if op is None:
        raise LookupError(
            f"{route.path}: its handler {route.endpoint.__qualname__} declares no @operation "
            "(or register it with include_in_schema=False)"
        )
    return op


def _parameters(route: Route, op: Operation) -> list[dict]:
    path = [
        {"name": name, "in": "path", "required": True,
         "schema": {"type": "integer" if type(conv).__name__ == "IntegerConvertor" else "string"}}
        for name, conv in route.param_convertors.items()
    ]  # fmt: skip
    query = [
        {"name": name, "in": "query", "required": name in op.required_query,
         "schema": TypeAdapter(kind).json_schema()}
        for name, kind in op.query.items()
    ]  # fmt: skip
    return path + query


def _operation(route: Route, op: Operation, ref, model: str) -> dict:
    out: dict[str, Any] = {"tags": [op.tag], "summary": op.summary}
    if doc := (route.endpoint.__doc__ or "").strip():
        out["description"] = " ".join(doc.split())
    if params := _parameters(route, op):
        out["parameters"] = params
    if op.public:
        out["security"] = []
    if op.body:
        schemas = [ref(m, "validation") for m in op.body]
        schema = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
        body = {"schema": schema, "example": op.example(model)}
        out["requestBody"] = {"required": True, "content": {"application/json": body}}
    elif op.form is not None:
        form = {"type": "object", "required": list(op.form), "properties": op.form}
        out["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": form}}}
    if op.ok_media != "application/json":
        content = {op.ok_media: {"schema": FILE if "octet-stream" in op.ok_media else {"type": "string"}}}
    else:
        content = {
            "application/json": {"schema": ref(op.ok, "serialization") if op.ok else {"type": "object"}}
        }
    if op.stream is not None:
        sse = f"when stream is true: `data:` lines of {op.stream.__name__} JSON, then `data: [DONE]`"
        content["text/event-stream"] = {"schema": {"type": "string", "description": sse}}
    error = {"application/json": {"schema": ref(P.ErrorResponse, "serialization")}}
    ok = op.ok_description if op.stream is None else f"{op.ok_description}, or SSE chunks when stream is true"
    out["responses"] = {
        "200": {"description": ok, "content": content},
        **{str(s): {"description": d, "content": error} for s, d in sorted(op.errors.items())},
    }
    return out


def document(routes: Sequence[BaseRoute], model: str) -> dict:
    """The OpenAPI 3.1 document of these routes, served with `model` as the model's name (its examples')."""
    ops = [(path, method, route, _declared(route)) for path, method, route in documented(routes)]
    wanted = [(P.ErrorResponse, "serialization")]
    for *_, op in ops:
        wanted += [m for m in op.models() if m not in wanted]
    refs, defs = models_json_schema(wanted, ref_template="#/components/schemas/{model}")

    def ref(model: type[BaseModel], mode: str) -> dict:
        return refs[(model, mode)]

    paths: dict[str, dict] = {}
    for path, method, route, op in ops:
        if method in paths.setdefault(path, {}):
            raise ValueError(f"{method.upper()} {path} is registered twice")
        paths[path][method] = _operation(route, op, ref, model)
    used = {op.tag for *_, op in ops}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "motet",
            "version": __version__,
            "description": "OpenAI-compatible LLM serving",
        },
        "tags": [{"name": t, "description": d} for t, d in TAGS.items() if t in used],
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an API key from --api-keys (a tenant's; /metrics and /v1/usage take an "
                    "admin's); a server without --api-keys asks for none",
                }
            },
        },
        "security": [{"bearer": []}],
    }
