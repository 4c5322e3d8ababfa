"""The prefill worker: computes prompt KV and first tokens, then hands the KV to a decode worker.

Life cycle of a request in this worker:

1. `PrefillRequest` from a gateway -> `engine.add_prefill` (or a draft,
   prefilled while it was typed, is submitted); the request waits in the
   scheduler, then its prompt runs in chunks, batched with other requests'
   chunks under the token budget;
2. the step that samples the first token sends it straight to the gateway
   (TTFT does not wait for the KV transfer); if that token already ends the
   request, nothing more happens;
3. otherwise the prompt's blocks are exported from the KV source until a
   lease deadline, and a `KVHandoff` tells the chosen decode worker where
   they are;
4. the decode worker's `KVAck` (or the lease running out) withdraws the
   export and frees the blocks.

An `Abort` before step 3 drops the request; after it, the blocks stay until
the acknowledgement, because the decode worker may be copying them. A
`Withdraw` drops a request only while it waits in step 1 (nothing of it has
been sent), and `Withdrawn` tells the gateway which it was.
"""

import time

import structlog
import zmq.asyncio

from pdrt.engine.outputs import RequestOutput
from pdrt.engine.sequence import SequenceStatus
from pdrt.node_config import NodeConfig
from pdrt.priority import CatchUp
from pdrt.roles.engine_worker import EngineWorker
from pdrt.transport import TransferBackend, make_source
from pdrt.wire import (
    Abort,
    DraftSubmitted,
    DraftUpdate,
    KVAck,
    KVHandoff,
    Load,
    PrefillRequest,
    Withdraw,
    Withdrawn,
)

log = structlog.get_logger(__name__)


