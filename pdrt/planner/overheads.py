"""What serving adds to the model's steps, measured on a running node.

A node of one prefill and two decode workers (a thread each, none lent to
another, and no prompt prefilled on a decode worker: the simulator models
neither, and a decode worker stepping with an idle prefill worker's thread
too puts OpenMP's waits on an oversubscribed host into the steps measured)
serves, over pdrt's native protocol, prompts of PROMPT tokens. Against the
cost model of the same machine:

* one request at a time (each sent after the last has ended), answers of
  ANSWER tokens: the median gap between two tokens of a stream, less the
  decode step the model needs, is what each step costs around the model
  (`step_overhead_s`: the worker's loop, its outputs, the gateway, the
  client); the median TTFT, less the prompt's step and that overhead, is
  how long a token takes to reach the client (`token_latency_s`); the
  median first gap after the first token, less a usual gap, is the KV
  handoff's cost (`handoff_s`);
* LOADED_STREAMS requests per decode worker, with answers of LOADED_ANSWER
  tokens, arriving evenly over the time one of them takes alone
  (LOADED_REPEATS times), load the node as serving does: the decode
  workers, the gateway and the client all busy, on a small host more than
  its cores.
  The CPU the gateway (read from /proc) and the client (this process) spend
  then, against a load of one-token answers, gives their CPU per request
  and per output token. What each stream adds to a step around the model
  (`decode_seq_s`: its output to send, and what the node's processes cost
  each other's caches) is the value at which the simulator, with every
  other figure in place, gives these requests the median TPOT they had
  (the median over the repeats).

A shared host's speed drifts within minutes, and each figure above is what
is left of a measurement once the model's steps are taken away: the steps
are taken at the host's speed just before each load (SpeedProbe, a prompt
and a decode step timed in this process while the node is idle), and the
figures then given at the speed the profile's steps were measured at.
"""

import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from pdrt.bench.cpu_meter import cpu_seconds
from pdrt.bench.driver import Target, make_driver
from pdrt.bench.runner import BenchOptions, run_rate
from pdrt.bench.stats import Slo
from pdrt.bench.workloads import RequestShape
from pdrt.planner.cost_model import CostModel
from pdrt.planner.profile import Profile, SpeedProbe
from pdrt.planner.simulator import Deployment, Overheads, Simulation

PROMPT, ANSWER = 64, 32
NUM_REQUESTS = 8
DECODE_WORKERS = 2
LOADED_STREAMS = 12  # per decode worker
LOADED_ANSWER = 256
LOADED_REPEATS = 3
CPU_REQUESTS = 120  # of one-token answers
# Their rate: this many requests' worth of light-load latency in flight. Per request, the gateway and the client
# spend less under load, where one wake-up reads many frames; goodput is decided near saturation.
CPU_CONCURRENCY = 32
FIT_STEPS = 40  # bisections of decode_seq_s


def loaded_requests(e2e_s: float) -> list[tuple[float, RequestShape]]:
    """The loaded runs' requests, from `e2e_s`, how long one of ANSWER tokens takes alone: they arrive evenly over
    the time one of LOADED_ANSWER tokens takes alone. Sent at once, they would queue at the prefill worker as a
    burst and join the decode workers as a served load rarely does."""
    count = LOADED_STREAMS * DECODE_WORKERS
    spacing = e2e_s * LOADED_ANSWER / ANSWER / count
    return [(i * spacing, RequestShape(PROMPT, LOADED_ANSWER)) for i in range(count)]


@dataclasses.dataclass(slots=True)
class _Measured:
    light: list  # records of the light load
    light_speed: tuple[float, float]  # the host's speed just before it (SpeedProbe.factors)
    loaded: list[tuple[float, tuple[float, float]]]  # per loaded run: its median TPOT, the host's speed before it
    loaded_requests: list[tuple[float, RequestShape]]
    cpu: list[tuple[int, int, float, float]]  # per CPU load: requests, output tokens, gateway CPU s, client CPU s


async def _loads(address: str, gateway_pid: int, probe: SpeedProbe) -> _Measured:
    """Every load in turn; the probe runs between them, while the node is idle."""
    driver = make_driver(Target(address))
    info = await driver.open()
    options = BenchOptions(slo=Slo(600, 600), max_model_len=info.max_model_len)
    try:
        first = await run_rate(driver, info, options, None, "overheads-0", requests=[(0.0, RequestShape(PROMPT,
                                                                                                        ANSWER))])
        e2e = first.records[0].e2e_s or 1.0
        requests = [(i * 2 * e2e, RequestShape(PROMPT, ANSWER)) for i in range(NUM_REQUESTS)]
        light_speed = probe.factors()
        light = await run_rate(driver, info, options, None, "overheads-1", requests=requests)
        cpu, loaded, records = [], [], list(light.records)
        gap = e2e / CPU_CONCURRENCY
        loaded_load = loaded_requests(e2e)
        loads = [("loaded", loaded_load)] * LOADED_REPEATS + [
            ("one-token", [(i * gap, RequestShape(PROMPT, 1)) for i in range(CPU_REQUESTS)])]
        for name, requests in loads:
            speed = probe.factors() if name == "loaded" else None
            gateway, client = cpu_seconds(gateway_pid), time.process_time()
            run = await run_rate(driver, info, options, None, f"overheads-{name}", requests=requests)
            used = (len(run.records), sum(r.num_output_tokens for r in run.records),
                    cpu_seconds(gateway_pid) - gateway, time.process_time() - client)
            if speed is not None:
                loaded.append((statistics.median(r.tpot_s or 0.0 for r in run.records), speed))
                cpu = cpu or [used]  # the first loaded run's CPU, against the one-token load's
            else:
                cpu.append(used)
            records += run.records
    finally:
        await driver.close()
    bad = [r.error for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"the node failed requests while measured: {bad}")
    return _Measured(light.records, light_speed, loaded, loaded_load, cpu)


