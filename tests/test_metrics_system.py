"""Metrics through `pdrt up`: every process reports, the controller merges and serves them, `pdrt status` shows them."""

import math
import signal
import subprocess
import sys
import time

import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import samples, total
from pdrt.metrics.status_table import CLEAR
from pdrt.testing.node import Node, free_port
from pdrt.wire import Cancel, Generate, Tokens
from tests.system_client import RawClient, default_sigint, scrape

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def node(model_dirs, tmp_path_factory):
    # The tiny model is below the size at which decode borrows by default; this node borrows to test it.
    extra = {"controller": {"metrics_port": free_port()}, "gateway": {"http_port": 0},
             "experimental": {"borrow_threads": True}}
    with Node(tmp_path_factory.mktemp("metrics-node"), str(model_dirs["llama"]), extra=extra) as running:
        running.metrics_url = f"http://127.0.0.1:{extra['controller']['metrics_port']}/metrics"
        yield running


@pytest.fixture(scope="module")
def client(node):
    c = RawClient(node.address)
    yield c
    c.close()


def scrape_until(node: Node, predicate, timeout_s: float = 15.0) -> list:
    """The metrics once `predicate(families)` holds (reports arrive every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        families = scrape(node)[1]
        if predicate(families):
            return families
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never satisfied the condition; last: {[f.name for f in families]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def served(node, client, prompts) -> tuple[list, list]:
    """The metrics before and after eight requests of 1 to 33 prompt tokens, once every process reported them."""
    before = scrape_until(node, lambda f: total(f, "pdrt_controller_processes") == 3
                          and {labels["process"] for labels, _ in samples(f, "pdrt_process_uptime_seconds")}
                          == {"controller", "gateway", "prefill-0", "decode-0"})
    batch = [p[:40] or [5] for p in prompts[:8]]
    results = client.generate_many(batch, GREEDY)
    assert all(len(tokens) == 8 for tokens in results.values())
    counts = ("pdrt_gateway_requests_total", "pdrt_kv_pulls_total", "pdrt_worker_prefill_seconds_count")
    after = scrape_until(node, lambda f: all(total(f, name) >= total(before, name) + 8 for name in counts))
    return before, after


def test_counters_move_as_requests_complete(served, prompts):
    before, after = served
    batch = [p[:40] or [5] for p in prompts[:8]]

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("pdrt_gateway_requests_total", outcome="finished_length") == 8
    assert moved("pdrt_gateway_ttft_seconds_count") == 8
    assert moved("pdrt_gateway_e2e_seconds_count") == 8
    assert moved("pdrt_gateway_tpot_seconds_count") == 8
    assert moved("pdrt_gateway_inter_token_seconds_count") >= 8
    assert moved("pdrt_gateway_output_tokens_total") == 64
    assert moved("pdrt_gateway_prompt_tokens_total") == sum(len(p) for p in batch)
    assert moved("pdrt_kv_handoffs_total", result="sent") == 8
    assert moved("pdrt_kv_pulls_total", result="succeeded") == 8
    assert moved("pdrt_kv_transfer_seconds_count") == 8
    assert moved("pdrt_worker_prefill_seconds_count", process="prefill-0") == 8
    assert moved("pdrt_worker_step_seconds_count", process="decode-0") >= 7
    assert total(after, "pdrt_worker_kv_blocks", role="decode") > 0


def test_the_decode_worker_borrows_the_idle_prefill_workers_thread(served):
    before, after = served  # the eight prompts are prefilled in the first steps; decode goes on alone
    name = "pdrt_worker_borrowing_steps_total"
    assert total(after, name, process="decode-0") > total(before, name, process="decode-0")


def test_the_prefill_worker_reports_its_catch_ups(served):
    _, after = served  # a prompt that waits while the decode worker has room takes the CPU: it may have
    catch_ups, seconds = ([(labels["process"], value) for labels, value in samples(after, name)]
                          for name in ("pdrt_prefill_catch_ups_total", "pdrt_prefill_caught_up_seconds_total"))
    assert [p for p, _ in catch_ups] == [p for p, _ in seconds] == ["prefill-0"]
    assert catch_ups[0][1] >= 0 and (seconds[0][1] > 0) == (catch_ups[0][1] > 0)


def test_the_merged_exposition_is_valid_labelled_and_holds_the_indices_in_range(node, served):
    text, families = scrape(node)
    headers = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(headers) == len(set(headers)), "a family appears twice"
    assert all({"process", "role"} <= set(s.labels) for f in families for s in f.samples)
    for name in ("pdrt_health_psi", "pdrt_health_ds", "pdrt_health_ke", "pdrt_health_etop"):
        assert samples(families, name), f"{name} missing"
    psi = total(families, "pdrt_health_psi", process="prefill-0")
    ds = total(families, "pdrt_health_ds", process="decode-0")
    assert psi > 0, psi  # +Inf when every recent prefill took as long (one step ran them all)
    assert 0 <= ds < 10
    assert total(families, "pdrt_health_ke") == 1.0  # every handoff pulled
    assert 0 <= total(families, "pdrt_health_etop") < math.inf  # 0 only if no request met its SLOs
    for labels, rate in samples(families, "pdrt_worker_prefix_cache_hit_rate"):
        assert math.isnan(rate) or 0 <= rate <= 1, labels
    assert total(families, "pdrt_gateway_slo_met_total", slo="both") <= total(families,
                                                                                "pdrt_gateway_slo_requests_total")


def test_a_cancelled_request_counts_as_cancelled_and_is_not_judged(node, client):
    before = scrape(node)[1]
    client.send(Generate("slow", token_ids=[7] * 20, params=SamplingParams(temperature=0, max_tokens=4000,
                                                                            ignore_eos=True)))
    first = client.recv()
    assert isinstance(first, Tokens)
    client.send(Cancel("slow"))
    final = first
    while not final.finished:
        final = client.recv()
    assert final.finish_reason == "cancelled"
    after = scrape_until(node, lambda f: total(f, "pdrt_gateway_requests_total", outcome="cancelled")
                         > total(before, "pdrt_gateway_requests_total", outcome="cancelled"))
    assert total(after, "pdrt_gateway_slo_requests_total") == total(before, "pdrt_gateway_slo_requests_total")


def test_pdrt_status_prints_the_table_once_and_refreshes_with_watch(node, served):
    command = [sys.executable, "-m", "pdrt.cli", "status", "--server", node.address, "--metrics", node.metrics_url]
    once = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr
    for expected in ("prefill-0", "decode-0", "SLO attainment:", "TTFT p50", "TPOT p50", "health: PSI", "KE 1.0000"):
        assert expected in once.stdout, once.stdout
    watching = subprocess.Popen([*command, "--watch", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 30
    output = ""
    while output.count(CLEAR) < 2 and time.monotonic() < deadline:
        output += watching.stdout.readline()
    watching.send_signal(signal.SIGINT)
    out, err = watching.communicate(timeout=30)
    assert (output + out).count(CLEAR) >= 2, err
    assert watching.returncode == 0, err
