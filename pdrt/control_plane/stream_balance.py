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


class StreamBalance:
    def __init__(self, registry: Registry, send: Callable[[bytes, object], None], pending: Callable[[], set[str]],
                 enabled: bool, tpot_slo_s: float, metrics: CollectorRegistry) -> None:
        self.registry = registry
        self.send = send
        self.pending = pending  # process ids changing roles now
        self.enabled = enabled
        self.tpot_slo_s = tpot_slo_s
        self.last_move = -COOLDOWN_S
        self.moves = Counter("pdrt_controller_streams_shed", "Streams the controller asked a crowded decode worker "
                             "to send on to the one with the fewest", registry=metrics)

    def tick(self, now: float | None = None) -> int:
        """Ask the most crowded decode worker to send streams on when it should; how many it was asked for."""
        now = time.monotonic() if now is None else now
        if not self.enabled or now - self.last_move < COOLDOWN_S:
            return 0
        changing = self.pending()
        workers = [e for e in self.registry.by_role("decode") if e.process_id not in changing]
        if len(workers) < 2:
            return 0
        most = max(workers, key=lambda e: e.load.num_running)
        fewest = min(workers, key=lambda e: e.load.num_running)
        gap = most.load.num_running - fewest.load.num_running
        if (gap < max(MIN_GAP, MIN_SHARE * most.load.num_running) or most.load.step_s <= self.tpot_slo_s
                or fewest.load.step_s > self.tpot_slo_s):
            return 0
        count = gap // 2
        reason = (f"{most.process_id} holds {most.load.num_running} streams, stepping in "
                  f"{most.load.step_s * 1e3:.1f} ms; {fewest.process_id} holds {fewest.load.num_running}")
        self.send(most.identity, ShedStreams(count, reason))
        self.last_move = now
        self.moves.inc(count)
        log.info("shedding streams", process=most.process_id, count=count, reason=reason)
        return count
