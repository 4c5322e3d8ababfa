"""A prefill:decode balance that follows the load: the balancer against every static split, in one run.

Three workers of one node serve a load at a fixed rate whose mix shifts: prefill-heavy (long prompts, short
answers), then decode-heavy (short prompts, long answers), then prefill-heavy again, --phase-s seconds each,
one request in each 1/rate seconds (workload).
Each worker stands for a device of its own: it computes with one thread and borrows no idle worker's (the
simulator models no lending either). The same requests (same arrival times, lengths and seeds) go to each of
these in turn, each repeat starting with the next:

  * each static split of the three workers: 1 prefill + 2 decode (pdrt's default shape, "default") and
    2 prefill + 1 decode, with the balancer off;
  * the default split with the balancer on ([controller] balance, interval --interval), starting as 1P+2D.

The rate and the decode-heavy answers' length are found first, on this host, unless --rate and --long-answer
give them: each phase's load midway between what the split made for it serves (2P+1D for the prefill-heavy
load, 1P+2D for the decode-heavy one) and what the other split serves (calibrate). A node whose balance follows
the load can then serve the whole run; each static split serves one kind of phase and is past its capacity in
the other (calibration logs whether it is: each split's attainment of the other phase's load alone).

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
relative error of a static split's median predicted attainment (at the host's speed around each run) against
its median measured attainment: like the others, a figure of the medians of the repeats. The largest error of
a single run's prediction, at the host's speed and from the profile as measured, is printed on the lines
before.
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
from pdrt.worker_profile import PREFILL_NICE  # noqa: E402

PHASES = ("prefill-heavy", "decode-heavy", "prefill-heavy")
# The rates calibration tries (calibrate), in prompts a second that one worker computes alone, each taking the
# profile's time of a prefill-heavy prompt: a split's prefill workers serve fewer than one each, queueing within
# the TTFT SLO.
RATE_LADDER = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.6, 1.8, 2.0)
# The decode-heavy answers' mean tokens: calibration picks one (calibrate); with --long-answer, none.
ANSWER_LADDER = (100, 150, 200, 250, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600)
# The SLOs, unless given: this many times what the profile says a request takes alone on this host, its prompt
# (TTFT: a prefill-heavy one) or a decode step of one stream with what serving adds to it (TPOT); as DistServe
# scales its SLOs. Hosts differ in speed several times over, and so the loads that a split holds within an SLO.
SLO_SCALE = 2.5
CALIBRATION_ATTAINMENT = 0.9  # the split made for a phase holds its load
SYSTEMS = {"default": (1, 2, False), "2p1d": (2, 1, False), "balancer": (1, 2, True)}
# Each worker a device of its own: one thread, none borrowed. Three workers share two cores, which three devices
# would not: prompts run niced below decode steps, so that a decode step never waits for a core behind a prompt.
DEVICES = {"prefill_threads": 1, "decode_threads": 1, "borrow_threads": False, "prefill_nice": PREFILL_NICE}
# Prefill workers prefill and decode workers decode: no prompt is prefilled on a decode worker (pdrt's conditional
# disaggregation, pdrt/roles/local_prefill.py, which the simulator does not model). With it, 1P+2D's idle decode
# workers take long prompts when the prefill worker falls behind, and 1P+2D holds what 2P+1D holds of the
# prefill-heavy load: the balance of roles is then not what decides it.
ROLES_KEPT = {"local_prefill_max_tokens": 0}
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
    """(arrival s, lengths, phase index) of every request: rate x phase_s requests a phase, one in each slot of
    1/rate seconds at a uniform time within it. A rate then means a load: Poisson arrivals over a phase of a few
    dozen requests bunch differently with every seed, and a bunch of long prompts past two prefill workers' room
    decides a run's attainment more than the split does (runs of 22 requests attained 86% and 100% of
    one rate with two seeds)."""
    rng = random.Random(f"elastic:{seed}")
    requests = []
    for index, phase in enumerate(phases):
        count = round(rate * phase_s)
        for slot in range(count):
            at = (slot + rng.random()) * phase_s / count
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
        "experimental": DEVICES | ROLES_KEPT}, ready_timeout_s=180)


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
              lengths: tuple[int, int, int, int], rates: tuple[float, ...]) -> tuple[float, int]:
    """The rate to offer and the decode-heavy answers' mean length, found on this host at the start of the run
    (a fixed load swings every system's attainment as the host's speed drifts): each phase's load between what
    the split made for it serves and what the other split serves, so that the one holds it with room and the
    other fails it, as the benchmark's premise has it.

    The rate: the middle rung of `rates` (ascending, requests/s) among those at which 2P+1D attains
    CALIBRATION_ATTAINMENT of a run of the prefill-heavy load alone, as long as a phase, and 1P+2D does not. The
    answers: likewise the middle rung of ANSWER_LADDER among those of the decode-heavy load at that rate that
    1P+2D holds and 2P+1D does not. Each limit is bisected over its ladder (a few runs rather than one per rung).
    The log says each split's attainment of the other phase's load."""
    long_prompt, short_answer, short_prompt, _ = lengths
    seen: dict[tuple, bool] = {}  # (split, phase, rate, answers) -> held

    def holds(address: str, name: str, phase: str, rate: float, answer: float) -> bool:
        key = (name, phase, rate, round(answer))
        if key not in seen:  # each run's prompts new to the node: a prefix cached by an earlier one costs nothing
            seen[key] = holds_alone(address, name, phase, phase_s, seed + 500 + len(seen),
                                    (long_prompt, short_answer, short_prompt, round(answer)), slo, rate)
        return seen[key]

    def limit(name: str, phase: str, ladder: tuple[float, ...], held) -> int:
        index = highest_holding(ladder, held)
        log(f"calibration: {name} holds the {phase} load up to {ladder[index]:g}" if index >= 0 else
            f"calibration: {name} holds none of the {phase} loads tried")
        return index

    answer = ANSWER_LADDER[0]  # the prefill-heavy runs do not read it
    with system_node(workdir / "calibration-2p1d", model, "2p1d", slo) as node:
        warm_up(node.address, seed)
        top = limit("2p1d", "prefill-heavy", rates,
                    lambda r: holds(node.address, "2p1d", "prefill-heavy", r, answer))
    with system_node(workdir / "calibration-default", model, "default", slo) as node:
        warm_up(node.address, seed)
        low = limit("default", "prefill-heavy", rates[:top + 1],
                    lambda r: holds(node.address, "default", "prefill-heavy", r, answer))
        rate = rates[between(low, top)]
        holds(node.address, "default", "prefill-heavy", rate, answer)  # the premise, logged
        longest = limit("default", "decode-heavy", ANSWER_LADDER,
                        lambda a: holds(node.address, "default", "decode-heavy", rate, a))
    with system_node(workdir / "calibration-2p1d-decode", model, "2p1d", slo) as node:
        warm_up(node.address, seed)
        shortest = limit("2p1d", "decode-heavy", ANSWER_LADDER[:longest + 1],
                         lambda a: holds(node.address, "2p1d", "decode-heavy", rate, a))
        answer = ANSWER_LADDER[between(shortest, longest)]
        holds(node.address, "2p1d", "decode-heavy", rate, answer)  # the premise, logged
    for phase, failed_above, held in (("prefill-heavy", low, top), ("decode-heavy", shortest, longest)):
        if failed_above >= held:
            log(f"calibration: no {phase} load here that the split made for it holds and the other fails: the "
                "premise does not hold on this host now")
    return rate, answer


def between(failed_above: int, held: int) -> int:
    """The index of the middle rung of those above rung `failed_above` up to rung `held` (the lower one of two
    in the middle: the one made for it holds it with the more room); `held` itself when there is none."""
    return (failed_above + 1 + held) // 2 if held > failed_above else max(0, held)


def holds_alone(address: str, name: str, phase: str, phase_s: float, seed: int, lengths: tuple[int, int, int, int],
                slo: Slo, rate: float) -> bool:
    """Whether node `name` at `address` attains CALIBRATION_ATTAINMENT of `phase`'s load alone at `rate`."""
    requests = workload(rate, phase_s, seed, lengths, (phase,))
    records = asyncio.run(drive(address, [(t, s) for t, s, _ in requests], slo, seed))
    attainment = summarize(records, 0.0, slo).attainment
    answers = f", answers of ~{lengths[3]} tokens" if phase == "decode-heavy" else ""
    log(f"calibration: {rate:g} req/s of the {phase} load{answers}, {name} attains {attainment:.0%}")
    return attainment >= CALIBRATION_ATTAINMENT


