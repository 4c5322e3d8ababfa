"""The gateway's open requests: admission, routing to workers, their outputs, and how each one ends.

Every request ends exactly once — finished, cancelled, failed, lost with
its worker, or past its deadline — with one final frame to its client. A
request is known by the client's id to the client and by an *attempt id* to
the workers; a retry (its worker died before it produced a token) is a new
attempt, so that late outputs of the old one are recognized and ignored.

Long on purpose: every request's life, from admission to its one end, is in this one place; the
decisions about where a prompt is prefilled are the LocalPrefill policy's (local_prefill.py).
"""

import random
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from pdrt.engine.outputs import RequestOutput
from pdrt.engine.sampling_params import SamplingParams
from pdrt.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVPoolFullError,
    OverloadedError,
    PdrtError,
    RequestTimeoutError,
    RoleChangedError,
    StreamMovedError,
    UnavailableError,
    WorkerLostError,
    error_for,
)
from pdrt.metrics.gateway_metrics import GatewayMetrics
from pdrt.node_config import NodeConfig
from pdrt.roles.client_share import holds_a_share, release, share_of
from pdrt.roles.gateway_request import GatewayRequest, new_internal_id
from pdrt.roles.local_prefill import LocalPrefill, LocalPrefillRules
from pdrt.roles.messaging import Outbox
from pdrt.roles.prefix_memory import PrefixMemory
from pdrt.roles.router import Router
from pdrt.roles.tenants import worker_salt
from pdrt.typeahead.draft_book import DraftBook, GatewayDraft
from pdrt.warmup.warmups import Warmups
from pdrt.wire import (
    Abort,
    DraftSubmitted,
    Error,
    PrefillRequest,
    RequestFailed,
    StepOutputs,
    Withdraw,
    Withdrawn,
    WorkerInfo,
)

log = structlog.get_logger(__name__)

MAX_TIMEOUT_S = 24 * 3600.0
WITHDRAW_TIMEOUT_S = 5.0  # for a prefill worker's answer to a withdraw


