"""The balancer: the controller's policy that moves workers between prefill and decode as the load changes.

Every `[controller] balance_interval_s`, and at once when the newest
requests are of another mix than the last evaluation's, it reads the
node's signals over the last two intervals (or as far back as MIN_REQUESTS
requests started, up to MAX_WINDOW_S):

* requests a minute as they start, and the SLO attainment of those that
  ended, from the gateways' counters (`pdrt_gateway_*`);
* their mean prompt length as they start: over the newest FRESH_REQUESTS
  when theirs is MIX_CHANGE times the window's, else over the last
  interval when enough started in it (a window straddling a change of the
  mix would average two loads into one that is neither);
* their mean answer length, read ahead over the same interval: the
  max_tokens the requests that start ask for, times the share of it that
  ended requests used (in the window, else since the gateway started).
  Answers that ended, or tokens streamed so far, follow a change of the
  mix only over a stream's whole life; what is asked for changes with the
  first requests of the new mix. Before any request ended, tokens
  streamed per request started stand in;
* what the open requests may still produce (the same share of their
  max_tokens left), the length the streams held now are predicted to run;
* the queues: prompts waiting at prefill workers, streams held by decode
  workers, and how long the decode workers' steps take now (their
  heartbeats' load).

It then predicts, with `pdrt plan`'s simulator and this host's profile
(pdrt/planner), the SLO attainment each split of the node's workers would
give that load over the time ahead, the mean over SAMPLES draws of it:
the queues as they stand, then Poisson arrivals at the measured rate with
lengths around the measured means, for the longest of HORIZON_S, two
intervals, and two lifetimes of a stream at the TPOT SLO (a queue that a
load just past a worker's capacity builds grows for tens of seconds, and
streams pile up on a decode worker over their whole lives: a shorter look
takes a load that will not hold for one that does); decode steps as much
slower or faster than the simulator's (the profile's step and what serving
adds to it) as the steps of the decode workers holding MIN_STEP_STREAMS
streams or more are now, and prompts as much slower or faster as the
prefill workers' recent steps of MIN_STEP_PROMPT_TOKENS prompt tokens or
more (a loaded machine is slower than the quiet one it was profiled on, a
shared one drifts, and what serving adds to a step is measured on one
shape of node only): the node's own steps anchor the prediction.
The best split is the one predicted to attain the most, or, where every
split is predicted to miss the SLOs for most requests (below URGENT), the
one predicted to serve them soonest (the worse of TTFT p90 and TPOT p90,
each over its SLO: its lateness) if it attains within MARGIN of the most;
a backlog that no split clears within the horizon predicts a few percent
for all, and the split that drains it fastest is still the one to be in.
It moves one worker toward the best split when all of these hold:

* the best split beats the current one by MARGIN of predicted attainment,
  or, where the current one is predicted to miss the SLOs for most
  requests (below URGENT), its lateness is below SOONER of the current
  one's;
* the same split was best at the previous evaluation too (hysteresis),
  unless it beats the current one by LARGE_GAIN or the current one is
  predicted to miss the SLOs for most requests (below URGENT): a load that
  shifts swamps a worker within seconds, and waiting to confirm costs them;
* no change was made in the last two intervals;
* no change is under way.

Predictions run on a thread of their own at niceness PREDICT_NICE: on a
CPU node they take what the workers leave, not a share of their cores.

Every evaluation is logged with its signals and reason and counted
(`pdrt_controller_balancer_decisions_total{action}`); the last one is
exported as `pdrt_controller_balancer_last_info` for `pdrt status`. Without
a profile of the model on this host (`pdrt profile`) it decides nothing and
says so once. `[controller] balance = false` turns it off.
"""

import asyncio
import functools
import math
import os
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry, Counter, Info

