"""What the gateway measures of each request's life: queueing, first token, token gaps, the end, and its SLOs.

The request table calls three hooks, each a few float operations and one
`observe()`, so streaming stays cheap:

* `sent`: the first attempt left for a worker (queue time: admit -> sent);
* `tokens`: tokens arrived from a worker (TTFT on the first, otherwise the
  gap since the previous batch: inter-token latency);
* `ended`: the request's final frame, or None for a client that vanished.

Times live on the `GatewayRequest` (`admitted_at`, `sent_at`, ...). A
request *meets its SLOs* when it finished (stop or length) with TTFT <=
`ttft_slo_s` and TPOT = (e2e - TTFT) / (output tokens - 1) <= `tpot_slo_s`.
Attainment counts every request that finished or failed; cancelled ones (the
client's choice) are left out.
"""

import time

from prometheus_client import Counter, Gauge, Histogram

from pdrt.metrics.process_metrics import install, new_registry
from pdrt.node_config import GatewayConfig
from pdrt.roles.gateway_request import GatewayRequest
from pdrt.wire import Error, Tokens

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
                     float("inf"))
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 float("inf"))
NOT_JUDGED = ("cancelled", "client_gone")


def outcome(final: object | None) -> str:
    """finished_stop, finished_length, cancelled, error_<code>, or client_gone (None: nothing could be sent)."""
    if isinstance(final, Tokens):
        return "cancelled" if final.finish_reason == "cancelled" else f"finished_{final.finish_reason}"
    if isinstance(final, Error):
        return f"error_{final.code}"
    return "client_gone"


class GatewayMetrics:
    def __init__(self, config: GatewayConfig) -> None:
        self.ttft_slo_s, self.tpot_slo_s = config.ttft_slo_s, config.tpot_slo_s
        self.registry = r = new_registry()
        install(r)
        self.queue = Histogram("pdrt_gateway_queue_seconds", "Admission to the first attempt sent to a worker",
                               buckets=QUEUE_BUCKETS, registry=r)
        self.ttft = Histogram("pdrt_gateway_ttft_seconds", "Admission to the first output token at the gateway",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("pdrt_gateway_inter_token_seconds", "Gap between two outputs of a request",
                                     buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.tpot = Histogram("pdrt_gateway_tpot_seconds", "Per finished request: (e2e - ttft) / (tokens - 1)",
                              buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("pdrt_gateway_e2e_seconds", "Admission to the final frame of a finished request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("pdrt_gateway_requests", "Requests ended, by outcome", ["outcome"], registry=r)
        self.started = Counter("pdrt_gateway_started_requests", "Requests sent to a worker (the first time)",
                               registry=r)
        self.started_prompt_tokens = Counter("pdrt_gateway_started_prompt_tokens", "Prompt tokens of started "
                                             "requests", registry=r)
        self.started_max_tokens = Counter("pdrt_gateway_started_max_tokens", "Answer tokens asked for (max_tokens) "
                                          "by started requests", registry=r)
        self.streamed_tokens = Counter("pdrt_gateway_streamed_tokens", "Output tokens, counted as they arrive",
                                       registry=r)
        self.prompt_tokens = Counter("pdrt_gateway_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.prefills_on_decode = Counter("pdrt_gateway_prefills_on_decode", "Attempts sent to a decode worker to "
                                          "prefill itself (conditional disaggregation)", registry=r)
        self.prefills_moved = Counter("pdrt_gateway_prefills_moved", "Prompts taken back from a prefill worker's "
                                      "queue, unstarted, to be prefilled on their decode worker", registry=r)
        self.migrations = Counter("pdrt_gateway_migrations", "Requests moved to other workers with their output "
                                  "begun, after theirs died or stopped decoding", registry=r)
        self.cached_tokens = Counter("pdrt_gateway_cached_prompt_tokens", "Prompt tokens served from a prefix cache",
                                     registry=r)
        self.output_tokens = Counter("pdrt_gateway_output_tokens", "Output tokens of ended requests", registry=r)
        self.max_tokens = Counter("pdrt_gateway_max_tokens", "Answer tokens asked for (max_tokens) by ended requests: "
                                  "against pdrt_gateway_output_tokens, how much of it answers use", registry=r)
        self.slo_requests = Counter("pdrt_gateway_slo_requests", "Requests judged against the SLOs (finished or "
                                    "failed)", registry=r)
        self.slo_met = Counter("pdrt_gateway_slo_met", "Judged requests that met the TTFT SLO, the TPOT SLO, both",
                               ["slo"], registry=r)
        self.slo_output_tokens = Counter("pdrt_gateway_slo_output_tokens", "Output tokens of requests that met "
                                         "both SLOs (ETOP's numerator)", registry=r)
        self.met_ttft, self.met_tpot, self.met_both = (self.slo_met.labels(s) for s in ("ttft", "tpot", "both"))
        Gauge("pdrt_gateway_ttft_slo_seconds", "The TTFT SLO", registry=r).set(self.ttft_slo_s)
        Gauge("pdrt_gateway_tpot_slo_seconds", "The TPOT SLO", registry=r).set(self.tpot_slo_s)

    def sent(self, req: GatewayRequest) -> None:
        if not req.sent_at:  # a retry is not queueing again, nor a new request
            req.sent_at = time.monotonic()
            self.queue.observe(req.sent_at - req.admitted_at)
            self.started.inc()
            self.started_prompt_tokens.inc(len(req.prompt_token_ids))
            self.started_max_tokens.inc(req.params.max_tokens)

    def tokens(self, req: GatewayRequest, num_new: int) -> None:
        if not num_new:
            return
        self.streamed_tokens.inc(num_new)
        now = time.monotonic()
        if req.first_token_at:
            self.inter_token.observe(now - req.last_token_at)
        else:
            req.first_token_at = now
            self.ttft.observe(now - req.admitted_at)
        req.last_token_at = now

    def ended(self, req: GatewayRequest, final: object | None) -> None:
        how = outcome(final)
        self.requests.labels(how).inc()
        num_tokens = len(req.token_ids)
        self.prompt_tokens.inc(len(req.prompt_token_ids))
        self.cached_tokens.inc(req.num_cached_tokens)
        self.output_tokens.inc(num_tokens)
        self.max_tokens.inc(req.params.max_tokens)
        if how in NOT_JUDGED:
            return
        self.slo_requests.inc()
        if not how.startswith("finished"):
            return
        e2e = time.monotonic() - req.admitted_at
        ttft = req.first_token_at - req.admitted_at if req.first_token_at else e2e
        self.e2e.observe(e2e)
        tpot = 0.0
        if num_tokens > 1:
            tpot = (e2e - ttft) / (num_tokens - 1)
            self.tpot.observe(tpot)
        ttft_ok, tpot_ok = ttft <= self.ttft_slo_s, tpot <= self.tpot_slo_s
        if ttft_ok:
            self.met_ttft.inc()
        if tpot_ok:
            self.met_tpot.inc()
        if ttft_ok and tpot_ok:
            self.met_both.inc()
            self.slo_output_tokens.inc(num_tokens)
