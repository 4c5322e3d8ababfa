"""How well `pdrt plan` predicts: its goodput for several deployments against measured `pdrt bench` ladders.

On this machine, with one model (default: a tiny random Llama built here):

1. the model's profile is measured (`pdrt profile`: engine step times and serving overheads), unless
   --profile gives one;
2. a pilot on the colocated server sets the SLOs, as scripts/bench_goodput.py does (unless they are given);
3. each deployment (colocated with every core; one prefill and one decode worker; one prefill and two decode
   workers, a thread each; --deployments may add two prefill and one decode) climbs a measured goodput ladder
   of the chat workload over the native protocol (exact lengths), and `pdrt plan`'s simulator predicts the
   same ladder: the same requests, seeds and SLOs.

--repeats runs every ladder again with another seed; the medians are compared. Last line:
`plan colocated=E1 1p1d=E2 1p2d=E3 ... max_error=V`, each E the relative error of the predicted goodput
(predicted / measured - 1).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_goodput import (  # noqa: E402  (the goodput benchmark's servers, pilot and ladder)
    CONTEXT,
    QUICK,
    PdrtServer,
    log,
    options_for,
    pilot_on,
    resolve_model,
    run_system,
)

from pdrt.bench import Slo  # noqa: E402
from pdrt.bench.workloads import LengthLimits  # noqa: E402
from pdrt.planner.predict import predict  # noqa: E402
from pdrt.planner.profile import Profile, profile_model  # noqa: E402
from pdrt.planner.simulator import Deployment  # noqa: E402

CORES = os.cpu_count() or 2
DEPLOYMENTS = {
    "colocated": (Deployment(colocated=1, threads=CORES), "colocated", {}),
    "1p1d": (Deployment(prefill=1, decode=1), "disaggregated", {}),
    "1p2d": (Deployment(prefill=1, decode=2), "disaggregated", {"decode": {"count": 2}}),
    "2p1d": (Deployment(prefill=2, decode=1), "disaggregated", {"prefill": {"count": 2}}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="checkpoint directory, 'tiny' (default) or 'wide' (a random "
                                                         "model whose steps are arithmetic, scripts/bench_elastic.py)")
    parser.add_argument("--profile", help="a saved profile of the model on this machine (default: measure one)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--duration", type=float, default=QUICK.duration_s, help="seconds of arrivals per rate")
    parser.add_argument("--ttft-slo", type=float, help="seconds (with --tpot-slo: no pilot)")
    parser.add_argument("--tpot-slo", type=float, help="seconds")
    parser.add_argument("--start-rate", type=float, help="the ladders' first rate (default: from the pilot)")
    parser.add_argument("--deployments", default="colocated,1p1d,1p2d", help=f"of {', '.join(DEPLOYMENTS)}")
    parser.add_argument("--out", default="bench-results/plan")
    args = parser.parse_args()
    names = args.deployments.split(",")
    settings = QUICK
    settings.duration_s = args.duration
    workdir = Path(tempfile.mkdtemp(prefix="bench-plan-"))
    model, model_name = resolve_model(args.model, workdir)
    profile = Profile.load(Path(args.profile)) if args.profile else profile_model(model, log=log)
    costs, overheads = profile.cost_model(), profile.serving_overheads()
    print(f"bench_plan: model {model_name}; {CORES} cores; overheads {overheads}", flush=True)

    if args.ttft_slo and args.tpot_slo and args.start_rate:
        slo, start_rate = Slo(args.ttft_slo, args.tpot_slo), args.start_rate
    else:
        slo, light_rate, _ = pilot_on(PdrtServer(workdir, model, "colocated"), "native", settings)
        slo = Slo(args.ttft_slo or slo.ttft_s, args.tpot_slo or slo.tpot_s)
        start_rate = args.start_rate or round(4 * light_rate, 3)
    print(f"SLOs: TTFT <= {slo.ttft_s * 1e3:.0f} ms, TPOT <= {slo.tpot_s * 1e3:.1f} ms; chat, length scale "
          f"{settings.length_scale}, {settings.duration_s:g} s a rate", flush=True)

    limits = LengthLimits(CONTEXT, settings.length_scale)
    measured: dict[str, list[float]] = {n: [] for n in names}
    predicted: dict[str, list[float]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        seed = 100 + repeat
        for name in names:
            deployment, mode, overrides = DEPLOYMENTS[name]
            def server(mode: str = mode, overrides: dict = overrides) -> PdrtServer:
                return PdrtServer(workdir, model, mode, slo, overrides=overrides)

            ladder = run_system(server, "native",
                                settings, slo, start_rate, seed, f"{name}:{repeat}", name)
            prediction = predict(costs, deployment, CORES, options_for(settings, slo, seed), limits, overheads,
                                 start_rate)
            measured[name].append(ladder.goodput)
            predicted[name].append(prediction.goodput.rate)
            log(f"{name}: measured {ladder.goodput:.3g} req/s, predicted {prediction.goodput.rate:.3g}")
    errors = {}
    print(f"{'deployment':<12}{'measured':>10}{'predicted':>11}{'error':>8}")
    for name in names:
        m, p = statistics.median(measured[name]), statistics.median(predicted[name])
        errors[name] = p / m - 1 if m else float("inf")
        print(f"{name:<12}{m:>10.3g}{p:>11.3g}{errors[name]:>+8.1%}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    (out / "plan.json").write_text(json.dumps({"slo": asdict(slo), "measured": measured, "predicted": predicted,
                                               "overheads": asdict(overheads)}, indent=1))
    print("plan " + " ".join(f"{n}={e:+.3f}" for n, e in errors.items())
          + f" max_error={max(abs(e) for e in errors.values()):.3f}")


if __name__ == "__main__":
    main()
