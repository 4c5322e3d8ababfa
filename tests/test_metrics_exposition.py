"""Prometheus text in and out: reports of several processes become one valid exposition."""

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdrt.metrics.exposition import histogram_quantile, merge, parse, quantile, relabel, render, samples, total


def report(requests: int, latencies: list[float]) -> bytes:
    registry = CollectorRegistry()
    Counter("pdrt_test_requests", "requests", ["outcome"], registry=registry).labels("ok").inc(requests)
    histogram = Histogram("pdrt_test_seconds", "latency", buckets=(0.1, 0.2, 0.4, float("inf")), registry=registry)
    for latency in latencies:
        histogram.observe(latency)
    return generate_latest(registry)


def test_two_reports_merge_into_one_family_each_with_every_sample_labelled():
    a = relabel(parse(report(3, [0.05, 0.15])), {"process": "gateway-a", "role": "gateway"})
    b = relabel(parse(report(4, [0.3])), {"process": "gateway-b", "role": "gateway"})
    text = render(merge([a, b])).decode()
    assert text.count("# TYPE pdrt_test_requests_total counter") == 1
    assert text.count("# TYPE pdrt_test_seconds histogram") == 1
    families = parse(text.encode())
    assert all({"process", "role"} <= set(s.labels) for f in families for s in f.samples)
    assert total(families, "pdrt_test_requests_total") == 7
    assert total(families, "pdrt_test_requests_total", process="gateway-b") == 4
    assert total(families, "pdrt_test_seconds_count") == 3
    assert [v for _, v in samples(families, "pdrt_test_requests_total", process="gateway-a")] == [3]


def test_relabel_keeps_a_label_the_sample_already_has():
    families = relabel(parse(b'# TYPE live gauge\nlive{role="decode"} 2\n'), {"process": "controller",
                                                                             "role": "controller"})
    assert families[0].samples[0].labels == {"process": "controller", "role": "decode"}


def test_quantile_interpolates_within_the_bucket_as_prometheus_does():
    buckets = [(0.1, 10.0), (0.2, 30.0), (float("inf"), 40.0)]
    assert quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert quantile(0.9, buckets) == pytest.approx(0.2)  # in the +Inf bucket: the largest finite bound
    assert math.isnan(quantile(0.5, []))
    assert math.isnan(quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]))


def test_histogram_quantile_sums_the_buckets_of_every_process():
    a = relabel(parse(report(0, [0.05] * 10)), {"process": "a"})
    b = relabel(parse(report(0, [0.3] * 10)), {"process": "b"})
    families = merge([a, b])
    assert histogram_quantile(0.25, families, "pdrt_test_seconds") <= 0.1
    assert 0.2 < histogram_quantile(0.9, families, "pdrt_test_seconds") <= 0.4
    assert histogram_quantile(0.9, families, "pdrt_test_seconds", process="a") <= 0.1


def test_text_that_is_not_an_exposition_is_rejected():
    with pytest.raises(ValueError):
        parse(b"this is { not prometheus\n")
