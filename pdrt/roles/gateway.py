"""The gateway: the only process clients talk to.

Life cycle of a request in the gateway:

1. a client frame is size-checked and decoded into its type (a bad frame
   gets an `Error` reply and changes nothing); the client must have said
   `Hello` with our protocol version first;
2. `Generate`: the prompt is tokenized (chat template for messages; a
   large one on a thread of its own) and checked against the context
   (request_intake.py), then routed: a prefill and a decode worker
   (or one colocated worker) picked from the controller's view; with no live
   worker the request waits in `unrouted` until one appears or it times out;
3. worker outputs (`StepOutputs`) are detokenized and streamed to the client,
   the frames of one worker step for one client as the parts of one ZeroMQ
   message; the request ends with a finished `Tokens` frame or an `Error`;
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

The gateway is the one actor of the client plane, so this module holds the dispatch of every
message it takes, which is why it is long; the work each message starts lives in the modules it names
(request_intake.py, request_table.py, the draft book, the warmups).
"""

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdrt.actors.actor import Actor, ActorRef, FromPeer, Tick
from pdrt.actors.sockets import SocketSpec, make_socket, send_now
from pdrt.control_plane.link import ControllerLink
from pdrt.engine.model_loader import load_tokenizer
from pdrt.errors import (
    MailboxFullError,
    PdrtError,
    RequestTimeoutError,
    UnavailableError,
)
from pdrt.http.server import DraftText, HttpFront
from pdrt.metrics.gateway_view import GatewayMetricsView
from pdrt.metrics.worker_metrics import SPLIT_ROLES
from pdrt.node_config import NodeConfig
from pdrt.roles.client_frames import decode_client_frames
from pdrt.roles.gateway_request import new_internal_id
from pdrt.roles.messaging import WORKER_ROLES, Inbox, Outbox
from pdrt.roles.prompt_renderer import PromptRenderer
from pdrt.roles.prompt_renders import PromptRenders, Rendered
from pdrt.roles.request_intake import RequestIntake
from pdrt.roles.request_table import RequestTable
from pdrt.roles.router import Router
from pdrt.roles.tenants import http_identity, is_http
from pdrt.typeahead.draft_book import DraftBook
from pdrt.warmup.guard import WarmupGuard
from pdrt.warmup.listener import WarmupListener
from pdrt.warmup.warmups import Warmups
from pdrt.wire import (
    MAX_CLIENT_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    ClusterView,
    DraftAbandon,
    DraftAppend,
    DraftOpen,
    DraftReplace,
    DraftSubmit,
    Error,
    GatewayBack,
    Generate,
    GetStatus,
    Hello,
    Load,
    MetricsView,
    ProcessLost,
    Ready,
    RequestFailed,
    Status,
    StepOutputs,
    Warmup,
    Withdrawn,
    WorkerInfo,
    WorkerStatus,
    encode,
)

log = structlog.get_logger(__name__)

MAX_CLIENTS = 100_000  # handshaken client identities remembered (those with something open, however many)
HTTP_ASK_TIMEOUT_S = 10.0
TICK_S = 0.2
# A hard cap far above the protocol's limit: ZeroMQ drops the connection of a
# peer that sends more, before the gateway could read (and answer) the frame.
HARD_FRAME_LIMIT = 8 * MAX_CLIENT_FRAME_BYTES


# A split worker answers a withdraw in whichever role it serves now: its name says the role it started with.
WORKER_SENDERS = {StepOutputs: WORKER_ROLES, RequestFailed: WORKER_ROLES, Withdrawn: SPLIT_ROLES}


@dataclass(frozen=True, slots=True)
class FromHttp:
    """A client message from the HTTP front, made with `tenant`'s key (its replies go to the HTTP front)."""

    message: object
    tenant: str = ""


def _request_id(message: object) -> str | None:
    """The id a client waits on for this message: the request's (a submit's too), else the draft's."""
    return getattr(message, "request_id", None) or getattr(message, "draft_id", None)


