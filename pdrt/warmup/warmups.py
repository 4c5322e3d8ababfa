"""The gateway's side of warmups: remembered sessions, held reservations, and which worker a session goes to.

A warmup (a datagram that passed the guard, or a native `Warmup`) for a
session the gateway remembers prefills the session's conversation so far —
everything up to where the next user turn starts — as a warmup draft on one
worker, held for the reservation's TTL. A later request or draft of the
session is routed to that worker, where the prefix cache has the
conversation: a warmup hit. Unknown sessions and a full reservation table
reserve nothing. Counters name every outcome.
"""

from collections import Counter
from collections.abc import Callable
from typing import Any

from pdrt.roles.messaging import Outbox
from pdrt.roles.router import Router
from pdrt.typeahead.draft_tokenizer import DraftTokenizer
from pdrt.typeahead.sessions import SessionStore
from pdrt.warmup.reservations import Reservations
from pdrt.wire import Abort, DraftUpdate, WorkerInfo


class Warmups:
    def __init__(self, max_reservations: int, ttl_s: float, tokenizer: Any, max_model_len: int, router: Router,
                 outbox: Outbox, role: str, new_id: Callable[[], str], counters: Counter[str]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.router = router
        self.outbox = outbox
        self.role = role  # the role that prefills: "prefill" or "colocated"
        self.new_id = new_id
        self.counters = counters
        self.sessions = SessionStore()
        self.reservations = Reservations(max_reservations, ttl_s)

    def worker_for(self, session_id: str) -> WorkerInfo | None:
        """The worker holding `session_id`'s warmup; counts a warmup hit or miss for a session's request."""
        if not session_id:
            return None
        reservation = self.reservations.get(session_id)
        if reservation is not None and self.router.is_live(reservation.worker):
            self.counters["warmup_hits"] += 1
            return reservation.worker
        self.counters["warmup_misses"] += 1
        return None

    def warm(self, session_id: str) -> None:
        reservation = self.reservations.get(session_id)
        if reservation is not None and self.router.is_live(reservation.worker):
            self.reservations.renew(reservation)
            self.counters["warmups_renewed"] += 1
            return
        history = self.sessions.get(session_id)
        if history is None:
            self.counters["warmups_unknown_session"] += 1
            return
        worker = self.router.pick(self.role)
        ids = DraftTokenizer(self.tokenizer, history).stable_ids()  # the conversation up to the next turn
        if worker is None or self.reservations.is_full or not ids or len(ids) >= self.max_model_len:
            self.counters["warmups_refused"] += 1
            return
        draft_id = self.new_id()
        self.outbox.send(worker.address, DraftUpdate(draft_id, 0, ids, colocated=self.role == "colocated"))
        self.reservations.add(session_id, worker, draft_id)
        self.counters["warmups"] += 1
        self.counters["warmup_tokens"] += len(ids)

    def remember(self, session_id: str, messages: list[dict[str, str]], answer: str) -> None:
        self.sessions.record(session_id, messages, answer)

    def expire(self) -> None:
        for reservation in self.reservations.expire():
            if self.router.is_live(reservation.worker):
                self.outbox.send(reservation.worker.address, Abort(reservation.draft_id))

    def worker_lost(self, worker: WorkerInfo) -> None:
        self.reservations.on_worker(worker.process_id)