def _per_request_and_token(loads: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(per request, per token) CPU seconds from two loads of (requests, tokens, seconds), neither negative."""
    (r1, t1, s1), (r2, t2, s2) = loads
    det = r1 * t2 - r2 * t1
    per_token = max(0.0, (r1 * s2 - r2 * s1) / det) if det else 0.0
    per_request = max(0.0, (s1 - per_token * t1) / r1)
    return per_request, per_token


def simulated_tpot(costs: CostModel, overheads: Overheads, cores: int, requests: list[tuple[float, RequestShape]]
                   ) -> float:
    """The median TPOT the simulator gives `requests` on a node of one prefill and DECODE_WORKERS decode workers."""
    served = Simulation(costs, Deployment(prefill=1, decode=DECODE_WORKERS), cores, overheads).run(requests)
    return statistics.median((r.finished - r.first_token) / (r.shape.output_tokens - 1) for r in served
                             if r.finished is not None and r.first_token is not None and r.shape.output_tokens > 1)


def fit_decode_seq(costs: CostModel, overheads: Overheads, cores: int, requests: list[tuple[float, RequestShape]],
                   tpot_s: float) -> float:
    """The `decode_seq_s` at which the simulator gives `requests` the median TPOT `tpot_s` (0 when even none
    makes them slower)."""
    def tpot_at(decode_seq_s: float) -> float:
        return simulated_tpot(costs, dataclasses.replace(overheads, decode_seq_s=decode_seq_s), cores, requests)

    low, high = 0.0, tpot_s
    if tpot_at(low) >= tpot_s:
        return 0.0
    for _ in range(FIT_STEPS):
        mid = (low + high) / 2
        if tpot_at(mid) < tpot_s:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def measure_overheads(model: str, profile: Profile, loaded=None) -> Overheads:
    """Start a node of one prefill and DECODE_WORKERS decode workers (a thread each) on `model`, and measure, the
    profile's step times taken at the host's speed just before each load (SpeedProbe, on `model` as `loaded`
    here when given); the figures returned are at the speed the profile was measured at."""
    from pdrt.testing.node import Node

    probe = SpeedProbe(model, profile, loaded=loaded)
    with tempfile.TemporaryDirectory(prefix="pdrt-profile-") as workdir:
        node = Node(Path(workdir), model, engine={"kv_cache_bytes": 1 << 30},
                    extra={"decode": {"count": DECODE_WORKERS}, "gateway": {"http_port": 0},
                           "experimental": {"prefill_threads": 1, "decode_threads": 1, "borrow_threads": False,
                                            "local_prefill_max_tokens": 0}})
        with node:
            measured = asyncio.run(_loads(node.address, node.child_pids()["gateway"], probe))
    steps = profile.cost_model()
    costs = steps.slower(*measured.light_speed)
    records = measured.light
    gap = statistics.median(g for r in records for g in r.itls_s[1:])
    step = max(0.0, gap - costs.decode_step_s(1, PROMPT + ANSWER // 2))
    ttft = statistics.median(r.ttft_s for r in records)
    latency = max(0.0, ttft - costs.prefill_s(PROMPT) - step)
    handoff = max(0.0, statistics.median(r.itls_s[0] for r in records) - gap)
    gateway = _per_request_and_token([(r, t, g) for r, t, g, _ in measured.cpu])
    client = _per_request_and_token([(r, t, c) for r, t, _, c in measured.cpu])
    base = Overheads(step_overhead_s=step, token_latency_s=latency, handoff_s=handoff, gateway_request_s=gateway[0],
                     gateway_token_s=gateway[1], client_request_s=client[0], client_token_s=client[1]
                     ).slower(1 / measured.light_speed[1])
    cores = os.cpu_count() or 1
    per_stream = [fit_decode_seq(steps.slower(*speed), base.slower(speed[1]), cores, measured.loaded_requests, tpot)
                  / speed[1] for tpot, speed in measured.loaded]
    return dataclasses.replace(base, decode_seq_s=statistics.median(per_stream))
