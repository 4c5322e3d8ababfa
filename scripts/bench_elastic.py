"""A prefill:decode balance that follows the load: the balancer against every static split, in one run.

Three workers of one node serve a load at a fixed rate whose mix shifts: prefill-heavy (long prompts, short
answers), then decode-heavy (short prompts, long answers), then prefill-heavy again, --phase-s seconds each.
Each worker stands for a device of its own: it computes with one thread and borrows no idle worker's (the
simulator models no lending either). The same requests (same arrival times, lengths and seeds) go to each of
these in turn, each repeat starting with the next:

  * each static split of the three workers: 1 prefill + 2 decode (pdrt's default shape, "default") and
    2 prefill + 1 decode, with the balancer off;
  * the default split with the balancer on ([controller] balance, interval --interval), starting as 1P+2D.

The rate and the decode-heavy answers' length are found first, on this host, unless --rate and --long-answer
give them: each phase's load within what the split made for it serves with room to spare (2P+1D for the
prefill-heavy load, 1P+2D for the decode-heavy one; calibrate). A node whose balance follows the load can then
serve the whole run; each static split serves one kind of phase and is past its capacity in the other
(calibration logs whether it is: each split's attainment of the other phase's load alone).

Per system: SLO attainment over the whole run and per phase, TTFT p95, and the role changes it made. The
balancer reads this host's profile of the model (`pdrt profile`, measured first unless --profile gives one).
`pdrt plan`'s simulator predicts the attainment of each static split over the same requests; the error of
each prediction is printed. The host's speed drifts by tens of percent within an hour, which moves a node at
its knee by tens of points of attainment: a prompt and a decode step are timed in this process just before and
just after each static run (SpeedProbe), and each prediction is made both from the profile as measured and
from the profile scaled to the host's speed around the run. --repeats runs everything again with other seeds;
figures are medians.

The model is a random Llama of 29 M parameters (`--model wider`, the default: hidden 768, 4 layers): its
decode step costs mostly the reading of its weights while each stream adds a good part of that, as on a GPU,
and a token costs the decode worker five times what it costs the gateway and the client together. With the
7.7 M one (`--model wide`) a step is mostly fixed cost and a token costs the decode worker three times what
it costs them: on two cores a second decode worker then adds little, and 2P+1D holds most decode-heavy loads
that 1P+2D holds. The tiny test model's steps are bound by Python (`--model tiny`).

Last line: `elastic dynamic_vs_best_static=X dynamic_vs_default=Y ttft_p95_cut=Z flip_ms=W plan_error=V`:
X and Y ratios of SLO attainment over the whole run, Z the relative cut of TTFT p95 against the default
split, W the median time from a role change's decision to the worker serving its new role, V the largest
relative error of the predicted attainments at the host's speed around each run (the error of those from the
profile as measured is printed on the line before).
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_goodput import log, resolve_model  # noqa: E402

from pdrt.bench import BenchOptions, Slo, Target, make_driver, percentile, run_rate  # noqa: E402
from pdrt.bench.record import RequestRecord  # noqa: E402
from pdrt.bench.stats import summarize  # noqa: E402
from pdrt.bench.workloads import RequestShape  # noqa: E402
from pdrt.planner.predict import simulated_records  # noqa: E402
from pdrt.planner.profile import Profile, SpeedProbe, default_profile_path, profile_model  # noqa: E402
from pdrt.planner.simulator import Deployment  # noqa: E402
from pdrt.testing.node import Node, free_port  # noqa: E402

PHASES = ("prefill-heavy", "decode-heavy", "prefill-heavy")
RATE_LADDER = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0)
# The decode-heavy answers' mean tokens: calibration picks one (calibrate); with --long-answer, none.
ANSWER_LADDER = (300, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1400, 1600)
CALIBRATION_ATTAINMENT = 0.9  # the split made for a phase holds its load
# The load offered against the highest that holds: the balancer's changes take seconds, a split at its knee never
# drains what built up meanwhile, and the host's speed drifts by tens of percent within minutes.
ROOM = 0.85
SYSTEMS = {"default": (1, 2, False), "2p1d": (2, 1, False), "balancer": (1, 2, True)}
# Each worker a device of its own: one thread, none borrowed, prompts not niced below decode steps (they would not
# share a device).
DEVICES = {"prefill_threads": 1, "decode_threads": 1, "borrow_threads": False, "prefill_nice": 0}
DEFAULT_POOL = {"kv_cache_bytes": 0}  # the pool `pdrt up` gives a worker, not the test harness's small one


def shape_of(phase: str, rng: random.Random, lengths: tuple[int, int, int, int]) -> RequestShape:
    """A prefill-heavy request (a long prompt, a short answer) or a decode-heavy one (a short prompt, a long
    answer), each length within 20% of its mean; `lengths` are the means (long prompt, short answer, short
    prompt, long answer)."""
    long_prompt, short_answer, short_prompt, long_answer = lengths

    def around(mean: int) -> int:
        return rng.randint(mean * 4 // 5, mean * 6 // 5)

    if phase == "prefill-heavy":
        return RequestShape(around(long_prompt), around(short_answer))
    return RequestShape(around(short_prompt), around(long_answer))


def workload(rate: float, phase_s: float, seed: int, lengths: tuple[int, int, int, int],
             phases: tuple[str, ...] = PHASES) -> list[tuple[float, RequestShape, int]]:
    """(arrival s, lengths, phase index) of every request: rate x phase_s requests a phase, at times drawn
    uniformly over it (Poisson arrivals at `rate` given their number). A phase's count then does not vary with
    the seed: over 40 s at 1.5 requests/s a Poisson count varies by 13%, and at a knee a tenth more load is tens
    of points of attainment."""
    rng = random.Random(f"elastic:{seed}")
    requests = []
    for index, phase in enumerate(phases):
        for at in sorted(rng.uniform(0, phase_s) for _ in range(round(rate * phase_s))):
            requests.append((index * phase_s + at, shape_of(phase, rng, lengths), index))
    return requests


async def drive(address: str, requests: list[tuple[float, RequestShape]], slo: Slo, seed: int
                ) -> list[RequestRecord]:
    driver = make_driver(Target(address))
    info = await driver.open()
    try:
        options = BenchOptions(slo=slo, seed=seed, max_model_len=info.max_model_len, max_in_flight=4096)
        run = await run_rate(driver, info, options, None, f"elastic:{seed}", requests=requests)
    finally:
        await driver.close()
    return run.records


def system_node(workdir: Path, model: str, name: str, slo: Slo, interval_s: float | None = None) -> Node:
    """A node of the split SYSTEMS[name] names, with its balancer when that system has one (`interval_s`: the
    balancer's interval, left to the default when None)."""
    prefill, decode, balance = SYSTEMS[name]
    controller = {"balance": balance, "metrics_port": free_port()}
    if interval_s is not None:
        controller["balance_interval_s"] = interval_s
    return Node(workdir, model, engine=DEFAULT_POOL, extra={
        "prefill": {"count": prefill}, "decode": {"count": decode},
        "gateway": {"ttft_slo_s": slo.ttft_s, "tpot_slo_s": slo.tpot_s, "http_port": 0},
        "controller": controller,
        "experimental": DEVICES}, ready_timeout_s=180)


def warm_up(address: str, seed: int) -> None:
    """A few short requests first: a process's first forward passes are slow."""
    asyncio.run(drive(address, [(0.05 * i, RequestShape(64, 8)) for i in range(5)], Slo(60, 60), seed))


def run_system(workdir: Path, model: str, name: str, requests, slo: Slo, interval_s: float, seed: int) -> dict:
    node = system_node(workdir, model, name, slo, interval_s)
    with node:
        warm_up(node.address, seed + 999)
        records = asyncio.run(drive(node.address, [(t, s) for t, s, _ in requests], slo, seed))
        flips = node.role_changes_ms()
    whole = summarize(records, 0.0, slo)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    result = {"attainment": whole.attainment, "phases": phase_attainment(records, requests, slo),
              "ttft_p95": percentile(ttfts, 95), "flips_ms": flips, "failed": whole.num_failed}
    log(f"{name}: attainment {whole.attainment:.1%} (phases {phase_figures(result, 'measured')}), "
        + f"TTFT p95 {1e3 * (result['ttft_p95'] or 0):.0f} ms, {len(flips)} role changes "
        + (f"({', '.join(f'{f:.0f}' for f in flips)} ms)" if flips else "") + f", {whole.num_failed} failed")
    return result


def phase_attainment(records: list[RequestRecord], requests, slo: Slo) -> list[float]:
    """The SLO attainment of the requests of each phase (`records` in the order of `requests`)."""
    return [summarize([r for r, (_, _, p) in zip(records, requests, strict=True) if p == i], 0.0, slo).attainment
            for i in range(len(PHASES))]


def phase_figures(result: dict, kind: str) -> str:
    """A system's attainment per phase, as measured or as predicted ("predicted", "anchored")."""
    key = "phases" if kind == "measured" else f"{kind}_phases"
    return ", ".join(f"{a:.0%}" for a in result[key])


def calibrate(workdir: Path, model: str, slo: Slo, phase_s: float, seed: int,
              lengths: tuple[int, int, int, int]) -> tuple[float, int]:
    """The rate to offer and the decode-heavy answers' mean length, found on this host at the start of the run
    (a fixed load swings every system's attainment as the host's speed drifts): each phase's load within what
    the split made for it serves, with room to spare.

    The rate: the highest rung of RATE_LADDER within ROOM of the highest at which 2P+1D attains
    CALIBRATION_ATTAINMENT of a run of the prefill-heavy load alone, as long as a phase. The answers: the
    longest of ANSWER_LADDER within ROOM of the longest at which 1P+2D attains as much of the decode-heavy load
    alone at that rate. Each is bisected over its ladder (a few runs rather than one per rung). Each split then
    serves the other phase's load alone, and the log says whether it fails it, as the benchmark's premise has
    it."""
    long_prompt, short_answer, short_prompt, _ = lengths
    node = system_node(workdir / "calibration-2p1d", model, "2p1d", slo)
    with node:
        warm_up(node.address, seed)
        rate = with_room(RATE_LADDER, highest_holding(RATE_LADDER, lambda r: holds_alone(
            node.address, "2p1d", "prefill-heavy", phase_s, seed + 500, lengths, slo, r)))
    node = system_node(workdir / "calibration-default", model, "default", slo)
    with node:
        warm_up(node.address, seed)
        longest = highest_holding(ANSWER_LADDER, lambda a: holds_alone(
            node.address, "default", "decode-heavy", phase_s, seed + 500,
            (long_prompt, short_answer, short_prompt, a), slo, rate))
        lengths = (long_prompt, short_answer, short_prompt, round(with_room(ANSWER_LADDER, longest)))
        holds_alone(node.address, "default", "prefill-heavy", phase_s, seed + 500, lengths, slo, rate)
    node = system_node(workdir / "calibration-2p1d-decode", model, "2p1d", slo)
    with node:
        warm_up(node.address, seed)
        holds_alone(node.address, "2p1d", "decode-heavy", phase_s, seed + 500, lengths, slo, rate)
    return rate, lengths[3]


def holds_alone(address: str, name: str, phase: str, phase_s: float, seed: int, lengths: tuple[int, int, int, int],
                slo: Slo, rate: float) -> bool:
    """Whether node `name` at `address` attains CALIBRATION_ATTAINMENT of `phase`'s load alone at `rate`."""
    requests = workload(rate, phase_s, seed, lengths, (phase,))
    records = asyncio.run(drive(address, [(t, s) for t, s, _ in requests], slo, seed))
    attainment = summarize(records, 0.0, slo).attainment
    answers = f", answers of ~{lengths[3]} tokens" if phase == "decode-heavy" else ""
    log(f"calibration: {rate:g} req/s of the {phase} load{answers}, {name} attains {attainment:.0%}")
    return attainment >= CALIBRATION_ATTAINMENT


def with_room(ladder: tuple[float, ...], held: int) -> float:
    """The highest rung of `ladder` within ROOM of its rung `held` (the lowest rung when none is)."""
    return max((r for r in ladder if r <= ROOM * ladder[held]), default=ladder[0])


def highest_holding(rates: tuple[float, ...], holds) -> int:
    """The index of the highest of the ascending `rates` for which `holds(rate)`, found by bisection (a rate
    that holds is taken to mean every lower one does); 0 when none holds."""
    held, failed = -1, len(rates)
    while failed - held > 1:
        middle = (held + failed) // 2
        if holds(rates[middle]):
            held = middle
        else:
            failed = middle
    return max(held, 0)


def predicted_attainment(profile: Profile, name: str, requests, slo: Slo, speed: tuple[float, float] = (1.0, 1.0)
                         ) -> tuple[float, list[float]]:
    """What the simulator predicts of system `name` over `requests`, over the whole run and per phase, with
    prompts and decode steps `speed` times as long as the profile says (and what serving adds to them as long
    as the decode steps)."""
    prefill, decode, _ = SYSTEMS[name]
    deployment = Deployment(prefill=prefill, decode=decode, prefill_nice=DEVICES["prefill_nice"])
    records = simulated_records(profile.cost_model().slower(*speed), deployment, os.cpu_count() or 2,
                                [(t, s) for t, s, _ in requests], BenchOptions(slo=slo),
                                profile.serving_overheads().slower(speed[1]))
    return summarize(records, 0.0, slo).attainment, phase_attainment(records, requests, slo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wider", help="checkpoint directory, 'wider' (default), 'wide' or "
                        "'tiny'")
    parser.add_argument("--profile", help="a saved profile of the model on this host (default: measure one)")
    parser.add_argument("--rate", type=float, help="requests/s throughout (default: found on this host, see "
                        "calibrate_rate)")
    parser.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase (default 40)")
    parser.add_argument("--interval", type=float, default=3.0, help="the balancer's interval, s (default 3)")
    parser.add_argument("--ttft-slo", type=float, default=1.5)
    parser.add_argument("--tpot-slo", type=float, default=0.012)
    parser.add_argument("--long-prompt", type=int, default=1400, help="prefill-heavy prompts' mean tokens")
    parser.add_argument("--short-answer", type=int, default=16, help="prefill-heavy answers' mean tokens")
    parser.add_argument("--short-prompt", type=int, default=64, help="decode-heavy prompts' mean tokens")
    parser.add_argument("--long-answer", type=int, help="decode-heavy answers' mean tokens (default: found on "
                        "this host with the rate, see calibrate)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=100, help="of the first repeat; the next ones count up")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", default="bench-results/elastic")
    args = parser.parse_args()
    names = args.systems.split(",")
    lengths = (args.long_prompt, args.short_answer, args.short_prompt, args.long_answer)
    workdir = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    os.environ["PDRT_CACHE_DIR"] = str(workdir / "cache")  # where the nodes' balancers find the profile
    model, model_name = resolve_model(args.model, workdir)
    profile = Profile.load(Path(args.profile)) if args.profile else profile_model(model, log=log)
    profile.save(default_profile_path(model))
    slo = Slo(args.ttft_slo, args.tpot_slo)
    probe = SpeedProbe(model, profile)
    if args.rate is None or args.long_answer is None:
        if args.rate is not None or args.long_answer is not None:
            parser.error("--rate and --long-answer go together: each is calibrated for the other")
        args.rate, args.long_answer = calibrate(workdir, model, slo, args.phase_s, args.seed, lengths)
        lengths = lengths[:3] + (args.long_answer,)
    print(f"bench_elastic: model {model_name}; {os.cpu_count()} cores; {args.rate:g} req/s; phases "
          f"{' -> '.join(PHASES)}, {args.phase_s:g} s each; prompts/answers {lengths[0]}/{lengths[1]} then "
          f"{lengths[2]}/{lengths[3]} tokens; SLOs TTFT {slo.ttft_s * 1e3:g} ms, TPOT "
          f"{slo.tpot_s * 1e3:g} ms; balancer interval {args.interval:g} s", flush=True)

    results: dict[str, list[dict]] = {n: [] for n in names}
    errors: dict[str, list[float]] = {"profile": [], "anchored": []}
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        requests = workload(args.rate, args.phase_s, seed, lengths)
        # Each repeat starts with the next system: the host drifts within minutes, and no system keeps one slot.
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            before = None if SYSTEMS[name][2] else probe.factors()  # the balancer's runs are not predicted
            result = run_system(workdir, model, name, requests, slo, args.interval, seed)
            if before is not None:
                after = probe.factors()
                speed = ((before[0] * after[0]) ** 0.5, (before[1] * after[1]) ** 0.5)
                result["predicted"], result["predicted_phases"] = predicted_attainment(profile, name, requests, slo)
                result["anchored"], result["anchored_phases"] = predicted_attainment(profile, name, requests, slo,
                                                                                     speed)
                result["speed"] = speed
                for kind, key in (("profile", "predicted"), ("anchored", "anchored")):
                    if result["attainment"] > 0:
                        errors[kind].append(abs(result[key] / result["attainment"] - 1))
                log(f"{name}: predicted attainment {result['predicted']:.1%} ({phase_figures(result, 'predicted')}); "
                    f"at the host's speed around the run (prompts x{speed[0]:.2f}, decode steps x{speed[1]:.2f} "
                    f"the profile's) {result['anchored']:.1%} ({phase_figures(result, 'anchored')})")
            results[name].append(result)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] or 0.0 for r in results[name])

    def phase_medians(name: str, key: str) -> str:
        if key not in results[name][0]:
            return ""
        return " ".join(f"{statistics.median(r[key][i] for r in results[name]):.0%}" for i in range(len(PHASES)))

    print(f"{'system':<10}{'attainment':>11}{'predicted':>10}{'anchored':>10}{'TTFT p95 ms':>13}   "
          f"{'per phase':<14}anchored per phase")
    for name in names:
        predicted = [f"{median(name, key):.1%}" if key in results[name][0] else "" for key in ("predicted",
                                                                                                "anchored")]
        print(f"{name:<10}{median(name, 'attainment'):>11.1%}{predicted[0]:>10}{predicted[1]:>10}"
              f"{1e3 * median(name, 'ttft_p95'):>13.0f}   {phase_medians(name, 'phases'):<14}"
              f"{phase_medians(name, 'anchored_phases')}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "elastic.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if not {"default", "2p1d", "balancer"} <= set(names):
        return
    dynamic = median("balancer", "attainment")
    best_static = max(median("default", "attainment"), median("2p1d", "attainment"))
    default = median("default", "attainment")
    cut = 1 - median("balancer", "ttft_p95") / median("default", "ttft_p95")
    flips = [f for r in results["balancer"] for f in r["flips_ms"]]
    print(f"plan_error from the profile as measured: {max(errors['profile'], default=float('nan')):.2f}")
    print(f"elastic dynamic_vs_best_static={dynamic / best_static:.2f} dynamic_vs_default={dynamic / default:.2f} "
          f"ttft_p95_cut={cut:.2f} flip_ms={statistics.median(flips) if flips else float('nan'):.0f} "
          f"plan_error={max(errors['anchored'], default=float('nan')):.2f}")


if __name__ == "__main__":
    main()
