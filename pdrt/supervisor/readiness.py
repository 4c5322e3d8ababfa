"""Is the node ready? Asked of the gateway, the way a client would ask it, or of the controller.

A node with a gateway is ready when the gateway answers `Hello` with `Ready`
and then reports, in its `Status`, every expected worker alive: that proves
the whole path a request takes (gateway up, workers registered with the
controller, the controller's view published to the gateway), not only that
processes exist.

A node without a gateway (say, one that runs only decode workers for another
node's controller) is ready when the controller lists every expected worker.
The controller has no query message; what it does have is the `ClusterView`
it sends every gateway right after the gateway registers. So the check
registers for a moment as a gateway named after the run, takes that view,
and says `Goodbye`. A gateway is no worker, so this probe never appears in
the view that real gateways route by.

Each check uses its own short-lived ZeroMQ context, so that no ZeroMQ I/O
thread is alive while the supervisor forks a child (fork in a threaded process
is where deadlocks come from).
"""

import secrets
import time

import msgspec
import zmq

from pdrt import wire
from pdrt.actors.cluster_key import ClusterKey
from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.control_plane.link import link_identity


def _ask(sock: zmq.Socket, message: msgspec.Struct, timeout_s: float) -> wire.ClientReply | None:
    sock.send(wire.encode(message))
    if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return None
    frames = sock.recv_multipart()
    try:
        return wire.client_reply_decoder.decode(frames[-1])
    except msgspec.DecodeError:
        return None


def check_gateway(address: str, expected_workers: list[str], timeout_s: float = 0.25) -> str | None:
    """None when the gateway is up and reports every expected worker alive; else what is missing."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        reply = _ask(sock, wire.Hello(wire.PROTOCOL_VERSION, client="pdrt-up"), timeout_s)
        if reply is None:
            return f"the gateway at {address} did not answer"
        if isinstance(reply, wire.Error):
            return f"the gateway refused the handshake: {reply.code}: {reply.message}"
        if not isinstance(reply, wire.Ready):
            return f"the gateway answered Hello with {type(reply).__name__}"
        status = _ask(sock, wire.GetStatus(), timeout_s)
        if not isinstance(status, wire.Status):
            return "the gateway did not report its status"
        alive = {worker.process_id for worker in status.workers if worker.alive}
        missing = [name for name in expected_workers if name not in alive]
        if missing:
            return f"workers not ready: {', '.join(missing)}"
        return None
    finally:
        sock.close()
        ctx.term()


def check_controller(address: str, expected_workers: list[str], probe_id: str, key: ClusterKey | None,
                     timeout_s: float = 0.5) -> str | None:
    """None when the controller at `address` (of the cluster of `key`) lists every expected worker; else what is
    missing."""
    view = cluster_view(address, probe_id, key, timeout_s)
    if isinstance(view, str):
        return view
    registered = {worker.process_id for worker in view.workers}
    missing = [name for name in expected_workers if name not in registered]
    if missing:
        return f"workers not registered with the controller at {address}: {', '.join(missing)}"
    return None


def cluster_view(address: str, probe_id: str, key: ClusterKey | None, timeout_s: float = 0.5
                 ) -> wire.ClusterView | str:
    """The workers the controller at `address` lists, asked by registering for a moment as gateway `probe_id`;
    or what went wrong."""
    incarnation = secrets.token_hex(4)
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, SocketSpec(zmq.DEALER, address, bind=False,
                                           identity=link_identity(probe_id, incarnation), key=key))
    except zmq.ZMQError as exc:
        ctx.term()
        return f"cannot connect to the controller at {address}: {exc}"
    try:
        sock.send(wire.encode(wire.Register(wire.PROTOCOL_VERSION, probe_id, incarnation, "gateway", "")))
        return _first_view(sock, time.monotonic() + timeout_s)
    finally:
        # Leave the registry at once (else the probe lingers there until its lease runs out).
        try:
            sock.send(wire.encode(wire.Goodbye(probe_id, incarnation)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        sock.close(linger=100)
        ctx.term()


def report_exit(address: str, key: ClusterKey | None, reporter: str, process_id: str, incarnation: str,
                timeout_s: float = 0.2) -> None:
    """Tell the controller at `address` that `process_id`'s `incarnation` exited, at once rather than after its
    lease; best effort: when the controller does not take it, the lease still runs out."""
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, SocketSpec(zmq.DEALER, address, bind=False, identity=reporter.encode(), key=key))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.send(wire.encode(wire.ProcessExited(process_id, incarnation)))
        sock.close(linger=int(timeout_s * 1000))
    except zmq.ZMQError:
        pass
    finally:
        ctx.term()


def _first_view(sock: zmq.Socket, deadline: float) -> wire.ClusterView | str:
    """The first ClusterView the controller sends after the probe's registration, or what went wrong."""
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
            return "the controller did not answer"
        try:
            message = wire.internal_decoder.decode(sock.recv())
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "the controller sent an undecodable frame"
        if isinstance(message, wire.Error):
            return f"the controller refused the readiness probe: {message.code}: {message.message}"
        if isinstance(message, wire.ClusterView):
            return message
