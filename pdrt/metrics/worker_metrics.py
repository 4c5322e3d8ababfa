"""What a worker measures: its engine's steps and prefills, its KV pool and prefix cache, and its KV transfers.

The engine loop calls `stepped` once per step (two `observe()` calls and a
walk over the step's sequences that reads a couple of attributes of each,
for the prefills among them); the transfer paths call
the `handoff_*` (prefill) and `pull*` (decode) hooks once per request. The
rest (blocks in use, prefix-cache hits, queue lengths, draft counters,
demotions, PSI and DS) is read from the engine and the worker's load only
when the metrics are collected, so it costs the hot loop nothing.

A request's prefill time runs from the start of the step that scheduled its
first chunk (after its submit, for a draft) to the end of the step that
sampled its first token.
"""

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pdrt.engine.llm_engine import LLMEngine
from pdrt.engine.scheduler import ScheduledBatch
from pdrt.metrics.health import DS_WINDOW, PSI_WINDOW, decoding_smoothness, prefill_stability
from pdrt.metrics.process_metrics import install, new_registry
from pdrt.priority import CatchUp
from pdrt.wire import Load

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, float("inf"))
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, float("inf"))
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, float("inf"))
BYTE_BUCKETS = tuple(float(4 ** k) for k in range(6, 17)) + (float("inf"),)  # 4 KiB .. 4 GiB
PREFILLING_ROLES = ("prefill", "colocated")  # a decode worker's prefills are the few it takes on itself
SPLIT_ROLES = ("prefill", "decode")  # a disaggregated node's workers, which hand KV over and can change roles
MAX_TRACKED_PREFILLS = 4096  # beyond this, forget prefills whose request is gone (aborted mid-prefill)
RECENT_STEPS = 32  # steps that decoded, for the load's step_s and decode_step_s


