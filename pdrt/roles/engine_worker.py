"""What every worker process shares: an engine stepped off the event loop, an inbox, an outbox, a controller link.

The worker is an actor. Messages from its inbox are handled one at a time on
the event-loop thread, but they never touch the engine directly: a handler
queues an *op* (a function that mutates the engine) and wakes the engine
loop. The engine loop runs in three steps, like vLLM's busy loop:

1. apply the queued ops (between steps, so the engine is never mutated
   while a step runs);
2. run one engine step on the engine thread, leaving the event loop free to
   serve sockets while the model computes;
3. emit what the step produced, one message per gateway.

An op that raises ends its request with a `RequestFailed` to the gateway (a
`PdrtError` with its own code, anything else as "internal", logged); it
never takes the worker down. Nor does any message a peer sends: the actor
logs and drops a message whose handler raises. Nor does a step that raises:
the engine finds the request to blame (pdrt/engine/llm_engine.py), which
fails with a retryable `step_failed`, and the others go on.

Between steps, a `StepGuard` (pdrt/engine/step_guard.py) watches the
interval between decode steps and, while it runs over the TPOT SLO, has
the scheduler decode the costliest streams less often.

On the CPU, prefill and decode workers keep an entry in the run's thread
ledger (pdrt/roles/thread_ledger.py): a prefill worker says whether it has
work, and a decode worker runs each step with the threads of the idle ones
too, where its profile says so (pdrt/worker_profile.py). The profile also
gives the worker its CPU priority (`take_priority`, once the model has
loaded).

A decode worker that exited copies nothing any more: the KV handed to it is
freed at once. A gateway that is lost (the controller says so:
`ProcessLost` with its inbox) can reach no client any more: every request it sent ends here at
once and frees its KV, and a request from it that arrives late is dropped.
A gateway introduces itself to a worker before it sends it anything, and a
gateway that was only frozen again when it thaws (`GatewayBack`, before
the requests it then sends again): its inbox is a live gateway's. A worker that the controller
declared lost while it was frozen (its answer to a heartbeat is
`process_lost`) drops what it held: its gateways have sent every request
of it on by then.

Drafts (prompts still being typed) are handled here for every role that
prefills: `DraftUpdate` creates or edits one, `DraftSubmitted` turns it into
a request (`on_submitted` lets the role record what it needs), and a draft
left without updates for `draft_ttl_s` is dropped with all its blocks.
"""

import asyncio
import contextvars
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch
import zmq.asyncio

from pdrt.actors.actor import Actor, ActorRef
from pdrt.control_plane.link import ControllerLink
from pdrt.engine.llm_engine import LLMEngine
from pdrt.engine.outputs import RequestOutput
from pdrt.engine.step_guard import StepGuard
from pdrt.engine.torch_threads import serial_torch
from pdrt.errors import (
    KVPoolFullError,
    PdrtError,
    RoleChangedError,
    StepFailedError,
    StreamMovedError,
    TransferError,
)
from pdrt.metrics.worker_metrics import WorkerMetrics
from pdrt.node_config import NodeConfig, role_of
from pdrt.priority import CatchUp, take_priority
from pdrt.roles.messaging import Inbox, Outbox, Senders
from pdrt.roles.thread_ledger import ThreadLedger
from pdrt.typeahead.draft_tokenizer import common_prefix_len
from pdrt.wire import (
    DraftSubmitted,
    DraftUpdate,
    Error,
    GatewayBack,
    KVAck,
    KVHandoff,
    Load,
    PrefillRequest,
    ProcessLost,
    RequestFailed,
    StepOutputs,
)
from pdrt.worker_profile import CATCH_UP_LATE, log_profile, worker_profile

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 0.5
# failures of this worker, not (or not surely) of the request
RETRYABLE = (TransferError, KVPoolFullError, RoleChangedError, StreamMovedError, StepFailedError)
# A draft without an update for this long belongs to a typist who paused (to
# think, or before pressing Enter): its last stable tokens are prefilled now.
DRAFT_PAUSE_S = 0.2
LOAD_REFRESH_S = 0.05  # how stale the load a heartbeat reports may be; measuring it costs a pass over the queues
STEP_POLL_S = 0.02  # how often a worker that catches up looks in on the step under way
MAX_LOST_GATEWAYS = 64  # inboxes of lost gateways remembered, so that their late requests are dropped


