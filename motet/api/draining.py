"""A uvicorn server that drains on SIGTERM.

The first SIGTERM does not close the listening socket: new requests get 503 (the app sees
`state.draining`) while the ones in flight finish, up to `drain_timeout` seconds; those still generating then
end as a failure midway does (a 503: a stream's error event and last event, never a cut connection), one
warning line counts them, and uvicorn shuts down as usual. A second SIGTERM, or SIGINT (Ctrl-C), is uvicorn's
own immediate shutdown, which ends `run` quietly. A failed start-up (`state.fatal`: the engine did not load;
`fail`: the API was not built) also ends the server. `on_tick` runs on each of uvicorn's ticks (about 10 a
second). While `motet serve` starts, the server runs before its state is built (motet/api/starting.py): `attach`
gives it the state once it is; a SIGTERM before that ends it at once (nothing can be in flight: every request is
answered 503 at once).

SIGHUP (`reload_on_sighup`) asks for a reload: its handler only sets a flag (a signal handler runs between
two bytecodes of whatever the main thread is doing, inside a lock the reload takes too, or inside another
handler, so it never does the work itself). The next tick starts `read` in a daemon thread of its own, once
however many signals came meanwhile, and a later tick applies what it read, on the loop. The loop never waits
on `read`: a read that does not return within RELOAD_DEADLINE_S (a keys file on a hung mount) is logged and
abandoned (what it reads, if ever, is dropped), and the next SIGHUP starts a new one; SIGTERM and SIGINT stop
the server meanwhile as always (a daemon thread does not hold the process at exit).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from motet.api.state import ServerState

log = logging.getLogger("motet.server")

CUT_GRACE_S = 5.0  # past the drain's deadline, how long the requests it cut get to send their last event
RELOAD_DEADLINE_S = 10.0  # a keys file of a million keys is read and checked in a few seconds


class ReloadRead:
    """One reload's `read`, in a daemon thread: its value or its ValueError once it returns."""

    def __init__(self, read: Callable[[], Any], deadline_s: float):
        self.deadline = time.monotonic() + deadline_s
        self.value: Any = None
        self.error: Exception | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(read,), name="sighup-reload", daemon=True).start()

    def _run(self, read: Callable[[], Any]) -> None:
        try:
            self.value = read()
        except Exception as e:  # (logged by the tick that finds it done)
            self.error = e
        finally:
            self.done.set()


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState | None,
        drain_timeout: float,
        on_tick: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self.state = state  # None until `attach`
        self.start_error: BaseException | None = None  # the API could not be built (`fail`)
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.cut = 0  # requests the drain's deadline ended
        self.on_tick_hook = on_tick
        self.reload: tuple[Callable[[], Any], Callable[[Any], None]] | None = None  # (read, apply)
        self.reload_deadline_s = RELOAD_DEADLINE_S
        self.reload_requested = False
        self.reading: ReloadRead | None = None  # the reload under way

    def attach(self, state: ServerState) -> None:
        """The server's state, built once the server runs (an assignment: safe from the thread that built it)."""
        self.state = state

    def fail(self, error: BaseException) -> None:
        """The API could not be built: the server ends at its next tick."""
        self.start_error = error

    def reload_on_sighup(self, read: Callable[[], Any], apply: Callable[[Any], None]) -> None:
        """After each SIGHUP, or burst of them: `read` in a thread of its own (a ValueError: logged, nothing
        applied), then `apply(what it read)` on the loop."""
        self.reload = (read, apply)
        signal.signal(signal.SIGHUP, self._request_reload)

    def _request_reload(self, sig, frame) -> None:
        self.reload_requested = True  # a signal handler: only a flag; on_tick runs the reload

    def run(self, sockets=None) -> None:
        """uvicorn's run; a Ctrl-C it has shut down on ends here. (uvicorn raises the signal again once it has
        stopped, for whoever embeds it: asyncio's runner then ends the run with a KeyboardInterrupt's traceback,
        which a user who pressed Ctrl-C reads as a crash.)"""
        try:
            super().run(sockets=sockets)
        except KeyboardInterrupt:
            if not self.should_exit:  # not the one it shut down on
                raise

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and self.state is None:  # still starting: a drain with nothing in flight
            self.should_exit = True
            return
        if sig == signal.SIGTERM and not self.state.draining:
            # A signal handler: only set flags; on_tick (on the event loop) does the rest.
            self.state.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            self._step_drain(counter)
        if self.start_error is not None or (self.state is not None and self.state.fatal is not None):
            self.should_exit = True
        self._step_reload()
        if self.on_tick_hook is not None:
            self.on_tick_hook()
        return await super().on_tick(counter)

    def _step_drain(self, counter: int) -> None:
        """The drain's progress on a tick: exit once nothing generates. Past the deadline, each tick cuts what
        still does (`streams.cut`: a 503 error event ends each stream, as a failure midway does; one that got
        its reply streams since, too), and the server exits once they have sent it, or CUT_GRACE_S later."""
        if not self.state.limiter.lines_closed:  # those waiting in their tenant's line: 503 at once
            self.state.limiter.close_lines()
        now = time.monotonic()
        if now > self.drain_deadline:
            from motet.api.streams import (
                cut,  # (the API's: loaded by then; `motet serve` answers before they load)
            )

            self.cut += cut(self.state)
        elif counter % 10 == 0:
            log.info("draining: %d requests in flight", len(self.state.inflight))
        if not self.state.inflight or now > self.drain_deadline + CUT_GRACE_S:
            if self.cut:
                log.warning(
                    "draining: %d requests still running after --drain-timeout %g s were ended (a 503 error)",
                    self.cut,
                    self.drain_timeout,
                )
            self.should_exit = True

    def _step_reload(self) -> None:
        """The reload's progress on a tick: apply a finished read, give up on an overdue one, start the next."""
        reading = self.reading
        if reading is not None and reading.done.is_set():
            self.reading = None
            if isinstance(reading.error, ValueError):  # the file's fault: it says what to fix
                log.error("SIGHUP: the API keys were not reloaded (the running ones stay): %s", reading.error)
            elif reading.error is not None:
                log.error("SIGHUP: the reload failed (the running keys stay)", exc_info=reading.error)
            else:
                self.reload[1](reading.value)
        elif reading is not None and time.monotonic() > reading.deadline:
            self.reading = None  # abandoned: its thread may end some day, and what it read is dropped
            log.error(
                "SIGHUP: the reload did not return within %g s (is the keys file on a hung mount?); skipped, "
                "the running keys stay; send SIGHUP again to retry",
                self.reload_deadline_s,
            )
        if self.reload_requested and self.reload is not None and self.reading is None:
            self.reload_requested = False  # (before it runs: a signal during the read asks for another)
            self.reading = ReloadRead(self.reload[0], self.reload_deadline_s)
