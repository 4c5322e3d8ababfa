"""How a process talks to its peers: one inbox it binds, and an outbox of connections it opens on demand.

Every internal message is a tagged struct from `pdrt.wire`, sent as a single
frame. The inbox is a ROUTER: a frame that does not decode is logged and
dropped (peers passed the controller's version check, so a bad frame is a
bug, not an attack). The outbox keeps one DEALER per peer address, created on
first use; sends never block the loop: a peer that is gone or too slow makes
the send fail (high-water mark), which is logged and counted.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdrt.actors.sockets import SocketSpec, bound_address, make_socket
from pdrt.wire import encode, internal_decoder

log = structlog.get_logger(__name__)


class Inbox:
    """A bound ROUTER; every decoded message goes to `handler`."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        self.socket = make_socket(ctx, SocketSpec(zmq.ROUTER, address, bind=True))
        self.address = bound_address(self.socket)
        self.handler = handler
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"inbox {self.address}")

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=True)
            if len(frames) != 2:
                log.warning("inbox dropped a frame with a bad envelope", parts=len(frames))
                continue
            try:
                message = internal_decoder.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("inbox dropped an undecodable frame", error=str(exc))
                continue
            await self.handler(message)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.socket.close()


class Outbox:
    """Sends internal messages to peers by address, one DEALER per peer."""

    def __init__(self, ctx: zmq.asyncio.Context, identity: str) -> None:
        # Plain (non-asyncio) sockets on the same context: a NOBLOCK send then
        # fails right here instead of inside a future nobody awaits.
        self.ctx = zmq.Context.shadow(ctx.underlying)
        self.identity = identity.encode()
        self.sockets: dict[str, zmq.Socket] = {}
        self.num_dropped = 0

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.sockets.get(address)
        if sock is None:
            sock = make_socket(self.ctx, SocketSpec(zmq.DEALER, address, bind=False, identity=self.identity))
            self.sockets[address] = sock
        return sock

    def send(self, address: str, message: msgspec.Struct) -> bool:
        """Queue `message` for `address` without waiting; False (and logged) when it cannot be queued."""
        try:
            self._socket(address).send(encode(message), flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            self.num_dropped += 1
            log.warning("outbox dropped a message", to=address, message=type(message).__name__, error=str(exc))
            return False

    def forget(self, address: str) -> None:
        """Close the connection to a peer that is gone, so its queue does not grow."""
        sock = self.sockets.pop(address, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()
