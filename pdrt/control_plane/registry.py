"""Who is alive: registrations, heartbeats and leases, without any I/O.

A process registers under a stable `process_id` ("decode-0") and a fresh
`incarnation` each time it starts. A heartbeat renews the lease of exactly
that incarnation. A process whose lease runs out, or that is replaced by a
newer incarnation of the same id, is *lost*: the registry reports it once so
the controller can tell the gateways, which stop routing to it and settle
its in-flight requests.
"""

import time
from dataclasses import dataclass

from pdrt.wire import Load, WorkerInfo


@dataclass(slots=True)
class Entry:
    process_id: str
    incarnation: str
    role: str
    address: str
    identity: bytes  # the ZeroMQ identity to reach it through the controller's ROUTER
    lease_expires_at: float
    load: Load


class Registry:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.entries: dict[str, Entry] = {}

    def register(self, process_id: str, incarnation: str, role: str, address: str, identity: bytes,
                 now: float | None = None) -> Entry | None:
        """Add a process; returns the entry it replaces (an older incarnation, now lost), if any."""
        now = time.monotonic() if now is None else now
        old = self.entries.get(process_id)
        self.entries[process_id] = Entry(process_id, incarnation, role, address, identity, now + self.lease_s, Load())
        if old is not None and old.incarnation != incarnation:
            return old
        return None

    def heartbeat(self, process_id: str, incarnation: str, load: Load, now: float | None = None) -> bool:
        """Renew a lease; False when this incarnation is not registered (it must register again)."""
        entry = self.entries.get(process_id)
        if entry is None or entry.incarnation != incarnation:
            return False
        entry.lease_expires_at = (time.monotonic() if now is None else now) + self.lease_s
        entry.load = load
        return True

    def expire(self, now: float | None = None) -> list[Entry]:
        """Remove and return every process whose lease has run out."""
        now = time.monotonic() if now is None else now
        lost = [e for e in self.entries.values() if e.lease_expires_at < now]
        for entry in lost:
            del self.entries[entry.process_id]
        return lost

    def remove(self, process_id: str, incarnation: str) -> Entry | None:
        """A process that says goodbye (clean shutdown)."""
        entry = self.entries.get(process_id)
        if entry is None or entry.incarnation != incarnation:
            return None
        return self.entries.pop(process_id)

    def by_role(self, role: str) -> list[Entry]:
        return [e for e in self.entries.values() if e.role == role]

    def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(e.process_id, e.incarnation, e.role, e.address, e.load)
                for e in self.entries.values() if e.role != "gateway"]
