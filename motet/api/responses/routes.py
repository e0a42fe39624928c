"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request is translated into a chat request (motet/api/responses/request.py) and runs the chat path: the same
spec, grammar and tool handling (motet/api/completions/generation.py `chat_spec`), the same actors, the same output splitter
(motet/api/completions/chat_output.py), whose deltas become output items and typed events (motet/api/responses/items.py). The
response is stored for its tenant (motet/api/responses/store.py) unless `store` is false, so a later request
continues the conversation with `previous_response_id`, after a restart too.

The store failing never loses an answer: a response that could not be stored (a full disk, an I/O error, a
tenant's limit reached while it was generated) is returned all the same, marked `store: false`, with a
warning; a stream always ends with its terminal event. A request the store has no room for is refused before
it is generated (400 naming the limit), and reading the store when it fails is a 507 / 503 saying why.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import anyio.to_thread
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.actors.reply import ReplyStream
from motet.api.billing import Bill
from motet.api.choice import Choice
from motet.api.completions.chat_output import ChatOutput
from motet.api.completions.generation import (
    MAX_WARNING_CHARS,
    WARNING_HEADER,
    accept_request,
    chat_output,
    chat_spec,
    submit,
    with_warnings,
)
from motet.api.errors import APIError, from_validation_error
from motet.api.openapi import operation
from motet.api.responses.input_items import not_found, read_response
from motet.api.responses.items import OutputItems
from motet.api.responses.request import ResponsesRequest, chat_request, input_items, renamed
from motet.api.responses.store import ConversationTooLong, QuotaExceeded, ResponseStore
from motet.api.sqlite_store import StorageFailure
from motet.api.state import ServerState, state_and_tenant
from motet.api.storage_errors import storage_error, stored_call
from motet.api.streams import EventStream, collect, in_flight, internal_error, observe, read_deltas, usage

log = logging.getLogger("motet.api")


# -- the Response object ------------------------------------------------------------------------------------
def _tool(tool) -> dict:
    """A request's function tool as the Response echoes it (flat, as the Responses API writes tools)."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    return {
        "type": "function",
        "name": fn.get("name"),
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
        "strict": fn.get("strict"),
    }


class ResponseRun:
    """One response being generated: its output items, and the Response object they make."""

    def __init__(self, state, tenant, req, rid, history, output: ChatOutput, choice: Choice):
        self.state, self.tenant, self.req, self.rid = state, tenant, req, rid
        self.history, self.output, self.choice = history, output, choice
        self.created_at = int(time.time())
        self.items = OutputItems()
        self.warning: str | None = None  # why the response was not stored, when storing failed

    def response(self, status: str, error: dict | None = None) -> dict:
        req = self.req
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": req.model,
            "instructions": req.instructions,
            "previous_response_id": req.previous_response_id,
            "output": self.items.items if done else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice or "auto",
            "tools": [_tool(t) for t in req.tools or []],
            "text": {"format": req.text_format},
            "reasoning": {"effort": None, "summary": None},
            "temperature": self.state.sampling_defaults.get("temperature", 1.0)
            if req.temperature is None
            else req.temperature,
            "top_p": self.state.sampling_defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "truncation": "disabled",
            "store": req.stored,
            "background": False,
            "service_tier": "flex" if req.service_tier == "flex" else "default",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict:
        u = usage([self.choice.prompt_ids], [self.choice], False)
        encode = self.state.system.model.encode
        reasoning = "".join(i["content"][0]["text"] for i in self.items.items if i["type"] == "reasoning")
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": u.prompt_tokens_details["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": u.completion_tokens,
            # the reasoning's share, re-tokenized from its text (the engine counts tokens, not parts)
            "output_tokens_details": {"reasoning_tokens": len(encode(reasoning, add_special_tokens=False))},
            "total_tokens": u.total_tokens,
        }

    def _status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def _finish_events(self) -> list[dict]:
        deltas, _ = self.output.finish(self.choice.finish_reason)
        return self.items.feed(deltas) + self.items.close(incomplete=self.choice.finish_reason == "length")

    def whole(self) -> dict:
        """The Response of a collected choice (the same items the stream would have sent)."""
        self.items.feed(self.output.feed(self.choice.text))
        self._finish_events()
        return self.response(self._status())

    async def save(self, response: dict) -> dict:
        """Store the response (unless `store` is false) and return it as the client gets it: if storing
        fails, the answer is not lost but returned marked `store: false`, with a warning (self.warning)."""
        store: ResponseStore | None = self.state.responses
        if not self.req.stored or store is None:
            return response
        put = functools.partial(store.put, self.tenant, response, input_items(self.req),
                                self.req.previous_response_id, self.history)  # fmt: skip
        try:
            await anyio.to_thread.run_sync(put)
        except (StorageFailure, QuotaExceeded) as e:
            what = "the response was not stored"
            self.warning = storage_error(e, what).message if isinstance(e, StorageFailure) else f"{what}: {e}"
            log.warning("%s: %s", self.rid, self.warning)
            return response | {"store": False}
        return response

    def warn(self, response: Response) -> Response:
        """The storing failure, if any, in the warning header (after the grammar's warnings)."""
        if self.warning is not None:
            value = "; ".join(
                filter(None, (response.headers.get(WARNING_HEADER), json.dumps(self.warning)[1:-1]))
            )
            response.headers[WARNING_HEADER] = value[:MAX_WARNING_CHARS]
        return response

    async def events(self, streams: list[ReplyStream], bill: Bill) -> AsyncIterator[str]:
        """The SSE body: response.created, in_progress, the items' events, then completed / incomplete
        (stored first, so a client that sees it can continue from it at once) or failed. It always ends
        with one of those: whatever fails on the way (the engine, a bug) ends it with response.failed."""
        seq = 0

        def send(event: dict) -> str:
            nonlocal seq
            event = event | {"sequence_number": seq}
            seq += 1
            return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

        try:
            yield send({"type": "response.created", "response": self.response("in_progress")})
            yield send({"type": "response.in_progress", "response": self.response("in_progress")})
            async for _, delta in read_deltas(streams, [self.choice]):
                for event in self.items.feed(self.output.feed(delta.text)) if delta.text else []:
                    yield send(event)
                if delta.finished:
                    observe(self.state, self.choice)
                    for event in self._finish_events():
                        yield send(event)
            bill.close()
            status = self._status()
            final = await self.save(self.response(status))
        except Exception as e:  # cancellation (the client left) is not an Exception: nothing to send then
            err = internal_error(e)
            failed = await self.save(
                self.response("failed", {"code": "server_error", "message": err.message})
            )
            yield send({"type": "response.failed", "response": failed})
            return
        yield send({"type": f"response.{status}", "response": final})


# -- the routes ---------------------------------------------------------------------------------------------
async def _history(state: ServerState, tenant: str, req: ResponsesRequest) -> tuple[list[dict], int]:
    """The conversation `previous_response_id` continues (the tenant's own responses only), and its turns."""
    if req.previous_response_id is None:
        return [], 0
    if state.responses is None:
        raise APIError(400, "this server stores no responses", param="previous_response_id")
    what = "the previous response could not be read"
    prev = await stored_call(what, state.responses.conversation, tenant, req.previous_response_id)
    if prev is None:
        raise not_found(req.previous_response_id, "previous_response_id", status=400)
    return prev.items, prev.turns


async def _admit(state: ServerState, tenant: str, req: ResponsesRequest, turns: int) -> None:
    """Refuse, before generating it, a response the store has no room for."""
    try:
        what = "the response store could not be read"
        await stored_call(what, state.responses.admit, tenant, input_items(req), turns)
    except QuotaExceeded as e:
        raise APIError(400, str(e), param="store", code="storage_quota_exceeded") from None
    except ConversationTooLong as e:
        raise APIError(400, str(e), param="previous_response_id", code="conversation_too_long") from None


@operation("a model response (OpenAI Responses API): the Response object, or its typed events when stream "
           "is true", tag="Responses", body=ResponsesRequest, ok_description="the Response",
           example=lambda model: {"model": model, "input": "Say hello in one sentence.",
                                  "max_output_tokens": 32})  # fmt: skip
async def create_response(request: Request) -> Response:
    state, tenant, req, adapter = await accept_request(request, ResponsesRequest)
    if req.store is True and state.responses is None:
        raise APIError(400, "this server stores no responses: send store false", param="store")
    history, turns = await _history(state, tenant, req)
    if req.stored and state.responses is not None:
        await _admit(state, tenant, req, turns)
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        spec, structure, _, _ = chat_spec(state, tenant, adapter, chat_request(req, history), rid)
    except APIError as e:
        raise renamed(e) from None
    except ValidationError as e:
        raise renamed(from_validation_error(e)) from None
    arrival = time.perf_counter()
    with in_flight(state) as streams:
        try:
            (adm,) = await submit(state, spec)
        except APIError as e:
            raise renamed(e) from None
        streams += adm.streams
        state.metrics.prompt_tokens.inc(len(adm.prompt_token_ids))
        choice = Choice(0, adm.prompt_token_ids, arrival)
        bill = Bill(state.system.model.max_model_len, state.usage, [adm.prompt_token_ids], [choice], streams)
        bill.reserve(spec.max_tokens)
        run = ResponseRun(state, tenant, req, rid, history, chat_output(state, adm, structure)(), choice)
        if req.stream:
            events = run.events(streams, bill)
            return with_warnings(EventStream(state, streams, events, bill, done=False), structure, rid)
        await collect(request, state, [choice], streams, bill)
        response = await run.save(run.whole())
        return run.warn(with_warnings(JSONResponse(response), structure, rid))


def _refuse_query(request: Request) -> None:
    for key, value in request.query_params.items():
        if key == "stream" and value.lower() == "true":
            raise APIError(
                400, "stream: replaying a stored response as events is not supported", param="stream"
            )
        if key not in ("stream", "include_obfuscation"):
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)


@operation("a stored response", tag="Responses", ok_description="the Response")
async def get_response(request: Request) -> Response:
    state, tenant = state_and_tenant(request)
    _refuse_query(request)
    return JSONResponse(
        await read_response(state, tenant, request.path_params["response_id"], ResponseStore.get)
    )


@operation("delete a stored response", tag="Responses", ok_description="deleted")
async def delete_response(request: Request) -> Response:
    state, tenant = state_and_tenant(request)
    response_id = request.path_params["response_id"]
    deleted = state.responses is not None and await stored_call(
        "the response could not be deleted", state.responses.delete, tenant, response_id
    )
    if not deleted:
        raise not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