class EngineWorker(Actor):
    role = ""  # a SplitWorker's changes while it runs
    senders: Senders = {}  # what this role's inbox takes, and from whom

    def __init__(self, config: NodeConfig, process_id: str, incarnation: str, ctx: zmq.asyncio.Context,
                 run_id: str = "local",
                 kv_allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
        self.config = config
        self.process_id = process_id
        engine_config = config.engine_config(self.role)
        # Built on the thread that runs its steps, the only one here whose torch ops run in parallel
        # (pdrt/engine/torch_threads.py).
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{process_id}-engine")
        self.engine = self.executor.submit(contextvars.copy_context().run, LLMEngine, engine_config,
                                           kv_allocator=kv_allocator).result()  # its logs name this process
        serial_torch()
        self.step_guard = StepGuard(self.engine.scheduler, config.gateway.tpot_slo_s)
        num_params = self.engine.loaded.num_params
        self.profile = worker_profile(config, self.role, num_params)
        log_profile(self.profile, process_id, num_params)
        self.ledger: ThreadLedger | None = None
        self.step_threads = engine_config.num_threads
        if self.role in ("prefill", "decode") and engine_config.device == "cpu":
            try:
                self.ledger = ThreadLedger(run_id, process_id, self.role, engine_config.num_threads,
                                           borrow=self.profile.borrow_threads)
            except OSError as exc:  # no /dev/shm: the worker runs on its own threads alone
                log.warning("no thread ledger: this worker neither lends nor borrows threads", error=str(exc))
        key = config.key
        self.outbox = Outbox(ctx, process_id, key)
        self.inbox = Inbox(ctx, config.ephemeral_address(), self._deliver, self.senders, key)
        self.link = ControllerLink(ctx, config.controller_address, process_id, incarnation, self.role,
                                   self.inbox.address, self.load, self._tell, key=key)
        self.ops: deque[tuple[str, Callable[[], None]]] = deque()
        self.wake = asyncio.Event()
        self.reply_to: dict[str, str] = {}  # request id -> the inbox of the gateway that sent it
        self.drafts: dict[str, float] = {}  # draft id -> time of its last update
        self.lost_gateways: deque[str] = deque(maxlen=MAX_LOST_GATEWAYS)
        self.draft_ttl_s = config.experimental.draft_ttl_s
        self._load = Load()
        self._load_measured_at = 0.0
        self.metrics = WorkerMetrics(self.role, self.engine, self.load)
        self.catch_up: CatchUp | None = None  # a prefill worker's (pdrt/worker_profile.py)
        self._ref: ActorRef | None = None

    def take_priority(self) -> None:
        """The CPU priority the profile gives this worker's role: its niceness, or a catch-up between two."""
        profile = self.profile
        if profile.catch_up_wait is not None:
            slo_s = self.config.gateway.ttft_slo_s
            self.catch_up = self.metrics.catch_up = CatchUp(profile.nice, profile.catch_up_wait * slo_s,
                                                            self.process_id, CATCH_UP_LATE * slo_s, self._decode_room)
        else:
            self.catch_up = self.metrics.catch_up = None
            take_priority(profile.nice, self.process_id)

    def _decode_room(self) -> float:
        """The share of the TPOT SLO that the pace of this host's decode workers leaves (0 where unknown)."""
        if self.ledger is None:
            return 0.0
        pace = self.ledger.decode_pace_s()
        return 1.0 - pace / self.config.gateway.tpot_slo_s

    # -- messages -------------------------------------------------------------

    async def _deliver(self, message: object) -> None:
        assert self._ref is not None
        await self._ref.deliver(message)

    def _tell(self, message: object) -> None:
        """What the controller sends (a role change) joins the mailbox."""
        if self._ref is not None:
            self._ref.tell(message)

    def queue_op(self, request_id: str, op: Callable[[], None]) -> None:
        """Run `op` on the engine before its next step; a PdrtError from it fails `request_id`."""
        self.ops.append((request_id, op))
        self.wake.set()

    def add_whole_request(self, request: PrefillRequest) -> None:
        """Prefill and decode `request` here (a colocated worker's requests; a decode worker's local prefills)."""
        rid = request.request_id
        self.reply_to[rid] = request.reply_to
        self.queue_op(rid, lambda: self.engine.add_request(rid, request.token_ids, request.params,
                                                           request.num_prior_outputs))

    def abort(self, request_id: str) -> None:
        """Its gateway ended `request_id`: drop it here, wherever it is."""
        self.drafts.pop(request_id, None)
        self.reply_to.pop(request_id, None)
        self.queue_op(request_id, lambda: self.engine.abort(request_id))

    def on_control(self, message: object) -> None:
        """What the controller tells every worker alike: a gateway was lost, or this worker was."""
        match message:
            case ProcessLost(exited=True) if role_of(message.process_id) != "gateway":
                self.peer_exited(message.process_id)
            case ProcessLost(address=address) if address and role_of(message.process_id) == "gateway":
                self.lost_gateways.append(address)
                dropped = [rid for rid, to in self.reply_to.items() if to == address]
                for rid in dropped:
                    self.abort(rid)
                log.warning("gateway lost: its requests dropped", gateway=message.process_id, requests=len(dropped))
            case GatewayBack(address=address):
                while address in self.lost_gateways:
                    self.lost_gateways.remove(address)
            case Error(code="process_lost"):
                dropped = list(self.reply_to) + list(self.drafts)
                for rid in dropped:
                    self.abort(rid)
                log.warning("this worker was declared lost: its requests went on elsewhere", requests=len(dropped))

    def peer_exited(self, process_id: str) -> None:
        """Worker `process_id` exited: whatever this worker holds for it may go."""

    def is_orphan(self, message: object) -> bool:
        """Whether `message` comes from a gateway that is lost; a handoff's KV is acknowledged, so it is freed."""
        if getattr(message, "reply_to", None) not in self.lost_gateways:
            return False
        if isinstance(message, KVHandoff):
            self.outbox.send(message.prefill_address, KVAck(message.request_id))
        log.info("gateway lost: its requests dropped", requests=1, request_id=getattr(message, "request_id", None))
        return True

    def fail(self, request_id: str, exc: PdrtError) -> None:
        """End `request_id` here with `exc`; the gateway tries it on other workers when this worker's failure is
        no fault of the request (its KV did not arrive, this worker's pool stayed full)."""
        reply_to = self.reply_to.pop(request_id, None)
        log.info("request failed", request_id=request_id, code=exc.code, error=str(exc))
        if reply_to is not None:
            retryable = isinstance(exc, RETRYABLE)
            self.outbox.send(reply_to, RequestFailed(request_id, exc.code, str(exc), retryable, self.process_id))

    # -- drafts ---------------------------------------------------------------------

    def draft_update(self, update: DraftUpdate) -> None:
        did = update.draft_id
        if did not in self.drafts and update.num_kept != 0:
            return  # an edit of a draft this worker lost: its submit starts afresh
        self.drafts[did] = time.monotonic()

        def apply() -> None:
            if did not in self.drafts:
                return  # abandoned or submitted since
            if did in self.engine.sequences:
                self.engine.update_draft(did, update.num_kept, update.token_ids)
            elif update.num_kept == 0 and update.token_ids:
                self.engine.add_draft(did, update.token_ids, colocated=update.colocated, cache_salt=update.cache_salt)
            else:
                self.drafts.pop(did, None)  # lost (expired, failed): its submit will start afresh

        self.queue_op(did, apply)

    def draft_submitted(self, submitted: DraftSubmitted) -> None:
        did = submitted.draft_id
        self.drafts.pop(did, None)
        self.reply_to[did] = submitted.reply_to
        self.on_submitted(submitted)

        def apply() -> None:
            seq = self.engine.sequences.get(did)
            if seq is not None and seq.is_draft:
                kept = common_prefix_len(seq.token_ids, submitted.token_ids)
                self.engine.submit_draft(did, kept, submitted.token_ids[kept:], submitted.params)
            else:
                self.add_submitted(did, submitted)

        self.queue_op(did, apply)

    def on_submitted(self, submitted: DraftSubmitted) -> None:
        """A draft became a request; called before its op runs."""

    def add_submitted(self, request_id: str, submitted: DraftSubmitted) -> None:
        """Start a submitted draft that this worker does not hold (any more) as a new request."""
        raise NotImplementedError

    def drop_draft(self, draft_id: str) -> None:
        if self.drafts.pop(draft_id, None) is not None:
            self.queue_op(draft_id, lambda: self.engine.abort(draft_id))

    def _expire_drafts(self) -> None:
        now = time.monotonic()
        for draft_id in [d for d, t in self.drafts.items() if t < now - self.draft_ttl_s]:
            log.info("draft expired", draft_id=draft_id)
            self.drafts.pop(draft_id)
            self.engine.abort(draft_id)
        for draft_id in [d for d, t in self.drafts.items() if t < now - DRAFT_PAUSE_S]:
            self.engine.draft_idle(draft_id)

    # -- the engine loop ----------------------------------------------------------

    def _apply_ops(self) -> bool:
        """Apply the queued ops; True when there were any."""
        applied = bool(self.ops)
        while self.ops:
            request_id, op = self.ops.popleft()
            try:
                op()
            except PdrtError as exc:
                self.fail(request_id, exc)
            except Exception as exc:  # a bug must cost one request, not the worker and every stream on it
                log.exception("an engine op failed", request_id=request_id)
                self.fail(request_id, PdrtError(f"the worker could not apply the request: {exc!r}"))
        return applied

    async def _wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except TimeoutError:
            pass
        self.wake.clear()

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._apply_ops():
                self._load = self._measure_load()  # what just arrived counts before the (maybe long) step
            has_work = self.engine.has_unfinished()
            if self.ledger is not None:
                self.ledger.set_busy(has_work)
            if has_work:
                started = time.perf_counter()
                outputs = await self._stepped(loop.run_in_executor(self.executor, self._step))
                self.metrics.stepped(started, self.step_threads - self.engine.config.num_threads)
                ended, decoded = time.perf_counter(), bool(self.engine.last_batch.decodes)
                self.step_guard.stepped(ended, decoded, self.engine.last_tokens_per_stream)
                if decoded and self.ledger is not None:
                    self.ledger.add_pace((ended - started) / max(1.0, self.engine.last_tokens_per_stream))
                if outputs:
                    self.emit(outputs)
                for request_id, exc in self.engine.take_failed():
                    self.drafts.pop(request_id, None)
                    self.fail(request_id, StepFailedError(f"an engine step failed on this request: {exc!r}"))
                if not self.engine.last_step_ran:  # nothing fits the pool now; wait for a free or an op
                    await self._wait(0.01)
            else:
                self.step_guard.idle()
                await self._wait(DRAFT_PAUSE_S if self.drafts else IDLE_WAIT_S)
            self._expire_drafts()
            try:
                self.after_step()
            except Exception:  # a fault in housekeeping must cost at most what it was about, never the worker
                log.exception("housekeeping between steps failed")
            now = time.monotonic()
            if now - self._load_measured_at >= LOAD_REFRESH_S:  # heartbeats read it 4 times a second
                self._load, self._load_measured_at = self._measure_load(), now

    async def _stepped(self, step: asyncio.Future) -> list[RequestOutput]:
        """The outputs of the engine step under way; a worker that catches up looks in every STEP_POLL_S meanwhile
        (`while_stepping`)."""
        while self.catch_up is not None:
            done, _ = await asyncio.wait({step}, timeout=STEP_POLL_S)
            if done:
                break
            self.while_stepping()
        return await step

    def while_stepping(self) -> None:
        """On the event loop while the engine thread steps (the engine is not to be touched)."""

    def _step(self) -> list[RequestOutput]:
        """On the engine thread: one engine step, with the threads the ledger allows now."""
        if self.ledger is not None and self.ledger.borrow:
            threads = self.ledger.threads_for_step()
            if threads != self.step_threads:
                torch.set_num_threads(threads)  # this thread's OpenMP team; the kernels read it too
                self.step_threads = threads
        return self.engine.step()

    def emit(self, outputs: list[RequestOutput]) -> None:
        """Send each gateway the outputs of its requests, one message per gateway."""
        by_gateway: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            # An abort that lands on a request's last step has dropped its gateway already: nothing to send.
            reply_to = self.reply_to.pop(out.request_id, None) if out.finished else self.reply_to.get(out.request_id)
            if reply_to is not None:
                by_gateway.setdefault(reply_to, []).append(out)
            if out.finished:
                log.info("request finished", request_id=out.request_id, finish_reason=out.finish_reason,
                         prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens)
        for reply_to, outs in by_gateway.items():
            self.outbox.send(reply_to, StepOutputs(self.process_id, outs))

    def after_step(self) -> None:
        """Housekeeping between steps (leases, retries); the engine may be mutated here."""

    # -- load ---------------------------------------------------------------------

    def _measure_load(self) -> Load:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        num_free = blocks.num_free_blocks
        waiting_tokens = sum(scheduler.num_pending_tokens(s) for s in scheduler.waiting)
        waiting_tokens += sum(scheduler.num_pending_tokens(s) for s in scheduler.running
                              if s.num_computed_tokens < s.num_prompt_tokens)
        num_held = len(self.engine.sequences) - len(scheduler.waiting) - len(scheduler.running)
        tokens_left = sum(max(0, s.params.max_tokens - s.output_index)
                          for s in (*scheduler.waiting, *scheduler.running))
        return Load(len(scheduler.waiting), len(scheduler.running), num_held, num_free, blocks.num_blocks,
                    blocks.num_blocks - num_free, waiting_tokens, len(self.drafts),
                    self.engine.num_draft_tokens_ahead, self.engine.num_draft_rollbacks, *self.metrics.step_times(),
                    *self.metrics.prefill_rate(), num_tokens_left=tokens_left)

    def load(self) -> Load:
        return self._load

    # -- life cycle -------------------------------------------------------------------

    async def serve(self, stop: asyncio.Event) -> None:
        self._ref = self.start()
        self._load = self._measure_load()
        self.inbox.start()
        self.link.start()
        engine_task = asyncio.create_task(self._engine_loop(), name="engine loop")
        log.info("worker serving", role=self.role, process=self.process_id, address=self.inbox.address)
        try:
            done, _ = await asyncio.wait([engine_task, asyncio.create_task(stop.wait())],
                                         return_when=asyncio.FIRST_COMPLETED)
            if engine_task in done:
                engine_task.result()  # a crash of the engine loop crashes the process; the supervisor restarts it
        finally:
            engine_task.cancel()
            self.link.close()
            self.inbox.close()
            await self._ref.stop()
            self.shut_down()

    def shut_down(self) -> None:
        """Once nothing delivers to it any more: wait out the engine thread, then close the sends, the thread
        ledger and what the role holds (`close`)."""
        self.executor.shutdown(wait=True)
        self.outbox.close()
        if self.ledger is not None:
            self.ledger.close()
        self.close()

    def close(self) -> None:
        """Release what the role holds beyond the engine (transfer endpoints, shared memory)."""
