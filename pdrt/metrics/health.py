"""The health indices (docs/architecture.md, Metrics), as plain functions of what each one is computed from.

* PSI, prefill stability = mean / std of recent prefill times (target > 8):
  a prefill worker whose prefills take predictably long;
* DS, decoding smoothness = std / mean of the last 10 decode step latencies
  (target < 0.15): streams that do not stutter;
* KE, handoff efficiency = successful KV transfers / completed prefills
  (target > 0.999);
* ETOP = output tokens of requests that met their SLOs per worker-hour.

An index with too little data to mean anything is NaN, never a flattering
default; a perfectly steady PSI (std 0) is +Inf.
"""

import math
import statistics
from collections.abc import Sequence

PSI_TARGET = 8.0
DS_TARGET = 0.15
KE_TARGET = 0.999
DS_WINDOW = 10  # decode steps
PSI_WINDOW = 100  # prefills


def prefill_stability(prefill_times: Sequence[float]) -> float:
    if len(prefill_times) < 2:
        return math.nan
    mean, std = statistics.fmean(prefill_times), statistics.pstdev(prefill_times)
    return math.inf if std == 0 else mean / std


def decoding_smoothness(step_latencies: Sequence[float]) -> float:
    if len(step_latencies) < 2:
        return math.nan
    mean = statistics.fmean(step_latencies)
    return math.nan if mean <= 0 else statistics.pstdev(step_latencies) / mean


def handoff_efficiency(num_succeeded: float, num_failed: float, num_expired: float) -> float:
    """Completed prefills are the handoffs that were settled: pulled, failed, or expired unacknowledged.

    Handoffs still in flight are left out (they would read as failures under
    load), and so are those whose request was cancelled before the pull.
    """
    settled = num_succeeded + num_failed + num_expired
    return math.nan if settled <= 0 else num_succeeded / settled


def effective_output_tokens_per_worker_hour(num_slo_tokens: float, worker_seconds: float) -> float:
    return math.nan if worker_seconds <= 0 else num_slo_tokens / (worker_seconds / 3600.0)
