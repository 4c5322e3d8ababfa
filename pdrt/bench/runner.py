"""The open loop: send each request at its arrival time, whatever the server has finished.

A closed loop (send the next request when one finishes) lets a slow server
slow its own load down, and hides the queueing that an SLO is about. Here
every request is an asyncio task started at its arrival time; the only
brake is `max_in_flight`, a safety valve against exhausting the client's
sockets and memory, and a run that hits it says so (`num_in_flight_waits`),
since its load was then no longer fully open.

Life of a run at one rate: plan the requests (lengths from the workload or
trace, arrival times from the arrival process), give the driver fresh prompt
content, start one task per request at its time, wait for all, summarize.
A sweep is runs at several rates over one connection, then goodput.
"""

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdrt.bench.arrivals import arrival_times, rescale_times
from pdrt.bench.driver import Driver, ServerInfo, Target, make_driver
from pdrt.bench.goodput import DEFAULT_TARGET, Goodput, goodput
from pdrt.bench.record import RequestRecord
from pdrt.bench.stats import RateSummary, Slo, summarize
from pdrt.bench.trace import read_trace
from pdrt.bench.workloads import LengthLimits, RequestShape, sample_shapes
from pdrt.errors import ConfigError

PAUSE_BETWEEN_RATES_S = 1.0  # lets the server settle (free KV, finish cancels) before the next rate


@dataclass(slots=True)
class BenchOptions:
    """What to send and how to judge it. The number of requests at a rate is `num_requests`, else
    rate × `duration_s`; a trace replays as recorded unless a rate is given, which rescales its times."""

    workload: str = "chat"
    trace: str | None = None
    num_requests: int | None = None
    duration_s: float = 30.0
    arrival: str = "poisson"
    cv: float = 1.0
    seed: int = 0
    slo: Slo = field(default_factory=lambda: Slo(1.0, 0.1))
    attainment_target: float = DEFAULT_TARGET
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_context: int | None = None
    max_model_len: int | None = None  # for servers that do not say
    max_in_flight: int = 256
    prompt_salt: str | None = None  # None: fresh prompt content each invocation (no prefix-cache hits across runs)

    def limits(self, info: ServerInfo) -> LengthLimits:
        max_len = self.max_model_len or info.max_model_len
        if not max_len:
            raise ConfigError("the server does not say its context length; give --max-model-len")
        return LengthLimits(max_len, self.length_scale, self.max_input_tokens, self.max_output_tokens,
                            self.max_context)


@dataclass(slots=True)
class RateResult:
    summary: RateSummary
    records: list[RequestRecord]

    def to_json(self) -> dict:
        return {"summary": self.summary.to_json(), "records": [r.to_json() for r in self.records]}


@dataclass(slots=True)
class BenchResult:
    target: Target
    server: ServerInfo
    options: BenchOptions
    runs: list[RateResult]
    goodput: Goodput

    @property
    def summaries(self) -> list[RateSummary]:
        return [run.summary for run in self.runs]


def plan(options: BenchOptions, rate: float | None, limits: LengthLimits) -> list[tuple[float, RequestShape]]:
    """(arrival time, lengths) of every request of a run at `rate` (None: a trace as recorded)."""
    if options.trace is not None:
        rows = read_trace(options.trace)[:options.num_requests]
        times = [row.arrival_s - rows[0].arrival_s for row in rows]
        shapes = [RequestShape(*limits.fit(r.shape.input_tokens, r.shape.output_tokens), r.shape.conversation)
                  for r in rows]
        return list(zip(times if rate is None else rescale_times(times, rate), shapes, strict=True))
    if rate is None:
        raise ConfigError("a synthetic workload needs a request rate")
    num = options.num_requests or max(1, round(rate * options.duration_s))
    times = arrival_times(num, rate, options.seed, options.arrival, options.cv)
    return list(zip(times, sample_shapes(options.workload, num, limits, options.seed), strict=True))


async def run_rate(driver: Driver, info: ServerInfo, options: BenchOptions, rate: float | None, salt: str,
                   on_done: Callable[[RequestRecord], None] | None = None,
                   requests: list[tuple[float, RequestShape]] | None = None) -> RateResult:
    """One open-loop run at `rate` over an opened driver.

    `requests` replaces the planned ones (arrival time, lengths), so a caller can mix loads, such as
    chat with a stream of long prompts; records keep their index in that list.
    """
    requests = plan(options, rate, options.limits(info)) if requests is None else requests
    driver.set_prompts(options.seed, salt)
    slots = asyncio.Semaphore(options.max_in_flight)
    records = [RequestRecord(i, t, s.input_tokens, s.output_tokens, s.conversation)
               for i, (t, s) in enumerate(requests)]
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def one(index: int, shape: RequestShape) -> None:
        try:
            await driver.send(index, shape, records[index], clock)
        finally:
            slots.release()
            if on_done is not None:
                on_done(records[index])

    tasks, num_waits = [], 0
    for index, (due, shape) in enumerate(requests):
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots.locked():
            num_waits += 1
        await slots.acquire()
        tasks.append(asyncio.create_task(one(index, shape)))
    await asyncio.gather(*tasks)
    offered = rate if rate is not None else _trace_rate(requests)
    return RateResult(summarize(records, offered, options.slo, num_waits), records)


def _trace_rate(requests: list[tuple[float, RequestShape]]) -> float:
    span = requests[-1][0] - requests[0][0]
    return (len(requests) - 1) / span if span > 0 else 0.0


async def run_sweep(target: Target, rates: list[float | None], options: BenchOptions,
                    on_rate_start: Callable[[float | None, int], Callable[[RequestRecord], None] | None]
                    | None = None) -> BenchResult:
    """Runs at each rate (in the order given) over one connection, and goodput from their attainment.

    `on_rate_start(rate, num_requests)` may return a callback for each finished request (a progress bar).
    """
    if not rates:
        raise ConfigError("no request rate to run")
    driver = make_driver(target)
    salt = options.prompt_salt if options.prompt_salt is not None else secrets.token_hex(4)
    runs = []
    try:
        info = await driver.open()
        limits = options.limits(info)
        for i, rate in enumerate(rates):
            if i:
                await asyncio.sleep(PAUSE_BETWEEN_RATES_S)
            on_done = on_rate_start(rate, len(plan(options, rate, limits))) if on_rate_start else None
            runs.append(await run_rate(driver, info, options, rate, f"{salt}:{i}", on_done))
    finally:
        await driver.close()
    points = [(run.summary.rate, run.summary.attainment) for run in runs]
    return BenchResult(target, info, options, runs, goodput(points, options.attainment_target))


def bench_rate(target: Target | str, rate: float, options: BenchOptions | None = None) -> RateSummary:
    """One run at `rate` against a server (a Target, or just its address); blocks, and returns the summary.

    For scripts: `bench_rate("tcp://127.0.0.1:7100", 2.0, BenchOptions(workload="chat", duration_s=20))`.
    """
    target = Target(target) if isinstance(target, str) else target
    result = asyncio.run(run_sweep(target, [rate], options or BenchOptions()))
    return result.runs[0].summary


def bench_sweep(target: Target | str, rates: list[float], options: BenchOptions | None = None) -> BenchResult:
    """Runs at every rate against a server, blocking; the result holds summaries, records and goodput."""
    target = Target(target) if isinstance(target, str) else target
    return asyncio.run(run_sweep(target, list(rates), options or BenchOptions()))
