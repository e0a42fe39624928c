"""Reading reply streams for one HTTP request: accumulate choices, collect them, or relay them as SSE.

However a request ends (finished, failed, client gone), what still runs in the engine is aborted, and a stream
that fails midway (the engine, a bug, the disk) still ends with an error event: never a cut connection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from motet.actors.reply import ReplyStream, merge_streams
from motet.actors.serving_errors import ServingError, ShuttingDown
from motet.api import protocol as P
from motet.api import tracing
from motet.api.billing import Bill
from motet.api.choice import Choice
from motet.api.errors import APIError, from_serving_error
from motet.api.state import ServerState
from motet.engine.outputs import OutputDelta

log = logging.getLogger("motet.api")


def release(state: ServerState, streams: list[ReplyStream]) -> None:
    """Abort what is still running (the client is gone, or the handler failed); never blocks."""
    for s in streams:
        if not s.closed:
            s.cancel()
            state.system.abort(s.request_id)


@contextlib.contextmanager
def in_flight(state: ServerState) -> Iterator[list[ReplyStream]]:
    """A generating request's handler: held in `state.inflight` while it runs (a drain waits for it, and cuts it
    at its deadline: `cut`), and the reply streams it adds to the list it is given released if it fails or is
    cancelled."""
    streams: list[ReplyStream] = []
    state.inflight.enter(streams)
    try:
        yield streams
    except BaseException:
        release(state, streams)
        raise
    finally:
        state.inflight.leave(streams)


def cut(state: ServerState) -> int:
    """A drain past its deadline: each request still generating ends as a failure midway does, a 503 (a stream
    with its error event, then its last event; a request not streamed, its 503 answer), and what runs of it is
    aborted. How many requests were cut."""
    n = 0
    for streams in state.inflight.requests():
        running = [s for s in streams if not s.closed]
        for s in running:
            s.cancel()
            state.system.abort(s.request_id)
            s.fail(ShuttingDown("the server shut down before the request finished"))
        n += bool(running)
    return n


def observe(state: ServerState, c: Choice, choices: list[Choice] | None = None) -> None:
    """A finished choice in the metrics; `choices`: the request's (the most tokens one choice of a prompt
    generated is counted once all of that prompt's choices are). What the tenant is billed is its `Bill`'s
    (motet/api/billing.py)."""
    if c.error is not None or c.first_token is None:
        return
    m, end = state.metrics, time.perf_counter()
    m.ttft.observe(c.first_token - c.arrival)
    m.e2e.observe(end - c.arrival)
    if len(c.token_ids) > 1:
        m.tpot.observe((end - c.first_token) / (len(c.token_ids) - 1))
    m.generation_tokens.inc(len(c.token_ids))
    m.observe_request(
        c.first_token - c.arrival,
        end - c.arrival,
        c.token_gaps,
        prompt_tokens=len(c.prompt_ids),
        generation_tokens=len(c.token_ids),
        finish_reason=c.finish_reason,
        timings=c.timings,
    )
    c.observed = True
    group = [x for x in choices or [c] if x.prompt_index == c.prompt_index]
    if all(x.observed for x in group):
        m.observe_group(max(len(x.token_ids) for x in group))
    tracing.choice_ended(c.arrival, c.timings)


def observe_cut(state: ServerState, choices: list[Choice]) -> None:
    """The client went away before it read every choice's end (called once the bill has taken what the engine
    had sent): each choice not yet counted in the metrics is, by the engine's reason where the engine had finished
    it, else as vLLM's `abort`. A choice that failed is not (as before: it never finished)."""
    for c in choices:
        if c.observed or c.error is not None:
            continue
        if c.finished:
            observe(state, c, choices)
        else:
            state.metrics.observe_abort()
            c.observed = True


