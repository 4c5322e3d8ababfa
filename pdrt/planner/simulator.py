"""A discrete-event simulation of a pdrt node serving a list of requests, from a cost model of its steps.

What it models, as pdrt runs (docs/architecture.md):

* a prefill worker takes prompts one at a time (on a CPU a step's time
  grows with its tokens, so pdrt runs prompts one by one), in the order its
  engine would (the highest response ratio first, pdrt/engine/prompt_order.py:
  a short prompt passes long ones that waited as long); the first token
  leaves at the end of the prompt's step; its KV then
  moves to the decode worker with the fewest streams, taking
  `handoff_s` plus its bytes over `transfer_bytes_per_s`;
* a decode worker runs continuous batching: each step decodes every stream
  it holds, and a stream that arrives joins at the next step;
* a colocated worker's step decodes every stream and prefills chunks of the
  waiting prompts, in arrival order, within `chunk` tokens a prompt and
  `step_tokens` a step (pdrt's scheduler), so its prompts stretch the steps
  its streams wait on;
* every worker's step also costs `step_overhead_s` (the worker loop around
  the model: messages to read), and `decode_seq_s` for each stream it
  decodes (its output to send), and every output token
  reaches the client `token_latency_s` after its step;
* outputs then pass through the gateway and the client, each a process
  that spends CPU per request and per token, first come, first served:
  on a small machine they take cores from the workers, and under load
  tokens queue in them;
* the workers share the host's `cores`: while the busy workers need more
  cores than there are, every one runs that much slower (processor
  sharing), as the kernel's scheduler shares them. A worker needs the cores
  its threads keep busy (CostModel.parallelism), the gateway and the
  client one each; a worker of several threads short of its cores runs at
  one thread's pace at most, its threads waiting for each other. A
  prefill worker runs at its niceness (10 unless configured: a tenth of the
  others' weight while they contend), and with a model too small for its
  steps to be arithmetic, only while its oldest prompt has waited less
  than a quarter of the TTFT SLO to start and half of it for its first
  token (pdrt/worker_profile.py).
* a chat turn whose conversation's previous turn has finished finds that
  turn's prompt and answer in the prefix cache;
* a run may start with streams already on the decode workers (the
  balancer's prediction from a node as it stands).

It does not model preemption (pools are taken as large enough), drafts,
a decode worker's own prefills (conditional disaggregation), thread
lending, or the step guard's demotions.
"""

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from pdrt.bench.workloads import RequestShape
from pdrt.engine.prompt_order import default_order
from pdrt.planner.cost_model import CostModel
from pdrt.worker_profile import CATCH_UP_LATE, CATCH_UP_WAIT, CPU_PROMPT_BATCH, PREFILL_NICE, catches_up

NICE_STEP = 1.25  # the kernel's weight of a process falls this much for each step of niceness

BLOCK = 16
EPS = 1e-12


@dataclass(slots=True, frozen=True)
class Deployment:
    """The workers of one node and what each gets."""

    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    threads: int = 1  # per worker
    chunk: int = 512  # a prompt's tokens per step in a colocated worker
    step_tokens: int = 2048
    prefill_nice: int = PREFILL_NICE  # the prefill workers' niceness ([experimental] prefill_nice)

    def describe(self) -> str:
        if self.colocated:
            return f"{self.colocated} colocated x {self.threads} threads"
        return f"{self.prefill}P+{self.decode}D x {self.threads} threads"


@dataclass(slots=True, frozen=True)
class Overheads:
    """What a step or a token costs outside the model's forward pass."""

    step_overhead_s: float = 0.0
    decode_seq_s: float = 0.0  # what each stream of a step adds around the model (its output)
    token_latency_s: float = 0.0
    handoff_s: float = 0.0
    transfer_bytes_per_s: float = 2e9
    gateway_request_s: float = 0.0  # CPU the gateway spends on a request, and on each of its output tokens
    gateway_token_s: float = 0.0
    client_request_s: float = 0.0  # the same for the client (`pdrt bench`, or the application)
    client_token_s: float = 0.0

    def slower(self, factor: float) -> "Overheads":
        """The same costs `factor` times as long (a host slower or faster than when they were measured)."""
        return Overheads(**{f.name: getattr(self, f.name) * (1 if f.name == "transfer_bytes_per_s" else factor)
                            for f in fields(self)})