from pdrt.bench.runner import BenchOptions
from pdrt.bench.stats import RateSummary, Slo
from pdrt.bench.workloads import RequestShape
from pdrt.control_plane.registry import Registry
from pdrt.control_plane.role_changes import SPLIT_ROLES, RoleChanges
from pdrt.control_plane.stream_balance import spread_to_joined
from pdrt.metrics.exposition import total
from pdrt.planner.predict import simulate
from pdrt.planner.profile import Profile
from pdrt.planner.simulator import Deployment, Overheads
from pdrt.worker_profile import PREFILL_NICE

log = structlog.get_logger(__name__)

MARGIN = 0.05  # of predicted attainment
LARGE_GAIN = 0.3  # of predicted attainment: acted on without waiting for a second evaluation to confirm it
URGENT = 0.5  # predicted attainment of the current split below which a better one is taken without waiting
SOONER = 0.7  # of the current split's predicted lateness: a split as good by attainment and this much sooner wins
MIN_REQUESTS = 5  # in a window, to read a load off it
MAX_WINDOW_S = 60.0  # the window stretches back beyond two intervals to hold MIN_REQUESTS, up to this
# The newest requests that, as soon as they started, tell a shift of the mix (MIX_CHANGE) before a window of
# MIN_REQUESTS does: the lengths are then read off them, and the evaluation comes at once.
FRESH_REQUESTS = 3
MAX_SIM_REQUESTS = 400
# Draws of the arrivals ahead a prediction averages: at a node's knee one draw's burst or lull swings a split's
# attainment by tens of points.
SAMPLES = 3
LENGTH_SIGMA = 0.5  # the spread of simulated lengths around the measured means (lognormal)
# Of steps against the simulator's, either way: beyond it, something else is wrong (a worker stalled, a stale
# profile of another host).
MAX_SLOWDOWN = 4.0
# A decode worker's steps tell how much slower decode runs than profiled only when it holds this many streams:
# a step of fewer is mostly its fixed cost, and the time it waited for a core while prompts were computed.
MIN_STEP_STREAMS = 4
# Likewise a prefill worker's steps tell how much slower prompts run than profiled only when they computed this
# many prompt tokens on average: a short prompt's step is mostly fixed cost.
MIN_STEP_PROMPT_TOKENS = 256
# A mix this many times longer or shorter, in prompts or answers, than the one a prediction under way is for makes
# it moot: it stops, and the next evaluation starts at once (on a busy CPU node a prediction of long streams takes
# seconds at PREDICT_NICE, and a shift of the mix would wait for it).
MIX_CHANGE = 2.0
STREAM_LIFETIMES = 2  # the prediction's horizon, at least, in lifetimes of a mean stream
HORIZON_S = 30.0  # the prediction's horizon, at least
PREDICT_NICE = 10  # the predictions' thread's: as a prefill worker's (pdrt/worker_profile.py)


@dataclass(slots=True, frozen=True)
class Signals:
    requests_per_min: float
    mean_input: float
    mean_output: float
    attainment: float | None  # of the requests judged in the window
    prefill_waiting: int
    decode_streams: int
    prefill: int  # workers of each role now
    decode: int
    decode_steps: tuple[tuple[int, float], ...] = ()  # per decode worker: (streams, recent decode step s)
    prefill_steps: tuple[tuple[float, float], ...] = ()  # per prefill worker: (prompt tokens a recent step, tokens/s)
    mean_left: float | None = None  # answer tokens an open request is expected to produce still; None: unknown
    held: tuple[int, ...] = ()  # streams held by each decode worker; () spreads decode_streams evenly
    fresh: bool = False  # lengths read off the newest requests, of another mix than the window's (FRESH_REQUESTS)

    def streams_by_worker(self) -> list[int]:
        if self.held:
            return list(self.held)
        share, rest = divmod(self.decode_streams, max(1, self.decode))
        return [share + (i < rest) for i in range(self.decode)]

    def describe(self) -> str:
        attained = "-" if self.attainment is None else f"{self.attainment:.0%}"
        left = "" if self.mean_left is None else f" ({self.mean_left:.0f} left per open request)"
        return (f"{self.requests_per_min:.0f} req/min, in {self.mean_input:.0f} / out {self.mean_output:.0f}{left} "
                f"tokens, attainment {attained}, queues {self.prefill_waiting} prompts / {self.decode_streams} "
                f"streams, {self.prefill}P+{self.decode}D")


