"""How a process talks to its peers: one inbox it binds, and an outbox of connections it opens on demand.

Every internal message is a tagged struct from `pdrt.wire`, sent as a single
frame, on sockets under the cluster key (only its holders connect at all).
The inbox is a ROUTER that knows each sender by its identity, which is the
sender's process id (the outbox sets it), and takes from each role only the
messages that role sends (`senders`): anything else — a frame that does not
decode, a message type this inbox does not take, a role that does not send
it, a `process_id` field naming another process than its sender — is
logged, counted and dropped, never handled. The outbox keeps one DEALER per
peer address, created on first use; sends never block the loop: a peer that
is gone or too slow makes the send fail (high-water mark), which is logged
and counted.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, bound_address, make_socket
from pdrt.node_config import role_of
from pdrt.wire import encode, internal_decoder

log = structlog.get_logger(__name__)


Senders = dict[type, tuple[str, ...]]  # message type -> the roles that may send it
WORKER_ROLES = ("prefill", "decode", "colocated")


class Inbox:
    """A bound ROUTER; every decoded message that its sender may send (`senders`) goes to `handler`."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, handler: Callable[[Any], Awaitable[None]],
                 senders: Senders, key: ClusterKey | None = None) -> None:
        self.socket = make_socket(ctx, SocketSpec(zmq.ROUTER, address, bind=True, key=key))
        self.address = bound_address(self.socket)
        self.handler = handler
        self.senders = senders
        self.num_dropped = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"inbox {self.address}")

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=True)
            why = "a bad envelope"
            if len(frames) == 2:
                sender = frames[0].decode(errors="replace")
                try:
                    message = internal_decoder.decode(frames[1])
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                    why = f"undecodable: {exc}"
                else:
                    why = self._refusal(sender, message)
                    if why is None:
                        await self.handler(message)
                        continue
            self.num_dropped += 1
            log.warning("inbox dropped a message", sender=frames[0][:64], why=why)

    def _refusal(self, sender: str, message: object) -> str | None:
        """Why `sender` may not send `message` here; None when it may."""
        roles = self.senders.get(type(message))
        if roles is None:
            return f"this inbox does not take {type(message).__name__}"
        if role_of(sender) not in roles:
            return f"{type(message).__name__} comes from {' or '.join(roles)}, not {sender!r}"
        claimed = getattr(message, "process_id", None)
        if claimed is not None and claimed != sender:
            return f"{sender!r} sent a {type(message).__name__} in the name of {claimed!r}"
        return None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.socket.close()


class Outbox:
    """Sends internal messages to peers by address, one DEALER per peer."""

    def __init__(self, ctx: zmq.asyncio.Context, identity: str, key: ClusterKey | None = None) -> None:
        # Plain (non-asyncio) sockets on the same context: a NOBLOCK send then
        # fails right here instead of inside a future nobody awaits.
        self.ctx = zmq.Context.shadow(ctx.underlying)
        self.identity = identity.encode()
        self.key = key
        self.sockets: dict[str, zmq.Socket] = {}
        self.num_dropped = 0

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.sockets.get(address)
        if sock is None:
            sock = make_socket(self.ctx, SocketSpec(zmq.DEALER, address, bind=False, identity=self.identity,
                                                    key=self.key))
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