@dataclass(slots=True, eq=False)  # identity: a request is itself, not its figures
class SimRequest:
    index: int
    arrival: float
    shape: RequestShape
    cached: int = 0
    first_token: float | None = None
    finished: float | None = None
    prefilled: int = 0  # prompt tokens computed (colocated chunks)
    decoded: int = 0  # output tokens after the first
    queued_at: int = 0  # its prefill worker's clock when it was queued

    @property
    def work(self) -> int:
        """Prompt tokens to compute: those past its cached prefix."""
        return self.shape.input_tokens - self.cached

    @property
    def context(self) -> int:
        return self.shape.input_tokens + 1 + self.decoded

    @property
    def done(self) -> bool:
        return self.decoded >= self.shape.output_tokens - 1


@dataclass(slots=True, eq=False)
class _Worker:
    kind: str
    threads: int
    queue: deque = field(default_factory=deque)  # prompts waiting
    running: list = field(default_factory=list)  # streams decoding
    joining: list = field(default_factory=list)  # streams that join at the next step
    work_left: float = 0.0  # seconds of the current step at full speed; 0: idle
    step: tuple | None = None  # what the current step does
    outputs: deque = field(default_factory=deque)  # a frontend's: (CPU seconds, [(request, is first, is last)])
    cores: float = 1.0  # what it keeps busy while it works
    weight: float = 1.0  # its share of contended cores against the others'
    work_done: int = 0  # a prefill worker's clock: prompt tokens it has computed (the engine's scheduler's)


