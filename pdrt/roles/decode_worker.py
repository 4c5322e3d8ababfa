"""The decode worker: pulls a prompt's KV from a prefill worker, then decodes it with continuous batching.

Life cycle of a request in this worker:

1. `KVHandoff` from a prefill worker -> `engine.reserve_import` reserves
   blocks (prefix-cache hits need no copy); when the pool has no room, the
   handoff waits in `waiting_imports` until blocks free up or its lease ends;
2. the transfer thread pulls the remaining blocks from the prefill worker's
   KV source, retrying a failed pull before giving up;
3. back between engine steps: `commit_import` starts decoding, and `KVAck`
   lets the prefill worker free its copy;
4. every engine step sends the new tokens of all its requests to each
   gateway in one message.

A `PrefillRequest` (conditional disaggregation: the gateway found the
prefill workers backed up and the prompt short) is prefilled and decoded
here, as a colocated worker would.

A failed transfer ends the request with `RequestFailed("transfer_failed")`;
it never decodes from KV that did not arrive. An `Abort` while the transfer
runs waits for it to end before freeing the blocks, because the transfer
thread is still writing into them.
"""

import asyncio
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import structlog
import zmq.asyncio

from pdrt.engine.outputs import ImportReservation
from pdrt.errors import KVPoolFullError, PdrtError, TransferError
from pdrt.node_config import NodeConfig
from pdrt.roles.engine_worker import EngineWorker
from pdrt.transport import make_puller
from pdrt.wire import Abort, KVAck, KVHandoff, PrefillRequest

log = structlog.get_logger(__name__)

PULL_ATTEMPTS = 3
PULL_TIMEOUT_S = 10.0
MAX_REMEMBERED_ABORTS = 10_000


class DecodeWorker(EngineWorker):
    role = "decode"
    senders = {KVHandoff: ("prefill",), PrefillRequest: ("gateway",), Abort: ("gateway",)}

    def __init__(self, config: NodeConfig, process_id: str, incarnation: str, ctx: zmq.asyncio.Context,
                 run_id: str = "local") -> None:
        super().__init__(config, process_id, incarnation, ctx, run_id)
        self.puller = make_puller(self.engine.pool.tensor, process_id, config.key)
        self.transfer_executor = ThreadPoolExecutor(1, thread_name_prefix=f"{process_id}-kv-pull")
        self.importing: dict[str, KVHandoff] = {}  # blocks reserved, transfer running
        self.waiting_imports: deque[KVHandoff] = deque()  # no room in the pool yet
        self.aborted: OrderedDict[str, None] = OrderedDict()  # aborts that may precede or overlap a handoff

    async def on_receive(self, message: object) -> None:
        match message:
            case KVHandoff(request_id=rid) if rid in self.aborted:
                self.outbox.send(message.prefill_address, KVAck(rid))
            case KVHandoff(request_id=rid):
                self.reply_to[rid] = message.reply_to
                self.queue_op(rid, lambda: self._reserve(message))
            case PrefillRequest():  # conditional disaggregation: a short prompt to prefill here
                self.add_whole_request(message)
            case Abort(request_id=rid):
                self._abort(rid)

    def _abort(self, request_id: str) -> None:
        self.aborted[request_id] = None
        while len(self.aborted) > MAX_REMEMBERED_ABORTS:
            self.aborted.popitem(last=False)
        self.reply_to.pop(request_id, None)
        if request_id not in self.importing:  # an import in flight is aborted when its transfer ends
            self.queue_op(request_id, lambda: self._drop(request_id))

    def _drop(self, request_id: str) -> None:
        self.engine.abort(request_id)
        for handoff in [h for h in self.waiting_imports if h.request_id == request_id]:
            self.waiting_imports.remove(handoff)
            self.outbox.send(handoff.prefill_address, KVAck(request_id))

    # -- import -------------------------------------------------------------------

    def _reserve(self, handoff: KVHandoff) -> None:
        rid = handoff.request_id
        try:
            reservation = self.engine.reserve_import(rid, handoff.token_ids, handoff.first_token, handoff.params,
                                                     handoff.first_logprob, handoff.num_prior_outputs)
        except KVPoolFullError:
            self.waiting_imports.append(handoff)
            return
        except PdrtError:
            self.outbox.send(handoff.prefill_address, KVAck(rid))
            raise
        self.importing[rid] = handoff
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.transfer_executor, self._pull, handoff, reservation)
        future.add_done_callback(lambda f: self.queue_op(rid, lambda: self._finish_import(handoff, f)))

    def _pull(self, handoff: KVHandoff, reservation: ImportReservation) -> float:
        """On the transfer thread: copy the blocks that are not cached here; returns seconds taken."""
        start = time.perf_counter()
        skip = reservation.num_cached_blocks
        for attempt in range(1, PULL_ATTEMPTS + 1):
            try:
                self.puller.pull(handoff.source, handoff.request_id, handoff.block_ids[skip:],
                                 reservation.block_ids[skip:], handoff.lease_expires_at, PULL_TIMEOUT_S)
                self.metrics.pulled(time.perf_counter() - start, len(handoff.block_ids) - skip)
                return time.perf_counter() - start
            except TransferError as exc:
                log.warning("kv pull failed", request_id=handoff.request_id, attempt=attempt, error=str(exc))
                if attempt == PULL_ATTEMPTS or time.monotonic() > handoff.lease_expires_at:
                    self.metrics.pull_failed()
                    raise
        raise AssertionError("unreachable")

    def _finish_import(self, handoff: KVHandoff, future: asyncio.Future) -> None:
        rid = handoff.request_id
        del self.importing[rid]
        self.outbox.send(handoff.prefill_address, KVAck(rid))
        exc = future.exception()
        if rid in self.aborted:
            self.engine.abort(rid)
        elif exc is not None:
            self.engine.abort(rid)
            raise exc if isinstance(exc, PdrtError) else TransferError(f"kv pull crashed: {exc!r}")
        else:
            self.engine.commit_import(rid)
            log.info("kv imported", request_id=rid, blocks=len(handoff.block_ids), seconds=round(future.result(), 6))

    def after_step(self) -> None:
        now = time.monotonic()
        while self.waiting_imports:
            handoff = self.waiting_imports[0]
            if handoff.lease_expires_at < now:
                self.waiting_imports.popleft()
                self.outbox.send(handoff.prefill_address, KVAck(handoff.request_id))
                self.fail(handoff.request_id, KVPoolFullError("the decode worker's KV pool stayed full"))
                continue
            needed = self.engine.block_manager.num_blocks_for(len(handoff.token_ids))
            if needed > self.engine.block_manager.num_free_blocks:
                break
            self.waiting_imports.popleft()
            try:
                self._reserve(handoff)
            except PdrtError as exc:
                self.fail(handoff.request_id, exc)

    def close(self) -> None:
        self.transfer_executor.shutdown(wait=True)
        self.puller.close()
