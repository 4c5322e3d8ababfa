"""The `pdrt status` table from a Status and a metrics exposition, each of which may be missing."""

from pdrt.metrics.exposition import parse
from pdrt.metrics.status_table import default_metrics_url, render_table
from pdrt.wire import Load, Status, WorkerStatus

METRICS = b"""\
# TYPE pdrt_gateway_requests_total counter
pdrt_gateway_requests_total{outcome="finished_stop",process="gateway",role="gateway"} 9
pdrt_gateway_requests_total{outcome="error_timeout",process="gateway",role="gateway"} 1
# TYPE pdrt_gateway_slo_requests_total counter
pdrt_gateway_slo_requests_total{process="gateway",role="gateway"} 10
# TYPE pdrt_gateway_slo_met_total counter
pdrt_gateway_slo_met_total{process="gateway",role="gateway",slo="both"} 8
# TYPE pdrt_gateway_ttft_slo_seconds gauge
pdrt_gateway_ttft_slo_seconds{process="gateway",role="gateway"} 1
# TYPE pdrt_gateway_tpot_slo_seconds gauge
pdrt_gateway_tpot_slo_seconds{process="gateway",role="gateway"} 0.1
# TYPE pdrt_gateway_ttft_seconds histogram
pdrt_gateway_ttft_seconds_bucket{le="0.1",process="gateway",role="gateway"} 5
pdrt_gateway_ttft_seconds_bucket{le="0.2",process="gateway",role="gateway"} 10
pdrt_gateway_ttft_seconds_bucket{le="+Inf",process="gateway",role="gateway"} 10
pdrt_gateway_ttft_seconds_count{process="gateway",role="gateway"} 10
pdrt_gateway_ttft_seconds_sum{process="gateway",role="gateway"} 1.2
# TYPE pdrt_worker_prefix_cache_hit_rate gauge
pdrt_worker_prefix_cache_hit_rate{process="prefill-0",role="prefill"} 0.25
# TYPE pdrt_health_psi gauge
pdrt_health_psi{process="prefill-0",role="prefill"} 9.5
# TYPE pdrt_health_ds gauge
pdrt_health_ds{process="decode-0",role="decode"} 0.04
# TYPE pdrt_health_ke gauge
pdrt_health_ke{process="controller",role="controller"} 1
# TYPE pdrt_health_etop gauge
pdrt_health_etop{process="controller",role="controller"} 12345
"""

STATUS = Status([WorkerStatus("decode-0", "decode", True, Load(num_running=3, num_blocks=100, num_used_blocks=25)),
                 WorkerStatus("prefill-0", "prefill", True, Load(num_waiting=2, num_blocks=100, num_drafts=1))])


def test_the_table_shows_workers_slo_attainment_latencies_and_indices():
    table = render_table(STATUS, parse(METRICS), [])
    lines = table.splitlines()
    assert lines[0].split() == ["process", "role", "alive", "running", "waiting", "kv", "used", "drafts", "prefix",
                                "hit", "psi", "ds"]
    assert lines[1].split() == ["decode-0", "decode", "yes", "3", "0", "25.0%", "0", "-", "-", "0.040"]
    assert lines[2].split() == ["prefill-0", "prefill", "yes", "0", "2", "0.0%", "1", "25%", "9.5", "-"]
    assert "requests: 10 ended, 0 open | error_timeout 1, finished_stop 9" in table
    assert "SLO attainment: 80.0% of 10 (TTFT <= 1.00 s, TPOT <= 100.0 ms)" in table
    assert "TTFT p50 100.0 ms  p90 180.0 ms" in table
    assert "TPOT p50 -" in table  # no TPOT histogram reported
    assert "health: PSI 9.5 (> 8)  DS 0.040 (< 0.15)  KE 1.0000 (> 0.999)  ETOP 12345 tokens/worker-hour" in table


def test_a_missing_source_is_named_and_the_rest_still_shown():
    table = render_table(STATUS, None, ["metrics http://127.0.0.1:7103/metrics: connection refused"])
    assert "prefill-0" in table and "SLO attainment" not in table
    assert table.endswith("unavailable: metrics http://127.0.0.1:7103/metrics: connection refused")
    assert "health: PSI -" in render_table(None, parse(b""), [])


def test_the_default_metrics_url_is_the_controller_port_on_the_gateway_host():
    assert default_metrics_url("tcp://10.0.0.5:7100") == "http://10.0.0.5:7103/metrics"
    assert default_metrics_url("ipc:///tmp/pdrt") == "http://127.0.0.1:7103/metrics"
