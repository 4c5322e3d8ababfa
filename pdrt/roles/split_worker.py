"""A worker of a disaggregated node: it prefills prompts and hands their KV over, or decodes KV handed to it, and
it changes between the two in place.

Every such worker has both sides, one engine and one KV pool:

* its prefill side (pdrt/roles/handoffs.py) takes a `PrefillRequest` that
  names a decode worker, prefills it, sends the first token to the gateway
  and the KV to that decode worker; its pool lives in a KV source (shared
  memory, or served over TCP) so that decode workers can pull from it;
* its decode side (pdrt/roles/kv_imports.py) pulls handed-over KV into the
  same pool and decodes it; a `PrefillRequest` naming no decode worker (a
  short prompt the gateway moved off busy prefill workers) is prefilled and
  decoded here.

Its *role* is what the gateways route to it as, and what its profile
(priority, threads lent or borrowed, how prompts batch) follows. The
controller changes it (`ChangeRole`) without a reload: the gateways route
by the new role from that moment, the worker takes the new profile, and a
worker that stops decoding sends each of its streams elsewhere (a
retryable `role_changed` failure, which the gateway turns into a
continuation on another decode worker: the stream goes on unchanged).
Prompts it was prefilling, and KV it holds for decode workers, finish as
they would have. Then it tells the controller (`RoleChanged`).

A decode worker the controller finds holding more streams than another
(`ShedStreams`, pdrt/control_plane/stream_balance.py) sends some on the same
way: those with the most tokens left to make, for the fewest tokens of
context to prefill again, so that the move pays for itself soonest, and
none about to end.
"""

import time

import structlog
import zmq.asyncio

from pdrt.engine.outputs import RequestOutput
from pdrt.errors import PdrtError, RoleChangedError, StreamMovedError
from pdrt.metrics.worker_metrics import SPLIT_ROLES
from pdrt.node_config import NodeConfig
from pdrt.roles.engine_worker import EngineWorker
from pdrt.roles.handoffs import Handoffs
from pdrt.roles.kv_imports import KVImports
from pdrt.transport import TransferBackend, make_source
from pdrt.wire import (
    Abort,
    ChangeRole,
    DraftSubmitted,
    DraftUpdate,
    GatewayBack,
    KVAck,
    KVHandoff,
    Load,
    PrefillRequest,
    RequestFailed,
    RoleChanged,
    ShedStreams,
    Withdraw,
)
from pdrt.worker_profile import log_profile, worker_profile

log = structlog.get_logger(__name__)

MIN_TOKENS_LEFT = 32  # a stream about to end is not worth a prefill elsewhere


