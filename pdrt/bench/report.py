"""A benchmark's results for people (a table) and for programs (a JSON file).

The table has one row per rate: attainment first (what goodput is made
of), then the latency percentiles in milliseconds, then throughput. The
JSON file holds everything: the configuration, the server, each rate's
summary with every request's record (its token timestamps included, so
plots and other figures can be made later), and goodput.
"""

import json
from dataclasses import asdict
from pathlib import Path

from pdrt.bench.runner import BenchResult
from pdrt.bench.stats import Distribution, RateSummary
from pdrt.text_table import aligned


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}" if value >= 0.1 else f"{value * 1000:.1f}"


def latency_cells(d: Distribution) -> list[str]:
    """p50, p90 and p99 of a latency, in milliseconds, for a table."""
    return [_ms(d.p50), _ms(d.p90), _ms(d.p99)]


HEADER = ["rate/s", "reqs", "fail", "attain", "ttft%", "tpot%", "ttft p50", "p90", "p99", "tpot p50", "p90", "p99",
          "e2e p50", "p90", "p99", "req/s", "tok/s"]


def _row(s: RateSummary) -> list[str]:
    return [f"{s.rate:g}", str(s.num_requests), str(s.num_failed), f"{s.attainment:.1%}",
            f"{s.ttft_attainment:.0%}", f"{s.tpot_attainment:.0%}",
            *latency_cells(s.ttft), *latency_cells(s.tpot), *latency_cells(s.e2e),
            f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}"]


def format_table(result: BenchResult) -> str:
    """The rates as rows (latencies in ms), then the SLOs, any warnings and goodput."""
    lines = aligned([HEADER] + [_row(s) for s in result.summaries], right=True)
    slo = result.options.slo
    lines.append(f"SLOs: TTFT <= {slo.ttft_s * 1000:g} ms and TPOT <= {slo.tpot_s * 1000:g} ms; latencies in ms; "
                 f"{result.target.protocol} protocol, model {result.server.model}, workload "
                 f"{result.options.trace or result.options.workload}")
    for s in result.summaries:
        if s.num_in_flight_waits:
            lines.append(f"warning: at {s.rate:g}/s, {s.num_in_flight_waits} requests waited for the in-flight cap "
                         f"({result.options.max_in_flight}); the load was not fully open there")
        if s.errors:
            lines.append(f"errors at {s.rate:g}/s: " + ", ".join(f"{k} x{v}" for k, v in sorted(s.errors.items())))
    lines.append(result.goodput.describe())
    return "\n".join(lines)


def to_json(result: BenchResult) -> dict:
    options = asdict(result.options)
    target = asdict(result.target)
    target.pop("api_key", None)  # a results file gets shared; the key stays out of it
    return {"config": {"target": {**target, "protocol": result.target.protocol}, **options},
            "server": asdict(result.server), "runs": [run.to_json() for run in result.runs],
            "goodput": {**result.goodput.to_json(), "description": result.goodput.describe()}}


def write_json(result: BenchResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(result), indent=1) + "\n")
    return path
