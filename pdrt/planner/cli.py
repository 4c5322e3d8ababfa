"""`pdrt profile` and `pdrt plan` on the command line."""

import argparse
import sys
from pathlib import Path

from pdrt.errors import ConfigError

MAX_SPLITS = 7


def _log(message: str) -> None:
    print(f"pdrt: {message}", file=sys.stderr, flush=True)


def _model(arg: str | None) -> str:
    from pdrt.cli import _model_path

    return _model_path(arg)


def cmd_profile(args: argparse.Namespace) -> int:
    from pdrt.planner.profile import default_profile_path, profile_model

    model = _model(args.model)
    threads = [int(t) for t in args.threads.split(",")] if args.threads else None
    _log(f"profiling {model} (engine steps, then a node of one prefill and two decode workers); this takes a few "
         "minutes")
    profile = profile_model(model, threads, args.max_context, serving=not args.engine_only, log=_log)
    path = profile.save(Path(args.out) if args.out else default_profile_path(model))
    for t, fit in profile.cost_model().fits.items():
        print(f"threads {t}: prefill {fit.prefill.fixed * 1e3:.2f} ms + {fit.prefill.per_token * 1e6:.2f} us/token "
              f"+ {fit.prefill.per_attention * 1e9:.3f} ns/attention; decode step {fit.decode.fixed * 1e3:.2f} ms + "
              f"{fit.decode.per_token * 1e6:.2f} us/sequence + {fit.decode.per_attention * 1e9:.3f} ns/context token")
    if profile.overheads:
        print("serving: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in profile.overheads.items()
                                      if k.endswith("_s") and not k.endswith("per_s")))
    print(path)
    return 0


def _deployments(workers: int, cores: int) -> list:
    from pdrt.planner.simulator import Deployment

    threads = max(1, cores // workers)
    out = [Deployment(colocated=1, threads=cores)]
    if workers > 1:
        out.append(Deployment(colocated=workers, threads=threads))
    # Every split of a few workers; of many, MAX_SPLITS spread evenly.
    splits = sorted({round(1 + i * (workers - 2) / max(1, MAX_SPLITS - 1)) for i in range(MAX_SPLITS)}
                    if workers - 1 > MAX_SPLITS else range(1, workers))
    out += [Deployment(prefill=p, decode=workers - p, threads=threads) for p in splits]
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from pdrt.bench.report import latency_cells
    from pdrt.bench.runner import BenchOptions
    from pdrt.bench.stats import Slo
    from pdrt.bench.workloads import LengthLimits
    from pdrt.planner.predict import predict
    from pdrt.planner.profile import Profile, default_profile_path
    from pdrt.text_table import aligned

    path = Path(args.profile) if args.profile else default_profile_path(_model(args.model))
    if not path.exists():
        raise ConfigError(f"no profile at {path}; run `pdrt profile` first (or give --profile)")
    profile = Profile.load(path)
    cores = args.cores or profile.cores
    workers = args.workers or cores
    slo = Slo(args.ttft_slo, args.tpot_slo)
    options = BenchOptions(workload=args.workload, trace=args.trace, duration_s=args.duration, seed=args.seed,
                           slo=slo, length_scale=args.length_scale, max_model_len=profile.max_model_len)
    limits = LengthLimits(profile.max_model_len, args.length_scale)
    costs, overheads = profile.cost_model(), profile.serving_overheads()
    measured = sorted(profile.prefill)
    _log(f"profile {path} ({'measured' if profile.measured else 'not measured'} on {profile.host}, "
         f"{profile.cores} cores, threads {measured}); planning for {cores} cores and {workers} workers")
    rows = [["deployment", "goodput req/s", *(["attain", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99"]
                                             if args.rate else [])]]
    best = None
    for d in _deployments(workers, cores):
        prediction = predict(costs, d, cores, options, limits, overheads, args.rate or 1.0)
        row = [d.describe() + ("" if d.threads in measured else " (threads not measured)"),
               f"{prediction.goodput.rate:.3g}"]
        if args.rate:  # the ladder's first rate
            s = prediction.at(args.rate)
            assert s is not None
            row += [f"{s.attainment:.0%}", *latency_cells(s.ttft), *latency_cells(s.tpot)]
        rows.append(row)
        if best is None or prediction.goodput.rate > best[1]:
            best = (d, prediction.goodput.rate)
    print("\n".join(aligned(rows)))
    assert best is not None
    print(f"best: {best[0].describe()}, goodput {best[1]:.3g} req/s at {slo.ttft_s * 1e3:g} ms TTFT and "
          f"{slo.tpot_s * 1e3:g} ms TPOT ({args.workload if not args.trace else args.trace})")
    return 0


def add_parsers(sub: "argparse._SubParsersAction") -> None:
    profile = sub.add_parser("profile", help="measure the model's step times on this machine, for `pdrt plan` and "
                                             "the balancer")
    profile.add_argument("--model", help="checkpoint directory (default: the fetched SmolLM2)")
    profile.add_argument("--threads", help="comma-separated thread counts (default: 1 up to the cores, doubling)")
    profile.add_argument("--max-context", type=int, default=2048, help="longest prompt measured (default 2048)")
    profile.add_argument("--engine-only", action="store_true", help="skip the serving overheads (no node started)")
    profile.add_argument("--out", help="where to save it (default: the pdrt cache, where the balancer looks)")
    profile.set_defaults(func=cmd_profile)

    plan = sub.add_parser("plan", help="predict latencies, SLO attainment and goodput of deployments by simulation")
    plan.add_argument("--model", help="the model whose saved profile to use (default: the fetched SmolLM2)")
    plan.add_argument("--profile", help="a profile file (default: the model's, saved by `pdrt profile`)")
    plan.add_argument("--workload", default="chat", help="chat, code or summarization (as for `pdrt bench`)")
    plan.add_argument("--trace", help="a trace file instead (as for `pdrt bench`)")
    plan.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    plan.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default 0.1)")
    plan.add_argument("--cores", type=int, help="the machine planned for (default: the profile's)")
    plan.add_argument("--workers", type=int, help="workers to split (default: one per core)")
    plan.add_argument("--rate", type=float, help="also show latencies at this rate (req/s)")
    plan.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per simulated rate")
    plan.add_argument("--length-scale", type=float, default=1.0)
    plan.add_argument("--seed", type=int, default=0)
    plan.set_defaults(func=cmd_plan)
