"""Which mode a node runs when its config leaves the choice to pdrt (`mode = "auto"`, the default), and why.

With a profile of the model on this host (`pdrt profile`), the planner
predicts the goodput of the node's workers colocated and split, at the
node's SLOs on the chat workload, and the node runs whichever serves more
(split on a tie). Without a profile, the hardware decides:

* GPUs: split with two or more, so that prompts and decode steps each have
  GPUs of their own; colocated on one, where the two would take turns on it.
* CPU: split with MIN_SPLIT_CORES cores or more. On fewer, the prefill and
  decode workers share cores with each other and with the gateway, so a
  prompt's arithmetic delays decode steps as it would in one batch, and the
  handoff and a second process's overheads are paid for nothing: one
  colocated worker serves more (docs/benchmarks.md, on two cores).
"""

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdrt.devices import cuda_device_count

if TYPE_CHECKING:
    from pdrt.node_config import NodeConfig

MIN_SPLIT_CORES = 4
PREDICTION_WORKLOAD = "chat"
PREDICTION_SECONDS = 30.0  # of simulated arrivals per rate
MAX_CACHED_PREDICTIONS = 32


def choose_mode(config: "NodeConfig", profile_path: Path | None = None, cores: int | None = None,
                seconds: float = PREDICTION_SECONDS) -> tuple[str, str]:
    """The mode for `config` ("disaggregated" or "colocated") and the reason, in words for its log; `cores`:
    those of the machine it runs on (default: this process's); `seconds` of arrivals simulated per rate."""
    if not cores:
        from pdrt.cpu_placement import allowed_cores  # it imports the node config, which imports this lazily

        cores = len(allowed_cores())
    if config.model and config.engine.device == "cpu":
        from pdrt.planner.profile import default_profile_path

        path = profile_path or default_profile_path(config.model)
        if path.exists():
            return _predicted(config, path, cores, seconds)
    if config.engine.device.startswith("cuda"):
        num_gpus = _num_gpus(config.engine.device, config.engine.gpus)
        if num_gpus >= 2:
            return "disaggregated", f"{num_gpus} GPUs: prompts and decode steps each get GPUs of their own"
        return "colocated", "one GPU: prompts and decode steps would take turns on it anyway"
    if cores >= MIN_SPLIT_CORES:
        return "disaggregated", f"{cores} cores: prompts and decode steps each get cores of their own"
    return "colocated", (f"{cores} cores, fewer than {MIN_SPLIT_CORES}: split workers would share them, and one "
                         "colocated worker serves more (run `pdrt profile` to decide from this model's measured "
                         "step times)")


def _num_gpus(device: str, gpus: str) -> int:
    """The GPUs a node of `device` spreads its workers over (those torch sees unless `gpus` names them); the
    node checks them when it starts."""
    if ":" in device:
        return 1
    named = [g for g in gpus.replace(" ", "").split(",") if g]
    return len(named) if named else cuda_device_count()


def _predicted(config: "NodeConfig", path: Path, cores: int, seconds: float) -> tuple[str, str]:
    from pdrt.bench.stats import Slo

    slo = Slo(config.gateway.ttft_slo_s, config.gateway.tpot_slo_s)
    key = hashlib.sha256(repr((path.read_bytes(), slo, cores, seconds, PREDICTION_WORKLOAD, config.colocated.count,
                               config.prefill.count, config.decode.count)).encode()).hexdigest()
    cache = path.with_name(f"{path.stem}.modes.json")
    known = _read_cache(cache)
    if key not in known:
        known[key] = _simulate(config, path, slo, cores, seconds)
        _write_cache(cache, known)
    rates = dict(zip(("colocated", "disaggregated"), known[key], strict=True))
    mode = "colocated" if rates["colocated"] > rates["disaggregated"] else "disaggregated"
    return mode, (f"predicted goodput at the SLOs ({slo.ttft_s:g} s TTFT, {slo.tpot_s:g} s TPOT, "
                  f"{PREDICTION_WORKLOAD}): colocated {rates['colocated']:.3g} req/s, disaggregated "
                  f"{rates['disaggregated']:.3g} req/s (profile {path})")


def _simulate(config: "NodeConfig", path: Path, slo, cores: int, seconds: float) -> list[float]:
    """The planner's predicted goodput of the node's workers colocated and split, in that order."""
    from pdrt.bench.runner import BenchOptions
    from pdrt.bench.workloads import LengthLimits
    from pdrt.planner.predict import predict
    from pdrt.planner.profile import Profile
    from pdrt.planner.simulator import Deployment

    profile = Profile.load(path)
    options = BenchOptions(workload=PREDICTION_WORKLOAD, duration_s=seconds, seed=0, slo=slo,
                           max_model_len=profile.max_model_len)
    limits = LengthLimits(profile.max_model_len)
    costs, overheads = profile.cost_model(), profile.serving_overheads()
    colocated = config.colocated.count
    split = config.prefill.count + config.decode.count
    deployments = [Deployment(colocated=colocated, threads=max(1, cores // colocated)),
                   Deployment(prefill=config.prefill.count, decode=config.decode.count,
                              threads=max(1, cores // split))]
    return [predict(costs, d, cores, options, limits, overheads).goodput.rate for d in deployments]


def _read_cache(cache: Path) -> dict[str, list[float]]:
    """Predictions made before, by their inputs' digest: a start with the same profile, SLOs and workers reuses
    one (the simulation takes tens of seconds); an unreadable cache is ignored."""
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_cache(cache: Path, known: dict[str, list[float]]) -> None:
    kept = dict(list(known.items())[-MAX_CACHED_PREDICTIONS:])
    try:
        partial = cache.with_name(f"{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps(kept))
        partial.replace(cache)
    except OSError:  # a read-only cache directory: the next start predicts again
        pass
