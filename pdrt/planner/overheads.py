"""What serving adds to the model's steps, measured on a running node at light load.

A node serves one request at a time (each sent after the last has ended),
prompts of PROMPT tokens and answers of ANSWER tokens, over pdrt's native
protocol. Against the cost model of the same machine:

* the median gap between two tokens of a stream, less the decode step the
  model needs, is what each step costs around the model (`step_overhead_s`:
  the worker's loop, its outputs, the gateway, the client);
* the median TTFT, less the prompt's step and that overhead, is how long a
  token takes to reach the client (`token_latency_s`);
* the median first gap after the first token, less a usual gap, is the KV
  handoff's cost (`handoff_s`);
* BATCH requests sent at once, with longer answers, decode together: their
  median gap, less the model's step for that batch and the step overhead,
  is what each stream adds to a step around the model (`decode_seq_s`: its
  output to send).

Then two heavier loads, answers of ANSWER tokens and of one token, give the
CPU the gateway (read from /proc) and the client (this process) spend per
request and per output token.
"""

import asyncio
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
from pdrt.planner.simulator import Overheads

PROMPT, ANSWER = 64, 32
NUM_REQUESTS = 8
CPU_REQUESTS = 120
BATCH = 16
# The heavier loads' rate: this many requests' worth of light-load latency in flight. Per token, the gateway and
# the client spend less under load, where one wake-up reads many frames; goodput is decided near saturation.
CPU_CONCURRENCY = 32


async def _loads(address: str, gateway_pid: int) -> tuple[list, list, list[tuple[int, int, float, float]]]:
    """The light load's records, the batch's, and per heavier load (requests, output tokens, gateway CPU s,
    client CPU s)."""
    driver = make_driver(Target(address))
    info = await driver.open()
    options = BenchOptions(slo=Slo(600, 600), max_model_len=info.max_model_len)
    try:
        first = await run_rate(driver, info, options, None, "overheads-0", requests=[(0.0, RequestShape(PROMPT,
                                                                                                        ANSWER))])
        e2e = first.records[0].e2e_s or 1.0
        requests = [(i * 2 * e2e, RequestShape(PROMPT, ANSWER)) for i in range(NUM_REQUESTS)]
        light = await run_rate(driver, info, options, None, "overheads-1", requests=requests)
        batch = await run_rate(driver, info, options, None, "overheads-batch",
                               requests=[(0.0, RequestShape(PROMPT, 4 * ANSWER)) for _ in range(BATCH)])
        cpu = []
        for answer in (ANSWER, 1):
            gap = e2e / CPU_CONCURRENCY
            requests = [(i * gap, RequestShape(PROMPT, answer)) for i in range(CPU_REQUESTS)]
            gateway, client = cpu_seconds(gateway_pid), time.process_time()
            run = await run_rate(driver, info, options, None, f"overheads-{answer}", requests=requests)
            cpu.append((len(run.records), sum(r.num_output_tokens for r in run.records),
                        cpu_seconds(gateway_pid) - gateway, time.process_time() - client))
    finally:
        await driver.close()
    bad = [r.error for r in light.records + batch.records if not r.ok]
    if bad:
        raise RuntimeError(f"light-load requests failed: {bad}")
    return light.records, batch.records, cpu


def _per_request_and_token(loads: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(per request, per token) CPU seconds from two loads of (requests, tokens, seconds), neither negative."""
    (r1, t1, s1), (r2, t2, s2) = loads
    det = r1 * t2 - r2 * t1
    per_token = max(0.0, (r1 * s2 - r2 * s1) / det) if det else 0.0
    per_request = max(0.0, (s1 - per_token * t1) / r1)
    return per_request, per_token


def measure_overheads(model: str, costs: CostModel) -> Overheads:
    """Start a node of one prefill and one decode worker (a thread each) on `model`, and measure."""
    from pdrt.testing.node import Node

    with tempfile.TemporaryDirectory(prefix="pdrt-profile-") as workdir:
        node = Node(Path(workdir), model, engine={"kv_cache_bytes": 1 << 30},
                    extra={"experimental": {"prefill_threads": 1, "decode_threads": 1}, "gateway": {"http_port": 0}})
        with node:
            records, batch, cpu = asyncio.run(_loads(node.address, node.child_pids()["gateway"]))
    gaps = [g for r in records for g in r.itls_s[1:]]
    gap = statistics.median(gaps)
    step = max(0.0, gap - costs.decode_step_s(1, PROMPT + ANSWER // 2))
    ttft = statistics.median(r.ttft_s for r in records)
    latency = max(0.0, ttft - costs.prefill_s(PROMPT) - step)
    handoff = max(0.0, statistics.median(r.itls_s[0] for r in records) - gap)
    batch_gap = statistics.median(g for r in batch for g in r.itls_s[1:])
    context = PROMPT + 2 * ANSWER
    per_seq = max(0.0, (batch_gap - step - costs.decode_step_s(BATCH, BATCH * context)) / BATCH)
    gateway = _per_request_and_token([(r, t, g) for r, t, g, _ in cpu])
    client = _per_request_and_token([(r, t, c) for r, t, _, c in cpu])
    return Overheads(step_overhead_s=step, decode_seq_s=per_seq, token_latency_s=latency, handoff_s=handoff,
                     gateway_request_s=gateway[0],
                     gateway_token_s=gateway[1], client_request_s=client[0], client_token_s=client[1])