async def collect(
    request: Request, state: ServerState, choices: list[Choice], streams: list[ReplyStream], bill: Bill
):
    """Wait for every choice to finish; stop early (and abort) if the client disconnects. The request is
    billed before its answer is sent, however it ends."""
    disconnected = False
    async with anyio.create_task_group() as tg:

        async def watch():
            nonlocal disconnected
            while (await request.receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            async for i, delta in merge_streams(streams):
                choices[i].add(delta)
        finally:
            release(state, streams)
            bill.close()
        tg.cancel_scope.cancel()
    if disconnected:
        observe_cut(state, choices)
        raise APIError(499, "client disconnected")
    for c in choices:
        if c.error is not None:
            raise from_serving_error(c.error)
        observe(state, c, choices)


def usage(prompts: list[list[int]], choices: list[Choice], drop_output: bool) -> P.Usage:
    """Prompts count once each (not once per choice); choices are grouped by prompt, n per prompt."""
    n = len(choices) // len(prompts)
    prompt = sum(len(p) for p in prompts)
    completion = 0 if drop_output else sum(len(c.token_ids) for c in choices)
    cached = sum(max(c.num_cached_tokens for c in choices[i * n : (i + 1) * n]) for i in range(len(prompts)))
    return P.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    )


async def read_deltas(
    streams: list[ReplyStream], choices: list[Choice]
) -> AsyncIterator[tuple[int, OutputDelta]]:
    """A stream's deltas as the engine makes them, each added to its choice first (choice `i` reads stream `i`);
    a failed choice's error is raised."""
    async for i, delta in merge_streams(streams):
        choices[i].add(delta)
        if delta.error is not None:
            raise delta.error
        yield i, delta


class Chunks:
    """A streamed chat or text completion's SSE chunks: one choice's in OpenAI's envelope (`kind`:
    "chat.completion.chunk" or "text_completion"), with vLLM's continuous usage on each where asked
    (stream_options: include_usage and continuous_usage_stats), and the usage chunk after the last."""

    def __init__(self, req, rid: str, kind: str, created: int, choices: list[Choice], drop: bool):
        self.choices, self.drop = choices, drop
        self.envelope = {"id": rid, "object": kind, "created": created, "model": req.model}
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and options.continuous_usage_stats

    def __call__(self, index: int, choice: dict, **top) -> str:
        chunk = {**self.envelope, "choices": [choice], **top}
        if self.include_usage:
            chunk["usage"] = self._so_far(self.choices[index]) if self.continuous else None
        return sse(chunk)

    def _so_far(self, c: Choice) -> dict:
        """One choice's tokens so far beside its prompt's."""
        n = 0 if self.drop else len(c.token_ids)
        return {
            "prompt_tokens": len(c.prompt_ids),
            "completion_tokens": n,
            "total_tokens": len(c.prompt_ids) + n,
        }

    def last(self, prompts: list[list[int]]) -> Iterator[str]:
        """The usage chunk, where asked for: after every choice's last."""
        if self.include_usage:
            yield sse(
                {
                    **self.envelope,
                    "choices": [],
                    "usage": usage(prompts, self.choices, self.drop).model_dump(),
                }
            )


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def internal_error(e: Exception) -> APIError:
    """What the client of a stream is told when it fails midway; a failure that is no API error is logged."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ServingError):
        return from_serving_error(e)
    log.error("a stream failed midway", exc_info=e)
    return APIError(500, f"internal server error: {type(e).__name__}")


async def relay(chunks: AsyncIterator[str], done: bool = True) -> AsyncIterator[str]:
    """The SSE body: the handler's chunks, an error event if a request fails midway, then [DONE]
    (unless `done` is false: the Responses API ends with its own last event)."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # not cancellation (the client is gone): that is no Exception
        yield sse(internal_error(e).body())
    if done:
        yield sse("[DONE]")


class EventStream(StreamingResponse):
    """An SSE response that releases its requests and closes their bill however it ends: finished, failed, or
    client gone (Starlette cancels the body on disconnect, possibly before it ever started). `chunks` closes the
    bill itself once every choice has ended, before its last events."""

    def __init__(
        self,
        state: ServerState,
        streams: list[ReplyStream],
        chunks: AsyncIterator[str],
        bill: Bill,
        done: bool = True,
    ):
        super().__init__(
            self._body(relay(chunks, done)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
        self.state, self.streams, self.bill = state, streams, bill
        self.sent_whole = False  # the body ran to its end (its last event sent): the client did not cut it
        state.inflight.enter(streams)  # until the response is done

    async def _body(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async for event in events:
            yield event
        self.sent_whole = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            release(self.state, self.streams)
            self.bill.close()
            if not self.sent_whole:  # the client went away midway
                observe_cut(self.state, self.bill.choices)
            self.state.inflight.leave(self.streams)
