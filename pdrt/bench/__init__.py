"""`pdrt bench`: an open-loop load generator that measures goodput the way DistServe does.

Requests of a workload (chat, code, summarization, or a trace file) are sent
at Poisson or gamma arrival times, whatever the server has finished, over
pdrt's native protocol or any OpenAI-compatible HTTP API. Each request's
TTFT, TPOT and end-to-end latency are recorded; a run at one rate gives
percentiles, SLO attainment and throughput, and a sweep of rates gives
goodput, the highest rate at which 90% of requests meet both SLOs.

From Python:

    from pdrt.bench import BenchOptions, Slo, Target, bench_rate, bench_sweep

    summary = bench_rate("tcp://127.0.0.1:7100", 2.0, BenchOptions(workload="chat", duration_s=20,
                                                                   slo=Slo(ttft_s=1.0, tpot_s=0.1)))
    result = bench_sweep(Target("http://127.0.0.1:7180/v1"), [0.5, 1, 2, 4])
    print(result.goodput.describe())

`run_sweep` is the same as a coroutine, for callers that have an event loop. For loads of their
own (chat with a stream of long prompts mixed in), open a driver with `make_driver(target)`, build
the (arrival time, lengths) list with `plan` for each part, merge them by time, and give it to
`run_rate(driver, info, options, rate, salt, requests=merged)`.
"""

from pdrt.bench.arrivals import arrival_times
from pdrt.bench.driver import ServerInfo, Target, make_driver
from pdrt.bench.goodput import Goodput, goodput
from pdrt.bench.record import RequestRecord
from pdrt.bench.runner import (
    BenchOptions,
    BenchResult,
    RateResult,
    bench_rate,
    bench_sweep,
    plan,
    run_rate,
    run_sweep,
)
from pdrt.bench.stats import Distribution, RateSummary, Slo, percentile, summarize
from pdrt.bench.trace import read_trace
from pdrt.bench.workloads import WORKLOADS, LengthLimits, RequestShape, sample_shapes

__all__ = ["WORKLOADS", "BenchOptions", "BenchResult", "Distribution", "Goodput", "LengthLimits", "RateResult",
           "RateSummary", "RequestRecord", "RequestShape", "ServerInfo", "Slo", "Target", "arrival_times",
           "bench_rate", "bench_sweep", "goodput", "make_driver", "percentile", "plan", "read_trace", "run_rate",
           "run_sweep", "sample_shapes", "summarize"]
