"""Figures of one run: latency percentiles, SLO attainment and throughput.

A request *attains* the SLOs when its TTFT and its TPOT are both within
them; a failed request never does, and counts in the denominator, so a
server cannot raise its attainment by refusing work. Percentiles are over
the requests that succeeded, interpolated linearly between ranks (numpy's
default).
"""

from collections import Counter
from dataclasses import asdict, dataclass

from pdrt.bench.record import RequestRecord
from pdrt.errors import ConfigError


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, linear between closest ranks; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True, frozen=True)
class Slo:
    """Latency objectives in seconds: time to first token, and time per output token after it."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ConfigError(f"SLOs must be > 0, got TTFT {self.ttft_s} s and TPOT {self.tpot_s} s")

    def is_met(self, record: RequestRecord) -> bool:
        ttft, tpot = record.ttft_s, record.tpot_s
        return ttft is not None and tpot is not None and ttft <= self.ttft_s and tpot <= self.tpot_s


@dataclass(slots=True, frozen=True)
class Distribution:
    """p50, p90, p99 and mean of one latency, in seconds (None when no request succeeded)."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Distribution":
        mean = sum(values) / len(values) if values else None
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)


@dataclass(slots=True, frozen=True)
class RateSummary:
    """Everything one run at one request rate measured, but the per-request records."""

    rate: float  # the offered load, requests/s
    num_requests: int
    num_ok: int
    num_failed: int
    errors: dict[str, int]
    attainment: float  # both SLOs
    ttft_attainment: float
    tpot_attainment: float
    ttft: Distribution
    tpot: Distribution
    e2e: Distribution
    itl: Distribution
    duration_s: float  # first due to last done
    request_throughput: float  # requests that succeeded, per second
    output_throughput: float  # their output tokens, per second
    num_in_flight_waits: int  # requests that waited for the in-flight cap (the load was not fully open)
    max_send_lag_s: float

    def to_json(self) -> dict:
        return asdict(self)


def _share(count: int, total: int) -> float:
    return count / total if total else 0.0


def summarize(records: list[RequestRecord], rate: float, slo: Slo, num_in_flight_waits: int = 0) -> RateSummary:
    ok = [r for r in records if r.ok]
    total = len(records)
    starts = [r.due_s for r in records]
    ends = [r.done_s for r in records if r.done_s is not None]
    duration = max(ends) - min(starts) if ends and starts else 0.0
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    lags = [r.send_lag_s for r in records if r.send_lag_s is not None]
    return RateSummary(
        rate=rate, num_requests=total, num_ok=len(ok), num_failed=total - len(ok),
        errors=dict(Counter(r.error or "unfinished" for r in records if not r.ok)),
        attainment=_share(sum(slo.is_met(r) for r in ok), total),
        ttft_attainment=_share(sum(t <= slo.ttft_s for t in ttfts), total),
        tpot_attainment=_share(sum(t <= slo.tpot_s for t in tpots), total),
        ttft=Distribution.of(ttfts), tpot=Distribution.of(tpots),
        e2e=Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itls_s]),
        duration_s=duration,
        request_throughput=_share(len(ok), duration) if duration > 0 else 0.0,
        output_throughput=_share(sum(r.num_output_tokens for r in ok), duration) if duration > 0 else 0.0,
        num_in_flight_waits=num_in_flight_waits, max_send_lag_s=max(lags, default=0.0))
