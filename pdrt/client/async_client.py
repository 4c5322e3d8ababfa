"""The asyncio client of pdrt's native protocol (docs/protocol.md): one DEALER socket, many requests at once.

Life of a request in this client:

1. `connect()` sends `Hello` and waits, with a timeout, for `Ready`; every
   other call connects first when it has to.
2. `generate()` and `stream()` pick a request id (a uuid), register a queue
   under it and send `Generate`.
3. One reader task receives every frame from the gateway and dispatches it:
   `Tokens` and `Error` frames by request id to that request's queue; `Ready`
   and `Status`, which carry no id, to the oldest caller waiting for one (the
   gateway answers one connection's frames in order). A frame for an id with
   no queue belongs to a request already given up, and is dropped.
4. The caller takes its request's frames from the queue, each wait bounded by
   the timeout. The last frame (finished, or an `Error`) removes the queue.
   A caller that stops early (timeout, `aclose()`, leaving the loop) removes
   the queue at once and sends `Cancel`, so neither side keeps the request.
5. A gateway that is lost (its connection drops: the socket monitor says so
   at once, or within 2.5 s when its host froze or died silently and its
   pings go unanswered) or that answers `handshake_required` on a connection that said
   Hello (it restarted) has lost what was open: the next call says Hello
   again, a request that had no reply yet is resent once (the new gateway
   never saw it), and a stream that had begun is resumed: the same request
   with the tokens received so far (and their logprobs) as its
   `continuation`, so that it goes on with the output it would have had
   (every request carries a seed). A submitted draft goes again as a
   `Generate` of its text. One that cannot go on ends with `gateway_lost`.

Long because the connection's whole life is here (handshake, one reader for every stream,
reconnection after a gateway restart); streams and drafts are their own modules.
"""

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Iterable

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.client.async_draft import AsyncDraft
from pdrt.client.async_stream import AsyncStream, Reply, seeded
from pdrt.client.completion import Completion
from pdrt.client.error_codes import error_from_reply
from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import (
    ClientClosedError,
    ConnectionForgottenError,
    InvalidRequestError,
    PdrtError,
    RequestTimeoutError,
    ServerUnreachableError,
    UnavailableError,
)
from pdrt.wire import (
    MAX_CLIENT_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    Error,
    Generate,
    GetStatus,
    Hello,
    Ready,
    Status,
    Tokens,
    Warmup,
    client_reply_decoder,
    encode,
)

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 60.0
# Closing keeps unsent frames (the Cancels of open requests) this long, so the server learns of them.
CLOSE_LINGER_MS = 500
# A gateway that stops answering pings (its host died or froze) drops the connection within five of these.
HEARTBEAT_MS = 500

Messages = Iterable[ChatMessage | dict[str, str] | tuple[str, str]]
FORGOTTEN = "the gateway no longer knows this connection (it restarted); what was open on it is lost"


def chat_messages(messages: Messages) -> list[ChatMessage]:
    """Chat messages from structs, {"role", "content"} dicts or (role, content) pairs."""
    out = []
    for m in messages:
        if isinstance(m, ChatMessage):
            out.append(m)
        elif isinstance(m, dict):
            out.append(ChatMessage(m["role"], m["content"]))
        else:
            role, content = m
            out.append(ChatMessage(role, content))
    return out


