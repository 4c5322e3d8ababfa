"""Conditional disaggregation through `pdrt up`: short prompts prefilled on the decode worker while prefill is busy."""

import json
import time

import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import total
from pdrt.roles.local_prefill import LocalPrefillRules
from pdrt.testing.node import Node, free_port
from pdrt.wire import Load
from tests.system_client import RawClient, scrape, used_blocks, wait_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
MAX_LOCAL = 64


def routes(node: Node) -> dict[str, tuple[str, bool]]:
    """Client request id -> (the worker that prefilled it, whether that was its decode worker), last attempt."""
    time.sleep(0.5)  # let the gateway's log lines reach the supervisor's stderr
    lines = [json.loads(line) for line in node.log_path.read_text().splitlines() if line.startswith("{")]
    return {ln["client_request_id"]: (ln["prefill"], ln["prefilled_on_decode"])
            for ln in lines if ln.get("event") == "request routed"}


def prefilled_on_decode(node: Node) -> set[str]:
    """Client request ids whose last attempt the decode worker prefilled itself (checked to be decode-0)."""
    local = {rid for rid, (worker, on_decode) in routes(node).items() if on_decode}
    assert all(routes(node)[rid][0] == "decode-0" for rid in local)
    return local


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    # Any queue at the prefill worker is long enough: every short prompt that finds the decode worker free of
    # another local prefill is prefilled there.
    experimental = {"local_prefill_max_tokens": MAX_LOCAL, "local_prefill_queue_tokens": 1}
    metrics_port = free_port()
    with Node(tmp_path_factory.mktemp("conditional"), str(model_dirs["llama"]),
              extra={"experimental": experimental, "controller": {"metrics_port": metrics_port}}) as running:
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
    local = prefilled_on_decode(node)
    assert local, "no short prompt was prefilled on the decode worker"
    assert not local & {f"r{i}" for i in range(len(long_prompts))}, "a prompt over the limit went to decode"
    wait_for(lambda: used_blocks(node) == {"prefill-0": 0, "decode-0": 0}, timeout_s=10)

    def counted() -> float:  # the gateway reports its metrics to the controller every second
        return total(scrape(node)[1], "pdrt_gateway_prefills_on_decode_total")

    wait_for(lambda: counted() == len(local), timeout_s=10, interval_s=0.2)


RULES = LocalPrefillRules(max_tokens=512, queue_tokens=512, max_slowdown=1.25, tpot_slo_s=0.2)


def decoding(step_s: float, decode_step_s: float) -> Load:
    return Load(num_running=8, step_s=step_s, decode_step_s=decode_step_s)


def test_a_short_prompt_behind_a_backlog_goes_to_a_decode_worker_with_room_in_its_steps():
    assert RULES.may_prefill_on_decode(300, 600, decoding(0.11, 0.1))
    assert RULES.may_prefill_on_decode(300, 600, Load(num_running=0))  # nothing decoding there to slow


def test_a_long_prompt_or_a_short_backlog_stays_with_the_prefill_worker():
    assert not RULES.may_prefill_on_decode(513, 600, decoding(0.1, 0.1))
    assert not RULES.may_prefill_on_decode(300, 511, decoding(0.1, 0.1))
    assert not RULES.may_prefill_on_decode(0, 600, decoding(0.1, 0.1))


def test_a_decode_worker_slowed_past_the_bound_or_near_the_tpot_slo_takes_no_prefill():
    assert not RULES.may_prefill_on_decode(300, 600, decoding(0.13, 0.1))  # 1.3x its plain steps
    assert not RULES.may_prefill_on_decode(300, 600, decoding(0.2, 0.19))  # at the TPOT SLO
    assert not RULES.may_prefill_on_decode(300, 600, decoding(0.5, 0.0))  # every recent step prefilled


def test_local_prefills_are_off_with_a_limit_of_zero():
    assert not LocalPrefillRules(max_tokens=0).may_prefill_on_decode(10, 10_000, Load())