class Gateway(Actor):
    def __init__(self, config: NodeConfig, process_id: str, incarnation: str, ctx: zmq.asyncio.Context) -> None:
        self.config = config
        self.process_id = process_id
        self.model_name = config.model.rstrip("/").rsplit("/", 1)[-1]
        self.tokenizer, context_length, vocab_size = load_tokenizer(config.model)
        self.max_model_len = min(config.engine.max_model_len or context_length, context_length)
        self.prompts = PromptRenderer(self.tokenizer, self.max_model_len, vocab_size)
        self.renders = PromptRenders(self.prompts, self._deliver)
        self.clients = make_socket(ctx, SocketSpec(zmq.ROUTER, config.gateway_address, bind=True))
        self.clients.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        key = config.key
        self.inbox = Inbox(ctx, config.ephemeral_address(), self._deliver, WORKER_SENDERS, key)
        self.outbox = Outbox(ctx, process_id, key)
        self.link = ControllerLink(ctx, config.controller_address, process_id, incarnation, "gateway",
                                   self.inbox.address, lambda: Load(), self._tell, key=key)
        self.router = Router()
        self.handshaken: OrderedDict[bytes, None] = OrderedDict()
        self.gone_clients: set[bytes] = set()
        self.counters: Counter[str] = Counter()
        role, x = config.prefilling_role, config.experimental
        self.drafts = DraftBook(self.tokenizer, self.prompts.max_chars, self.max_model_len, self.router, self.outbox,
                                role, x.max_drafts, x.draft_ttl_s, self._new_id, self.counters)
        self.warmups = Warmups(x.warmup_max_reservations, x.warmup_ttl_s, self.tokenizer, self.max_model_len,
                               self.router, self.outbox, role, self._new_id, self.counters)
        self.table = RequestTable(config, self.tokenizer, self.router, self.outbox, self.inbox.address, self.drafts,
                                  self.warmups, self._reply_all, process_id)
        self.intake = RequestIntake(self.prompts, self.renders, self.table, self.drafts, self.warmups, self._reply)
        self.warmup_listener: WarmupListener | None = None
        if config.warmup.key:
            guard = WarmupGuard(config.warmup.key.encode(), self.model_name, x.warmup_max_age_s)
            self.warmup_listener = WarmupListener(config.host, config.warmup.port, guard,
                                                  lambda session_id: self._tell(Warmup(session_id)))
        self.http: HttpFront | None = None
        if config.gateway.http_port:
            self.http = HttpFront(config.host, config.gateway.http_port, config.gateway.tenants(), self.model_name,
                                  self.max_model_len, x.request_timeout_s, self._ask_from_http,
                                  lambda message, tenant: self._tell(FromHttp(message, tenant)), self.status,
                                  lambda: self.metrics_view.exposition())
        self.metrics_view = GatewayMetricsView(self.table.metrics, self.status, process_id)
        self._ref: ActorRef | None = None

    def _new_id(self) -> str:
        return new_internal_id(self.process_id)

    # -- plumbing -------------------------------------------------------------------

    async def _deliver(self, message: object) -> None:
        assert self._ref is not None
        await self._ref.deliver(message)

    def _tell(self, message: object) -> None:
        """From callbacks (controller link, UDP): never wait; a full mailbox drops and counts."""
        assert self._ref is not None
        try:
            self._ref.tell(message)
        except MailboxFullError:
            self.counters[f"dropped_busy_{type(message).__name__.lower()}"] += 1

    async def _ask_from_http(self, message: object, tenant: str) -> PdrtError | None:
        """An HTTP handler's client message, taken by the actor in turn; its refusal comes back."""
        assert self._ref is not None
        return await self._ref.ask(FromHttp(message, tenant), HTTP_ASK_TIMEOUT_S)

    def _reply(self, identity: bytes, message: msgspec.Struct) -> None:
        self._reply_all(identity, [message])

    def _reply_all(self, identity: bytes, messages: list[msgspec.Struct]) -> None:
        """Send a client its messages, each a frame of one ZeroMQ message (a client reads them one by one)."""
        if is_http(identity):
            assert self.http is not None
            for message in messages:
                self.http.deliver(message)
            return
        try:
            send_now(self.clients, [identity, *map(encode, messages)])
        except zmq.ZMQError as exc:  # the client left, or stopped reading
            if identity not in self.gone_clients:
                log.info("client unreachable; ending its requests", error=str(exc))
            self.gone_clients.add(identity)  # its requests and drafts end at the next tick

    async def _read_clients(self) -> None:
        while True:
            frames = await self.clients.recv_multipart()
            await self._deliver(FromPeer(frames[0], frames[1:]))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self._deliver(Tick())

    # -- dispatch -------------------------------------------------------------------

    async def on_receive(self, message: object) -> PdrtError | None:
        match message:
            case FromHttp(message=request, tenant=tenant):
                return self._client_message(http_identity(tenant), request)
            case FromPeer(identity=identity, message=frames):
                self._client_frame(identity, frames)
            case Rendered(identity=identity):
                self._take(identity, message)
            case StepOutputs():
                self.table.outputs(message)
            case RequestFailed():
                self.table.failed(message)
            case Withdrawn():
                self.table.withdrawn(message)
            case Warmup(session_id=session_id):
                self.warmups.warm(session_id)
            case ClusterView(workers=workers, complete=complete):
                known = {(w.process_id, w.incarnation) for w in self.router.workers.values()}
                for worker in self.router.update(workers, complete):
                    self._worker_lost(worker)
                for worker in workers:  # introduced before anything is sent to it (its inbox may reuse a port)
                    if (worker.process_id, worker.incarnation) not in known:
                        self.outbox.send(worker.address, GatewayBack(self.inbox.address))
                self.table.route_waiting()
            case ProcessLost(process_id=process_id, incarnation=incarnation):
                worker = self.router.remove(process_id, incarnation)
                if worker is not None:
                    self._worker_lost(worker)
            case MetricsView():
                self.metrics_view.update(message)
            case Error(code="process_lost"):  # frozen past its lease: its workers dropped its requests
                log.warning("this gateway was declared lost; its requests go on anew",
                            requests=len(self.table.requests))
                for worker in self.router.workers.values():
                    self.outbox.send(worker.address, GatewayBack(self.inbox.address))
                self.table.send_all_again()
            case Tick():
                self._expire()
            case _:
                log.warning("gateway ignored a message", message=type(message).__name__)
        return None

    def _worker_lost(self, worker: WorkerInfo) -> None:
        log.warning("worker lost", process=worker.process_id, role=worker.role)
        self.outbox.forget(worker.address)
        self.drafts.worker_lost(worker)
        self.warmups.worker_lost(worker)
        self.table.worker_lost(worker)

    def _expire(self) -> None:
        for identity in self.gone_clients:
            self.table.forget_client(identity)
            self.drafts.forget_client(identity)
            self.renders.forget_client(identity)
            self.handshaken.pop(identity, None)
        self.gone_clients.clear()
        self.drafts.sync_paused(TICK_S)
        for draft in self.drafts.expire():
            error = RequestTimeoutError(f"draft {draft.draft_id!r} saw no activity for {self.drafts.ttl_s} s")
            self._reply(draft.identity, Error(error.code, str(error), draft.draft_id))
        self.warmups.expire()
        self.table.expire()
        self.table.rebalance()

    # -- client frames ----------------------------------------------------------------

    def _client_frame(self, identity: bytes, frames: list[bytes]) -> None:
        message = decode_client_frames(frames)
        if isinstance(message, Error):
            self._reply(identity, message)
        elif isinstance(message, Hello):
            self._hello(identity, message)
        elif identity not in self.handshaken:
            self._reply(identity, Error("handshake_required", "send Hello with the protocol version first",
                                        _request_id(message)))
        else:
            self._take(identity, message)

    def _take(self, identity: bytes, message: object) -> None:
        """Take a client message; a refusal goes back to the client as an error."""
        error = self._client_message(identity, message)
        if error is not None:
            self._reply(identity, Error(error.code, str(error), _request_id(message)))

    def _client_message(self, identity: bytes, message: object) -> PdrtError | None:
        """Take a decoded client message (native or HTTP); a refusal is returned, for the caller to report.

        Whatever goes wrong here, the client hears of it: a fault of the gateway's own is an "internal"
        error for that message, never a silence that leaves the client waiting for its timeout."""
        try:
            self._client_request(identity, message)
        except PdrtError as exc:
            return exc
        except Exception as exc:
            log.exception("a client message could not be handled", message=type(message).__name__)
            return PdrtError(f"the gateway failed on this message: {exc!r}")
        return None

    def _client_request(self, identity: bytes, message: object) -> None:
        match message:
            case Generate():
                self.intake.generate(identity, message)
            case Cancel(request_id=request_id):
                self.intake.cancel(identity, request_id)
            case GetStatus():
                self._reply(identity, self.status())
            case Warmup(session_id=session_id):
                self.warmups.warm(session_id, identity)
            case DraftAppend():
                self.drafts.append(identity, message)
            case DraftReplace():
                self.drafts.replace(identity, message)
            case DraftOpen() if not self.table.admitting:
                raise UnavailableError("the server is shutting down")
            case DraftOpen(session_id=session_id):
                self.drafts.open(identity, message, self.warmups.worker_for(identity, session_id))
            case DraftSubmit():
                self.intake.submit(identity, message)
            case DraftAbandon(draft_id=draft_id):
                self.drafts.abandon(identity, draft_id)
            case DraftText(draft_id=draft_id, text=text):
                self.drafts.set_text(identity, draft_id, text)
            case Rendered():
                self.intake.rendered(message)

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            self._reply(identity, Error("unsupported_version", f"this server speaks protocol {PROTOCOL_VERSION}, "
                                                               f"the client {hello.protocol_version}"))
            return
        self.handshaken[identity] = None
        self.handshaken.move_to_end(identity)
        if len(self.handshaken) > MAX_CLIENTS:
            self._forget_idle_client()
        self._reply(identity, Ready(PROTOCOL_VERSION, self.process_id, self.model_name, self.max_model_len))

    def _forget_idle_client(self) -> None:
        """Forget the handshake of the least recent client that has nothing open: a client with requests or drafts
        open is never forgotten (its resends would then collide with what it had open). The open requests and
        drafts of all clients are bounded, so few are passed over."""
        for identity in self.handshaken:
            if not (self.table.num_open_by[identity] or self.drafts.num_open_by[identity]):
                del self.handshaken[identity]
                return

    def status(self) -> Status:
        workers = [WorkerStatus(w.process_id, w.role, True, w.load) for w in self.router.workers.values()]
        counters = dict(self.counters)
        counters["open_drafts"] = len(self.drafts.drafts)
        counters["warmup_reservations"] = len(self.warmups.reservations.by_session)
        counters["open_answer_tokens_left"] = sum(max(0, r.params.max_tokens - len(r.token_ids))
                                                  for r in self.table.by_client.values())
        if self.warmup_listener is not None:
            guard = self.warmup_listener.guard
            counters["warmup_datagrams_accepted"] = guard.accepted
            counters.update({f"warmup_dropped_{k}": v for k, v in guard.dropped.items()})
        return Status(sorted(workers, key=lambda w: w.process_id), len(self.table.by_client), counters)

    # -- life cycle ----------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        self._ref = self.start()
        self.inbox.start()
        self.link.start()
        tasks = [asyncio.create_task(self._read_clients()), asyncio.create_task(self._tick())]
        if self.warmup_listener is not None:
            await self.warmup_listener.start()
        if self.http is not None:
            await self.http.start()
        log.info("gateway serving", address=self.config.gateway_address, inbox=self.inbox.address,
                 model=self.model_name, max_model_len=self.max_model_len)
        try:
            await stop.wait()
            await self._drain()
        finally:
            for task in tasks:
                task.cancel()
            if self.warmup_listener is not None:
                self.warmup_listener.close()
            if self.http is not None:
                await self.http.stop()
            self.link.close()
            self.inbox.close()
            self.renders.close()
            await self._ref.stop()
            self.outbox.close()
            self.clients.close()

    async def _drain(self) -> None:
        self.table.admitting = False
        deadline = time.monotonic() + self.config.experimental.drain_timeout_s
        log.info("gateway draining", open_requests=len(self.table.by_client))
        while (self.table.by_client or self.renders) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.table.end_all(UnavailableError("the server shut down before the request finished"))