class SplitWorker(EngineWorker):
    senders = {PrefillRequest: ("gateway",), DraftUpdate: ("gateway",), DraftSubmitted: ("gateway",),
               Withdraw: ("gateway",), Abort: ("gateway",), GatewayBack: ("gateway",), KVAck: SPLIT_ROLES,
               KVHandoff: SPLIT_ROLES}

    def __init__(self, config: NodeConfig, process_id: str, incarnation: str, ctx: zmq.asyncio.Context,
                 run_id: str, role: str) -> None:
        self.role = role
        self.incarnation = incarnation
        backend = TransferBackend[config.transfer.upper()]
        self.source = make_source(backend, f"pdrt-{run_id}-{process_id}-{incarnation}", config.host, config.key,
                                  config.worker_device)
        super().__init__(config, process_id, incarnation, ctx, run_id, kv_allocator=self.source.allocate)
        descriptor = self.source.descriptor
        log.info("kv source serving", backend=TransferBackend(descriptor.backend).name.lower(),
                 address=descriptor.tcp_address or descriptor.address)
        self.handoffs = Handoffs(self, config.experimental.kv_lease_s)
        self.imports = KVImports(self)

    async def on_receive(self, message: object) -> None:
        if self.is_orphan(message):
            return
        match message:
            case PrefillRequest(decode_address="") if self.role != "decode":
                self._bounce(message.request_id, message.reply_to)
            case PrefillRequest(decode_address=""):  # prefilled and decoded here
                self.add_whole_request(message)
            case PrefillRequest():
                self.handoffs.admit(message)
            case KVHandoff() if self.role != "decode":  # routed here before the change: decoded elsewhere
                self._bounce(message.request_id, message.reply_to)
                self.outbox.send(message.prefill_address, KVAck(message.request_id))
            case KVHandoff():
                self.imports.receive(message)
            case KVAck(request_id=rid) if rid in self.handoffs.held:
                self.queue_op(rid, lambda: self.handoffs.release(rid))
            case DraftUpdate():
                self.draft_update(message)
            case DraftSubmitted():
                self.draft_submitted(message)
            case Withdraw():
                self.handoffs.withdraw(message)
            case Abort(request_id=rid):
                self.abort(rid)
            case ChangeRole(role=role, reason=reason) if role in SPLIT_ROLES:
                self._change_role(role, reason)
            case ShedStreams(count=count, reason=reason) if self.role == "decode" and count > 0:
                self.queue_op("", lambda: self._shed(count, reason))
            case _:
                self.on_control(message)

    def _bounce(self, request_id: str, reply_to: str) -> None:
        """A stream to decode that reached this worker after it stopped decoding: its gateway sends it on."""
        exc = RoleChangedError(f"{self.process_id} is a {self.role} worker now")
        self.outbox.send(reply_to, RequestFailed(request_id, exc.code, str(exc), True, self.process_id))

    def abort(self, rid: str) -> None:
        """Drop `rid` on whichever side holds it. KV handed off stays exported until the decode worker
        acknowledges, the lease runs out or that worker exits: until then it may be copying it (its own abort
        ends its side)."""
        self.drop_draft(rid)
        if self.handoffs.abort(rid) or rid in self.handoffs.held:
            return
        self.reply_to.pop(rid, None)
        self.imports.abort(rid)

    def peer_exited(self, process_id: str) -> None:
        self.queue_op("", lambda: self.handoffs.release_held_for(process_id))

    def fail(self, request_id: str, exc: PdrtError) -> None:
        self.handoffs.forget(request_id)  # a prompt that failed is handed off to no one
        super().fail(request_id, exc)

    def on_submitted(self, submitted: DraftSubmitted) -> None:
        self.handoffs.submitted(submitted)

    def add_submitted(self, request_id: str, submitted: DraftSubmitted) -> None:
        self.engine.add_prefill(request_id, submitted.token_ids, submitted.params)

    def emit(self, outputs: list[RequestOutput]) -> None:
        super().emit(outputs)  # first tokens go to the gateways before any handoff
        self.handoffs.hand_off(outputs)

    def after_step(self) -> None:
        now = time.monotonic()
        self.handoffs.expire(now)
        self.imports.admit_waiting()
        if self.catch_up is not None:
            self.handoffs.forget_gone()
            self.catch_up.update(self.handoffs.oldest_wait(now), self.handoffs.oldest_age(now))

    def while_stepping(self) -> None:
        if self.catch_up is not None:
            self.catch_up.check(self.handoffs.oldest_age(time.monotonic()))

    def _measure_load(self) -> Load:
        """The load, with the queue's account for the gateways' moves of late prompts, remade whenever the load
        is (after each op batch, and between steps): a prompt is in it from the first heartbeat after it was
        added, not a step later. It costs the square of the waiting prompts, up to MAX_FORETOLD."""
        load = super()._measure_load()
        scheduler = self.engine.scheduler
        load.first_token_work = scheduler.first_token_work()
        load.prefilling = [seq.request_id for seq in scheduler.started_prompts()]
        return load

    # -- role changes -------------------------------------------------------------------

    def _change_role(self, role: str, reason: str) -> None:
        """Serve as `role` from now on: its profile at once, its old role's streams elsewhere between steps."""
        started, old = time.perf_counter(), self.role
        if role != old:
            self.role = self.link.role = role
            self.metrics.new_role(role)
            self.profile = worker_profile(self.config, role, self.engine.loaded.num_params)
            log_profile(self.profile, self.process_id, self.engine.loaded.num_params)
            self.take_priority()
            if self.ledger is not None:
                self.ledger.set_role(role, self.profile.borrow_threads)
        self.queue_op("", lambda: self._finish_role_change(old, role, reason, started))

    def _finish_role_change(self, old: str, role: str, reason: str, started: float) -> None:
        """Between steps: batch prompts as the new role does, and stop decoding when it is not decode's."""
        self.engine.scheduler.batch_prompts(self.profile.prompt_batch_tokens)
        moved = self._move_streams() if role != "decode" else 0
        seconds = time.perf_counter() - started
        log.info("serving a new role", process=self.process_id, old=old, role=role, moved_streams=moved,
                 seconds=round(seconds, 6), reason=reason)
        self.link.send(RoleChanged(self.process_id, self.incarnation, role, moved))

    def _move_streams(self) -> int:
        """End every stream this worker decodes with a retryable failure, so its gateway continues it on a
        decode worker; prompts prefilled for a decode worker stay. Returns how many moved."""
        exc = RoleChangedError(f"{self.process_id} is a {self.role} worker now")
        moved = self.imports.fail_all(exc)
        for rid in [rid for rid in self.reply_to if rid not in self.handoffs.requests and rid not in self.drafts
                    and rid not in self.imports.importing]:
            self.engine.abort(rid)
            self.fail(rid, exc)
            moved += 1
        return moved

    def _shed(self, count: int, reason: str) -> None:
        """Between steps: send `count` decoding streams to other decode workers, as continuations."""
        def worth(seq) -> float:
            return (seq.params.max_tokens - seq.output_index) / seq.num_tokens

        exc = StreamMovedError(f"{self.process_id} has more streams than another decode worker")
        decoding = [seq for seq in self.engine.scheduler.running if seq.is_decoding and seq.request_id in self.reply_to
                    and seq.request_id not in self.handoffs.requests and seq.request_id not in self.drafts
                    and seq.params.max_tokens - seq.output_index >= MIN_TOKENS_LEFT]
        shed = sorted(decoding, key=worth, reverse=True)[:count]
        for seq in shed:
            self.engine.abort(seq.request_id)
            self.fail(seq.request_id, exc)
        self.metrics.streams_shed.inc(len(shed))
        log.info("streams sent on", process=self.process_id, asked=count, moved=len(shed), reason=reason)

    def close(self) -> None:
        self.imports.close()
        self.source.close()