class PrefillWorker(EngineWorker):
    role = "prefill"
    senders = {PrefillRequest: ("gateway",), DraftUpdate: ("gateway",), DraftSubmitted: ("gateway",),
               Withdraw: ("gateway",), Abort: ("gateway",), KVAck: ("decode",)}

    def __init__(self, config: NodeConfig, process_id: str, incarnation: str, ctx: zmq.asyncio.Context,
                 run_id: str) -> None:
        backend = TransferBackend[config.transfer.upper()]
        self.source = make_source(backend, f"pdrt-{run_id}-{process_id}-{incarnation}", config.host, config.key)
        super().__init__(config, process_id, incarnation, ctx, run_id, kv_allocator=self.source.allocate)
        descriptor = self.source.descriptor
        log.info("kv source serving", backend=TransferBackend(descriptor.backend).name.lower(),
                 address=descriptor.tcp_address or descriptor.address)
        self.lease_s = config.experimental.kv_lease_s
        self.requests: dict[str, PrefillRequest] = {}  # admitted and not yet handed off
        self.held: dict[str, float] = {}  # handed off: request id -> lease deadline
        self.arrived: dict[str, float] = {}  # admitted, first token not out yet: request id -> time.monotonic()
        self.catch_up: CatchUp | None = None  # set by pdrt.process for a model that small
        self.unadded: set[str] = set()  # admitted while a step ran: their add op has not run yet

    async def on_receive(self, message: object) -> None:
        match message:
            case PrefillRequest():
                self._admit(message)
            case KVAck(request_id=rid) if rid in self.held:
                self.queue_op(rid, lambda: self._release(rid))
            case DraftUpdate():
                self.draft_update(message)
            case DraftSubmitted():
                self.draft_submitted(message)
            case Withdraw():
                self._withdraw(message)
            case Abort(request_id=rid):
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        self.drop_draft(rid)
        self.arrived.pop(rid, None)
        self.unadded.discard(rid)
        if self.requests.pop(rid, None) is not None:
            self.reply_to.pop(rid, None)
            self.queue_op(rid, lambda: self.engine.abort(rid))

    def _admit(self, request: PrefillRequest) -> None:
        rid = request.request_id
        self.requests[rid] = request
        self.reply_to[rid] = request.reply_to
        self.arrived[rid] = time.monotonic()
        self.unadded.add(rid)

        def add() -> None:
            if rid not in self.unadded:
                return  # withdrawn or aborted before it was added
            self.unadded.discard(rid)
            try:
                self.engine.add_prefill(rid, request.token_ids, request.params, request.num_prior_outputs)
            except Exception:
                self.requests.pop(rid, None)
                self.arrived.pop(rid, None)
                raise

        self.queue_op(rid, add)

    def _withdraw(self, message: Withdraw) -> None:
        """Answer at once, not after the running step: a request still waiting to start is dropped here.

        The step running now may have just taken it; then its work is lost,
        and nothing of it is sent: its gateway and its handoff are forgotten
        here, and the abort frees its blocks before the next step.
        """
        rid = message.request_id
        seq = self.engine.sequences.get(rid)
        waits = rid in self.unadded or (seq is not None and seq.status is SequenceStatus.WAITING)
        if not (rid in self.requests and waits):
            self.outbox.send(message.reply_to, Withdrawn(rid, False, self.process_id))
        elif self.outbox.send(message.reply_to, Withdrawn(rid, True, self.process_id)):  # undelivered, it stays
            del self.requests[rid]
            self.arrived.pop(rid, None)
            self.reply_to.pop(rid, None)
            if rid in self.unadded:
                self.unadded.discard(rid)  # its add will find it gone
            else:
                self.queue_op(rid, lambda: self.engine.abort(rid))

    def on_submitted(self, submitted: DraftSubmitted) -> None:
        self.requests[submitted.draft_id] = PrefillRequest(submitted.draft_id, submitted.token_ids, submitted.params,
                                                           submitted.reply_to, submitted.decode_address,
                                                           submitted.decode_id)

    def add_submitted(self, request_id: str, submitted: DraftSubmitted) -> None:
        self.engine.add_prefill(request_id, submitted.token_ids, submitted.params)

    def emit(self, outputs: list[RequestOutput]) -> None:
        super().emit(outputs)  # first tokens go to the gateways before any handoff
        for out in outputs:
            self.arrived.pop(out.request_id, None)
            request = self.requests.pop(out.request_id, None)
            if request is None or out.kv_block_ids is None:
                continue
            self.reply_to.pop(out.request_id, None)  # from here on the decode worker reports this request
            deadline = time.monotonic() + self.lease_s
            self.source.export(out.request_id, out.kv_block_ids, deadline, request.decode_id)
            self.held[out.request_id] = deadline
            self.metrics.handoff_sent(len(out.kv_block_ids))
            log.info("prefill handed off", request_id=out.request_id, blocks=len(out.kv_block_ids),
                     cached_tokens=out.num_cached_tokens, decode=request.decode_address)
            self.outbox.send(request.decode_address, KVHandoff(
                out.request_id, request.token_ids, out.new_token_ids[0], request.params, request.reply_to,
                self.inbox.address, self.source.descriptor, out.kv_block_ids, deadline,
                out.new_logprobs[0] if out.new_logprobs else None, request.num_prior_outputs))

    def _measure_load(self) -> Load:
        """The load, with the queue's account for the gateways' moves of late prompts, remade whenever the load
        is (after each op batch, and between steps): a prompt is in it from the first heartbeat after it was
        added, not a step later. It costs the square of the waiting prompts, up to MAX_FORETOLD."""
        load = super()._measure_load()
        scheduler = self.engine.scheduler
        load.first_token_work = scheduler.first_token_work()
        load.prefilling = [seq.request_id for seq in scheduler.started_prompts()]
        return load

    def _release(self, request_id: str, acked: bool = True) -> None:
        if self.held.pop(request_id, None) is not None:
            self.metrics.handoff_settled(acked)
            self.source.withdraw(request_id)
            self.engine.release(request_id)

    def after_step(self) -> None:
        now = time.monotonic()
        for request_id in [rid for rid, deadline in self.held.items() if deadline < now]:
            log.warning("kv lease expired without an acknowledgement", request_id=request_id)
            self._release(request_id, acked=False)
        if self.catch_up is not None:
            self.catch_up.update(self._oldest_wait(now))

    def _oldest_wait(self, now: float) -> float:
        """Seconds the oldest admitted prompt not yet started has waited; 0 when none waits."""
        waiting = [self.arrived[s.request_id] for s in self.engine.scheduler.waiting if s.request_id in self.arrived]
        return now - min(waiting) if waiting else 0.0

    def close(self) -> None:
        self.source.close()
