"""A worker's prefill side: prompts it prefills for a decode worker, and the KV it holds until that one has it.

Life cycle of a request here:

1. `PrefillRequest` naming a decode worker -> `engine.add_prefill` (or a
   draft, prefilled while it was typed, is submitted); the request waits in
   the scheduler, then its prompt runs in chunks, batched with other
   requests' chunks under the token budget;
2. the step that samples the first token sends it straight to the gateway
   (TTFT does not wait for the KV transfer); if that token already ends the
   request, nothing more happens;
3. otherwise the prompt's blocks are exported from the worker's KV source
   until a lease deadline, and a `KVHandoff` tells the chosen decode worker
   where they are;
4. the decode worker's `KVAck` (or the lease running out) withdraws the
   export and frees the blocks.

An `Abort` before step 3 drops the request; after it, the blocks stay until
the acknowledgement, because the decode worker may be copying them, or
until the decode worker is known to have exited (`release_held_for`): then
nobody can be. A
`Withdraw` drops a request only while it waits in step 1 (nothing of it has
been sent), and `Withdrawn` tells the gateway which it was.
"""

import time
from typing import TYPE_CHECKING, NamedTuple

import structlog

from pdrt.engine.outputs import RequestOutput
from pdrt.engine.sequence import SequenceStatus
from pdrt.wire import DraftSubmitted, KVHandoff, PrefillRequest, Withdraw, Withdrawn

if TYPE_CHECKING:
    from pdrt.roles.split_worker import SplitWorker

log = structlog.get_logger(__name__)


class Export(NamedTuple):
    """KV handed off and still held: until when, and for which decode worker."""

    deadline: float
    decode_id: str


class Handoffs:
    def __init__(self, worker: "SplitWorker", lease_s: float) -> None:
        self.worker = worker
        self.lease_s = lease_s
        self.requests: dict[str, PrefillRequest] = {}  # admitted and not yet handed off
        self.held: dict[str, Export] = {}  # handed off, not yet acknowledged
        self.arrived: dict[str, float] = {}  # admitted, first token not out yet: request id -> time.monotonic()
        self.unadded: set[str] = set()  # admitted while a step ran: their add op has not run yet

    def admit(self, request: PrefillRequest) -> None:
        w, rid = self.worker, request.request_id
        self.requests[rid] = request
        w.reply_to[rid] = request.reply_to
        self.arrived[rid] = time.monotonic()
        self.unadded.add(rid)

        def add() -> None:
            if rid not in self.unadded:
                return  # withdrawn or aborted before it was added
            self.unadded.discard(rid)
            # One that fails is failed by the worker, which forgets it here too (`forget`).
            w.engine.add_prefill(rid, request.token_ids, request.params, request.num_prior_outputs)

        w.queue_op(rid, add)

    def abort(self, rid: str) -> bool:
        """Drop `rid` if it is still to be prefilled here; True when it was."""
        self.arrived.pop(rid, None)
        self.unadded.discard(rid)
        if self.requests.pop(rid, None) is None:
            return False
        self.worker.reply_to.pop(rid, None)
        self.worker.queue_op(rid, lambda: self.worker.engine.abort(rid))
        return True

    def forget(self, rid: str) -> None:
        """`rid` failed before its handoff: nothing of it is handed off."""
        self.requests.pop(rid, None)
        self.arrived.pop(rid, None)
        self.unadded.discard(rid)

    def withdraw(self, message: Withdraw) -> None:
        """Answer at once, not after the running step: a request still waiting to start is dropped here.

        The step running now may have just taken it; then its work is lost,
        and nothing of it is sent: its gateway and its handoff are forgotten
        here, and the abort frees its blocks before the next step.
        """
        w, rid = self.worker, message.request_id
        seq = w.engine.sequences.get(rid)
        waits = rid in self.unadded or (seq is not None and seq.status is SequenceStatus.WAITING)
        if not (rid in self.requests and waits):
            w.outbox.send(message.reply_to, Withdrawn(rid, False, w.process_id))
        elif w.outbox.send(message.reply_to, Withdrawn(rid, True, w.process_id)):  # undelivered, it stays
            del self.requests[rid]
            self.arrived.pop(rid, None)
            w.reply_to.pop(rid, None)
            if rid in self.unadded:
                self.unadded.discard(rid)  # its add will find it gone
            else:
                w.queue_op(rid, lambda: w.engine.abort(rid))

    def submitted(self, submitted: DraftSubmitted) -> None:
        self.requests[submitted.draft_id] = PrefillRequest(submitted.draft_id, submitted.token_ids, submitted.params,
                                                           submitted.reply_to, submitted.decode_address,
                                                           submitted.decode_id)

    def hand_off(self, outputs: list[RequestOutput]) -> None:
        """After the outputs went to the gateways: export the KV of each request whose first token came, and
        tell its decode worker."""
        w = self.worker
        for out in outputs:
            self.arrived.pop(out.request_id, None)
            request = self.requests.pop(out.request_id, None)
            if request is None or out.kv_block_ids is None:
                continue
            w.reply_to.pop(out.request_id, None)  # from here on the decode worker reports this request
            deadline = time.monotonic() + self.lease_s
            w.source.export(out.request_id, out.kv_block_ids, deadline, request.decode_id)
            self.held[out.request_id] = Export(deadline, request.decode_id)
            w.metrics.handoff_sent(len(out.kv_block_ids))
            log.info("prefill handed off", request_id=out.request_id, blocks=len(out.kv_block_ids),
                     cached_tokens=out.num_cached_tokens, decode=request.decode_address)
            w.outbox.send(request.decode_address, KVHandoff(
                out.request_id, request.token_ids, out.new_token_ids[0], request.params, request.reply_to,
                w.inbox.address, w.source.descriptor, out.kv_block_ids, deadline,
                out.new_logprobs[0] if out.new_logprobs else None, request.num_prior_outputs))

    def release(self, request_id: str, acked: bool = True) -> None:
        """On the engine's side of a step: the decode worker has the KV (or its lease ran out)."""
        if self.held.pop(request_id, None) is not None:
            self.worker.metrics.handoff_settled(acked)
            self.worker.source.withdraw(request_id)
            self.worker.engine.release(request_id)

    def expire(self, now: float) -> None:
        for request_id in [rid for rid, export in self.held.items() if export.deadline < now]:
            log.warning("kv lease expired without an acknowledgement", request_id=request_id)
            self.release(request_id, acked=False)

    def release_held_for(self, decode_id: str) -> None:
        """On the engine's side of a step: decode worker `decode_id` exited, so nothing copies what it was handed
        any more: free it now rather than at the lease."""
        for request_id in [rid for rid, export in self.held.items() if export.decode_id == decode_id]:
            self.release(request_id, acked=False)

    def forget_gone(self) -> None:
        """Between steps: drop from `arrived` the prompts the engine no longer holds (failed, moved by a role
        change), so that none counts as late forever."""
        sequences = self.worker.engine.sequences
        for rid in [r for r in self.arrived if r not in self.unadded and r not in sequences]:
            del self.arrived[rid]

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest admitted prompt without its first token has been here, started or not; 0 when none
        (reads this object's own table only: safe while the engine steps)."""
        return now - min(self.arrived.values()) if self.arrived else 0.0

    def oldest_wait(self, now: float) -> float:
        """Seconds the oldest admitted prompt not yet started has waited; 0 when none waits."""
        waiting = [self.arrived[s.request_id] for s in self.worker.engine.scheduler.waiting
                   if s.request_id in self.arrived]
        return now - min(waiting) if waiting else 0.0
