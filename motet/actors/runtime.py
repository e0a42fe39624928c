"""A small actor runtime on AnyIO.

An actor owns its state and a mailbox (a memory object stream). Others `tell` it a message (fire and
forget) or `ask` it one (request/reply: the envelope carries a one-shot reply stream). By default an
actor handles one message at a time in `handle`; an actor with its own loop (the scheduler) overrides
`main` and drains the mailbox itself.

`ActorSystem` supervises the actors in one task group: it starts them in order (each one's `on_start`
finishes before the next starts, so the executor has the model loaded before the scheduler runs), and
stops them in reverse order. A crash of any actor's loop cancels the group and is re-raised: the
system fails as a whole, loudly, rather than limping on with a dead actor.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

log = logging.getLogger("motet.actors")


@dataclass
class Envelope:
    """A message and, for `ask`, where its reply goes."""

    message: Any
    reply: MemoryObjectSendStream | None = None


@dataclass
class _Failure:
    error: BaseException


class ActorStopped(RuntimeError):
    """The actor's mailbox is closed: it is shutting down or has stopped."""


class Actor:
    name = "actor"
    mailbox_size: float = math.inf  # bounded actors make `tell` wait when full

    def __init__(self):
        self._send, self._recv = anyio.create_memory_object_stream[Envelope](self.mailbox_size)
        self.running = False  # between start-up and stop
        self.done = anyio.Event()  # set when the actor has stopped

    # -- sending ------------------------------------------------------------------------------------------
    async def tell(self, message: Any) -> None:
        try:
            await self._send.send(Envelope(message))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ActorStopped(self.name) from None

    def tell_nowait(self, message: Any) -> None:
        """Never blocks: for callers that must not wait (the scheduler, signal paths)."""
        try:
            self._send.send_nowait(Envelope(message))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ActorStopped(self.name) from None

    async def ask(self, message: Any) -> Any:
        """Send and wait for the reply; an exception raised by the handler is raised here."""
        reply_send, reply_recv = anyio.create_memory_object_stream[Any](1)
        async with reply_recv:
            try:
                await self._send.send(Envelope(message, reply_send))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                raise ActorStopped(self.name) from None
            try:
                result = await reply_recv.receive()
            except anyio.EndOfStream:
                raise ActorStopped(f"{self.name} stopped before replying") from None
        if isinstance(result, _Failure):
            raise result.error
        return result

    # -- running --------------------------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Set up before the next actor starts (load the model, open resources)."""

    async def on_stop(self) -> None:
        """Clean up after the mailbox is drained."""

    async def handle(self, message: Any) -> Any:
        raise NotImplementedError(f"{self.name} does not handle {type(message).__name__}")

    async def main(self) -> None:
        """The default loop: one message at a time until the mailbox closes."""
        async for envelope in self._recv:
            await self.deliver(envelope)

    async def deliver(self, envelope: Envelope) -> None:
        """Handle one envelope; a handler's exception goes to the asker, never kills the actor."""
        try:
            result = await self.handle(envelope.message)
        except Exception as e:
            if envelope.reply is None:
                log.exception("%s: unhandled error on %s", self.name, type(envelope.message).__name__)
                return
            result = _Failure(e)
        if envelope.reply is not None:
            # The asker may have gone away (cancelled): then there is nobody to tell.
            with envelope.reply, contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                envelope.reply.send_nowait(result)

    def close(self) -> None:
        """Close the mailbox: `main` ends after the messages already in it."""
        self._send.close()

    async def _run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        await self.on_start()
        self.running = True
        task_status.started()
        try:
            async with self._recv:
                await self.main()
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_stop()
            self.running = False
            self.done.set()


class ActorSystem:
    """Runs actors in one task group: ordered start-up, reverse-ordered graceful stop."""

    def __init__(self, actors: list[Actor]):
        self.actors = actors
        self._tg: anyio.abc.TaskGroup | None = None
        self.started = anyio.Event()
        self.stopped = anyio.Event()

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every actor in order, then run until they all stop (see `stop`)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for actor in self.actors:
                    await tg.start(self._supervise, actor)
                self.started.set()
                task_status.started()
        finally:
            self.stopped.set()

    @staticmethod
    async def _supervise(actor: Actor, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await actor._run(task_status=task_status)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException:
            if actor.running:
                log.exception("actor %s crashed; stopping the system", actor.name)
            else:  # a failed start-up: whoever started the system reports it (the server in one line)
                log.debug("actor %s failed to start", actor.name, exc_info=True)
            raise

    async def stop(self) -> None:
        """Stop front to back (ingress first), each after the one before it has finished: the scheduler
        still has its executor while it winds down."""
        for actor in self.actors[::-1]:
            actor.close()
            if actor.running:
                await actor.done.wait()
        await self.stopped.wait()

    def cancel(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
