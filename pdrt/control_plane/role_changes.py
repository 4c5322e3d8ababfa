"""Role changes of a disaggregated node's workers, in the controller: from the decision to the worker's word.

A change starts when the balancer (pdrt/control_plane/balancer.py) or an
operator (`SetRole`) asks for it. The registry takes the new role at once,
so the next cluster view routes by it; the worker gets `ChangeRole`, hands
over what its old role held, and answers `RoleChanged`. The time between is
the change's duration, logged and exported. A change is refused when the
worker is not a prefill or decode worker, already has the role, is in the
middle of a change, or is the last live worker of its role. A worker that
dies during its change ends it unmade: its next incarnation registers with
the role it was started as.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram, Info

from pdrt.control_plane.registry import Registry
from pdrt.errors import WorkerLostError
from pdrt.wire import ChangeRole, Error, RoleChanged

log = structlog.get_logger(__name__)

SPLIT_ROLES = ("prefill", "decode")
CHANGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))
CHANGE_TIMEOUT_S = 10.0  # a worker that has not answered by then is taken as changed (its lease says if it lives)


@dataclass(slots=True)
class Change:
    process_id: str
    old: str
    role: str
    reason: str
    started: float
    requester: bytes | None  # the operator's identity, answered when the change is done


class RoleChanges:
    def __init__(self, registry: Registry, send: Callable[[bytes, object], None], metrics: CollectorRegistry) -> None:
        self.registry = registry
        self.send = send
        self.pending: dict[str, Change] = {}
        self.last = Info("pdrt_controller_role_change_last", "The last role change", registry=metrics)
        self.changes = Counter("pdrt_controller_role_changes", "Role changes of workers, by their new role",
                               ["role"], registry=metrics)
        self.seconds = Histogram("pdrt_controller_role_change_seconds", "From a role change's decision to the "
                                 "worker serving its new role", buckets=CHANGE_BUCKETS, registry=metrics)

    def refusal(self, process_id: str, role: str) -> str | None:
        """Why `process_id` cannot become `role` now; None when it can."""
        entry = self.registry.entries.get(process_id)
        if entry is None:
            return f"no live process {process_id!r}"
        if entry.role not in SPLIT_ROLES or role not in SPLIT_ROLES:
            return "only the prefill and decode workers of a disaggregated node change roles, to prefill or decode"
        if entry.role == role:
            return f"{process_id} is a {role} worker already"
        if process_id in self.pending:
            return f"{process_id} is changing its role already"
        if len(self.registry.by_role(entry.role)) <= 1:
            return f"{process_id} is the last {entry.role} worker"
        return None

    def start(self, process_id: str, role: str, reason: str, requester: bytes | None = None) -> str | None:
        """Begin the change, or say why not. The caller broadcasts the new view."""
        why = self.refusal(process_id, role)
        if why is not None:
            return why
        entry = self.registry.entries[process_id]
        change = Change(process_id, entry.role, role, reason, time.monotonic(), requester)
        self.pending[process_id] = change
        entry.role = role
        self.send(entry.identity, ChangeRole(role, reason))
        log.info("role change", process=process_id, old=change.old, role=role, reason=reason)
        return None

    def confirmed(self, message: RoleChanged) -> bool:
        """The worker serves its new role; False when no such change was under way."""
        change = self.pending.get(message.process_id)
        if change is None or change.role != message.role:
            return False
        del self.pending[message.process_id]
        self._done(change, message)
        return True

    def lost(self, process_id: str) -> None:
        """The worker died or left during its change: the change ends unmade (a new incarnation registers with
        the role it was started as), and the operator who asked hears so at once."""
        change = self.pending.pop(process_id, None)
        if change is None:
            return
        log.warning("a role change ended with its worker", process=process_id, role=change.role)
        if change.requester is not None:
            exc = WorkerLostError(f"{process_id} died before it served as a {change.role} worker")
            self.send(change.requester, Error(exc.code, str(exc)))

    def expire(self) -> None:
        """Changes whose worker never answered (it died, or the answer was lost) end here."""
        now = time.monotonic()
        for change in [c for c in self.pending.values() if now - c.started > CHANGE_TIMEOUT_S]:
            del self.pending[change.process_id]
            log.warning("a role change was not confirmed", process=change.process_id, role=change.role)

    def _done(self, change: Change, message: RoleChanged) -> None:
        seconds = time.monotonic() - change.started
        self.changes.labels(change.role).inc()
        self.seconds.observe(seconds)
        self.last.info({"worker": change.process_id, "from_role": change.old, "to_role": change.role,
                        "seconds": f"{seconds:.3f}", "reason": change.reason[:200]})
        log.info("role changed", process=change.process_id, old=change.old, role=change.role,
                 seconds=round(seconds, 4), moved_streams=message.moved, reason=change.reason)
        if change.requester is not None:
            self.send(change.requester, message)
