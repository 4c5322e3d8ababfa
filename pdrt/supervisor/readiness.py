"""Is the node ready? Asked of the gateway, the way a client would ask it.

The node is ready when the gateway answers `Hello` with `Ready` and then
reports, in its `Status`, every expected worker alive: that proves the whole
path a request takes (gateway up, workers registered with the controller, the
controller's view published to the gateway), not only that processes exist.

Each check uses its own short-lived ZeroMQ context, so that no ZeroMQ I/O
thread is alive while the supervisor forks a child (fork in a threaded process
is where deadlocks come from).
"""

import msgspec
import zmq

from pdrt import wire


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
