"""Prefill capacity held for sessions whose user just focused the input box.

A reservation is a warmup draft on one worker: the session's conversation
so far, prefilled into that worker's KV (and so into its prefix cache), held
until the TTL runs out. The session's next request or draft goes to the same
worker and finds the prefix there. At most `max_reservations` at a time,
and at most `max_per_owner` of them for one client's sessions.
"""

import time
from collections import Counter
from dataclasses import dataclass

from pdrt.roles.client_share import holds_a_share, release
from pdrt.typeahead.sessions import SessionKey
from pdrt.wire import WorkerInfo


@dataclass(slots=True)
class Reservation:
    session: SessionKey
    worker: WorkerInfo
    draft_id: str  # the warmup draft on the worker
    expires_at: float


class Reservations:
    def __init__(self, max_reservations: int = 64, ttl_s: float = 10.0, max_per_owner: int = 32) -> None:
        self.max_reservations = max_reservations
        self.max_per_owner = max_per_owner
        self.ttl_s = ttl_s
        self.by_session: dict[SessionKey, Reservation] = {}
        self.num_by_owner: Counter[bytes] = Counter()

    def get(self, session: SessionKey) -> Reservation | None:
        reservation = self.by_session.get(session)
        if reservation is None or reservation.expires_at < time.monotonic():
            return None
        return reservation

    def is_full_for(self, owner: bytes) -> bool:
        """Whether no reservation can be made for `owner` now: the table, or its share of it, is full."""
        return len(self.by_session) >= self.max_reservations or (self.num_by_owner[owner] >= self.max_per_owner
                                                                 and holds_a_share(owner))

    def add(self, session: SessionKey, worker: WorkerInfo, draft_id: str) -> Reservation:
        reservation = Reservation(session, worker, draft_id, time.monotonic() + self.ttl_s)
        self._drop(session)
        self.by_session[session] = reservation
        self.num_by_owner[session[0]] += 1
        return reservation

    def renew(self, reservation: Reservation) -> None:
        reservation.expires_at = time.monotonic() + self.ttl_s

    def _drop(self, session: SessionKey) -> Reservation | None:
        reservation = self.by_session.pop(session, None)
        if reservation is not None:
            release(self.num_by_owner, session[0])
        return reservation

    def expire(self) -> list[Reservation]:
        now = time.monotonic()
        expired = [r for r in self.by_session.values() if r.expires_at < now]
        for reservation in expired:
            self._drop(reservation.session)
        return expired

    def on_worker(self, process_id: str) -> list[Reservation]:
        """Drop the reservations held on a worker that is gone."""
        lost = [r for r in self.by_session.values() if r.worker.process_id == process_id]
        for reservation in lost:
            self._drop(reservation.session)
        return lost