@dataclass(slots=True, frozen=True)
class Decision:
    best: tuple[int, int]  # (prefill, decode)
    predicted: dict[tuple[int, int], float]  # split -> predicted attainment
    lateness: dict[tuple[int, int], float] = field(default_factory=dict)  # split -> lateness(); {}: not known
    slowdown: float = 1.0  # of decode steps against the simulator's, that the prediction took
    prefill_slowdown: float = 1.0  # of prompts' steps, likewise


def mix_changed(before: Signals, now: Signals) -> bool:
    """Whether the requests starting now are of another mix than `before`'s: prompts or answers MIX_CHANGE times
    as long or as short."""
    return shifted((before.mean_input, before.mean_output), (now.mean_input, now.mean_output))


def shifted(before: tuple[float, float], now: tuple[float, float]) -> bool:
    """Whether mean (prompt, answer) lengths `now` are MIX_CHANGE times as long or as short as `before`'s."""
    return any(max(a, b) >= MIX_CHANGE * max(1.0, min(a, b)) for a, b in zip(before, now, strict=True))


def started_means(counts: dict[str, float]) -> tuple[float, float]:
    """The mean prompt and max_tokens of the requests that started over a span of the gateways' counters."""
    return counts["prompt"] / max(1.0, counts["requests"]), counts["asked"] / max(1.0, counts["requests"])


def lateness(summary: RateSummary, slo: Slo) -> float:
    """How late a run serves: the worse of its TTFT p90 and TPOT p90, each over its SLO (inf: nothing served)."""
    if summary.ttft.p90 is None:
        return math.inf
    return max(summary.ttft.p90 / slo.ttft_s, (summary.tpot.p90 or 0.0) / slo.tpot_s)


def within_bounds(ratio: float) -> float:
    """A measured ratio of steps to the simulator's, kept within MAX_SLOWDOWN either way."""
    return min(MAX_SLOWDOWN, max(1 / MAX_SLOWDOWN, ratio))


