"""The cluster key: every internal socket speaks ZeroMQ CURVE under it, and a peer without it is refused.

One secret per cluster: a CURVE secret key (40 characters of Z85), from
which its public key follows. Every process of the cluster holds it and
uses the one key pair for everything:

* a socket that binds (a ROUTER: the controller, every inbox, a KV source)
  is a CURVE server with that pair;
* a socket that connects (a DEALER) is a CURVE client with the same pair,
  and names the cluster's public key as its server's.

CURVE alone admits any client that knows the server's public key. So every
context that has a server socket also runs a ZAP handler (RFC 27, a thread
of its own answering `inproc://zeromq.zap.01`) that admits a client only
when its long-term public key is the cluster's: in CURVE's handshake the
client proves it holds the matching secret key. A peer without the key
fails the handshake: libzmq drops the connection before a single message
reaches the application, so nothing it sends is ever decoded.

ZAP fails closed. By default libzmq consults ZAP only while a handler is
bound, and admits every CURVE client when none is; so a server socket names
the ZAP domain `pdrt` and sets ZMQ_ZAP_ENFORCE_DOMAIN, and a handshake
with no handler to answer it fails. If the handler thread dies, the node
refuses every new peer, key holders included, rather than admitting
anyone. The handler likewise refuses a request for any other domain.

The handler thread ends when its context terminates (its blocking receive
returns ETERM), so closing or destroying a context never waits on it.
"""

import binascii
import threading
from dataclasses import dataclass, field

import structlog
import zmq
from zmq.utils import z85

from pdrt.errors import ConfigError

log = structlog.get_logger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"pdrt"
KEY_CHARS = 40


@dataclass(frozen=True)
class ClusterKey:
    secret: bytes  # Z85
    public: bytes = field(init=False)  # Z85

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_CHARS:
            raise ConfigError(f"the cluster key must be {KEY_CHARS} characters of Z85 (`pdrt key` makes one), "
                              f"got {len(self.secret)} characters")
        try:
            object.__setattr__(self, "public", zmq.curve_public(self.secret))
        except (zmq.ZMQError, ValueError, binascii.Error) as exc:
            raise ConfigError(f"the cluster key is not a Z85 CURVE secret key: {exc}") from None

    @classmethod
    def generate(cls) -> "ClusterKey":
        return cls(zmq.curve_keypair()[1])

    @classmethod
    def parse(cls, text: str) -> "ClusterKey | None":
        """The key `text` holds; None for an empty text (no key: plain sockets)."""
        text = text.strip()
        return cls(text.encode("ascii", "replace")) if text else None

    @property
    def text(self) -> str:
        return self.secret.decode()

    def secure(self, sock: zmq.Socket, server: bool) -> None:
        """Make `sock` a CURVE server or client of this cluster; call before it binds or connects."""
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        if server:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            _enforce_zap(sock)
            _zap_handler(sock.context, self)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.public)


def _enforce_zap(sock: zmq.Socket) -> None:
    """Make `sock` refuse a handshake that no ZAP handler admits, even when no handler is bound."""
    # libzmq fails a handshake that finds no handler only with both set: enforcing an empty domain admits all.
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


class ZapHandler:
    """Admits CURVE clients whose public key is the cluster's; counts the rest."""

    def __init__(self, ctx: zmq.Context, key: ClusterKey) -> None:
        self.public = z85.decode(key.public)
        self.num_admitted = 0
        self.num_refused = 0
        sync_ctx = zmq.Context.shadow(ctx.underlying)
        self.socket = sync_ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.thread = threading.Thread(target=self._serve, name="zap-handler", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while True:
                request = self.socket.recv_multipart()
                self.socket.send_multipart(self._answer(request))
        except zmq.ContextTerminated:
            pass
        except zmq.ZMQError as exc:
            log.error("the ZAP handler stopped; no new peer can connect", error=str(exc))
        finally:
            self.socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, identity, mechanism, credentials...
        version, request_id = (request + [b"", b""])[:2]
        admitted = (len(request) == 7 and request[2] == ZAP_DOMAIN and request[5] == b"CURVE"
                    and request[6] == self.public)
        if admitted:
            self.num_admitted += 1
            return [version, request_id, b"200", b"OK", b"cluster", b""]
        self.num_refused += 1
        return [version, request_id, b"400", b"not a member of this cluster", b"", b""]


_handlers: dict[int, ZapHandler] = {}
_lock = threading.Lock()


def _zap_handler(ctx: zmq.Context, key: ClusterKey) -> ZapHandler:
    """The ZAP handler of `ctx`'s underlying context, started on first use."""
    with _lock:
        handler = _handlers.get(ctx.underlying)
        if handler is None or not handler.thread.is_alive():
            handler = _handlers[ctx.underlying] = ZapHandler(ctx, key)
        return handler


def zap_handler(ctx: zmq.Context) -> ZapHandler | None:
    """The ZAP handler running on `ctx`, if a server socket of it has started one."""
    with _lock:
        return _handlers.get(ctx.underlying)
