"""Streams spread over the decode workers: the controller's policy that moves running streams off a crowded one.

The gateways send each new stream to the decode worker with the fewest, but
a stream stays where it started. A decode worker added by a role change,
or one whose streams ended early, is left with few while another keeps
many and misses the TPOT SLO. Each controller tick, when the decode worker
with the most streams

* steps slower than the TPOT SLO (its streams miss it now),
* holds at least MIN_GAP streams more than the one with the fewest, and at
  least MIN_SHARE of its own streams more (a move between two workers
  about as crowded changes neither's step, and costs a prefill each), and
* the one with the fewest steps within the SLO (streams moved to a worker
  that misses it too go on missing it, after a prefill),

it is asked (`ShedStreams`) to send half the difference on. They go as
continuations, which the gateways route to the decode worker with the
fewest streams; each costs one prefill of its context there. After a move,
the next waits COOLDOWN_S, for the moved streams to show in the loads.

A worker that has just become a decode worker (`joined`) is the one
exception to the step times: the balancer made it one because the decode
workers were to be short of room, and the streams held now are the ones
that will run longest. For JOINED_S after it serves its new role, the
crowded worker sends half the gap on as soon as the gap is large enough,
whatever its step time, once; the balancer's simulator places the streams
held at a change the same way (`spread_to_joined`).

Workers in the middle of a role change take no part. It runs when the
balancer does (`[controller] balance`).
"""

import time
from collections.abc import Callable

import structlog
from prometheus_client import CollectorRegistry, Counter

from pdrt.control_plane.registry import Registry
from pdrt.wire import ShedStreams

log = structlog.get_logger(__name__)

MIN_GAP = 2  # streams: a gap of one moves nothing
MIN_SHARE = 0.25  # of the crowded worker's streams: a smaller gap is noise between two loaded workers
COOLDOWN_S = 2.0
JOINED_S = 5.0  # after a worker became a decode worker, it takes half the crowded one's streams whatever its step


def spread_to_joined(counts: list[int]) -> int:
    """How many streams the most crowded of decode workers holding `counts` sends on to a worker that has
    just joined them (holding none): half the gap when the gap is large enough to move at all (against none, a
    gap of MIN_GAP is)."""
    most = max(counts, default=0)
    return most // 2 if most >= MIN_GAP else 0


class StreamBalance:
    def __init__(self, registry: Registry, send: Callable[[bytes, object], None], pending: Callable[[], set[str]],
                 enabled: bool, tpot_slo_s: float, metrics: CollectorRegistry) -> None:
        self.registry = registry
        self.send = send
        self.pending = pending  # process ids changing roles now
        self.enabled = enabled
        self.tpot_slo_s = tpot_slo_s
        self.last_move = -COOLDOWN_S
        self.joined: dict[str, float] = {}  # process id -> when it became a decode worker
        self.moves = Counter("pdrt_controller_streams_shed", "Streams the controller asked a crowded decode worker "
                             "to send on to the one with the fewest", registry=metrics)

    def join(self, process_id: str, now: float | None = None) -> None:
        """`process_id` has become a decode worker: it takes half the crowded one's streams at the next tick."""
        self.joined[process_id] = time.monotonic() if now is None else now

    def tick(self, now: float | None = None) -> int:
        """Ask the most crowded decode worker to send streams on when it should; how many it was asked for."""
        now = time.monotonic() if now is None else now
        self.joined = {p: t for p, t in self.joined.items() if now - t < JOINED_S}
        if not self.enabled or (now - self.last_move < COOLDOWN_S and not self.joined):
            return 0
        changing = self.pending()
        workers = [e for e in self.registry.by_role("decode") if e.process_id not in changing]
        if len(workers) < 2:
            return 0
        most = max(workers, key=lambda e: e.load.num_running)
        fewest = min(workers, key=lambda e: e.load.num_running)
        gap = most.load.num_running - fewest.load.num_running
        joined = self.joined.pop(fewest.process_id, None) is not None
        if not joined and (now - self.last_move < COOLDOWN_S or most.load.step_s <= self.tpot_slo_s
                           or fewest.load.step_s > self.tpot_slo_s):
            return 0
        if gap < max(MIN_GAP, MIN_SHARE * most.load.num_running):
            return 0
        count = gap // 2
        reason = (f"{most.process_id} holds {most.load.num_running} streams, stepping in "
                  f"{most.load.step_s * 1e3:.1f} ms; {fewest.process_id} holds {fewest.load.num_running}"
                  + (", a decode worker since just now" if joined else ""))
        self.send(most.identity, ShedStreams(count, reason))
        self.last_move = now
        self.moves.inc(count)
        log.info("shedding streams", process=most.process_id, count=count, reason=reason)
        return count
