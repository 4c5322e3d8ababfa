"""Predicted latencies, SLO attainment and goodput of a deployment, from simulated runs of pdrt bench's loads.

A run at one rate simulates exactly the requests `pdrt bench` would send at
that rate (the same workload, seed, lengths and arrival times), and its
figures come from the same summary code, so a prediction and a measurement
compare figure by figure. Goodput is read off a ladder of simulated rates as
`pdrt bench` reads it off measured ones (pdrt.bench.goodput).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdrt.bench.goodput import DEFAULT_TARGET, Goodput, goodput
from pdrt.bench.record import RequestRecord
from pdrt.bench.runner import BenchOptions, plan
from pdrt.bench.stats import RateSummary, summarize
from pdrt.bench.workloads import LengthLimits, RequestShape
from pdrt.planner.cost_model import CostModel
from pdrt.planner.simulator import Deployment, Overheads, Simulation

MIN_REQUESTS = 10
LADDER_PRECISION = 1.03  # bisect until the last rate that met the target and the first that missed are this close
MAX_RATE_STEPS = 40
NO_OVERHEADS = Overheads()


@dataclass(slots=True)
class Prediction:
    deployment: Deployment
    goodput: Goodput
    runs: list[RateSummary]  # every simulated rate, in the order simulated

    def at(self, rate: float) -> RateSummary | None:
        return next((r for r in self.runs if abs(r.rate - rate) < 1e-9), None)


def simulate(model: CostModel, deployment: Deployment, cores: int, requests: list[tuple[float, RequestShape]],
             options: BenchOptions, rate: float, overheads: Overheads = NO_OVERHEADS,
             held: Sequence[Sequence[tuple[int, int]]] = ()) -> RateSummary:
    """The summary `pdrt bench` would print for these requests, had the node served them as simulated (with
    `held`, Simulation.run's, judged by the pace of the tokens they have left)."""
    records = simulated_records(model, deployment, cores, requests, options, overheads, held)
    return summarize(records, rate, options.slo)


def simulated_records(model: CostModel, deployment: Deployment, cores: int,
                      requests: list[tuple[float, RequestShape]], options: BenchOptions,
                      overheads: Overheads = NO_OVERHEADS, held: Sequence[Sequence[tuple[int, int]]] = ()
                      ) -> list[RequestRecord]:
    """The record `pdrt bench` would keep of each of `requests`, in their order, had the node served them as
    simulated."""
    served = Simulation(model, deployment, cores, overheads, options.slo.ttft_s).run(requests, held)
    records = []
    for req in served:
        record = RequestRecord(req.index, req.arrival, req.shape.input_tokens, req.shape.output_tokens,
                               req.shape.conversation)
        record.sent(req.arrival)
        if req.finished is not None and req.first_token is not None:
            record.tokens(1, req.first_token)
            record.finish(req.finished, req.shape.output_tokens)
        records.append(record)
    return records


def requests_at(options: BenchOptions, rate: float, limits: LengthLimits) -> list[tuple[float, RequestShape]]:
    """The requests a goodput ladder sends at `rate` (scripts/bench_goodput.py: at least MIN_REQUESTS)."""
    count = max(MIN_REQUESTS, round(rate * options.duration_s))
    return plan(replace(options, num_requests=count), rate, limits)


def predict(model: CostModel, deployment: Deployment, cores: int, options: BenchOptions, limits: LengthLimits,
            overheads: Overheads = NO_OVERHEADS, start_rate: float = 1.0,
            target: float = DEFAULT_TARGET) -> Prediction:
    """Goodput of `deployment`: rates doubling from `start_rate` until attainment misses `target` (or halving
    until it meets it), then bisected geometrically until the bracket is within LADDER_PRECISION."""
    runs: list[RateSummary] = []

    def attained(rate: float) -> bool:
        summary = simulate(model, deployment, cores, requests_at(options, rate, limits), options, rate, overheads)
        runs.append(summary)
        return summary.attainment >= target

    passed, missed, rate = None, None, start_rate
    for _ in range(MAX_RATE_STEPS):
        if attained(rate):
            passed = rate
            if missed is not None:
                break
            rate *= 2
        else:
            missed = rate
            if passed is not None:
                break
            rate /= 2
            if rate < start_rate / 1024:
                break
    while passed is not None and missed is not None and missed / passed > LADDER_PRECISION:
        rate = (passed * missed) ** 0.5
        if attained(rate):
            passed = rate
        else:
            missed = rate
    return Prediction(deployment, goodput([(r.rate, r.attainment) for r in runs], target), runs)
