"""The gateway's side of warmups: remembered sessions, held reservations, and which worker a session goes to.

A warmup (a datagram that passed the guard, or a native or HTTP `Warmup`)
for a session the gateway remembers prefills the session's conversation so
far — everything up to where the next user turn starts — as a warmup draft
on one worker, held for the reservation's TTL. A later request or draft of
the session is routed to that worker, where the prefix cache has the
conversation: a warmup hit. Unknown sessions and a full reservation table
reserve nothing. Counters name every outcome.

A client warms only its own sessions (pdrt/typeahead/sessions.py), at most
CLIENT_RATE a second, and holds at most half of the reservations; a
datagram, signed with the warmup key, may warm any session. What is cheap
is checked first: the conversation is tokenized only once a reservation
and a worker are there for it.
"""

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pdrt.roles.client_share import share_of
from pdrt.roles.messaging import Outbox
from pdrt.roles.router import Router
from pdrt.typeahead.draft_tokenizer import DraftTokenizer
from pdrt.typeahead.sessions import SessionKey, SessionStore
from pdrt.warmup.guard import TokenBuckets
from pdrt.warmup.reservations import Reservations
from pdrt.wire import Abort, DraftUpdate, WorkerInfo

CLIENT_RATE = 20.0  # warmups a second one client may ask for (a burst as large)
MAX_CLIENTS = 4096  # clients whose warmup rate is tracked


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
        self.reservations = Reservations(max_reservations, ttl_s, share_of(max_reservations))
        self.rates = TokenBuckets(CLIENT_RATE, CLIENT_RATE, MAX_CLIENTS)

    def worker_for(self, owner: bytes, session_id: str) -> WorkerInfo | None:
        """The worker holding the warmup of `owner`'s session; counts a warmup hit or miss for its request."""
        if not session_id:
            return None
        reservation = self.reservations.get((owner, session_id))
        if reservation is not None and self.router.is_live(reservation.worker):
            self.counters["warmup_hits"] += 1
            return reservation.worker
        self.counters["warmup_misses"] += 1
        return None

    def warm(self, session_id: str, owner: bytes | None = None) -> None:
        """Prefill the conversation of `owner`'s session; without an owner (a signed datagram), of whoever's it is."""
        session = (owner, session_id) if owner is not None else self.sessions.key_of(session_id)
        if session is None:
            self.counters["warmups_unknown_session"] += 1
            return
        reservation = self.reservations.get(session)
        if reservation is not None and self.router.is_live(reservation.worker):
            self.reservations.renew(reservation)
            self.counters["warmups_renewed"] += 1
            return
        history = self.sessions.get(session)
        if history is None:
            self.counters["warmups_unknown_session"] += 1
            return
        if owner is not None and not self.rates.take(owner, time.monotonic()):
            self.counters["warmups_rate_limited"] += 1
            return
        worker = self.router.pick(self.role) if not self.reservations.is_full_for(session[0]) else None
        if worker is None:
            self.counters["warmups_refused"] += 1
            return
        ids = DraftTokenizer(self.tokenizer, history).stable_ids()  # the conversation up to the next turn
        if not ids or len(ids) >= self.max_model_len:
            self.counters["warmups_refused"] += 1
            return
        draft_id = self.new_id()
        self.outbox.send(worker.address, DraftUpdate(draft_id, 0, ids, colocated=self.role == "colocated",
                                                     cache_salt=self.sessions.salt_of(session)))
        self.reservations.add(session, worker, draft_id)
        self.counters["warmups"] += 1
        self.counters["warmup_tokens"] += len(ids)

    def remember(self, session: SessionKey, messages: list[dict[str, str]], answer: str, cache_salt: str = "") -> None:
        self.sessions.record(session, messages, answer, cache_salt)

    def expire(self) -> None:
        for reservation in self.reservations.expire():
            if self.router.is_live(reservation.worker):
                self.outbox.send(reservation.worker.address, Abort(reservation.draft_id))

    def worker_lost(self, worker: WorkerInfo) -> None:
        self.reservations.on_worker(worker.process_id)
