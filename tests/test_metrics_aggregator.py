"""The controller's merge: reports labelled by sender, stale or departed processes dropped, KE and ETOP computed."""

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pdrt.control_plane.registry import Registry
from pdrt.metrics.aggregator import MetricsAggregator
from pdrt.metrics.exposition import parse, samples, total
from pdrt.wire import MetricsReport


def exposition(uptime_s: float, counters: dict[tuple[str, str], float]) -> bytes:
    """A process's report: its uptime and counters given as (name, result label or "") -> value."""
    registry = CollectorRegistry()
    Gauge("pdrt_process_uptime_seconds", "uptime", registry=registry).set(uptime_s)
    made: dict[str, Counter] = {}
    for (name, result), value in counters.items():
        if name not in made:
            made[name] = Counter(name, name, ["result"] if result else [], registry=registry)
        (made[name].labels(result) if result else made[name]).inc(value)
    return generate_latest(registry)


@pytest.fixture
def node() -> tuple[Registry, MetricsAggregator]:
    registry = Registry(lease_s=60.0)
    for pid, role in (("gateway", "gateway"), ("prefill-0", "prefill"), ("decode-0", "decode")):
        registry.register(pid, "i1", role, f"tcp://{pid}", pid.encode())
    return registry, MetricsAggregator(registry)


def test_reports_merge_labelled_with_their_sender_and_the_indices_follow_from_them(node):
    _, aggregator = node
    aggregator.report(MetricsReport("gateway", "i1", "gateway", exposition(
        100.0, {("pdrt_gateway_slo_output_tokens", ""): 3600})))
    aggregator.report(MetricsReport("prefill-0", "i1", "prefill", exposition(
        1800.0, {("pdrt_kv_handoffs", "sent"): 100, ("pdrt_kv_handoffs", "expired"): 1})))
    aggregator.report(MetricsReport("decode-0", "i1", "decode", exposition(
        1800.0, {("pdrt_kv_pulls", "succeeded"): 98, ("pdrt_kv_pulls", "failed"): 1})))
    aggregator.refresh()
    families = parse(aggregator.exposition())
    assert total(families, "pdrt_kv_handoffs_total", process="prefill-0", role="prefill", result="sent") == 100
    assert total(families, "pdrt_health_ke") == pytest.approx(0.98)  # 98 of 100 settled handoffs
    assert total(families, "pdrt_health_etop") == pytest.approx(3600)  # 3600 tokens over two half-hour workers
    live = {labels["role"]: value for labels, value in samples(families, "pdrt_controller_processes")}
    assert live == {"gateway": 1, "prefill": 1, "decode": 1, "colocated": 0}
    assert {labels["process"] for labels, _ in samples(families, "pdrt_process_uptime_seconds")} == {
        "controller", "gateway", "prefill-0", "decode-0"}


def test_reports_of_unknown_incarnations_are_ignored_and_departed_processes_leave_the_view(node):
    registry, aggregator = node
    aggregator.report(MetricsReport("decode-0", "old", "decode", exposition(5.0, {("pdrt_kv_pulls", "succeeded"): 7})))
    aggregator.report(MetricsReport("nobody", "i1", "decode", exposition(5.0, {("pdrt_kv_pulls", "succeeded"): 7})))
    aggregator.refresh()
    assert total(aggregator.snapshot, "pdrt_kv_pulls_total") == 0
    assert math.isnan(total(aggregator.snapshot, "pdrt_health_ke"))  # nothing settled yet
    aggregator.report(MetricsReport("decode-0", "i1", "decode", exposition(5.0, {("pdrt_kv_pulls", "succeeded"): 7})))
    aggregator.refresh()
    assert total(aggregator.snapshot, "pdrt_kv_pulls_total") == 7
    registry.remove("decode-0", "i1")
    aggregator.refresh()
    assert total(aggregator.snapshot, "pdrt_kv_pulls_total") == 0


def test_a_report_that_does_not_parse_is_dropped(node):
    _, aggregator = node
    aggregator.report(MetricsReport("gateway", "i1", "gateway", b"not { prometheus text\n"))
    aggregator.refresh()
    assert "gateway" not in aggregator.reports
