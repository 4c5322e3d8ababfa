"""The gateway: the only process clients talk to.

Life cycle of a request in the gateway:

1. a client frame is size-checked and decoded into its type (a bad frame
   gets an `Error` reply and changes nothing); the client must have said
   `Hello` with our protocol version first;
2. `Generate`: the prompt is tokenized (chat template for messages) and
   checked against the context, then routed: a prefill and a decode worker
   (or one colocated worker) picked from the controller's view; with no live
   worker the request waits in `unrouted` until one appears or it times out;
3. worker outputs (`StepOutputs`) are detokenized and streamed to the client;
   the request ends with a finished `Tokens` frame or an `Error`;
4. a lost worker: requests that have produced no token yet are sent again
   (a new attempt, so late outputs of the old one are ignored); the others
   end with `Error("worker_lost")`. Every request has a deadline.

On shutdown the gateway stops admitting, lets open requests finish for up to
the drain timeout, then ends the rest with an error.
"""

import asyncio
import itertools
import time
from collections import OrderedDict, deque

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdrt.actors.actor import Actor, ActorRef
from pdrt.actors.sockets import SocketSpec, make_socket
from pdrt.control_plane.link import ControllerLink
from pdrt.engine.model_loader import load_tokenizer
from pdrt.errors import (
    DuplicateRequestError,
    MailboxFullError,
    PdrtError,
    RequestTimeoutError,
    UnavailableError,
    WorkerLostError,
)
from pdrt.node_config import NodeConfig
from pdrt.roles.client_frames import decode_client_frames
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.roles.messaging import Inbox, Outbox
from pdrt.roles.prompt_renderer import PromptRenderer
from pdrt.roles.router import Router
from pdrt.wire import (
    MAX_CLIENT_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Cancel,
    ClusterView,
    Error,
    Generate,
    GetStatus,
    Hello,
    Load,
    PrefillRequest,
    ProcessLost,
    Ready,
    RequestFailed,
    Status,
    StepOutputs,
    WorkerInfo,
    WorkerStatus,
    encode,
)

log = structlog.get_logger(__name__)

MAX_CLIENTS = 100_000  # handshaken client identities remembered
TICK_S = 0.2
# A hard cap far above the protocol's limit: ZeroMQ drops the connection of a
# peer that sends more, before the gateway could read (and answer) the frame.
HARD_FRAME_LIMIT = 8 * MAX_CLIENT_FRAME_BYTES


