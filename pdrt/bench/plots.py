"""PNG plots of a benchmark: latency CDFs per rate, and SLO attainment against rate.

The CDFs show what a percentile table hides (a long tail, two modes); the
SLO is drawn on them as a vertical line, so the share of requests left of
it can be read off. The attainment plot marks the target and the goodput
read off the curve. matplotlib (the `bench` extra) is imported here only,
with the Agg backend, so the benchmark runs without a display and without
matplotlib when no plot is asked for.
"""

from pathlib import Path

from pdrt.bench.runner import BenchResult
from pdrt.errors import ConfigError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'pdrt[bench]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(result: BenchResult, path: str | Path) -> Path:
    """TTFT, TPOT and end-to-end latency CDFs side by side, one line per rate."""
    plt = _pyplot()
    slo = result.options.slo
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("TTFT", lambda r: r.ttft_s, slo.ttft_s), ("TPOT", lambda r: r.tpot_s, slo.tpot_s),
              ("end-to-end latency", lambda r: r.e2e_s, None)]
    for ax, (name, value, limit) in zip(axes, panels, strict=True):
        for run in result.runs:
            values = sorted(v * 1000 for v in map(value, run.records) if v is not None)
            if values:
                shares = [(i + 1) / len(run.records) for i in range(len(values))]  # failures never reach 1
                ax.step(values, shares, where="post", label=f"{run.summary.rate:g} req/s")
        if limit is not None:
            ax.axvline(limit * 1000, color="black", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result.server.model}: latency CDFs ({result.options.trace or result.options.workload})")
    return _save(fig, plt, path)


def plot_attainment(result: BenchResult, path: str | Path) -> Path:
    """Attainment (both SLOs, and each alone) against rate, with the target and goodput marked."""
    plt = _pyplot()
    summaries = sorted(result.summaries, key=lambda s: s.rate)
    rates = [s.rate for s in summaries]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(rates, [s.attainment * 100 for s in summaries], "o-", label="both SLOs")
    ax.plot(rates, [s.ttft_attainment * 100 for s in summaries], "s--", alpha=0.6, label="TTFT SLO")
    ax.plot(rates, [s.tpot_attainment * 100 for s in summaries], "^--", alpha=0.6, label="TPOT SLO")
    target = result.goodput.target * 100
    ax.axhline(target, color="gray", linestyle=":", label=f"{target:.0f}% target")
    if result.goodput.rate > 0:
        label = (">= " if result.goodput.bound == "at_least" else "") + f"{result.goodput.rate:.3g}"
        ax.axvline(result.goodput.rate, color="red", linestyle=":", label=f"goodput {label}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{result.server.model}: attainment against rate")
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: BenchResult, prefix: str | Path) -> list[Path]:
    """`<prefix>-cdf.png` and `<prefix>-attainment.png`."""
    prefix = str(prefix)
    return [plot_latency_cdfs(result, prefix + "-cdf.png"), plot_attainment(result, prefix + "-attainment.png")]
