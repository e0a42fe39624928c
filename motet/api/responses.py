"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request is translated into a chat request (motet/api/responses_request.py) and runs the chat path: the same
spec, grammar and tool handling (motet/api/openai.py `chat_spec`), the same actors, the same output splitter
(motet/api/chat_output.py), whose deltas become output items and typed events (motet/api/response_items.py). The
response is stored for its tenant (motet/api/response_store.py) unless `store` is false, so a later request
continues the conversation with `previous_response_id`, after a restart too.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import anyio.to_thread
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.actors.reply import ReplyStream, merge_streams
from motet.api.chat_output import ChatOutput
from motet.api.errors import APIError, from_serving_error, from_validation_error
from motet.api.openai import accept_request, chat_output, chat_spec, submit, with_warnings
from motet.api.response_items import OutputItems
from motet.api.response_store import ResponseStore
from motet.api.responses_request import ResponsesRequest, chat_request, input_items, renamed
from motet.api.state import ServerState
from motet.api.streams import Choice, EventStream, collect, observe, release, usage


def _not_found(response_id: str, param: str, status: int = 404) -> APIError:
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return APIError(status, f"No response found with id '{response_id}'.", param=param, code=code)


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
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "truncation": "disabled",
            "store": req.stored,
            "background": False,
            "service_tier": "default",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict:
        u = usage([self.choice.prompt_ids], [self.choice], False)
        encode = self.state.system.engine.tokenizer.hf.encode
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

    async def save(self, response: dict) -> None:
        store: ResponseStore | None = self.state.responses
        if self.req.stored and store is not None:
            context = [*self.history, *input_items(self.req)]
            await anyio.to_thread.run_sync(store.put, self.tenant, response, context)

    async def events(self, streams: list[ReplyStream]) -> AsyncIterator[str]:
        """The SSE body: response.created, in_progress, the items' events, then completed / incomplete
        (stored first, so a client that sees it can continue from it at once) or failed."""
        seq = 0

        def send(event: dict) -> str:
            nonlocal seq
            event = event | {"sequence_number": seq}
            seq += 1
            return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

        yield send({"type": "response.created", "response": self.response("in_progress")})
        yield send({"type": "response.in_progress", "response": self.response("in_progress")})
        async for _, delta in merge_streams(streams):
            self.choice.add(delta)
            if delta.error is not None:
                err = from_serving_error(delta.error)
                failed = self.response("failed", {"code": "server_error", "message": err.message})
                await self.save(failed)
                yield send({"type": "response.failed", "response": failed})
                return
            for event in self.items.feed(self.output.feed(delta.text)) if delta.text else []:
                yield send(event)
            if delta.finished:
                observe(self.state, self.choice)
                for event in self._finish_events():
                    yield send(event)
        status = self._status()
        final = self.response(status)
        await self.save(final)
        yield send({"type": f"response.{status}", "response": final})


# -- the routes ---------------------------------------------------------------------------------------------
def _tenant(request: Request) -> tuple[ServerState, str]:
    state: ServerState = request.app.state.motet
    return state, state.auth.tenant(request.headers.get("authorization"))


async def _history(state: ServerState, tenant: str, req: ResponsesRequest) -> list[dict]:
    """The conversation `previous_response_id` continues (the tenant's own responses only)."""
    if req.previous_response_id is None:
        return []
    if state.responses is None:
        raise APIError(400, "this server stores no responses", param="previous_response_id")
    prev = await anyio.to_thread.run_sync(state.responses.get, tenant, req.previous_response_id)
    if prev is None:
        raise _not_found(req.previous_response_id, "previous_response_id", status=400)
    return prev.conversation()


async def create_response(request: Request) -> Response:
    state, tenant, req, adapter = await accept_request(request, ResponsesRequest)
    if req.store is True and state.responses is None:
        raise APIError(400, "this server stores no responses: send store false", param="store")
    history = await _history(state, tenant, req)
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        spec, structure, _, _ = chat_spec(state, tenant, adapter, chat_request(req, history), rid)
    except APIError as e:
        raise renamed(e) from None
    except ValidationError as e:
        raise renamed(from_validation_error(e)) from None
    arrival = time.perf_counter()
    state.inflight += 1
    streams: list[ReplyStream] = []
    try:
        try:
            (adm,) = await submit(state, spec)
        except APIError as e:
            raise renamed(e) from None
        streams = adm.streams
        state.metrics.prompt_tokens.inc(len(adm.prompt_token_ids))
        choice = Choice(0, adm.prompt_token_ids, arrival)
        run = ResponseRun(state, tenant, req, rid, history, chat_output(state, adm, structure)(), choice)
        if req.stream:
            return with_warnings(EventStream(state, streams, run.events(streams), done=False), structure, rid)
        await collect(request, state, [choice], streams)
        response = run.whole()
        await run.save(response)
        return with_warnings(JSONResponse(response), structure, rid)
    except BaseException:
        release(state, streams)
        raise
    finally:
        state.inflight -= 1


def _refuse_query(request: Request) -> None:
    for key, value in request.query_params.items():
        if key == "stream" and value.lower() == "true":
            raise APIError(
                400, "stream: replaying a stored response as events is not supported", param="stream"
            )
        if key not in ("stream", "include_obfuscation"):
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)


async def get_response(request: Request) -> Response:
    state, tenant = _tenant(request)
    _refuse_query(request)
    response_id = request.path_params["response_id"]
    stored = (
        await anyio.to_thread.run_sync(state.responses.get, tenant, response_id) if state.responses else None
    )
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    state, tenant = _tenant(request)
    response_id = request.path_params["response_id"]
    deleted = state.responses is not None and await anyio.to_thread.run_sync(
        state.responses.delete, tenant, response_id
    )
    if not deleted:
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