class WorkerMetrics:
    def __init__(self, role: str, engine: LLMEngine, load: Callable[[], Load]) -> None:
        self.role = role  # the worker's current role
        self.engine = engine
        self.bytes_per_block = engine.pool.layout.bytes_per_block
        self.registry = r = new_registry()
        install(r)
        self.step_seconds = Histogram("pdrt_worker_step_seconds", "Latency of one engine step that ran",
                                      buckets=STEP_BUCKETS, registry=r)
        self.step_tokens = Histogram("pdrt_worker_step_tokens", "Tokens one engine step computed (decodes and "
                                     "prefill chunks)", buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.decode_steps: deque[float] = deque(maxlen=DS_WINDOW)
        self.recent_steps: deque[tuple[float, bool]] = deque(maxlen=RECENT_STEPS)  # (seconds, prefilled too)
        self.recent_prefills: deque[tuple[float, int]] = deque(maxlen=RECENT_STEPS)  # (seconds, prompt tokens)
        self.prefill_times: deque[float] = deque(maxlen=PSI_WINDOW)
        self.prefill_started: dict[str, float] = {}  # request id -> perf_counter of its first chunk's step
        self.catch_up: CatchUp | None = None  # a prefill worker's, where it catches up
        self.prefill_seconds = Histogram("pdrt_worker_prefill_seconds", "First chunk scheduled -> first token, "
                                         "per request", buckets=PREFILL_BUCKETS, registry=r)
        if role in SPLIT_ROLES:
            handoffs = Counter("pdrt_kv_handoffs", "KV handoffs to decode workers: sent, then acked or expired",
                               ["result"], registry=r)
            self.handoffs_sent, self.handoffs_acked, self.handoffs_expired = (
                handoffs.labels(x) for x in ("sent", "acked", "expired"))
            self.handoff_bytes = Counter("pdrt_kv_handoff_bytes", "Bytes of KV handed off", registry=r)
            pulls = Counter("pdrt_kv_pulls", "KV transfers from prefill workers, by result", ["result"], registry=r)
            self.pulls_succeeded, self.pulls_failed = pulls.labels("succeeded"), pulls.labels("failed")
            self.transfer_seconds = Histogram("pdrt_kv_transfer_seconds", "Time to pull one request's KV",
                                              buckets=TRANSFER_BUCKETS, registry=r)
            self.transfer_bytes = Histogram("pdrt_kv_transfer_bytes", "Bytes pulled for one request (prefix-cache "
                                            "hits excluded)", buckets=BYTE_BUCKETS, registry=r)
            self.borrowing_steps = Counter("pdrt_worker_borrowing_steps", "Steps run with threads borrowed from "
                                           "idle prefill workers on this host", registry=r)
            self.streams_shed = Counter("pdrt_worker_streams_shed", "Streams sent on to a decode worker with fewer "
                                        "streams, as the controller asked", registry=r)
        r.register(_EngineCollector(self, load))

    # -- hooks ----------------------------------------------------------------------

    def new_role(self, role: str) -> None:
        """The worker serves `role` from now on: the old role's recent steps say nothing of the new one's."""
        self.role = role
        self.recent_steps.clear()
        self.recent_prefills.clear()

    def stepped(self, started: float, borrowed_threads: int = 0) -> None:
        """After an engine step that began at `started` (time.perf_counter()) with `borrowed_threads` lent."""
        batch = self.engine.last_batch
        if batch.is_empty:
            return
        now = time.perf_counter()
        self.step_seconds.observe(now - started)
        if batch.decodes:  # what a stream waits per token: a step that gave it several counts for each
            per_token = (now - started) / max(self.engine.last_tokens_per_stream, 1.0)
            self.decode_steps.append(per_token)
            self.recent_steps.append((per_token, bool(batch.prefills)))
        if batch.prefills:
            self.recent_prefills.append((now - started, sum(n for _, n in batch.prefills)))
        if borrowed_threads > 0:
            self.borrowing_steps.inc()
        self.step_tokens.observe(len(batch.decodes) + sum(n for _, n in batch.prefills))
        self._prefills(batch, started, now)

    def _prefills(self, batch: ScheduledBatch, started: float, now: float) -> None:
        """Start and end the prefill times of this step's prompts.

        A chunk of one token is placed among the decodes, so a prompt shows
        up on either side; a sequence with more than one output token is a
        decode, or a recompute after preemption, and not a prefill.
        """
        for seq in itertools.chain((seq for seq, _ in batch.prefills), batch.decodes):
            if seq.num_output_tokens <= 1 and not seq.is_draft and seq.request_id not in self.prefill_started:
                self.prefill_started[seq.request_id] = started
        for seq in itertools.chain(batch.prefill_samples, batch.decode_samples):
            if seq.num_output_tokens == 1:
                seconds = now - self.prefill_started.pop(seq.request_id, started)
                self.prefill_seconds.observe(seconds)
                self.prefill_times.append(seconds)
        if len(self.prefill_started) > MAX_TRACKED_PREFILLS:
            self.prefill_started = {k: v for k, v in self.prefill_started.items() if k in self.engine.sequences}

    def step_times(self) -> tuple[float, float]:
        """Mean latency of the recent steps that decoded, and of those that prefilled nothing (0.0: none)."""
        if not self.recent_steps:
            return 0.0, 0.0
        plain = [seconds for seconds, prefilled in self.recent_steps if not prefilled]
        mean = sum(seconds for seconds, _ in self.recent_steps) / len(self.recent_steps)
        return mean, sum(plain) / len(plain) if plain else 0.0

    def prefill_rate(self) -> tuple[float, float]:
        """Prompt tokens per second of the recent steps that prefilled, their decodes included, and the prompt
        tokens one of them computed on average ((0.0, 0.0): none)."""
        seconds = sum(s for s, _ in self.recent_prefills)
        if seconds <= 0:
            return 0.0, 0.0
        tokens = sum(n for _, n in self.recent_prefills)
        return tokens / seconds, tokens / len(self.recent_prefills)

    def handoff_sent(self, num_blocks: int) -> None:
        self.handoffs_sent.inc()
        self.handoff_bytes.inc(num_blocks * self.bytes_per_block)

    def handoff_settled(self, acked: bool) -> None:
        (self.handoffs_acked if acked else self.handoffs_expired).inc()

    def pulled(self, seconds: float, num_blocks: int) -> None:
        """On the transfer thread (prometheus_client's metrics take their own locks)."""
        self.pulls_succeeded.inc()
        self.transfer_seconds.observe(seconds)
        self.transfer_bytes.observe(num_blocks * self.bytes_per_block)

    def pull_failed(self) -> None:
        self.pulls_failed.inc()


class _EngineCollector:
    """The engine's and the load's state, read when collected."""

    def __init__(self, metrics: WorkerMetrics, load: Callable[[], Load]) -> None:
        self.metrics = metrics
        self.load = load

    def collect(self) -> Iterator[Metric]:
        m, load = self.metrics, self.load()
        engine, blocks = m.engine, m.engine.block_manager
        yield GaugeMetricFamily("pdrt_worker_kv_blocks_used", "KV blocks in use", value=load.num_used_blocks)
        yield GaugeMetricFamily("pdrt_worker_kv_blocks", "KV blocks in the pool", value=load.num_blocks)
        yield GaugeMetricFamily("pdrt_worker_running_sequences", "Sequences the scheduler runs", value=load.num_running)
        yield GaugeMetricFamily("pdrt_worker_waiting_sequences", "Sequences waiting to be scheduled",
                                value=load.num_waiting)
        yield GaugeMetricFamily("pdrt_worker_held_sequences", "Prefilled sequences holding KV for a handoff",
                                value=load.num_held)
        yield GaugeMetricFamily("pdrt_worker_drafts", "Prompts being typed, prefilled ahead", value=load.num_drafts)
        yield CounterMetricFamily("pdrt_worker_prefix_cache_queries", "Blocks looked up in the prefix cache",
                                  value=blocks.num_prefix_queries)
        yield CounterMetricFamily("pdrt_worker_prefix_cache_hits", "Blocks found in the prefix cache",
                                  value=blocks.num_prefix_hits)
        rate = blocks.num_prefix_hits / blocks.num_prefix_queries if blocks.num_prefix_queries else math.nan
        yield GaugeMetricFamily("pdrt_worker_prefix_cache_hit_rate", "Prefix-cache hits / queries", value=rate)
        yield CounterMetricFamily("pdrt_worker_prefill_tokens", "Prompt tokens computed (cache hits excluded)",
                                  value=engine.num_computed_prompt_tokens)
        yield CounterMetricFamily("pdrt_worker_draft_tokens_ahead", "Draft tokens whose KV was ready before submit",
                                  value=engine.num_draft_tokens_ahead)
        yield CounterMetricFamily("pdrt_worker_draft_rollbacks", "Draft edits that rolled computed KV back",
                                  value=engine.num_draft_rollbacks)
        scheduler = engine.scheduler
        yield CounterMetricFamily("pdrt_worker_demotions", "Streams decoded less often (or less often still) "
                                  "because the decode step interval ran over the TPOT SLO",
                                  value=scheduler.num_demotions)
        yield CounterMetricFamily("pdrt_worker_promotions", "Demoted streams decoded every step again",
                                  value=scheduler.num_promotions)
        yield GaugeMetricFamily("pdrt_worker_demoted_streams", "Streams decoded less often than every step",
                                value=len(scheduler.demoted))
        spec = engine.speculator
        if spec is not None:
            yield CounterMetricFamily("pdrt_worker_spec_proposed_tokens", "Proposed tokens verified in decode steps",
                                      value=spec.num_proposed)
            yield CounterMetricFamily("pdrt_worker_spec_accepted_tokens", "Proposed tokens kept: the target model "
                                      "made them", value=spec.num_accepted)
            rate = spec.num_accepted / spec.num_proposed if spec.num_proposed else math.nan
            yield GaugeMetricFamily("pdrt_worker_spec_acceptance_rate", "Kept / proposed tokens", value=rate)
            per_step = spec.num_decode_tokens / spec.num_decode_seq_steps if spec.num_decode_seq_steps else math.nan
            yield GaugeMetricFamily("pdrt_worker_spec_tokens_per_step", "Tokens a decoding stream gets per step",
                                    value=per_step)
        if m.role in PREFILLING_ROLES:
            yield GaugeMetricFamily("pdrt_health_psi", "Prefill stability: mean/std of recent prefill times "
                                    "(target > 8)", value=prefill_stability(m.prefill_times))
        if m.catch_up is not None:
            yield CounterMetricFamily("pdrt_prefill_catch_ups", "Times the prefill worker took its starting "
                                      "niceness back because a prompt waited too long to start or for its first token",
                                      value=m.catch_up.num_catch_ups)
            yield CounterMetricFamily("pdrt_prefill_caught_up_seconds", "Seconds the prefill worker ran at its "
                                      "starting niceness, catching up", value=m.catch_up.caught_up_s)
        if m.role in ("decode", "colocated"):
            yield GaugeMetricFamily("pdrt_health_ds", "Decoding smoothness: std/mean of the last 10 decode step "
                                    "latencies (target < 0.15)", value=decoding_smoothness(m.decode_steps))