def predict_splits(profile: Profile, overheads: Overheads, signals: Signals, slo: Slo, threads: int, cores: int,
                   horizon_s: float, seed: int = 0, cancelled: Callable[[], bool] = lambda: False,
                   prefill_nice: int = PREFILL_NICE) -> Decision | None:
    """Predicted attainment of every split of the node's split workers under the load `signals` describe: the
    mean over SAMPLES draws of the arrivals and lengths ahead. None when `cancelled()` said so between two
    simulations."""
    costs = profile.cost_model()
    left = signals.mean_output / 2 if signals.mean_left is None else signals.mean_left
    context = round(signals.mean_input + max(0.0, signals.mean_output - left))  # of a stream held now
    # Against the step as the simulator makes it (the model's step and what serving adds to it), not the model's
    # alone: the profile's loaded node already put a loaded step's extra cost per stream in those additions.
    ratios = [seconds / (costs.decode_step_s(batch, batch * context, threads) + overheads.step_overhead_s
                         + overheads.decode_seq_s * batch)
              for batch, seconds in signals.decode_steps if batch >= MIN_STEP_STREAMS and seconds]
    slowdown = within_bounds(statistics.median(ratios)) if ratios else 1.0
    prompt_ratios = [tokens / rate / (costs.prefill_s(round(tokens), 0, threads) + overheads.step_overhead_s)
                     for tokens, rate in signals.prefill_steps if tokens >= MIN_STEP_PROMPT_TOKENS and rate > 0]
    prefill_slowdown = within_bounds(statistics.median(prompt_ratios)) if prompt_ratios else 1.0
    costs = costs.slower(prefill_slowdown, slowdown)
    # The ratio was taken against the decode step with what serving adds to it: both scale.
    overheads = replace(overheads, step_overhead_s=overheads.step_overhead_s * slowdown,
                        decode_seq_s=overheads.decode_seq_s * slowdown)
    counts = signals.streams_by_worker()
    workers = signals.prefill + signals.decode
    rate = signals.requests_per_min / 60
    options = BenchOptions(slo=slo)
    runs: dict[tuple[int, int], list[RateSummary]] = {(p, workers - p): [] for p in range(1, workers)}
    for sample in range(SAMPLES):
        requests, streams = draw(random.Random(seed + sample), signals, sum(counts), rate, left, context,
                                 horizon_s, profile.max_model_len)
        for (p, d), summaries in runs.items():
            if cancelled():
                return None
            deployment = Deployment(prefill=p, decode=d, threads=threads, prefill_nice=prefill_nice)
            summaries.append(simulate(costs, deployment, cores, requests,
                                      options, rate, overheads, held_after_change(streams, counts, d)))
    predicted = {split: statistics.fmean(r.attainment for r in summaries) for split, summaries in runs.items()}
    late = {split: statistics.fmean(lateness(r, slo) for r in summaries) for split, summaries in runs.items()}
    current = (signals.prefill, signals.decode)
    soonest = min(late, key=lambda s: (late[s], s != current))
    if max(predicted.values()) < URGENT and max(predicted.values()) - predicted[soonest] < MARGIN:
        # Every split fails most requests (a backlog none clears within the horizon) and the one that serves them
        # soonest is within MARGIN of the most: a point or two between them is noise, and it is the one to be in.
        best = soonest
    else:  # among good ones the current split stays on a tie
        best = max(predicted, key=lambda s: (predicted[s], s == current))
    return Decision(best, predicted, late, slowdown, prefill_slowdown)


def draw(rng: random.Random, signals: Signals, num_streams: int, rate: float, left: float, context: int,
         horizon_s: float, max_model_len: int) -> tuple[list[tuple[float, RequestShape]], list[tuple[int, int]]]:
    """One draw of what is ahead: the prompts waiting now and Poisson arrivals at `rate` over `horizon_s`
    ((arrival s, lengths) in order), and the `num_streams` streams held now ((context, tokens left) each),
    lengths around the measured means."""
    def shape(mean_in: float, mean_out: float) -> RequestShape:
        mu = -LENGTH_SIGMA ** 2 / 2  # the lognormal's mean is then the measured mean
        out = max(1, round(mean_out * rng.lognormvariate(mu, LENGTH_SIGMA)))
        inp = max(4, round(mean_in * rng.lognormvariate(mu, LENGTH_SIGMA)))
        return RequestShape(min(inp, max(4, max_model_len - out)), out)

    requests = [(0.0, shape(signals.mean_input, signals.mean_output)) for _ in range(signals.prefill_waiting)]
    streams = [(context, shape(0, left).output_tokens) for _ in range(num_streams)]
    now = 0.0
    while rate > 0 and len(requests) < MAX_SIM_REQUESTS:
        now += rng.expovariate(rate)
        if now > horizon_s:
            break
        requests.append((now, shape(signals.mean_input, signals.mean_output)))
    return requests, streams


def share_used(window: dict[str, float], since_start: dict[str, float]) -> float | None:
    """The share of their max_tokens that ended requests produced: in the window when enough ended there, else
    since the gateways started; None before any ended."""
    for counts, least in ((window, MIN_REQUESTS), (since_start, 1)):
        if counts["ended"] >= least and counts["ended_asked"] > 0:
            return min(1.0, counts["ended_output"] / counts["ended_asked"])
    return None


