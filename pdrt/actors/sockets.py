"""The one place ZeroMQ sockets are made.

Topology: a process that serves binds a ROUTER; its peers connect DEALERs
with a short identity; one-way streams use PUSH/PULL. A socket of the
internal plane carries the cluster key (pdrt/actors/cluster_key.py): one
that binds is a CURVE server that admits only key holders, one that
connects a CURVE client; clients' sockets have none. Every socket gets
linger 0 (closing never blocks on unsent messages: a peer that is gone must
not hang shutdown) and explicit high-water marks (a slow peer makes sends
fail fast instead of growing memory without bound). A socket with a
heartbeat pings its peer (libzmq answers on the peer's I/O thread, whatever
its event loop is doing) and drops the connection when the answers stop: a
peer whose host died or froze is noticed as a disconnect, not by silence.
An address that cannot be bound (in use, not this host's) is a `ConfigError`:
the process cannot start, and a restart would not help.
"""

import asyncio
import errno
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pdrt.actors.cluster_key import ClusterKey
from pdrt.errors import ConfigError

DEFAULT_HWM = 10_000
UNBINDABLE = (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL)  # a restart does not mend these
HEARTBEAT_MISSES = 4


@dataclass(frozen=True, slots=True)
class SocketSpec:
    kind: int  # zmq.ROUTER, zmq.DEALER, zmq.PUSH, zmq.PULL, ...
    address: str  # "tcp://127.0.0.1:5555", "ipc:///run/pdrt/gw.sock", "tcp://127.0.0.1:*"
    bind: bool
    identity: bytes | None = None
    hwm: int = DEFAULT_HWM
    key: ClusterKey | None = None  # the cluster's, for the internal plane
    heartbeat_ms: int = 0  # ping interval; the connection drops after HEARTBEAT_MISSES intervals unanswered


def make_socket(ctx: zmq.Context, spec: SocketSpec) -> zmq.Socket:
    """Create, configure and bind or connect a socket as `spec` says (asyncio or plain, as `ctx` is)."""
    sock = ctx.socket(spec.kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, spec.hwm)
    sock.setsockopt(zmq.RCVHWM, spec.hwm)
    if spec.identity is not None:
        sock.setsockopt(zmq.IDENTITY, spec.identity)
    if spec.kind == zmq.ROUTER:
        # Sending to an unknown or departed peer raises instead of dropping silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if spec.heartbeat_ms:
        sock.setsockopt(zmq.HEARTBEAT_IVL, spec.heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(spec.heartbeat_ms * HEARTBEAT_MISSES))
    if spec.key is not None:
        spec.key.secure(sock, server=spec.bind)
    try:
        if spec.bind:
            sock.bind(spec.address)
        else:
            sock.connect(spec.address)
    except zmq.ZMQError as exc:
        sock.close()
        if spec.bind and exc.errno in UNBINDABLE:  # another process holds the port, or it is not ours to take
            raise ConfigError(f"cannot listen on {spec.address}: {exc.strerror}") from exc
        raise
    return sock


def send_now(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send `frames` as one message without waiting, or raise zmq.ZMQError (the peer is gone or not reading).

    An asyncio socket reports a failed NOBLOCK send in the future it returns, not by raising: read there, the
    error reaches the caller, and no future is left holding an exception that nobody retrieves."""
    result = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    if isinstance(result, asyncio.Future) and result.done() and result.exception() is not None:
        raise result.exception()


def bound_address(sock: zmq.asyncio.Socket) -> str:
    """The address a socket bound to, with the port filled in when it asked for `*`."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
