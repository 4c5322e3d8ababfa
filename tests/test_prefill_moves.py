"""Prompts that a backed-up prefill worker would make late move, unstarted, to their decode worker."""

import inspect
import logging

import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import total
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.roles.local_prefill import LocalPrefillRules, first_token_seconds, stall_fits
from pdrt.roles.prefix_memory import PrefixMemory
from pdrt.testing.node import Node, free_port
from tests.system_client import RawClient, node_status, scrape, used_blocks, wait_for
from tests.test_conditional_disaggregation import prefilled_on_decode

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


TTFT_SLO_S = 1.0


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    # The decode worker's streams have all the TPOT room they could want, and no prompt goes to the decode
    # worker on arrival: prompts reach it only by moving. Chunks of 32 tokens slow the prefill worker down.
    gateway = {"ttft_slo_s": TTFT_SLO_S, "tpot_slo_s": 60.0}
    experimental = {"local_prefill_max_slowdown": 1000.0, "local_prefill_queue_tokens": 1 << 30}
    metrics_port = free_port()
    with Node(tmp_path_factory.mktemp("moves"), str(model_dirs["llama"]), engine={"max_prefill_chunk_size": 32},
              extra={"gateway": gateway, "experimental": experimental, "controller": {"metrics_port": metrics_port}}) \
            as running:
        running.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        yield running


def prefill_rate(node: Node) -> float:
    return sum(w.load.prefill_tokens_per_s for w in node_status(node).workers if w.process_id == "prefill-0")


def test_prompts_a_prefill_queue_would_make_late_move_to_the_decode_worker_and_equal_generate(node, tokenizer,
                                                                                              references):
    ids = tokenizer(inspect.getsource(logging))["input_ids"]
    client = RawClient(node.address)
    try:
        client.generate_many([ids[:300]], GREEDY)
        rate = wait_for(lambda: prefill_rate(node), timeout_s=10)
        # Prompts of 1000 tokens that take the prefill worker 3 TTFT SLOs: the first meet the SLO there, the
        # last would not, and moving some to the decode worker lets more meet it.
        batch = [ids[i * 500: i * 500 + 1000] for i in range(min(60, max(8, round(3 * TTFT_SLO_S * rate / 1000))))]
        results = client.generate_many(batch, GREEDY)
    finally:
        client.close()
    for i, prompt in enumerate(batch):
        assert results[f"r{i}"] == references["llama"].greedy(prompt), f"request {i}"
    moved = prefilled_on_decode(node)
    assert moved, "no queued prompt moved to the decode worker"
    assert len(moved) < len(batch), "the prefill worker prefilled none of the batch"
    wait_for(lambda: used_blocks(node) == {"prefill-0": 0, "decode-0": 0}, timeout_s=10)
    wait_for(lambda: total(scrape(node)[1], "pdrt_gateway_prefills_moved_total") == len(moved), timeout_s=10,
             interval_s=0.2)


def request(num_prompt_tokens: int, admitted_at: float, sent_at: float) -> GatewayRequest:
    req = GatewayRequest.create(b"c", "r", [1] * num_prompt_tokens, SamplingParams(max_tokens=100), True, 1e9,
                                None)
    req.admitted_at, req.sent_at = admitted_at, sent_at
    return req


def test_the_move_that_leaves_the_fewest_late_is_chosen():
    now = 100.0

    def move(ttft_slo_s: float, queue: list, seconds_elsewhere) -> GatewayRequest | None:
        return LocalPrefillRules(ttft_slo_s=ttft_slo_s).prompt_to_move(queue, now, seconds_elsewhere)

    first, second, third = request(400, 99.0, 99.0), request(400, 99.5, 99.5), request(400, 99.9, 99.9)
    queue = [(third, 3.0), (first, 1.0), (second, 2.0)]  # seconds to each first token, as the worker serves them
    # First tokens 2.0, 2.5 and 3.1 s after arrival; with a TTFT SLO of 2.2 s, two are late. Moving the second
    # (0.5 s on the decode worker) leaves none: the third's first token comes 1 s sooner, 2.1 s after arrival.
    assert move(2.2, queue, lambda r: 0.5) is second
    assert move(2.2, queue, lambda r: None if r is second else 0.5) is first  # the third then 2.1
    assert move(2.2, queue, lambda r: 0.5 if r is third else None) is third  # the second stays late
    early, later = request(400, 100.0, 100.0), request(400, 100.0, 100.0)
    # Either move leaves none late: the later prompt's, the less likely to have started when the worker is asked.
    assert move(1.5, [(early, 1.0), (later, 2.0)], lambda r: 1.0) is later
    assert move(2.2, queue, lambda r: 5.0) is second  # late itself, but the third then not
    assert move(2.6, queue, lambda r: 5.0) is None  # any move leaves one late, as none does
    assert move(4.0, queue, lambda r: 0.5) is None  # none late


def test_the_workers_account_loses_the_work_of_prompts_gone_since():
    work = {"gw-1": 400, "gw-2": 800, "other-1": 1000, "gw-3": 1400}
    seconds = first_token_seconds(work, lambda rid: rid == "gw-2", 400.0)
    assert seconds == {"gw-1": 1.0, "other-1": 1.5, "gw-3": 2.5}


def test_a_stall_fits_while_every_stream_stays_within_its_tpot_bound_over_its_life():
    now = 100.0
    stream = request(10, 90.0, 90.0)
    stream.first_token_at = 95.0
    stream.token_ids = [1] * 51  # 5 s for 50 gaps: 0.1 s each; 49 more tokens to go
    # 5 s + stall + 49 * 0.1 s over 99 gaps within 0.12 s: stalls up to 1.98 s fit.
    assert stall_fits([stream], 1.9, 0.1, 0.12, now)
    assert not stall_fits([stream], 2.1, 0.1, 0.12, now)
    assert stall_fits([], 100.0, 0.1, 0.12, now)
    queued = request(10, 99.0, 99.0)  # no token yet: it starts now, 99 gaps of 0.1 s ahead within 0.12 s
    assert stall_fits([queued], 1.9, 0.1, 0.12, now)
    assert not stall_fits([queued], 2.1, 0.1, 0.12, now)


def test_a_workers_cached_prefix_is_the_leading_blocks_sent_there_within_its_bound():
    memory = PrefixMemory(block_size=4, hash_seed=0, max_blocks=3)
    first = memory.keys(list(range(10)))  # two full blocks; the last two tokens are no block
    assert len(first) == 2
    memory.remember("decode-0", first)
    assert memory.cached_tokens("decode-0", memory.keys(list(range(8)) + [7, 7, 7, 7])) == 8
    assert memory.cached_tokens("decode-0", memory.keys([9] + list(range(1, 12)))) == 0  # another first block
    assert memory.cached_tokens("prefill-0", first) == 0
    memory.remember("decode-0", memory.keys(list(range(100, 108))))  # two more: the oldest block goes
    assert memory.cached_tokens("decode-0", first) == 0
    memory.forget("decode-0")
    assert memory.workers == {}