def held_after_change(streams: list[tuple[int, int]], counts: list[int], decode: int) -> list[list[tuple[int, int]]]:
    """`streams` placed on `decode` decode workers as they would be after a change from workers holding `counts`
    of them: those that stay keep theirs; the streams of one taken away (the least busy goes) move one by one to
    the worker with the fewest; a worker added takes what the most crowded one sends on to it at once
    (pdrt/control_plane/stream_balance.py)."""
    counts = sorted(counts, reverse=True)
    kept, moved = counts[:decode], sum(counts[decode:])
    for _ in range(moved):
        kept[kept.index(min(kept))] += 1
    while len(kept) < decode:
        sent = spread_to_joined(kept)
        if sent:
            kept[kept.index(max(kept))] -= sent
        kept.append(sent)
    it = iter(streams)
    return [[next(it) for _ in range(n)] for n in kept]


def _yield_cpu() -> None:
    """Lower the calling thread's CPU priority to PREDICT_NICE (Linux keeps niceness per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREDICT_NICE)
    except OSError as exc:  # not permitted here: predictions run at the controller's priority
        log.warning("balancer predictions run at the controller's priority", error=str(exc))


class Balancer:
    def __init__(self, registry: Registry, roles: RoleChanges, enabled: bool, interval_s: float, slo: Slo,
                 threads: int, cores: int, profile_path: Path, metrics: CollectorRegistry,
                 prefill_nice: int = PREFILL_NICE) -> None:
        self.registry, self.roles = registry, roles
        self.enabled, self.interval_s, self.slo = enabled, interval_s, slo
        self.threads, self.cores, self.prefill_nice = threads, cores, prefill_nice
        self.profile_path = profile_path
        self.profile: Profile | None = None
        self.samples: deque[tuple[float, dict[str, float]]] = deque()
        self.next_at = time.monotonic() + interval_s
        self.last_change_at = -math.inf
        self.previous_best: tuple[int, int] | None = None
        self.evaluated: Signals | None = None  # the load the last evaluation read
        self.evaluating = False
        self.predictor = ThreadPoolExecutor(1, thread_name_prefix="balancer-predict", initializer=_yield_cpu)
        self.said_why_not = False
        self.decisions = Counter("pdrt_controller_balancer_decisions", "The balancer's evaluations, by what it did",
                                 ["action"], registry=metrics)
        self.last = Info("pdrt_controller_balancer_last", "The balancer's last decision", registry=metrics)

    def _load_profile(self) -> bool:
        if self.profile is None:
            try:
                self.profile = Profile.load(self.profile_path)
            except Exception as exc:  # a missing or unreadable profile leaves the balancer idle, said once
                if not self.said_why_not:
                    log.warning("balancer idle: no profile of the model on this host; run `pdrt profile`",
                                path=str(self.profile_path), error=str(exc))
                    self._record("idle", f"no profile at {self.profile_path}")
                    self.said_why_not = True
                return False
            log.info("balancer using a profile", path=str(self.profile_path))
        return True

    def _record(self, action: str, reason: str) -> None:
        self.decisions.labels(action).inc()
        self.last.info({"action": action, "reason": reason[:200], "at": time.strftime("%H:%M:%S")})

    def sample(self, families: list, now: float) -> None:
        """Keep the gateways' counters as they stand now (called every controller tick; kept four times an
        interval)."""
        if self.samples and now - self.samples[-1][0] < self.interval_s / 4:
            return
        counters = {
            "requests": total(families, "pdrt_gateway_started_requests_total"),
            "prompt": total(families, "pdrt_gateway_started_prompt_tokens_total"),
            "asked": total(families, "pdrt_gateway_started_max_tokens_total"),
            "output": total(families, "pdrt_gateway_streamed_tokens_total"),
            "ended": total(families, "pdrt_gateway_requests_total"),
            "ended_output": total(families, "pdrt_gateway_output_tokens_total"),
            "ended_asked": total(families, "pdrt_gateway_max_tokens_total"),
            "open": total(families, "pdrt_gateway_open_requests"),
            "left": total(families, "pdrt_gateway_open_answer_tokens_left"),
            "judged": total(families, "pdrt_gateway_slo_requests_total"),
            "met": total(families, "pdrt_gateway_slo_met_total", slo="both"),
        }
        self.samples.append((now, counters))
        # Two intervals back, or as far as MIN_REQUESTS started (up to MAX_WINDOW_S): at a low rate two intervals
        # hold too few requests to read a load off.
        while len(self.samples) > 2 and now - self.samples[1][0] >= 2 * self.interval_s and (
                counters["requests"] - self.samples[1][1]["requests"] >= MIN_REQUESTS
                or now - self.samples[1][0] >= MAX_WINDOW_S):
            self.samples.popleft()

    def signals(self) -> Signals | None:
        if len(self.samples) < 2:
            return None
        (t0, first), (t1, last) = self.samples[0], self.samples[-1]
        delta = {k: last[k] - first[k] for k in last}
        if delta["requests"] < 0:  # a gateway restarted and its counters with it: start the window again
            self.samples = deque([self.samples[-1]])
            return None
        if t1 - t0 <= 0 or delta["requests"] < MIN_REQUESTS:
            return None
        prefill, decode = self.registry.by_role("prefill"), self.registry.by_role("decode")
        # Lengths from the newest requests when they show another mix than the window's, else from the last
        # interval alone when enough requests started in it: a window that straddles a change of the mix averages
        # two loads into one that is neither.
        fresh = next(({k: last[k] - c[k] for k in last} for _, c in reversed(self.samples)
                      if last["requests"] - c["requests"] >= FRESH_REQUESTS), None)
        start = next((c for t, c in reversed(self.samples) if t <= t1 - self.interval_s), first)
        recent = {k: last[k] - start[k] for k in last}
        is_fresh = fresh is not None and shifted(started_means(fresh), started_means(delta))
        if is_fresh:
            lengths = fresh
        else:
            lengths = recent if recent["requests"] >= MIN_REQUESTS else delta
        used = share_used(delta, last)
        if used is None:
            mean_output, mean_left = lengths["output"] / lengths["requests"], None
        else:
            mean_output = used * lengths["asked"] / lengths["requests"]
            mean_left = used * last["left"] / last["open"] if last["open"] else None
        return Signals(
            requests_per_min=60 * delta["requests"] / (t1 - t0),
            mean_input=lengths["prompt"] / lengths["requests"], mean_output=max(1.0, mean_output),
            mean_left=mean_left,
            attainment=delta["met"] / delta["judged"] if delta["judged"] else None,
            prefill_waiting=sum(e.load.num_waiting for e in prefill),
            decode_streams=sum(e.load.num_running + e.load.num_waiting for e in decode),
            prefill=len(prefill), decode=len(decode),
            decode_steps=tuple((e.load.num_running, e.load.decode_step_s) for e in decode),
            prefill_steps=tuple((e.load.prefill_step_tokens, e.load.prefill_tokens_per_s) for e in prefill),
            held=tuple(e.load.num_running + e.load.num_waiting for e in decode), fresh=is_fresh)

    def due(self, now: float) -> bool:
        """Whether to evaluate now: every interval, and at once when the newest requests are of another mix than
        the last evaluation's."""
        if not self.enabled or self.evaluating:
            return False
        if now < self.next_at and not (self.evaluated is not None and (latest := self.signals()) is not None
                                       and latest.fresh and mix_changed(self.evaluated, latest)):
            return False
        self.next_at = now + self.interval_s
        return len(self.registry.by_role("prefill")) + len(self.registry.by_role("decode")) >= 3 \
            and self._load_profile()

    def horizon_s(self, signals: Signals) -> float:
        return max(HORIZON_S, 2 * self.interval_s, STREAM_LIFETIMES * signals.mean_output * self.slo.tpot_s)

    async def evaluate(self) -> bool:
        """Predict every split from the signals (on the predictor's thread: it takes a moment), then act on it;
        True when a role change began."""
        signals = self.signals()
        if signals is None:
            self._record("keep", "too few requests in the window to read a load off")
            return False
        assert self.profile is not None
        self.evaluating, self.evaluated = True, signals
        try:
            cancel = threading.Event()
            predict = functools.partial(predict_splits, self.profile, self.profile.serving_overheads(), signals,
                                        self.slo, self.threads, self.cores, self.horizon_s(signals),
                                        cancelled=cancel.is_set, prefill_nice=self.prefill_nice)
            future = asyncio.get_running_loop().run_in_executor(self.predictor, predict)
            latest = signals
            while not future.done():
                await asyncio.wait({future}, timeout=self.interval_s / 4)
                latest = self.signals() or latest
                if not future.done() and mix_changed(signals, latest):
                    cancel.set()
            decision = future.result()
        finally:
            self.evaluating = False
        if decision is None:
            why = f"the mix changed while predicting for {signals.describe()}; predicting again"
            log.info("balancer decision", action="restart", reason=why, signals=latest.describe())
            self._record("restart", why)
            self.next_at = time.monotonic()
            return False
        return self.act(signals, decision, time.monotonic())

    def act(self, signals: Signals, decision: Decision, now: float) -> bool:
        current = (signals.prefill, signals.decode)
        best, predicted = decision.best, decision.predicted
        gain = predicted[best] - predicted.get(current, 0.0)
        late = decision.lateness
        sooner = (predicted.get(current, 0.0) < URGENT and best in late and current in late
                  and late[best] < SOONER * late[current])
        previous, self.previous_best = self.previous_best, best
        figures = ", ".join(f"{p}P+{d}D {a:.0%}" + (f" (late x{late[(p, d)]:.1f})" if (p, d) in late else "")
                            for (p, d), a in sorted(predicted.items()))
        if decision.slowdown != 1.0:
            figures += f"; decode steps x{decision.slowdown:.2f} the simulator's"
        if decision.prefill_slowdown != 1.0:
            figures += f"; prompts x{decision.prefill_slowdown:.2f} the simulator's"
        if best == current or (gain < MARGIN and not sooner):
            why = f"keep {current[0]}P+{current[1]}D: predicted {figures}"
            action = "keep"
        elif previous != best and gain < LARGE_GAIN and predicted.get(current, 0.0) >= URGENT:
            why = f"{best[0]}P+{best[1]}D best ({figures}); waiting for the next evaluation to confirm"
            action = "wait"
        elif self.roles.pending:
            why = f"{best[0]}P+{best[1]}D best ({figures}); a role change is under way"
            action = "wait"
        elif now - self.last_change_at < 2 * self.interval_s:
            why = f"{best[0]}P+{best[1]}D best ({figures}); a change was made {now - self.last_change_at:.0f} s ago"
            action = "wait"
        else:
            role = "prefill" if best[0] > current[0] else "decode"
            started, why = self._change(role, f"predicted {figures}")
            action = "change" if started else "refused"
            if started:
                self.last_change_at = now
        log.info("balancer decision", action=action, reason=why, signals=signals.describe())
        self._record(action, f"{why}; load {signals.describe()}")
        return action == "change"

    def _change(self, role: str, reason: str) -> tuple[bool, str]:
        """Move the least busy worker of the other role to `role`: whether the change began, and what happened. A
        decode worker's streams go on to the others: the least busy is the one with the fewest tokens left to
        produce; a prefill worker's, the one with the fewest prompts."""
        other = next(r for r in SPLIT_ROLES if r != role)
        candidates = sorted(self.registry.by_role(other), key=lambda e: (
            e.load.num_tokens_left if other == "decode" else 0,
            e.load.num_running + e.load.num_waiting, e.load.num_waiting_tokens))
        if not candidates:
            return False, f"no {other} worker to move"
        entry = candidates[0]
        refusal = self.roles.start(entry.process_id, role, f"balancer: {reason}")
        return refusal is None, refusal or f"moved {entry.process_id} to {role} ({reason})"
