"""A request's reply stream: a one-slot mailbox that merges pending deltas.

The scheduler must never wait for a client, so `put` never blocks: when the reader has not taken the
previous delta yet, the new one is merged into it (texts and tokens concatenated). A slow reader thus
gets fewer, larger deltas; a fast one gets one per step. Single event loop: no locks needed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio

from motet.actors.serving_errors import ServingError
from motet.engine.core.sequence import RequestTimings, TokenLogprob


@dataclass
class Delta:
    """Everything new for one request since the reader's last take."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, with the first delta
    num_cached_tokens: int = 0
    error: ServingError | None = None
    timings: RequestTimings | None = None  # with the final delta: the request's phases, for /metrics

    def merge(self, later: Delta) -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.finished, self.finish_reason, self.stop_reason = (
            later.finished,
            later.finish_reason,
            later.stop_reason,
        )
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.num_cached_tokens = later.num_cached_tokens
        self.error = self.error or later.error
        self.timings = later.timings or self.timings


class ReplyStream:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.cancelled = False  # set by the reader when its client went away
        self.closed = False  # the last delta has been put
        self.num_puts = 0
        self._pending: Delta | None = None
        self._ready = anyio.Event()
        self.on_put: Callable[[], None] | None = None  # lets a reader wait on several streams at once

    def put(self, delta: Delta) -> None:
        """Never blocks; merges into the pending delta if the reader is behind."""
        if self.closed:
            return
        self.num_puts += 1
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self.closed = delta.finished or delta.error is not None
        self._ready.set()
        if self.on_put is not None:
            self.on_put()

    def fail(self, error: ServingError) -> None:
        self.put(Delta(finished=True, error=error))

    def cancel(self) -> None:
        self.cancelled = True

    def take_nowait(self) -> Delta | None:
        delta, self._pending = self._pending, None
        return delta

    async def get(self) -> Delta:
        """The next (possibly merged) delta; after the final one, waits forever: stop iterating."""
        while self._pending is None:
            await self._ready.wait()
            self._ready = anyio.Event()
        delta, self._pending = self._pending, None
        return delta

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            delta = await self.get()
            yield delta
            if delta.finished or delta.error is not None:
                return


async def merge_streams(streams: list[ReplyStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(index, delta) from several streams as they come, until each has given its final delta."""
    wake = anyio.Event()

    def on_put():
        wake.set()

    for s in streams:
        s.on_put = on_put
    open_ = list(range(len(streams)))
    while open_:
        wake = anyio.Event()  # reset before scanning: a put during a yield below sets the new one
        for i in list(open_):
            delta = streams[i].take_nowait()
            if delta is None:
                continue
            if delta.finished or delta.error is not None:
                open_.remove(i)
            yield i, delta
        if open_ and not wake.is_set() and not any(streams[i]._pending for i in open_):
            await wake.wait()
