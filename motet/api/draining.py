"""A uvicorn server that drains on SIGTERM.

The first SIGTERM does not close the listening socket: new requests get 503 (the app sees
`state.draining`) while the ones in flight finish, up to `drain_timeout` seconds; then uvicorn shuts down
as usual. A second SIGTERM, or SIGINT, is uvicorn's own immediate shutdown. A failed start-up
(`state.fatal`) also ends the server. `on_tick` runs on each of uvicorn's ticks (about 10 a second).

SIGHUP (`reload_on_sighup`) asks for `reload` to run: its handler only sets a flag, and the next tick runs
`reload` in a worker thread, once however many signals came meanwhile. A signal handler runs between two
bytecodes of whatever the main thread is doing (inside a lock the reload takes too, or inside another
handler), so it never does the work itself.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

import anyio.to_thread
import uvicorn

from motet.api.state import ServerState

log = logging.getLogger("motet.server")


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        drain_timeout: float,
        on_tick: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.on_tick_hook = on_tick
        self.reload: Callable[[], None] | None = None
        self.reload_requested = False

    def reload_on_sighup(self, reload: Callable[[], None]) -> None:
        """Run `reload` (in a worker thread) after each SIGHUP, or burst of them."""
        self.reload = reload
        signal.signal(signal.SIGHUP, self._request_reload)

    def _request_reload(self, sig, frame) -> None:
        self.reload_requested = True  # a signal handler: only a flag; on_tick runs the reload

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            # A signal handler: only set flags; on_tick (on the event loop) does the rest.
            self.state.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if counter % 10 == 0:
                log.info("draining: %d requests in flight", self.state.inflight)
            if self.state.inflight == 0 or time.monotonic() > self.drain_deadline:
                self.should_exit = True
        if self.state.fatal is not None:
            self.should_exit = True
        if self.reload_requested and self.reload is not None:
            self.reload_requested = False  # (before it runs: a signal during the reload asks for another)
            try:
                await anyio.to_thread.run_sync(self.reload)
            except Exception:
                log.exception("SIGHUP: the reload failed")
        if self.on_tick_hook is not None:
            self.on_tick_hook()
        return await super().on_tick(counter)
