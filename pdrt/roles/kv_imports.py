"""A worker's decode side: KV handed over by prefill workers, pulled into its own pool, then decoded here.

Life cycle of a handoff here:

1. `KVHandoff` -> `engine.reserve_import` reserves blocks (prefix-cache hits
   need no copy); when the pool has no room, the handoff waits in `waiting`
   until blocks free up or its lease ends;
2. the transfer thread pulls the remaining blocks from the prefill worker's
   KV source, retrying a failed pull before giving up;
3. back between engine steps: `commit_import` starts decoding, and `KVAck`
   lets the prefill worker free its copy.

A failed transfer ends the request with `RequestFailed("transfer_failed")`,
which the gateway retries elsewhere; it never decodes from KV that did not
arrive. An `Abort` while the transfer runs waits for it to end before
freeing the blocks, because the transfer thread is still writing into them.
"""

import asyncio
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog

from pdrt.engine.outputs import ImportReservation
from pdrt.engine.torch_threads import serial_torch
from pdrt.errors import KVPoolFullError, PdrtError, TransferError
from pdrt.transport import make_puller
from pdrt.wire import KVAck, KVHandoff

if TYPE_CHECKING:
    from pdrt.roles.split_worker import SplitWorker

log = structlog.get_logger(__name__)

PULL_ATTEMPTS = 3
PULL_TIMEOUT_S = 10.0
MAX_REMEMBERED_ABORTS = 10_000


class KVImports:
    def __init__(self, worker: "SplitWorker") -> None:
        self.worker = worker
        self.puller = make_puller(worker.engine.pool.tensor, worker.process_id, worker.config.key)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"{worker.process_id}-kv-pull",
                                           initializer=serial_torch)
        self.importing: dict[str, KVHandoff] = {}  # blocks reserved, transfer running
        self.waiting: deque[KVHandoff] = deque()  # no room in the pool yet
        self.aborted: OrderedDict[str, None] = OrderedDict()  # aborts that may precede or overlap a handoff
        self.failing: dict[str, PdrtError] = {}  # imports in flight to end with this error once their pull ends

    def receive(self, handoff: KVHandoff) -> None:
        w, rid = self.worker, handoff.request_id
        if rid in self.aborted:
            w.outbox.send(handoff.prefill_address, KVAck(rid))
            return
        w.reply_to[rid] = handoff.reply_to
        w.queue_op(rid, lambda: self._reserve(handoff))

    def abort(self, request_id: str) -> None:
        self.aborted[request_id] = None
        while len(self.aborted) > MAX_REMEMBERED_ABORTS:
            self.aborted.popitem(last=False)
        if request_id not in self.importing:  # an import in flight is aborted when its transfer ends
            self.worker.queue_op(request_id, lambda: self._drop(request_id))

    def _drop(self, request_id: str) -> None:
        self.worker.engine.abort(request_id)
        for handoff in [h for h in self.waiting if h.request_id == request_id]:
            self.waiting.remove(handoff)
            self.worker.outbox.send(handoff.prefill_address, KVAck(request_id))

    def fail_all(self, exc: PdrtError) -> int:
        """On the engine's side of a step: end every import, waiting or in flight, with `exc`; the count."""
        for handoff in self.waiting:
            self.worker.outbox.send(handoff.prefill_address, KVAck(handoff.request_id))
            self.worker.fail(handoff.request_id, exc)
        moved = len(self.waiting) + len(self.importing)
        self.waiting.clear()
        self.failing.update((rid, exc) for rid in self.importing)
        return moved

    def _reserve(self, handoff: KVHandoff) -> None:
        w, rid = self.worker, handoff.request_id
        try:
            reservation = w.engine.reserve_import(rid, handoff.token_ids, handoff.first_token, handoff.params,
                                                  handoff.first_logprob, handoff.num_prior_outputs)
        except KVPoolFullError:
            self.waiting.append(handoff)
            return
        except PdrtError:
            w.outbox.send(handoff.prefill_address, KVAck(rid))
            raise
        self.importing[rid] = handoff
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, self._pull, handoff, reservation)
        future.add_done_callback(lambda f: w.queue_op(rid, lambda: self._finish(handoff, f)))

    def _pull(self, handoff: KVHandoff, reservation: ImportReservation) -> float:
        """On the transfer thread: copy the blocks that are not cached here; returns seconds taken."""
        start = time.perf_counter()
        skip = reservation.num_cached_blocks
        for attempt in range(1, PULL_ATTEMPTS + 1):
            try:
                self.puller.pull(handoff.source, handoff.request_id, handoff.block_ids[skip:],
                                 reservation.block_ids[skip:], handoff.lease_expires_at, PULL_TIMEOUT_S)
                self.worker.metrics.pulled(time.perf_counter() - start, len(handoff.block_ids) - skip)
                return time.perf_counter() - start
            except TransferError as exc:
                log.warning("kv pull failed", request_id=handoff.request_id, attempt=attempt, error=str(exc))
                if attempt == PULL_ATTEMPTS or time.monotonic() > handoff.lease_expires_at:
                    self.worker.metrics.pull_failed()
                    raise
        raise AssertionError("unreachable")

    def _finish(self, handoff: KVHandoff, future: asyncio.Future) -> None:
        w, rid = self.worker, handoff.request_id
        del self.importing[rid]
        w.outbox.send(handoff.prefill_address, KVAck(rid))
        exc = future.exception()
        failing = self.failing.pop(rid, None)
        if rid in self.aborted:
            w.engine.abort(rid)
        elif exc is not None or failing is not None:
            w.engine.abort(rid)
            if failing is not None:
                raise failing
            raise exc if isinstance(exc, PdrtError) else TransferError(f"kv pull crashed: {exc!r}")
        else:
            w.engine.commit_import(rid)
            log.info("kv imported", request_id=rid, blocks=len(handoff.block_ids), seconds=round(future.result(), 6))

    def admit_waiting(self) -> None:
        """Between steps: reserve the waiting handoffs that fit now; end those whose lease ran out."""
        w, now = self.worker, time.monotonic()
        while self.waiting:
            handoff = self.waiting[0]
            if handoff.lease_expires_at < now:
                self.waiting.popleft()
                w.outbox.send(handoff.prefill_address, KVAck(handoff.request_id))
                w.fail(handoff.request_id, KVPoolFullError("the decode worker's KV pool stayed full"))
                continue
            needed = w.engine.block_manager.num_blocks_for(len(handoff.token_ids))
            if needed > w.engine.block_manager.num_free_blocks:
                break
            self.waiting.popleft()
            try:
                self._reserve(handoff)
            except PdrtError as exc:
                w.fail(handoff.request_id, exc)

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.puller.close()
