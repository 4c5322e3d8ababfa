"""Conditional disaggregation through `pdrt up`: short prompts prefilled on the decode worker while prefill is busy."""

import json
import time

import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import total
from pdrt.testing.node import Node, free_port
from tests.system_client import RawClient, scrape, used_blocks, wait_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
MAX_LOCAL = 64


def routes(node: Node) -> dict[str, tuple[str, bool]]:
    """Client request id -> (the worker that prefilled it, whether that was its decode worker), last attempt."""
    time.sleep(0.5)  # let the gateway's log lines reach the supervisor's stderr
    lines = [json.loads(line) for line in node.log_path.read_text().splitlines() if line.startswith("{")]
    return {ln["client_request_id"]: (ln["prefill"], ln["prefilled_on_decode"])
            for ln in lines if ln.get("event") == "request routed"}


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    # Any queue at the prefill worker is long enough: every short prompt that finds the decode worker free of
    # another local prefill is prefilled there.
    gateway = {"local_prefill_max_tokens": MAX_LOCAL, "local_prefill_queue_tokens": 1}
    metrics_port = free_port()
    with Node(tmp_path_factory.mktemp("conditional"), str(model_dirs["llama"]),
              extra={"gateway": gateway, "controller": {"metrics_port": metrics_port}}) as running:
        running.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield running


def test_short_prompts_behind_a_busy_prefill_worker_are_prefilled_on_the_decode_worker_and_equal_generate(
        node, prompts, references):
    long_prompts = [p for p in prompts if len(p) > 400]
    short_prompts = [p[:n] for p, n in zip(prompts, [3, 9, 17, 33, 40, 50, 60, 64] * 2, strict=False)]
    batch = long_prompts + short_prompts  # the long ones go first and fill the prefill worker's queue
    client = RawClient(node.address)
    try:
        results = client.generate_many(batch, GREEDY)
    finally:
        client.close()
    for i, prompt in enumerate(batch):
        assert results[f"r{i}"] == references["llama"].greedy(prompt), f"request {i} ({len(prompt)} prompt tokens)"
    routed = routes(node)
    local = {rid for rid, (worker, on_decode) in routed.items() if on_decode}
    assert all(routed[rid][0] == "decode-0" for rid in local)
    assert local, "no short prompt was prefilled on the decode worker"
    assert not local & {f"r{i}" for i in range(len(long_prompts))}, "a prompt over the limit went to decode"
    wait_for(lambda: used_blocks(node) == {"prefill-0": 0, "decode-0": 0}, timeout_s=10)

    def counted() -> float:  # the gateway reports its metrics to the controller every second
        return total(scrape(node)[1], "pdrt_gateway_prefills_on_decode_total")

    wait_for(lambda: counted() == len(local), timeout_s=10, interval_s=0.2)
