"""An actor: private state, a bounded mailbox, and one message handled at a time.

Life cycle: `start()` schedules the actor's task on the running loop and
returns an `ActorRef`; the task runs `on_start`, then takes messages in
arrival order and awaits `on_receive` for each; `stop()` (or a failure whose
policy is STOP) lets the message being handled finish, runs `on_stop`, and
fails every ask still queued with `ActorStoppedError`; queued tells are
dropped.

Errors: an exception raised while handling an `ask` goes back to the asker
and the actor carries on. One raised while handling a `tell` has nobody to go
back to: it is logged and `on_failure` decides whether the actor resumes or
stops. Every ask has a timeout, so no caller waits on an actor forever.
"""

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

import structlog

from pdrt.errors import ActorStoppedError, AskTimeoutError, MailboxFullError

log = structlog.get_logger(__name__)

DEFAULT_MAILBOX_SIZE = 4096


class FailurePolicy(enum.Enum):
    RESUME = enum.auto()  # drop the message, keep handling the next ones
    STOP = enum.auto()


@dataclass(slots=True)
class _Envelope:
    message: Any
    reply: asyncio.Future | None


_STOP = object()


@dataclass(frozen=True, slots=True)
class Tick:
    """A message an actor's own timer sends it: time to do its periodic work."""


@dataclass(frozen=True, slots=True)
class FromPeer:
    """A message that arrived on a socket, with the ZeroMQ identity of the peer that sent it."""

    identity: bytes
    message: object


class Actor:
    """Subclass and override `on_receive`; the other hooks are optional."""

    mailbox_size = DEFAULT_MAILBOX_SIZE

    async def on_start(self) -> None:
        pass

    async def on_receive(self, message: Any) -> Any:
        raise NotImplementedError

    async def on_stop(self) -> None:
        pass

    async def on_failure(self, exc: BaseException, message: Any) -> FailurePolicy:
        return FailurePolicy.RESUME

    def start(self) -> "ActorRef":
        """Start on the running event loop."""
        return ActorRef(self)


class ActorRef:
    """The only handle other code holds on an actor."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.name = type(actor).__name__
        self._mailbox: asyncio.Queue[_Envelope | object] = asyncio.Queue(actor.mailbox_size)
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    @property
    def is_alive(self) -> bool:
        return not self._stopping and not self._task.done()

    def _post(self, envelope: _Envelope) -> None:
        if not self.is_alive:
            raise ActorStoppedError(f"{self.name} has stopped")
        try:
            self._mailbox.put_nowait(envelope)
        except asyncio.QueueFull:
            raise MailboxFullError(f"{self.name}'s mailbox is full ({self.actor.mailbox_size})") from None

    def tell(self, message: Any) -> None:
        """Deliver `message` without waiting for it to be handled."""
        self._post(_Envelope(message, None))

    async def deliver(self, message: Any) -> None:
        """Like `tell`, but wait for room in a full mailbox: socket readers use it to push back on peers."""
        if not self.is_alive:
            raise ActorStoppedError(f"{self.name} has stopped")
        await self._mailbox.put(_Envelope(message, None))

    async def ask(self, message: Any, timeout: float) -> Any:
        """Deliver `message` and wait at most `timeout` seconds for the handler's result."""
        reply = asyncio.get_running_loop().create_future()
        self._post(_Envelope(message, reply))
        try:
            return await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            raise AskTimeoutError(f"{self.name} did not answer {type(message).__name__} in {timeout} s") from None

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop after the message being handled; later messages are not handled."""
        if not self._stopping and not self._task.done():
            self._stopping = True
            try:  # wake the loop if it waits on an empty mailbox; a full one wakes it anyway
                self._mailbox.put_nowait(_STOP)
            except asyncio.QueueFull:
                pass
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self._task.cancel()
            raise AskTimeoutError(f"{self.name} did not stop in {timeout} s") from None

    def _fail(self, envelope: _Envelope | object) -> None:
        if isinstance(envelope, _Envelope) and envelope.reply is not None and not envelope.reply.done():
            envelope.reply.set_exception(ActorStoppedError(f"{self.name} stopped before answering"))

    async def _run(self) -> None:
        actor = self.actor
        try:
            await actor.on_start()
            while not self._stopping:
                envelope = await self._mailbox.get()
                if envelope is _STOP:
                    break
                if not await self._handle(envelope):
                    break
        except Exception:
            log.exception("actor crashed", actor=self.name)
        finally:
            self._stopping = True
            while not self._mailbox.empty():
                self._fail(self._mailbox.get_nowait())
            try:
                await actor.on_stop()
            except Exception:
                log.exception("actor on_stop failed", actor=self.name)

    async def _handle(self, envelope: _Envelope) -> bool:
        """Handle one message; False when the actor must stop."""
        try:
            result = await self.actor.on_receive(envelope.message)
        except Exception as exc:
            if envelope.reply is not None:
                if not envelope.reply.done():
                    envelope.reply.set_exception(exc)
                return True
            log.exception("actor failed on a message", actor=self.name, message=type(envelope.message).__name__)
            return await self.actor.on_failure(exc, envelope.message) is FailurePolicy.RESUME
        if envelope.reply is not None and not envelope.reply.done():
            envelope.reply.set_result(result)
        return True