class RequestTable:
    def __init__(self, config: NodeConfig, tokenizer: Any, router: Router, outbox: Outbox, inbox_address: str,
                 drafts: DraftBook, warmups: Warmups, reply: Callable[[bytes, list[msgspec.Struct]], None],
                 process_id: str) -> None:
        self.max_open_requests = config.gateway.max_open_requests
        self.max_open_per_client = share_of(self.max_open_requests)
        self.num_open_by: Counter[bytes] = Counter()  # open requests per client identity
        self.max_failures = config.gateway.max_request_failures
        self.request_timeout_s = config.experimental.request_timeout_s
        self.unrouted_wait_s = config.experimental.unrouted_wait_s
        self.tokenizer = tokenizer
        self.router = router
        self.outbox = outbox
        self.inbox_address = inbox_address
        self.role = config.prefilling_role  # "prefill" (then a decode worker too) or "colocated"
        self.drafts = drafts
        self.warmups = warmups
        self.reply = reply  # a client's frames, sent as the parts of one ZeroMQ message
        self.held: dict[bytes, list[msgspec.Struct]] | None = None  # while a worker's outputs are taken
        self.process_id = process_id
        # Where the prompts' KV went: the prompts' cached parts, for moves.
        self.prefixes = PrefixMemory(config.experimental.block_size, config.experimental.hash_seed)
        self.requests: dict[str, GatewayRequest] = {}  # attempt id -> request
        self.local = LocalPrefill(LocalPrefillRules.of(config), router, self.prefixes, self.requests, process_id)
        self.by_client: dict[tuple[bytes, str], GatewayRequest] = {}
        self.unrouted: deque[GatewayRequest] = deque()
        self.admitting = True
        self.metrics = GatewayMetrics(config.gateway)

    # -- admission ----------------------------------------------------------------------

    def check_admission(self, identity: bytes, request_id: str, timeout_s: float | None, num_pending: int = 0) -> None:
        """Raise the reason a new request cannot open now; `num_pending` more are on their way (being rendered).
        One client holds at most its share of the open requests."""
        if not self.admitting:
            raise UnavailableError("the server is shutting down")
        if (identity, request_id) in self.by_client:
            raise DuplicateRequestError(f"request {request_id!r} is already open")
        num_open = len(self.by_client) + num_pending
        if num_open >= self.max_open_requests:
            raise OverloadedError(f"the server has {num_open} open requests, its limit; retry later")
        num_here = self.num_open_by[identity]
        if num_here >= self.max_open_per_client and holds_a_share(identity):
            raise OverloadedError(f"this client has {num_here} open requests, its share of the server's "
                                  f"{self.max_open_requests}; retry when some have ended")
        if timeout_s is not None and not (0 < timeout_s <= MAX_TIMEOUT_S):
            raise InvalidRequestError(f"timeout_s must be in (0, {MAX_TIMEOUT_S}], got {timeout_s}")

    def admit(self, identity: bytes, request_id: str, ids: list[int], params: SamplingParams, stream: bool,
              timeout_s: float | None) -> GatewayRequest:
        self.check_admission(identity, request_id, timeout_s)
        deadline = time.monotonic() + (timeout_s or self.request_timeout_s)
        # One seed for every attempt: a stream that moves samples on as it would have. The salt the workers
        # see is the client's salt in its tenant's name (pdrt/roles/tenants.py).
        params = msgspec.structs.replace(params, seed=random.getrandbits(63) if params.seed is None else params.seed,
                                         cache_salt=worker_salt(identity, params.cache_salt))
        return GatewayRequest.create(identity, request_id, ids, params, stream, deadline, self.tokenizer)

    def open(self, req: GatewayRequest, draft: GatewayDraft | None = None) -> None:
        self.by_client[(req.identity, req.request_id)] = req
        self.num_open_by[req.identity] += 1
        if not self._route(req, draft):
            self._wait_for_worker(req)

    # -- routing --------------------------------------------------------------------------

    def _route(self, req: GatewayRequest, draft: GatewayDraft | None = None,
               local_on: WorkerInfo | None = None) -> bool:
        """Send `req` to its workers; False when no live worker can take it now.

        A submitted draft goes to the worker that prefilled it, if that one
        is alive; a session's request to the worker holding its warmup; a
        prompt moved off a prefill queue to the decode worker `local_on`.
        """
        held = draft is not None and draft.worker is not None and bool(draft.sent) \
            and self.router.is_live(draft.worker)
        prefill: WorkerInfo | None
        decode: WorkerInfo | None = None
        if local_on is not None:
            prefill = local_on
        elif held:
            prefill = draft.worker
        elif req.preferred is not None and self.router.is_live(req.preferred):
            prefill = req.preferred
        else:
            prefill = self.router.pick(self.role)
        if self.role == "prefill" and local_on is None:
            decode = self.router.pick("decode")
        if draft is not None and not held:
            self.drafts.drop(draft, "drafts_rerouted")  # its KV is gone with its worker, or it never had any
        if prefill is None or (decode is None and self.role == "prefill" and local_on is None):
            return False
        if local_on is None and not held and req.preferred is None and decode is not None \
                and self.local.on_decode(req, prefill, decode, time.monotonic()):
            local_on = decode
        local = local_on is not None
        if local:
            prefill, decode = local_on, None  # the decode worker prefills and decodes it, as a colocated one would
            self.metrics.prefills_on_decode.inc()
        req.attempt += 1
        req.num_attempt_tokens, req.early_decode_outputs = 0, []
        req.internal_id = draft.internal_id if held else new_internal_id(self.process_id)
        req.prefill, req.decode, req.pinned = prefill, decode, held
        self.requests[req.internal_id] = req
        for worker in req.workers():
            self.router.open_requests[worker.process_id] += 1
        decode_address, decode_id = (decode.address, decode.process_id) if decode else ("", "")
        message: msgspec.Struct
        if held:
            message = DraftSubmitted(req.internal_id, req.prompt_token_ids, req.params, self.inbox_address,
                                     decode_address, decode_id)
        else:  # a continuation when the request has output already: the workers go on from it
            message = PrefillRequest(req.internal_id, req.route_token_ids(), req.params, self.inbox_address,
                                     decode_address, decode_id, len(req.token_ids))
        if not self.outbox.send(prefill.address, message):  # the worker's queue is full: try again later
            self._detach(req, abort=False)
            return False
        if self.role == "prefill":  # only moves ask where a prompt's prefix is cached
            self.prefixes.remember(prefill.process_id, req.block_keys(self.prefixes))
        self.metrics.sent(req)
        log.info("request routed", request_id=req.internal_id, client_request_id=req.request_id,
                 prompt_tokens=len(req.prompt_token_ids), prefill=prefill.process_id,
                 decode=decode.process_id if decode else None, from_draft=held, prefilled_on_decode=local)
        return True

    def _wait_for_worker(self, req: GatewayRequest) -> None:
        req.unrouted_at = time.monotonic()
        self.unrouted.append(req)

    def route_waiting(self) -> None:
        for _ in range(len(self.unrouted)):
            req = self.unrouted.popleft()
            if (req.identity, req.request_id) in self.by_client and not self._route(req):
                self.unrouted.append(req)
                break

    def rebalance(self) -> None:
        """Each tick: move waiting prompts that their prefill worker's queue would make late to their decode
        workers (`LocalPrefill.move`), asked back with `Withdraw` and answered by `withdrawn`."""
        if self.role == "prefill":
            self.local.move(time.monotonic(), self._withdraw)

    def _withdraw(self, req: GatewayRequest) -> bool:
        if req.prefill is None or not self.outbox.send(req.prefill.address, Withdraw(req.internal_id,
                                                                                     self.inbox_address)):
            return False
        req.withdrawing = time.monotonic()
        return True

    def withdrawn(self, message: Withdrawn) -> None:
        """A prefill worker's answer to `Withdraw`: an unstarted prompt goes to its decode worker to be prefilled."""
        req = self.requests.get(message.request_id)
        asked = req is not None and req.withdrawing is not None and req.prefill is not None
        if not asked or req.prefill.process_id != message.process_id:
            return  # ended, retried or moved since
        req.withdrawing = None
        if not message.withdrawn:
            req.pinned = True  # it started there
            return
        decode = req.decode
        self._detach(req, abort=False)
        self.metrics.prefills_moved.inc()
        local_on = decode if decode is not None and self.router.is_live(decode) else None
        if not self._route(req, local_on=local_on):
            self._wait_for_worker(req)

    def _detach(self, req: GatewayRequest, abort: bool) -> None:
        """Forget the current attempt of `req`; with `abort`, tell its live workers to drop it."""
        if self.requests.pop(req.internal_id, None) is None:
            return
        for worker in req.workers():
            self.router.open_requests[worker.process_id] -= 1
            if abort and self.router.is_live(worker):
                self.outbox.send(worker.address, Abort(req.internal_id))
        req.prefill = req.decode = None
        req.withdrawing = None

    def end(self, req: GatewayRequest, final: msgspec.Struct, abort: bool = False) -> None:
        self._detach(req, abort)
        if req in self.unrouted:
            self.unrouted.remove(req)
        if self.by_client.pop((req.identity, req.request_id), None) is not None:
            release(self.num_open_by, req.identity)
            self._send(req.identity, final)
            self.metrics.ended(req, final)
            log.info("request ended", request_id=req.internal_id or None, client_request_id=req.request_id,
                     outcome=getattr(final, "finish_reason", None) or getattr(final, "code", None),
                     output_tokens=len(req.token_ids))

    def fail(self, req: GatewayRequest, error: PdrtError) -> None:
        self.end(req, Error(error.code, str(error), req.request_id), abort=True)

    def _retry(self, req: GatewayRequest, failure: PdrtError | None = None) -> None:
        """Send `req` again on live workers: a new attempt. With output begun it is a continuation (a migration):
        its prompt and its output so far, from which the workers go on as if nothing had happened. A `failure`
        (its worker died, or failed it) counts: the `max_request_failures`-th ends the request with it, so that
        one request that takes workers down takes down no more than that; a move (a role change, a crowded
        worker) does not count."""
        if failure is not None:
            req.failures += 1
            if req.failures >= self.max_failures:
                self.fail(req, error_for(failure.code, f"the request failed on {req.failures} workers; the last "
                                                       f"said: {failure}"))
                return
        if req.token_ids:
            self.metrics.migrations.inc()
            log.warning("migrating a request", request_id=req.internal_id, client_request_id=req.request_id,
                        output_tokens=len(req.token_ids), failures=req.failures, moved=failure is None)
        self._detach(req, abort=True)
        log.info("retrying a request", request_id=req.internal_id, client_request_id=req.request_id,
                 attempt=req.attempt + 1)
        if not self._route(req):
            self._wait_for_worker(req)

    # -- worker messages -----------------------------------------------------------------

    def _send(self, identity: bytes, frame: msgspec.Struct) -> None:
        if self.held is not None:
            self.held.setdefault(identity, []).append(frame)
        else:
            self.reply(identity, [frame])

    def outputs(self, message: StepOutputs) -> None:
        """Take a worker's step: what it brings each client goes out as one message, not one per request
        (a send wakes ZeroMQ's I/O thread: one per token costs the gateway a large share of its CPU)."""
        self.held = {}
        try:
            self._outputs(message)
        finally:
            held, self.held = self.held, None
            for identity, frames in held.items():
                self.reply(identity, frames)

    def _outputs(self, message: StepOutputs) -> None:
        for out in message.outputs:
            req = self.requests.get(out.request_id)
            if req is None or not req.runs_on(message.process_id):
                continue  # a cancelled or abandoned attempt, or a worker that does not serve it
            try:
                self._output(req, out, message.process_id)
            except Exception as exc:  # one request's bad output ends that request, never its step's others
                log.exception("a worker output could not be taken", request_id=out.request_id)
                self.fail(req, PdrtError(f"the gateway could not take the request's output: {exc!r}"))

    def _output(self, req: GatewayRequest, out: RequestOutput, process_id: str) -> None:
        from_decode = req.decode is not None and process_id == req.decode.process_id
        if from_decode and req.awaits_first_token:
            req.early_decode_outputs.append(out)  # overtook the prefill worker's first token
            return
        self._take(req, out)
        if not from_decode and req.early_decode_outputs and out.request_id in self.requests:
            early, req.early_decode_outputs = req.early_decode_outputs, []
            for later in early:
                if later.request_id in self.requests:
                    self._take(req, later)

    def _take(self, req: GatewayRequest, out: RequestOutput) -> None:
        self.metrics.tokens(req, len(out.new_token_ids))
        if req.awaits_first_token and req.decode is not None:  # its KV goes to the decode worker now
            self.prefixes.remember(req.decode.process_id, req.block_keys(self.prefixes))
        frame, finished = req.add(out)
        if finished:
            if req.session_id and req.messages is not None:
                self.warmups.remember((req.identity, req.session_id), req.messages, req.answer, req.params.cache_salt)
            self.end(req, frame, abort=not out.finished)  # a stop string seen here first: stop the worker
        elif frame is not None:
            self._send(req.identity, frame)

    def failed(self, message: RequestFailed) -> None:
        req = self.requests.get(message.request_id)
        if req is None or not req.runs_on(message.process_id):
            return
        if message.retryable:
            moved = message.code in (RoleChangedError.code, StreamMovedError.code, KVPoolFullError.code)
            self._retry(req, None if moved else error_for(message.code, message.message))
        else:
            self.end(req, Error(message.code, message.message, req.request_id), abort=True)

    def send_all_again(self) -> None:
        """Every routed request goes on anew, a begun stream as a continuation: its workers dropped it."""
        for req in list(self.requests.values()):
            self._retry(req)

    def worker_lost(self, worker: WorkerInfo) -> None:
        self.prefixes.forget(worker.process_id)
        for req in list(self.requests.values()):
            if not any(w.process_id == worker.process_id and w.incarnation == worker.incarnation
                       for w in req.workers()):
                continue
            if req.awaits_first_token or req.decode is None or req.decode.process_id == worker.process_id:
                self._retry(req, WorkerLostError(f"worker {worker.process_id} was lost"))
            # else: the prefill worker died after its first token; the decode worker has its KV, or fails the
            # pull and the request goes on elsewhere (a retryable RequestFailed)

    # -- client actions and time ------------------------------------------------------------

    def cancel(self, identity: bytes, request_id: str) -> None:
        req = self.by_client.get((identity, request_id))
        if req is None:
            self._send(identity, Error("unknown_request", f"no open request {request_id!r}", request_id))
            return
        self.end(req, req.cancelled(), abort=True)

    def expire(self) -> None:
        now = time.monotonic()
        for req in [r for r in self.by_client.values() if r.deadline < now]:
            if req not in self.unrouted:
                self.fail(req, RequestTimeoutError("the request did not finish before its deadline"))
        for req in [r for r in self.unrouted if r.deadline < now or r.unrouted_at + self.unrouted_wait_s < now]:
            self.fail(req, UnavailableError(f"no worker could take the request within {self.unrouted_wait_s:g} s"))
        # A prefill worker answers a withdraw at once; an answer lost (or refused) would leave the request with
        # no worker that knows it: it starts again.
        for req in [r for r in self.by_client.values()
                    if r.withdrawing is not None and r.withdrawing + WITHDRAW_TIMEOUT_S < now]:
            self._retry(req)

    def forget_client(self, identity: bytes) -> None:
        """A client that cannot be reached any more: its requests end (workers told), nothing is sent."""
        for req in [r for r in self.by_client.values() if r.identity == identity]:
            self._detach(req, abort=True)
            if req in self.unrouted:
                self.unrouted.remove(req)
            del self.by_client[(req.identity, req.request_id)]
            release(self.num_open_by, req.identity)
            self.metrics.ended(req, None)

    def end_all(self, error: PdrtError) -> None:
        for req in list(self.by_client.values()):
            self.fail(req, error)