class AsyncClient:
    """A connection to one gateway. Safe for many concurrent requests on one event loop.

    `timeout_s` bounds every wait: the handshake, `status()`, and the gap
    between two frames of a request (for a non-streamed `generate()`, whose
    only frame comes at the end, the whole request). A request that exceeds it
    raises `RequestTimeoutError` and is cancelled on the server.
    """

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "pdrt-python") -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.name = name
        self.ready: Ready | None = None  # the server's handshake reply, once connected
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watcher: asyncio.Task | None = None
        self._connect_lock = asyncio.Lock()
        self._requests: dict[str, asyncio.Queue[Reply]] = {}
        self._hello_waiters: deque[asyncio.Future] = deque()
        self._status_waiters: deque[asyncio.Future] = deque()
        self._is_closed = False

    @property
    def num_open_requests(self) -> int:
        """Requests this client still tracks (streams not yet ended, closed or timed out)."""
        return len(self._requests)

    # -- connection ------------------------------------------------------------------

    async def connect(self, timeout_s: float | None = None) -> Ready:
        """Say Hello and wait for Ready; raises ServerUnreachableError when no answer comes in time."""
        async with self._connect_lock:
            if self._is_closed:
                raise ClientClosedError("the client is closed")
            if self.ready is not None:
                return self.ready
            if self._socket is None:
                self._socket = make_socket(zmq.asyncio.Context.instance(),
                                           SocketSpec(zmq.DEALER, self.address, bind=False,
                                                      heartbeat_ms=HEARTBEAT_MS))
                self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._reader = asyncio.create_task(self._read())
                self._watcher = asyncio.create_task(self._watch())
            timeout = self.timeout_s if timeout_s is None else timeout_s
            try:
                reply = await self._ask(self._hello_waiters, Hello(PROTOCOL_VERSION, self.name), timeout)
            except RequestTimeoutError:
                raise ServerUnreachableError(f"no pdrt server answered at {self.address} within {timeout:g} s")\
                    from None
            self.ready = reply
            return reply

    async def close(self) -> None:
        """Cancel every open request on the server, fail their waiting callers, and close the socket."""
        if self._is_closed:
            return
        for request_id, queue in list(self._requests.items()):
            try:
                self._send(Cancel(request_id))
            except PdrtError:
                pass
            queue.put_nowait(ClientClosedError("the client was closed"))
        self._requests.clear()
        self._is_closed = True
        for waiter in (*self._hello_waiters, *self._status_waiters):
            if not waiter.done():
                waiter.set_exception(ClientClosedError("the client was closed"))
        self._hello_waiters.clear()
        self._status_waiters.clear()
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
        if self._socket is not None:
            self._socket.close(linger=CLOSE_LINGER_MS)

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------

    def stream(self, prompt: str | None = None, messages: Messages | None = None,
               token_ids: list[int] | None = None, params: SamplingParams | None = None,
               timeout_s: float | None = None, session_id: str = "") -> AsyncStream:
        """A streamed request from exactly one of `prompt`, chat `messages` or `token_ids`; sent on first use.

        A chat request with a `session_id` is remembered by the server, so that a warmup of the session
        can prefill the conversation before its next turn.
        """
        return AsyncStream(self, self._generate_message(prompt, messages, token_ids, params, True, session_id),
                           self.timeout_s if timeout_s is None else timeout_s)

    async def generate(self, prompt: str | None = None, messages: Messages | None = None,
                       token_ids: list[int] | None = None, params: SamplingParams | None = None,
                       timeout_s: float | None = None, session_id: str = "") -> Completion:
        """A non-streamed request: the server sends everything in one frame when it is done."""
        message = self._generate_message(prompt, messages, token_ids, params, False, session_id)
        async with AsyncStream(self, message, self.timeout_s if timeout_s is None else timeout_s) as stream:
            async for _ in stream:
                pass
        return stream.completion

    async def status(self, timeout_s: float | None = None) -> Status:
        """The gateway's view: live workers with their load, and its number of open requests."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        await self.connect(timeout)
        try:
            return await self._ask(self._status_waiters, GetStatus(), timeout)
        except ConnectionForgottenError:
            await self.connect(timeout)
            return await self._ask(self._status_waiters, GetStatus(), timeout)

    async def wait_ready(self, expected_workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                         poll_s: float = 0.2) -> Status:
        """Poll status until `expected_workers` live workers (default: at least one) or raise UnavailableError."""
        deadline = time.monotonic() + timeout_s
        wanted = 1 if expected_workers is None else expected_workers
        while True:
            remaining = deadline - time.monotonic()
            try:
                status = await self.status(max(0.05, min(remaining, self.timeout_s)))
                num_alive = sum(w.alive for w in status.workers)
                if num_alive >= wanted:
                    return status
                problem = f"{num_alive} of {wanted} workers are up"
            except (ServerUnreachableError, RequestTimeoutError) as exc:
                problem = str(exc)
            if time.monotonic() + poll_s >= deadline:
                raise UnavailableError(f"the server at {self.address} was not ready within {timeout_s:g} s: "
                                       f"{problem}")
            await asyncio.sleep(poll_s)

    # -- internals -----------------------------------------------------------------------

    def draft(self, messages: Messages | None = None, session_id: str = "", cache_salt: str = "") -> AsyncDraft:
        """A prompt the user is typing: the next user turn after chat `messages`, or a plain prompt (None).
        `cache_salt`: as `SamplingParams.cache_salt`, for the draft and the request it becomes."""
        return AsyncDraft(self, chat_messages(messages) if messages is not None else None, session_id, cache_salt)

    async def warmup(self, session_id: str) -> None:
        """The user focused the input of `session_id`: the server may prefill its conversation so far."""
        await self.connect()
        self._send(Warmup(session_id))

    def _generate_message(self, prompt: str | None, messages: Messages | None, token_ids: list[int] | None,
                          params: SamplingParams | None, stream: bool, session_id: str = "") -> Generate:
        if sum(x is not None for x in (prompt, messages, token_ids)) != 1:
            raise InvalidRequestError("give exactly one of prompt, messages or token_ids")
        params = seeded(params)
        return Generate(uuid.uuid4().hex, prompt=prompt,
                        messages=chat_messages(messages) if messages is not None else None,
                        token_ids=list(token_ids) if token_ids is not None else None,
                        params=params, stream=stream, session_id=session_id)

    async def _open(self, message: msgspec.Struct, reply_id: str | None = None) -> asyncio.Queue[Reply]:
        """Register a queue for the replies to `message` (under its request id, or `reply_id`), then send it."""
        await self.connect()
        key = reply_id if reply_id is not None else message.request_id
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._requests[key] = queue
        try:
            self._send(message)
        except BaseException:
            self._requests.pop(key, None)
            raise
        return queue

    def _send(self, message: msgspec.Struct) -> None:
        """Send one frame now, or raise: a full send queue fails fast instead of blocking the caller."""
        if self._is_closed or self._socket is None:
            raise ClientClosedError("the client is closed")
        frame = encode(message)
        if len(frame) > MAX_CLIENT_FRAME_BYTES:
            raise InvalidRequestError(f"the request encodes to {len(frame)} bytes; the protocol's limit is "
                                      f"{MAX_CLIENT_FRAME_BYTES}")
        # With NOBLOCK and no send pending, pyzmq resolves the future before returning it.
        exc = self._socket.send(frame, flags=zmq.NOBLOCK).exception()
        if exc is not None:
            raise UnavailableError(f"could not send to {self.address}: {exc}") from exc

    async def _ask(self, waiters: deque[asyncio.Future], message: msgspec.Struct, timeout_s: float):
        """Send a frame whose reply carries no request id, and wait for that reply in turn."""
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            self._send(message)
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise RequestTimeoutError(f"no reply from {self.address} within {timeout_s:g} s") from None
        finally:
            if waiter in waiters:
                waiters.remove(waiter)

    async def _read(self) -> None:
        assert self._socket is not None
        while True:
            for frame in await self._socket.recv_multipart():  # the replies of one worker step come together
                try:
                    reply = client_reply_decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("dropped a frame from the server that does not decode", error=str(exc))
                    continue
                self._dispatch(reply)

    async def _watch(self) -> None:
        """The socket monitor: a dropped connection means the gateway is gone (or restarting)."""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and (self.ready is not None or self._requests):
                log.warning("the connection to the gateway dropped", address=self.address)
                self._forget_connection()

    def _forget_connection(self) -> None:
        """The gateway no longer knows this connection: whatever was sent on it is lost. The next call says Hello
        again; each stream resends or resumes its request."""
        self.ready = None
        for queue in self._requests.values():
            queue.put_nowait(ConnectionForgottenError(FORGOTTEN))
        self._requests.clear()
        while _resolve(self._status_waiters, ConnectionForgottenError(FORGOTTEN)):
            pass

    def _dispatch(self, reply: Ready | Tokens | Error | Status) -> None:
        if isinstance(reply, Error) and reply.code == "handshake_required":
            self._forget_connection()  # the gateway restarted
        elif isinstance(reply, Tokens | Error) and reply.request_id is not None:
            queue = self._requests.get(reply.request_id)
            if queue is not None:
                queue.put_nowait(reply)
        elif isinstance(reply, Ready):
            _resolve(self._hello_waiters, reply)
        elif isinstance(reply, Status):
            _resolve(self._status_waiters, reply)
        elif isinstance(reply, Error):  # an answer to a Hello (unsupported_version) or to a GetStatus
            if not _resolve(self._hello_waiters, error_from_reply(reply)):
                if not _resolve(self._status_waiters, error_from_reply(reply)):
                    log.warning("error from the server", code=reply.code, message=reply.message)


def _resolve(waiters: deque[asyncio.Future], result: object) -> bool:
    """Hand `result` (an exception is raised in the waiter) to the oldest pending waiter, if any."""
    while waiters:
        waiter = waiters.popleft()
        if waiter.done():
            continue
        if isinstance(result, BaseException):
            waiter.set_exception(result)
        else:
            waiter.set_result(result)
        return True
    return False