class Simulation:
    def __init__(self, model: CostModel, deployment: Deployment, cores: int, overheads: Overheads | None = None,
                 ttft_slo_s: float = 1.0):
        self.model, self.deployment, self.cores = model, deployment, cores
        self.overheads = overheads or Overheads()
        d = deployment
        self.workers = ([_Worker("prefill", d.threads) for _ in range(d.prefill)]
                        + [_Worker("decode", d.threads) for _ in range(d.decode)]
                        + [_Worker("colocated", d.threads) for _ in range(d.colocated)])
        if not self.workers or (d.prefill and not d.decode) or (d.decode and not d.prefill):
            raise ValueError(f"{d.describe()} cannot serve requests")
        self.prompt_order = default_order(CPU_PROMPT_BATCH)  # a CPU prefill worker's, prompts one by one
        self.nice_weight = NICE_STEP ** -d.prefill_nice  # a prefill worker's weight against the others'
        for w in self.workers:
            w.cores = model.parallelism(w.threads)
            w.weight = self.nice_weight if w.kind == "prefill" else 1.0
        # A prefill worker that catches up takes its CPU back while a prompt has waited this long (CatchUp; the
        # limits as they are when the decode steps have no room left, the case where they matter).
        catching_up = catches_up(d.prefill_nice)
        self.catch_up_s = CATCH_UP_WAIT * ttft_slo_s if catching_up else None
        self.late_s = CATCH_UP_LATE * ttft_slo_s if catching_up else None  # ... or has been here this long
        self.gateway, self.client = _Worker("gateway", 1), _Worker("client", 1)
        self.frontends = [self.gateway, self.client]
        self.now = 0.0
        self.timers: list[tuple[float, int, tuple]] = []  # (due, order of setting, what is due)
        self.order = itertools.count()
        self.conversations: dict[int, tuple[float, int]] = {}  # conversation -> (when its turn ended, context)

    # -- routing --------------------------------------------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        previous = self.conversations.get(req.shape.conversation)
        if previous is not None and previous[0] <= self.now:
            req.cached = min(previous[1], req.shape.input_tokens - 1) // BLOCK * BLOCK
        kind = "colocated" if self.deployment.colocated else "prefill"
        workers = [w for w in self.workers if w.kind == kind]
        target = min(workers, key=lambda w: (sum(r.work for r in w.queue)
                                             + (w.work_left > 0) * 1e-3, len(w.running)))
        req.queued_at = target.work_done
        target.queue.append(req)
        if kind == "prefill" and self.late_s is not None:
            self._timer(self.now + self.late_s, ("late", (target, req)))

    def _late(self, w: _Worker, req: SimRequest) -> None:
        """A prompt's time for its first token is up: its prefill worker takes the CPU back if it still holds it."""
        computing = w.step is not None and w.step[0] == "prefill" and w.step[1] is req
        if req.first_token is None and (computing or any(r is req for r in w.queue)):
            w.weight = 1.0

    def _hand_off(self, req: SimRequest) -> None:
        decoders = [w for w in self.workers if w.kind == "decode"]
        target = min(decoders, key=lambda w: len(w.running) + len(w.joining))
        target.joining.append(req)

    # -- steps ----------------------------------------------------------------------------------------------

    def _start_step(self, w: _Worker) -> None:
        if w in self.frontends:
            if w.outputs:
                w.step, w.work_left = ("outputs",), max(w.outputs[0][0], EPS)
            return
        if w.joining:
            w.running += w.joining
            w.joining = []
        t = w.threads
        if w.kind == "prefill":
            if self.catch_up_s is not None:
                waited = self.now - w.queue[0].arrival if w.queue else 0.0
                if waited >= self.catch_up_s:
                    w.weight = 1.0
                elif waited < self.catch_up_s / 2:
                    w.weight = self.nice_weight
            if not w.queue:
                return
            req = min(w.queue, key=lambda r: self.prompt_order.key(w.work_done - r.queued_at, r.work))
            w.queue.remove(req)
            w.work_done += req.work
            w.step = ("prefill", req)
            w.work_left = self.model.prefill_s(req.work, req.cached, t)
        else:
            chunks = []
            if w.kind == "colocated":
                budget = self.deployment.step_tokens - len(w.running)
                for req in w.queue:
                    if budget <= 0:
                        break
                    start = max(req.prefilled, req.cached)
                    n = min(self.deployment.chunk, req.shape.input_tokens - start, budget)
                    chunks.append((req, n, start))
                    budget -= n
            if not w.running and not chunks:
                return
            context = sum(r.context for r in w.running)
            w.step = ("mixed", list(w.running), chunks)
            w.work_left = self.model.mixed_step_s(len(w.running), context, [(n, s) for _, n, s in chunks], t)
            w.work_left += self.overheads.decode_seq_s * len(w.running)
        w.work_left += self.overheads.step_overhead_s

    def _finish_step(self, w: _Worker) -> None:
        if w in self.frontends:
            self._finish_output(w)
            return
        step, w.step, w.work_left = w.step, None, 0.0
        outputs = []
        if step[0] == "prefill":
            req = step[1]
            outputs.append((req, True, req.shape.output_tokens <= 1))
            if req.shape.output_tokens > 1:
                kv = req.shape.input_tokens * self.model.kv_bytes_per_token
                self._timer(self.now + self.overheads.handoff_s + kv / self.overheads.transfer_bytes_per_s,
                            ("handoff", req))
        else:
            _, decoding, chunks = step
            for req in decoding:
                req.decoded += 1
                outputs.append((req, False, req.done))
                if req.done:
                    w.running.remove(req)
            for req, n, start in chunks:
                req.prefilled = start + n
                if req.prefilled >= req.shape.input_tokens:
                    w.queue.remove(req)
                    outputs.append((req, True, req.shape.output_tokens <= 1))
                    if req.shape.output_tokens > 1:
                        w.joining.append(req)
        if outputs:
            self._timer(self.now + self.overheads.token_latency_s, ("outputs", outputs))

    def _cpu(self, w: _Worker, outputs: list) -> float:
        o = self.overheads
        per_request, per_token = ((o.gateway_request_s, o.gateway_token_s) if w is self.gateway
                                  else (o.client_request_s, o.client_token_s))
        return per_token * len(outputs) + per_request * sum(first for _, first, _ in outputs)

    def _finish_output(self, w: _Worker) -> None:
        _, outputs = w.outputs.popleft()
        w.step, w.work_left = None, 0.0
        if w is self.gateway:
            self.client.outputs.append((self._cpu(self.client, outputs), outputs))
            return
        for req, first, last in outputs:
            if first:
                req.first_token = self.now
            if last:
                req.finished = self.now
                if req.shape.conversation >= 0:
                    self.conversations[req.shape.conversation] = (self.now, req.shape.input_tokens
                                                                  + req.shape.output_tokens)

    def _timer(self, due: float, payload: tuple) -> None:
        heapq.heappush(self.timers, (due, next(self.order), payload))

    def _speeds(self, busy: list[_Worker]) -> dict[int, float]:
        """Each busy worker's speed (1: as fast as alone): the cores shared by weight, none given more than it
        needs, what it leaves shared among the rest (the kernel's fair share, water-filled)."""
        speeds, left, active = {}, float(self.cores), list(busy)
        while active:
            total = sum(w.weight for w in active)
            sated = [w for w in active if left * w.weight / total >= w.cores]
            if not sated:
                for w in active:
                    share = left * w.weight / total
                    # A worker's threads wait for each other at every parallel region: one of them descheduled
                    # holds the rest, so short of its cores it runs at most at one thread's pace.
                    speeds[id(w)] = min(1.0, share) / w.cores
                break
            for w in sated:
                speeds[id(w)] = 1.0
                left -= w.cores
                active.remove(w)
        return speeds

    # -- the clock ------------------------------------------------------------------------------------------

    def run(self, requests: list[tuple[float, RequestShape]],
            held: Sequence[Sequence[tuple[int, int]]] = ()) -> list[SimRequest]:
        """Serve `requests` ((arrival s, lengths), in arrival order) to the end. `held`: the streams the decode
        workers hold as the run starts, per worker ((context tokens, tokens left) of each), their first tokens
        out at 0; they come last in what is returned."""
        reqs = [SimRequest(i, t, s) for i, (t, s) in enumerate(requests)]
        for req in reqs:
            self._timer(req.arrival, ("arrive", req))
        decoders = [w for w in self.workers if w.kind == "decode"]
        if len(held) > len(decoders):
            raise ValueError(f"streams held by {len(held)} decode workers, {len(decoders)} simulated")
        for worker, streams in zip(decoders, held, strict=False):
            for context, left in streams:
                req = SimRequest(len(reqs), 0.0, RequestShape(max(1, context - 1), left + 1), first_token=0.0)
                worker.running.append(req)
                reqs.append(req)
        everyone = self.workers + self.frontends
        while True:
            for w in everyone:
                if w.step is None:
                    self._start_step(w)
            busy = [w for w in everyone if w.step is not None]
            speeds = self._speeds(busy)
            next_step = min((w.work_left / speeds[id(w)] for w in busy), default=float("inf"))
            next_timer = self.timers[0][0] - self.now if self.timers else float("inf")
            dt = max(0.0, min(next_step, next_timer))
            if dt == float("inf"):
                break
            self.now += dt
            for w in busy:
                w.work_left -= dt * speeds[id(w)]
                if w.work_left <= EPS:
                    self._finish_step(w)
            while self.timers and self.timers[0][0] <= self.now + EPS:
                _, _, (kind, what) = heapq.heappop(self.timers)
                if kind == "arrive":
                    self._arrive(what)
                elif kind == "handoff":
                    self._hand_off(what)
                elif kind == "late":
                    self._late(*what)
                else:
                    self.gateway.outputs.append((self._cpu(self.gateway, what), what))
        return reqs