class Gateway(Actor):
    def __init__(self, config: NodeConfig, process_id: str, incarnation: str, ctx: zmq.asyncio.Context) -> None:
        self.config = config
        self.process_id = process_id
        self.model_name = config.model.rstrip("/").rsplit("/", 1)[-1]
        self.tokenizer, context_length = load_tokenizer(config.model)
        self.max_model_len = min(config.engine.max_model_len or context_length, context_length)
        self.prompts = PromptRenderer(self.tokenizer, self.max_model_len)
        self.clients = make_socket(ctx, SocketSpec(zmq.ROUTER, config.gateway_address, bind=True))
        self.clients.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        self.inbox = Inbox(ctx, config.ephemeral_address(), self._deliver)
        self.outbox = Outbox(ctx, process_id)
        self.link = ControllerLink(ctx, config.controller_address, process_id, incarnation, "gateway",
                                   self.inbox.address, lambda: Load(), self._from_controller)
        self.router = Router()
        self.handshaken: OrderedDict[bytes, None] = OrderedDict()
        self.requests: dict[str, GatewayRequest] = {}  # internal id -> request
        self.by_client: dict[tuple[bytes, str], GatewayRequest] = {}
        self.unrouted: deque[GatewayRequest] = deque()
        self.ids = itertools.count()
        self.draining = False
        self._ref: ActorRef | None = None

    # -- plumbing -------------------------------------------------------------------

    async def _deliver(self, message: object) -> None:
        assert self._ref is not None
        await self._ref.deliver(message)

    def _from_controller(self, message: object) -> None:
        assert self._ref is not None
        try:
            self._ref.tell(message)
        except MailboxFullError:
            log.warning("gateway mailbox full; dropped a controller message", message=type(message).__name__)

    def _reply(self, identity: bytes, message: msgspec.Struct) -> None:
        try:
            self.clients.send_multipart([identity, encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client left, or stopped reading
            log.info("could not reply to a client", error=str(exc))

    async def _read_clients(self) -> None:
        while True:
            frames = await self.clients.recv_multipart()
            assert self._ref is not None
            await self._ref.deliver(("client", frames[0], frames[1:]))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            assert self._ref is not None
            await self._ref.deliver("tick")

    # -- dispatch -------------------------------------------------------------------

    async def on_receive(self, message: object) -> None:
        if isinstance(message, tuple):
            self._client_frame(message[1], message[2])
        elif isinstance(message, StepOutputs):
            self._outputs(message)
        elif isinstance(message, RequestFailed):
            self._failed(message)
        elif isinstance(message, ClusterView):
            for worker in self.router.update(message.workers):
                self._worker_lost(worker)
            self._route_waiting()
        elif isinstance(message, ProcessLost):
            worker = self.router.remove(message.process_id, message.incarnation)
            if worker is not None:
                self._worker_lost(worker)
        elif message == "tick":
            self._expire()
        else:
            log.warning("gateway ignored a message", message=type(message).__name__)

    # -- client frames ----------------------------------------------------------------

    def _client_frame(self, identity: bytes, frames: list[bytes]) -> None:
        message = decode_client_frames(frames)
        if isinstance(message, Error):
            self._reply(identity, message)
        elif isinstance(message, Hello):
            self._hello(identity, message)
        elif identity not in self.handshaken:
            self._reply(identity, Error("handshake_required", "send Hello with the protocol version first"))
        elif isinstance(message, Generate):
            try:
                self._generate(identity, message)
            except PdrtError as exc:
                self._reply(identity, Error(exc.code, str(exc), message.request_id))
        elif isinstance(message, Cancel):
            self._cancel(identity, message.request_id)
        elif isinstance(message, GetStatus):
            self._reply(identity, self.status())

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._reply(identity, Error("unsupported_version", f"this server speaks protocol {PROTOCOL_VERSION}, "
                                                               f"the client {hello.protocol_version}"))
            return
        self.handshaken[identity] = None
        self.handshaken.move_to_end(identity)
        while len(self.handshaken) > MAX_CLIENTS:
            self.handshaken.popitem(last=False)
        self._reply(identity, Ready(PROTOCOL_VERSION, self.process_id, self.model_name, self.max_model_len))

    def status(self) -> Status:
        workers = [WorkerStatus(w.process_id, w.role, True, w.load) for w in self.router.workers.values()]
        return Status(sorted(workers, key=lambda w: w.process_id), len(self.by_client))

    def _generate(self, identity: bytes, message: Generate) -> None:
        if self.draining:
            raise UnavailableError("the server is shutting down")
        if (identity, message.request_id) in self.by_client:
            raise DuplicateRequestError(f"request {message.request_id!r} is already open")
        if len(self.by_client) >= self.config.gateway.max_open_requests:
            raise UnavailableError(f"the server has {len(self.by_client)} open requests, its limit; retry later")
        ids = self.prompts.render(message)
        timeout = message.timeout_s or self.config.gateway.request_timeout_s
        req = GatewayRequest.create(identity, message.request_id, ids, message.params, message.stream,
                                    time.monotonic() + timeout, self.tokenizer)
        self.by_client[(identity, message.request_id)] = req
        if not self._route(req):
            self.unrouted.append(req)

    # -- routing ----------------------------------------------------------------------

    def _route(self, req: GatewayRequest) -> bool:
        """Send `req` to its workers; False when no live worker can take it now."""
        if self.config.mode == "colocated":
            prefill, decode = self.router.pick("colocated"), None
            if prefill is None:
                return False
        else:
            prefill, decode = self.router.pick("prefill"), self.router.pick("decode")
            if prefill is None or decode is None:
                return False
        req.attempt += 1
        req.internal_id = f"{self.process_id}-{next(self.ids)}.{req.attempt}"
        req.prefill, req.decode = prefill, decode
        self.requests[req.internal_id] = req
        for worker in req.workers():
            self.router.open_requests[worker.process_id] += 1
        self.outbox.send(prefill.address, PrefillRequest(req.internal_id, req.prompt_token_ids, req.params,
                                                         self.inbox.address, decode.address if decode else ""))
        return True

    def _route_waiting(self) -> None:
        for _ in range(len(self.unrouted)):
            req = self.unrouted.popleft()
            if (req.identity, req.request_id) in self.by_client and not self._route(req):
                self.unrouted.append(req)
                break

    def _detach(self, req: GatewayRequest, abort: bool) -> None:
        """Forget the current attempt of `req`; with `abort`, tell its live workers to drop it."""
        if self.requests.pop(req.internal_id, None) is None:
            return
        for worker in req.workers():
            self.router.open_requests[worker.process_id] -= 1
            if abort and self.router.is_live(worker):
                self.outbox.send(worker.address, Abort(req.internal_id))
        req.prefill = req.decode = None

    def _end(self, req: GatewayRequest, final: msgspec.Struct, abort: bool = False) -> None:
        self._detach(req, abort)
        if self.by_client.pop((req.identity, req.request_id), None) is not None:
            self._reply(req.identity, final)

    def _retry(self, req: GatewayRequest) -> None:
        self._detach(req, abort=True)
        log.info("retrying a request", request_id=req.request_id, attempt=req.attempt + 1)
        if not self._route(req):
            self.unrouted.append(req)

    # -- worker messages -----------------------------------------------------------------

    def _outputs(self, message: StepOutputs) -> None:
        for out in message.outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # a cancelled or abandoned attempt
            from_decode = req.decode is not None and message.process_id == req.decode.process_id
            if from_decode and not req.has_tokens:
                req.early_decode_outputs.append(out)  # overtook the prefill worker's first token
                continue
            self._take(req, out)
            if not from_decode and req.early_decode_outputs and out.request_id in self.requests:
                early, req.early_decode_outputs = req.early_decode_outputs, []
                for later in early:
                    if later.request_id in self.requests:
                        self._take(req, later)

    def _take(self, req: GatewayRequest, out) -> None:
        frame, finished = req.add(out)
        if finished:
            self._end(req, frame, abort=not out.finished)  # a stop string seen here first: stop the worker
        elif frame is not None:
            self._reply(req.identity, frame)

    def _failed(self, message: RequestFailed) -> None:
        req = self.requests.get(message.request_id)
        if req is None:
            return
        if message.retryable and not req.has_tokens:
            self._retry(req)
        else:
            self._end(req, Error(message.code, message.message, req.request_id), abort=True)

    def _worker_lost(self, worker: WorkerInfo) -> None:
        log.warning("worker lost", process=worker.process_id, role=worker.role)
        self.outbox.forget(worker.address)
        for req in list(self.requests.values()):
            if not any(w.process_id == worker.process_id and w.incarnation == worker.incarnation
                       for w in req.workers()):
                continue
            if not req.has_tokens:
                self._retry(req)
            elif req.decode is None or req.decode.process_id == worker.process_id:
                error = WorkerLostError(f"{worker.process_id} died after the request had produced tokens")
                self._end(req, Error(error.code, str(error), req.request_id), abort=True)
            # else: the prefill worker died after its handoff; the decode worker carries on

    def _cancel(self, identity: bytes, request_id: str) -> None:
        req = self.by_client.get((identity, request_id))
        if req is None:
            self._reply(identity, Error("unknown_request", f"no open request {request_id!r}", request_id))
            return
        if req in self.unrouted:
            self.unrouted.remove(req)
        self._end(req, req.cancelled(), abort=True)

    def _expire(self) -> None:
        now = time.monotonic()
        for req in [r for r in self.by_client.values() if r.deadline < now]:
            if req in self.unrouted:
                self.unrouted.remove(req)
                error: PdrtError = UnavailableError("no worker became available before the request's deadline")
            else:
                error = RequestTimeoutError("the request did not finish before its deadline")
            self._end(req, Error(error.code, str(error), req.request_id), abort=True)

    # -- life cycle ----------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        self._ref = self.start()
        self.inbox.start()
        self.link.start()
        tasks = [asyncio.create_task(self._read_clients()), asyncio.create_task(self._tick())]
        log.info("gateway serving", address=self.config.gateway_address, model=self.model_name,
                 max_model_len=self.max_model_len)
        try:
            await stop.wait()
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            self.link.close()
            self.inbox.close()
            await self._ref.stop()
            self.outbox.close()
            self.clients.close()

    async def _drain(self) -> None:
        self.draining = True
        deadline = time.monotonic() + self.config.gateway.drain_timeout_s
        log.info("gateway draining", open_requests=len(self.by_client))
        while self.by_client and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in list(self.by_client.values()):
            error = UnavailableError("the server shut down before the request finished")
            self._end(req, Error(error.code, str(error), req.request_id), abort=True)
