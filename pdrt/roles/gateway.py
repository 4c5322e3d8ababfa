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

Type-ahead: a draft (`DraftOpen`, appends and edits) is prefilled on one
worker while it is typed (see `DraftBook`); `DraftSubmit` sends its final
tokens there and it goes on as step 3. Warmup (UDP or `Warmup`): the
session's remembered conversation is prefilled on a worker for a TTL, and
the session's next request or draft is routed to that worker.

On shutdown the gateway stops admitting, lets open requests finish for up to
the drain timeout, then ends the rest with an error.
"""

import asyncio
import itertools
import time
from collections import Counter, OrderedDict, deque

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
from pdrt.typeahead.draft_book import DraftBook, GatewayDraft
from pdrt.typeahead.draft_tokenizer import DraftTokenizer
from pdrt.typeahead.sessions import SessionStore
from pdrt.warmup.guard import WarmupGuard
from pdrt.warmup.listener import WarmupListener
from pdrt.warmup.reservations import Reservations
from pdrt.wire import (
    MAX_CLIENT_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Cancel,
    ClusterView,
    DraftAbandon,
    DraftAppend,
    DraftOpen,
    DraftReplace,
    DraftSubmit,
    DraftSubmitted,
    DraftUpdate,
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
    Warmup,
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
        self.counters: Counter[str] = Counter()
        self.prefill_role = "colocated" if config.mode == "colocated" else "prefill"
        self.drafts = DraftBook(self.tokenizer, self.max_model_len, self.router, self.outbox, self.prefill_role,
                                config.gateway.max_drafts, config.engine.draft_ttl_s, self._new_id, self.counters)
        self.sessions = SessionStore()
        self.reservations = Reservations(config.warmup.max_reservations, config.warmup.ttl_s)
        self.warmup_guard: WarmupGuard | None = None
        self.warmup_listener: WarmupListener | None = None
        if config.warmup.key:
            self.warmup_guard = WarmupGuard(config.warmup.key.encode(), self.model_name, config.warmup.max_age_s)
            self.warmup_listener = WarmupListener(config.host, config.warmup.port, self.warmup_guard,
                                                  self._warmup_datagram)
        self._ref: ActorRef | None = None

    def _new_id(self) -> str:
        return f"{self.process_id}-{next(self.ids)}"

    # -- plumbing -------------------------------------------------------------------

    async def _deliver(self, message: object) -> None:
        assert self._ref is not None
        await self._ref.deliver(message)

    def _warmup_datagram(self, session_id: str) -> None:
        assert self._ref is not None
        try:
            self._ref.tell(Warmup(session_id))
        except MailboxFullError:
            self.counters["warmups_dropped_busy"] += 1

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
        elif isinstance(message, Warmup):
            self._warmup(message.session_id)
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
        elif isinstance(message, Cancel):
            self._cancel(identity, message.request_id)
        elif isinstance(message, GetStatus):
            self._reply(identity, self.status())
        elif isinstance(message, Warmup):
            self._warmup(message.session_id)
        else:
            try:
                self._client_request(identity, message)
            except PdrtError as exc:
                request_id = message.draft_id if hasattr(message, "draft_id") else message.request_id
                self._reply(identity, Error(exc.code, str(exc), request_id))

    def _client_request(self, identity: bytes, message: object) -> None:
        if isinstance(message, Generate):
            self._generate(identity, message)
        elif isinstance(message, DraftAppend):
            self.drafts.append(identity, message)
        elif isinstance(message, DraftReplace):
            self.drafts.replace(identity, message)
        elif isinstance(message, DraftOpen):
            if self.draining:
                raise UnavailableError("the server is shutting down")
            self.drafts.open(identity, message, self._session_worker(message.session_id))
        elif isinstance(message, DraftSubmit):
            self._submit(identity, message)
        elif isinstance(message, DraftAbandon):
            self.drafts.abandon(identity, message.draft_id)

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
        counters = dict(self.counters)
        counters["open_drafts"] = len(self.drafts.drafts)
        counters["warmup_reservations"] = len(self.reservations.by_session)
        if self.warmup_guard is not None:
            counters["warmup_datagrams_accepted"] = self.warmup_guard.accepted
            counters.update({f"warmup_dropped_{k}": v for k, v in self.warmup_guard.dropped.items()})
        return Status(sorted(workers, key=lambda w: w.process_id), len(self.by_client), counters)

    def _admit(self, identity: bytes, request_id: str, ids: list[int], params, stream: bool,
               timeout_s: float | None) -> GatewayRequest:
        if self.draining:
            raise UnavailableError("the server is shutting down")
        if (identity, request_id) in self.by_client:
            raise DuplicateRequestError(f"request {request_id!r} is already open")
        if len(self.by_client) >= self.config.gateway.max_open_requests:
            raise UnavailableError(f"the server has {len(self.by_client)} open requests, its limit; retry later")
        timeout = timeout_s or self.config.gateway.request_timeout_s
        return GatewayRequest.create(identity, request_id, ids, params, stream, time.monotonic() + timeout,
                                     self.tokenizer)

    def _open(self, req: GatewayRequest, draft: GatewayDraft | None = None) -> None:
        self.by_client[(req.identity, req.request_id)] = req
        if not self._route(req, draft):
            self.unrouted.append(req)

    def _generate(self, identity: bytes, message: Generate) -> None:
        ids = self.prompts.render(message)
        req = self._admit(identity, message.request_id, ids, message.params, message.stream, message.timeout_s)
        if message.session_id and message.messages is not None:
            req.session_id = message.session_id
            req.messages = [{"role": m.role, "content": m.content} for m in message.messages]
        req.preferred = self._session_worker(message.session_id)
        self._open(req)

    def _submit(self, identity: bytes, message: DraftSubmit) -> None:
        draft = self.drafts.take(identity, message.draft_id)
        try:
            ids = self.prompts.check(draft.tokens.final_ids())
            req = self._admit(identity, message.request_id, ids, message.params, message.stream, message.timeout_s)
        except PdrtError:
            self.drafts.drop(draft, "drafts_failed")
            raise
        if draft.messages is not None:
            req.session_id = draft.session_id
            req.messages = [*draft.messages, {"role": "user", "content": draft.text}]
        self._open(req, draft)

    # -- warmup -----------------------------------------------------------------------

    def _session_worker(self, session_id: str) -> WorkerInfo | None:
        """The worker holding `session_id`'s warmup, counted as a hit (or a miss) of the warmup."""
        if not session_id:
            return None
        reservation = self.reservations.get(session_id)
        if reservation is not None and self.router.is_live(reservation.worker):
            self.counters["warmup_hits"] += 1
            return reservation.worker
        self.counters["warmup_misses"] += 1
        return None

    def _warmup(self, session_id: str) -> None:
        reservation = self.reservations.get(session_id)
        if reservation is not None and self.router.is_live(reservation.worker):
            self.reservations.renew(reservation)
            self.counters["warmups_renewed"] += 1
            return
        history = self.sessions.get(session_id)
        if history is None:
            self.counters["warmups_unknown_session"] += 1
            return
        worker = self.router.pick(self.prefill_role)
        if worker is None or self.reservations.is_full:
            self.counters["warmups_refused"] += 1
            return
        ids = DraftTokenizer(self.tokenizer, history).stable_ids()  # the conversation up to the next turn
        if not ids or len(ids) >= self.max_model_len:
            self.counters["warmups_refused"] += 1
            return
        draft_id = self._new_id()
        self.outbox.send(worker.address, DraftUpdate(draft_id, 0, ids, colocated=self.prefill_role == "colocated"))
        self.reservations.add(session_id, worker, draft_id)
        self.counters["warmups"] += 1
        self.counters["warmup_tokens"] += len(ids)

    # -- routing ----------------------------------------------------------------------

    def _route(self, req: GatewayRequest, draft: GatewayDraft | None = None) -> bool:
        """Send `req` to its workers; False when no live worker can take it now.

        A submitted draft goes to the worker that prefilled it, if that one
        is alive; a session's request to the worker holding its warmup.
        """
        held = draft is not None and draft.worker is not None and draft.sent and self.router.is_live(draft.worker)
        if held:
            prefill = draft.worker
        elif req.preferred is not None and self.router.is_live(req.preferred):
            prefill = req.preferred
        else:
            prefill = self.router.pick(self.prefill_role)
        decode = self.router.pick("decode") if self.prefill_role == "prefill" else None
        if prefill is None or (decode is None and self.prefill_role == "prefill"):
            if draft is not None:
                self.drafts.drop(draft, "drafts_rerouted")
            return False
        req.attempt += 1
        req.internal_id = draft.internal_id if held else f"{self._new_id()}.{req.attempt}"
        req.prefill, req.decode = prefill, decode
        self.requests[req.internal_id] = req
        for worker in req.workers():
            self.router.open_requests[worker.process_id] += 1
        decode_address = decode.address if decode else ""
        if held:
            self.outbox.send(prefill.address, DraftSubmitted(req.internal_id, req.prompt_token_ids, req.params,
                                                             self.inbox.address, decode_address))
        else:
            if draft is not None:
                self.drafts.drop(draft, "drafts_rerouted")
            self.outbox.send(prefill.address, PrefillRequest(req.internal_id, req.prompt_token_ids, req.params,
                                                             self.inbox.address, decode_address))
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
            if req.session_id and req.messages is not None:
                self.sessions.record(req.session_id, req.messages, req.answer)
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
        self.drafts.worker_lost(worker)
        self.reservations.on_worker(worker.process_id)
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
        for draft in self.drafts.expire():
            error = RequestTimeoutError(f"draft {draft.draft_id!r} saw no activity for {self.drafts.ttl_s} s")
            self._reply(draft.identity, Error(error.code, str(error), draft.draft_id))
        for reservation in self.reservations.expire():
            if self.router.is_live(reservation.worker):
                self.outbox.send(reservation.worker.address, Abort(reservation.draft_id))
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
        if self.warmup_listener is not None:
            await self.warmup_listener.start()
        log.info("gateway serving", address=self.config.gateway_address, model=self.model_name,
                 max_model_len=self.max_model_len)
        try:
            await stop.wait()
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            if self.warmup_listener is not None:
                self.warmup_listener.close()
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
