"""Keeps the interval between decode steps within the TPOT SLO by decoding the costliest streams less often.

The interval it watches is the wall time from the end of one step that
decoded to the end of the next: that is what a stream waits between two of
its tokens, with whatever the worker does between steps and any step that
only prefilled. It judges the mean of the last SLOWEST of them: with streams
demoted, steps that decode them alternate with steps that skip them, and a
stream's TPOT is the mean of both kinds.

After PATIENCE consecutive means over the SLO it demotes one stream
(Scheduler.demote): the decoding one with the most work left, its context
(what its attention reads each step) times the tokens its max_tokens still
allows, and then one more after each further PATIENCE. Of two streams that
cost a step alike, the one with more tokens to come spreads the delay over
more of them: a long answer skipped for a while keeps its mean TPOT, a
short one ends with it broken.

It never demotes more than half the decoding streams; with half demoted
it decodes the demoted ones less often still (every SLOWEST-th step). Once
RECOVERY consecutive means have stayed low enough to take one more stream
back (under n / (n + 1) of the SLO with n streams decoding: a stream adds
at most its share of the step), it promotes one back, the most recently
demoted first, and so on. A fixed margin kept a stream demoted for good in
a large batch, its own TPOT broken, where a step had room for it.
Sequences carry no priority, so their lengths alone say which stream
costs the most.
"""

from collections import deque

import structlog

from pdrt.engine.scheduler import Scheduler
from pdrt.engine.sequence import Sequence

log = structlog.get_logger(__name__)

PATIENCE = 3
RECOVERY = 8
DECODE_EVERY = 2
SLOWEST = 4


class StepGuard:
    def __init__(self, scheduler: Scheduler, tpot_slo_s: float) -> None:
        self.scheduler = scheduler
        self.tpot_slo_s = tpot_slo_s
        self.intervals: deque[float] = deque(maxlen=SLOWEST)  # a cycle of the least often decoded stream
        self.num_over = 0  # consecutive means over the SLO
        self.num_under = 0  # consecutive means low enough to promote a stream back (`room`)
        self.last_decode_at: float | None = None

    def stepped(self, now: float, decoded: bool, tokens_per_stream: float = 1.0) -> None:
        """After each engine step, at `now` (time.perf_counter()): one that `decoded` ends an interval, in
        which a decoding stream got `tokens_per_stream` tokens on average (more than one where proposed tokens
        were kept): what it waits per token is the interval over that."""
        if not decoded:
            return
        if self.last_decode_at is not None:
            self.observe((now - self.last_decode_at) / max(tokens_per_stream, 1.0))
        self.last_decode_at = now

    def idle(self) -> None:
        """The engine has nothing to do: the next step that decodes begins afresh."""
        self.last_decode_at = None
        self.intervals.clear()

    def observe(self, interval_s: float) -> None:
        """One interval between two steps that decoded."""
        demoted = self.scheduler.demoted
        self.intervals.append(interval_s)
        mean_s = sum(self.intervals) / len(self.intervals)
        if mean_s > self.tpot_slo_s:
            self.num_over, self.num_under = self.num_over + 1, 0
            if self.num_over >= PATIENCE:
                self.num_over = 0
                self._demote(mean_s)
        else:
            self.num_over = 0
            self.num_under = self.num_under + 1 if demoted and mean_s < self.room() * self.tpot_slo_s else 0
            if self.num_under >= RECOVERY:
                self.num_under = 0
                self._promote(demoted[-1], "recovered")
        if demoted:
            decoding = self._num_decoding()
            while len(demoted) > decoding // 2:  # streams have ended since
                self._promote(demoted[-1], "fewer streams")

    def room(self) -> float:
        """The share of the SLO under which the interval has room for one more stream decoded every step."""
        decoding = self._num_decoding()
        return decoding / (decoding + 1)

    @staticmethod
    def work_left(seq: Sequence) -> int:
        """What a stream still costs: its context times the tokens it may still produce."""
        return seq.num_tokens * max(1, seq.params.max_tokens - seq.output_index)

    def _num_decoding(self) -> int:
        return sum(seq.is_decoding for seq in self.scheduler.running)

    def _demote(self, mean_s: float) -> None:
        scheduler = self.scheduler
        candidates = [s for s in scheduler.running if s.is_decoding and s.decode_every == 1]
        if candidates and len(scheduler.demoted) < self._num_decoding() // 2:
            self._slow(max(candidates, key=self.work_left), DECODE_EVERY, mean_s)
            return
        slowable = [s for s in scheduler.demoted if s.decode_every < SLOWEST]
        if slowable:
            self._slow(max(slowable, key=self.work_left), SLOWEST, mean_s)

    def _slow(self, seq: Sequence, decode_every: int, mean_s: float) -> None:
        self.scheduler.demote(seq, decode_every)
        log.info("stream demoted", request_id=seq.request_id, context_tokens=seq.num_tokens,
                 tokens_left=seq.params.max_tokens - seq.output_index, decode_every=decode_every,
                 mean_interval_s=round(mean_s, 6), tpot_slo_s=self.tpot_slo_s)

    def _promote(self, seq: Sequence, reason: str) -> None:
        self.scheduler.promote(seq)
        log.info("stream promoted", request_id=seq.request_id, context_tokens=seq.num_tokens, reason=reason)
