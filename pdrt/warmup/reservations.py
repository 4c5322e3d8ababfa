"""Prefill capacity held for sessions whose user just focused the input box.

A reservation is a warmup draft on one worker: the session's conversation
so far, prefilled into that worker's KV (and so into its prefix cache), held
until the TTL runs out. The session's next request or draft goes to the same
worker and finds the prefix there. At most `max_reservations` at a time.
"""

import time
from dataclasses import dataclass

from pdrt.wire import WorkerInfo


@dataclass(slots=True)
class Reservation:
    session_id: str
    worker: WorkerInfo
    draft_id: str  # the warmup draft on the worker
    expires_at: float


class Reservations:
    def __init__(self, max_reservations: int = 64, ttl_s: float = 10.0) -> None:
        self.max_reservations = max_reservations
        self.ttl_s = ttl_s
        self.by_session: dict[str, Reservation] = {}

    def get(self, session_id: str) -> Reservation | None:
        reservation = self.by_session.get(session_id)
        if reservation is None or reservation.expires_at < time.monotonic():
            return None
        return reservation

    @property
    def is_full(self) -> bool:
        return len(self.by_session) >= self.max_reservations

    def add(self, session_id: str, worker: WorkerInfo, draft_id: str) -> Reservation:
        reservation = Reservation(session_id, worker, draft_id, time.monotonic() + self.ttl_s)
        self.by_session[session_id] = reservation
        return reservation

    def renew(self, reservation: Reservation) -> None:
        reservation.expires_at = time.monotonic() + self.ttl_s

    def expire(self) -> list[Reservation]:
        now = time.monotonic()
        expired = [r for r in self.by_session.values() if r.expires_at < now]
        for reservation in expired:
            del self.by_session[reservation.session_id]
        return expired

    def on_worker(self, process_id: str) -> list[Reservation]:
        """Drop the reservations held on a worker that is gone."""
        lost = [r for r in self.by_session.values() if r.worker.process_id == process_id]
        for reservation in lost:
            del self.by_session[reservation.session_id]
        return lost
