"""A request's reply stream: a one-slot mailbox that merges pending deltas.

The scheduler must never wait for a client, so `put` never blocks: when the reader has not taken the
previous delta yet, the new one waits beside it, and the reader takes them merged into one (the engine's
`OutputDelta.merge`: texts and tokens concatenated). A slow reader thus gets fewer, larger deltas; a fast one
gets one per step. The deltas are the engine's own records (motet/engine/outputs.py), as it gave them out; a
failure is one more, its error a ServingError. Single event loop: no locks needed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio

from motet.actors.serving_errors import ServingError
from motet.engine.outputs import OutputDelta


class ReplyStream:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.cancelled = False  # set by the reader when its client went away
        self.closed = False  # the last delta has been put
        self.num_puts = 0
        self._pending: list[OutputDelta] = []  # put, not taken yet
        self._ready = anyio.Event()
        self.on_put: Callable[[], None] | None = None  # lets a reader wait on several streams at once

    def put(self, delta: OutputDelta) -> None:
        """Never blocks; the reader takes what is pending merged, if it is behind."""
        if self.closed:
            return
        self.num_puts += 1
        self._pending.append(delta)
        self.closed = delta.last
        self._ready.set()
        if self.on_put is not None:
            self.on_put()

    def fail(self, error: ServingError) -> None:
        self.put(OutputDelta(self.request_id, finished=True, error=error))

    def cancel(self) -> None:
        self.cancelled = True

    def take_nowait(self) -> OutputDelta | None:
        """What is pending, merged into one delta; None if nothing is."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        return OutputDelta.merge(pending)

    async def get(self) -> OutputDelta:
        """The next (possibly merged) delta; after the final one, waits forever: stop iterating."""
        while not self._pending:
            await self._ready.wait()
            self._ready = anyio.Event()
        return self.take_nowait()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            delta = await self.get()
            yield delta
            if delta.last:
                return


async def merge_streams(streams: list[ReplyStream]) -> AsyncIterator[tuple[int, OutputDelta]]:
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
            if delta.last:
                open_.remove(i)
            yield i, delta
        if open_ and not wake.is_set() and not any(streams[i]._pending for i in open_):
            await wake.wait()