def highest_holding(rates: tuple[float, ...], holds) -> int:
    """The index of the highest of the ascending `rates` for which `holds(rate)`, found by bisection (a rate
    that holds is taken to mean every lower one does); -1 when none holds."""
    held, failed = -1, len(rates)
    while failed - held > 1:
        middle = (held + failed) // 2
        if holds(rates[middle]):
            held = middle
        else:
            failed = middle
    return held


def host_slo(profile: Profile, lengths: tuple[int, int, int, int], ttft_s: float | None, tpot_s: float | None
             ) -> Slo:
    """The SLOs given, or SLO_SCALE times what a request takes alone on this host by the profile: a prefill-heavy
    prompt (TTFT), a decode step of one decode-heavy stream with what serving adds to it (TPOT)."""
    costs, overheads = profile.cost_model(), profile.serving_overheads()
    step_s = (costs.decode_step_s(1, lengths[2], DEVICES["decode_threads"]) + overheads.step_overhead_s
              + overheads.decode_seq_s)
    return Slo(ttft_s or round(SLO_SCALE * long_prompt_s(profile, lengths), 2), tpot_s or round(SLO_SCALE * step_s, 4))


def long_prompt_s(profile: Profile, lengths: tuple[int, int, int, int]) -> float:
    """What the profile says a prefill-heavy prompt takes on a prefill worker's threads."""
    return profile.cost_model().prefill_s(lengths[0], 0, DEVICES["prefill_threads"])


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
                        "calibrate)")
    parser.add_argument("--phase-s", type=float, default=60.0, help="seconds of each phase (default 60)")
    parser.add_argument("--interval", type=float, default=3.0, help="the balancer's interval, s (default 3)")
    parser.add_argument("--ttft-slo", type=float, help="s (default: from the profile, see SLO_SCALE)")
    parser.add_argument("--tpot-slo", type=float, help="s (default: from the profile, see SLO_SCALE)")
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
    slo = host_slo(profile, lengths, args.ttft_slo, args.tpot_slo)
    probe = SpeedProbe(model, profile)
    if args.rate is None or args.long_answer is None:
        if args.rate is not None or args.long_answer is not None:
            parser.error("--rate and --long-answer go together: each is calibrated for the other")
        prompt_s = long_prompt_s(profile, lengths)
        rates = tuple(round(r / prompt_s, 3) for r in RATE_LADDER)
        args.rate, args.long_answer = calibrate(workdir, model, slo, args.phase_s, args.seed, lengths, rates)
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
    print(f"plan_error of a single run: {max(errors['anchored'], default=float('nan')):.2f} at the host's speed, "
          f"{max(errors['profile'], default=float('nan')):.2f} from the profile as measured")
    of_medians = [abs(median(n, "anchored") / median(n, "attainment") - 1) for n in ("default", "2p1d")
                  if median(n, "attainment") > 0]
    print(f"elastic dynamic_vs_best_static={dynamic / best_static:.2f} dynamic_vs_default={dynamic / default:.2f} "
          f"ttft_p95_cut={cut:.2f} flip_ms={statistics.median(flips) if flips else float('nan'):.0f} "
          f"plan_error={max(of_medians, default=float('nan')):.2f}")


if __name__ == "__main__":
    main()
