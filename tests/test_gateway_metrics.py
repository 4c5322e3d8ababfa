"""The gateway's request metrics and its /metrics view: outcomes, SLO attainment, and one valid exposition."""

import time

import pytest

from pdrt.engine.sampling_params import SamplingParams
from pdrt.metrics.exposition import parse, render, samples, total
from pdrt.metrics.gateway_metrics import GatewayMetrics, outcome
from pdrt.metrics.gateway_view import GatewayMetricsView
from pdrt.node_config import GatewayConfig
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.wire import Error, Load, MetricsView, Status, Tokens, WorkerStatus


def request(num_output_tokens: int, ttft_s: float, e2e_s: float) -> GatewayRequest:
    """A request admitted `e2e_s` ago whose first token came `ttft_s` after admission."""
    req = GatewayRequest.create(b"client", "r", [1, 2, 3], SamplingParams(), True, time.monotonic() + 60, None)
    req.admitted_at = time.monotonic() - e2e_s
    req.first_token_at = req.admitted_at + ttft_s
    req.token_ids = list(range(num_output_tokens))
    return req


def finished(reason: str = "length") -> Tokens:
    return Tokens("r", [], finished=True, finish_reason=reason)


@pytest.fixture
def metrics() -> GatewayMetrics:
    return GatewayMetrics(GatewayConfig(ttft_slo_s=0.5, tpot_slo_s=0.05))


def families(metrics: GatewayMetrics):
    return list(metrics.registry.collect())


def test_outcomes_name_the_finish_reason_or_the_error_code():
    assert outcome(finished("stop")) == "finished_stop"
    assert outcome(finished("length")) == "finished_length"
    assert outcome(finished("cancelled")) == "cancelled"
    assert outcome(Error("worker_lost", "gone", "r")) == "error_worker_lost"
    assert outcome(None) == "client_gone"


def test_a_request_meets_its_slos_only_with_both_ttft_and_tpot_within_them(metrics):
    metrics.ended(request(11, ttft_s=0.1, e2e_s=0.5), finished())  # tpot 0.04: meets both
    metrics.ended(request(11, ttft_s=0.9, e2e_s=1.0), finished())  # ttft over
    metrics.ended(request(11, ttft_s=0.1, e2e_s=2.1), finished("stop"))  # tpot 0.2: over
    metrics.ended(request(1, ttft_s=0.2, e2e_s=0.2), finished())  # one token: tpot does not apply
    metrics.ended(request(3, ttft_s=0.1, e2e_s=5.0), Error("timeout", "late", "r"))  # failed: judged, not met
    metrics.ended(request(3, ttft_s=0.1, e2e_s=0.2), finished("cancelled"))  # the client's choice: not judged
    got = families(metrics)
    assert total(got, "pdrt_gateway_slo_requests_total") == 5
    met = {labels["slo"]: value for labels, value in samples(got, "pdrt_gateway_slo_met_total")}
    assert met == {"ttft": 3, "tpot": 3, "both": 2}
    assert total(got, "pdrt_gateway_slo_output_tokens_total") == 12
    assert total(got, "pdrt_gateway_requests_total", outcome="finished_length") == 3
    assert total(got, "pdrt_gateway_requests_total", outcome="error_timeout") == 1
    assert total(got, "pdrt_gateway_output_tokens_total") == 11 * 3 + 1 + 3 + 3
    assert total(got, "pdrt_gateway_max_tokens_total") == 6 * SamplingParams().max_tokens  # asked for, ended
    assert total(got, "pdrt_gateway_tpot_seconds_count") == 3  # finished, with more than one token
    assert total(got, "pdrt_gateway_e2e_seconds_count") == 4


def test_queue_time_ttft_and_token_gaps_are_observed_once_each(metrics):
    req = request(0, ttft_s=0, e2e_s=0.01)
    req.first_token_at = 0.0
    metrics.sent(req)
    metrics.sent(req)  # a retry: not queueing again
    metrics.tokens(req, 0)  # an output without tokens (an abort's) is no token
    metrics.tokens(req, 1)
    metrics.tokens(req, 2)
    metrics.tokens(req, 1)
    got = families(metrics)
    assert total(got, "pdrt_gateway_queue_seconds_count") == 1
    assert total(got, "pdrt_gateway_ttft_seconds_count") == 1
    assert total(got, "pdrt_gateway_inter_token_seconds_count") == 2


def test_the_view_serves_this_gateway_live_and_the_others_from_the_controller(metrics):
    status = Status([WorkerStatus("decode-0", "decode", True, Load())], 2,
                    {"drafts_opened": 4, "warmup_dropped_stale": 1, "open_drafts": 3, "open_answer_tokens_left": 40})
    view = GatewayMetricsView(metrics, lambda: status, "gateway")
    metrics.ended(request(5, ttft_s=0.1, e2e_s=0.2), finished())
    stale_self = 'pdrt_gateway_requests_total{outcome="finished_length",process="gateway",role="gateway"} 99.0\n'
    other = 'pdrt_gateway_requests_total{outcome="finished_stop",process="gateway-b",role="gateway"} 7.0\n'
    decode = 'pdrt_worker_kv_blocks_used{process="decode-0",role="decode"} 12.0\n'
    view.update(MetricsView(("# TYPE pdrt_gateway_requests_total counter\n" + stale_self + other
                             + "# TYPE pdrt_worker_kv_blocks_used gauge\n" + decode).encode()))
    text = view.exposition().decode()
    assert text.count("# TYPE pdrt_gateway_requests_total counter") == 1
    got = parse(text.encode())
    assert total(got, "pdrt_gateway_requests_total", process="gateway") == 1  # live, not the stale 99
    assert total(got, "pdrt_gateway_requests_total", process="gateway-b") == 7
    assert total(got, "pdrt_worker_kv_blocks_used", process="decode-0") == 12
    assert total(got, "pdrt_gateway_events_total", event="drafts_opened", process="gateway", role="gateway") == 4
    assert total(got, "pdrt_gateway_events_total", event="warmup_dropped_stale") == 1
    assert total(got, "pdrt_gateway_open_drafts") == 3
    assert total(got, "pdrt_gateway_open_requests") == 2
    assert total(got, "pdrt_gateway_open_answer_tokens_left") == 40


def test_a_view_that_does_not_parse_keeps_the_previous_one(metrics):
    view = GatewayMetricsView(metrics, lambda: Status([]), "gateway")
    view.update(MetricsView(b"# TYPE up gauge\nup{process=\"decode-0\"} 1\n"))
    view.update(MetricsView(b"garbage { here\n"))
    assert total(parse(view.exposition()), "up", process="decode-0") == 1
    assert render([]) == b""


def test_started_requests_and_streamed_tokens_count_as_they_happen_retries_once(metrics):
    req = request(5, ttft_s=0.1, e2e_s=0.5)
    metrics.sent(req)
    metrics.sent(req)  # a retry on another worker
    metrics.tokens(req, 2)
    metrics.tokens(req, 1)
    got = families(metrics)
    assert total(got, "pdrt_gateway_started_requests_total") == 1
    assert total(got, "pdrt_gateway_started_prompt_tokens_total") == len(req.prompt_token_ids)
    assert total(got, "pdrt_gateway_started_max_tokens_total") == req.params.max_tokens
    assert total(got, "pdrt_gateway_streamed_tokens_total") == 3
    assert total(got, "pdrt_gateway_output_tokens_total") == 0  # counted when it ends
