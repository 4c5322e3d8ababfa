"""How many proposed tokens each decoding sequence verifies in a step: as many as make the step pay.

A decode step of b sequences and r rows (their tokens and the proposals
they verify) costs `cost_b + per_row_b * (r - b)` seconds (`StepCost`,
fitted on this engine's own steps): where reading the weights dominates
(a small batch) rows are cheap, and where arithmetic does (a large batch, a
CPU) each costs nearly as much as a stream's token. Each batch size gets its
own fit, from its own steps: the cost of a row is not a straight line
across batch sizes (on a CPU the first rows past a batch cost most, as the
threads' shares of attention fall out of balance), so one line through
steps of every size prices a large batch's row at what it costs in a small
one. A sequence keeps its j-th proposed token with a probability of about
a**j, where a is its acceptance estimate:

* the recent acceptance rate of its proposals (an average over its last
  verifications, starting at PRIOR), and
* for a sampled sequence, at most the top-1 probability of the target's
  recent (tempered) distributions for it: the token drawn is the proposed
  one with at most that probability, so a flat distribution (high entropy)
  keeps few proposals however often the text repeated before. A greedy
  sequence keeps a proposal whenever it is the most likely token, however
  sure the model is of it: its rate alone says.

The gate adds proposed tokens, likeliest first, while each adds clearly
more expected tokens per second than the step yields without it: with E
tokens expected from a step of cost C, a token kept with probability p joins
when p * C > MIN_GAIN * per_row * E. (At break-even a row gains nothing,
and the prices are estimates from noisy steps: a row must be worth more
than it costs by a margin, or a misjudged price would make speculation
cost.) A sequence none of whose tokens joins verifies nothing that step;
one left out PROBE_EVERY steps in a row verifies one token, so that a
stretch of copying is noticed again. Probes are spread further apart where
a row is dear (a large batch on a CPU, where each costs nearly a stream's
token), so that together they cost at most MAX_PROBE_SHARE of the steps'
time.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass

PRIOR = 0.5  # acceptance rate of a sequence with no verification yet
RATE_WEIGHT = 0.3  # of the newest verification in a sequence's acceptance rate
TOP1_WEIGHT = 0.3  # of the newest distribution in a sequence's top-1 probability
MIN_GAIN = 1.25  # what a proposed row must be expected to give, over what it costs
PROBE_EVERY = 16  # steps, at the least, between two probes of a sequence
MAX_PROBE_SHARE = 0.01  # of the decode steps' time that probing may take
COST_WINDOW = 256  # decode steps in the cost fit
REFIT_EVERY = 16  # steps between two fits: a fit reads the whole window, too much for every step
MIN_BATCH_STEPS = 8  # steps with and without proposals each, in the window, to price a batch size on its own


@dataclass(slots=True)
class SeqStats:
    rate: float = PRIOR
    top1: float = 1.0  # of its sampled distributions; stays 1.0 for a greedy sequence
    steps_without: int = 0  # steps since it last verified a proposal


class StepCost:
    """Seconds of a decode step against its batch and rows.

    A batch size with enough recent steps both with and without proposals
    is priced from those alone: its cost is the median of its steps without
    proposals, and a row the median of what each step with proposals cost
    past that, per row (medians, as a shared machine's steps are noisy).
    Other batch sizes use a least-squares line through every recent step
    (refitted every REFIT_EVERY steps), and until the steps vary enough, two
    forward passes timed at start-up."""

    def __init__(self, fixed_s: float, per_row_s: float) -> None:
        self.fixed_s, self.per_row_s = fixed_s, max(per_row_s, 0.0)
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=COST_WINDOW)  # (batch, rows, seconds)
        self.num_observed = 0
        self.batches: dict[int, tuple[float, float]] = {}  # batch -> (its cost without proposals, per row)

    @classmethod
    def from_timings(cls, rows: tuple[int, int], seconds: tuple[float, float]) -> "StepCost":
        per_row = (seconds[1] - seconds[0]) / (rows[1] - rows[0])
        return cls(max(seconds[0] - per_row * rows[0], 0.0), per_row)

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        self.steps.append((batch, rows, seconds))
        self.num_observed += 1
        if self.num_observed % REFIT_EVERY:
            return
        self._fit_line()
        self._fit_batch(batch)

    def _fit_line(self) -> None:
        n = len(self.steps)
        mean_r = sum(r for _, r, _ in self.steps) / n
        var = sum((r - mean_r) ** 2 for _, r, _ in self.steps)
        if var < n * 0.25:  # rows hardly varied: the slope is not in these steps
            return
        mean_s = sum(s for _, _, s in self.steps) / n
        slope = sum((r - mean_r) * (s - mean_s) for _, r, s in self.steps) / var
        self.per_row_s = max(slope, 0.0)
        self.fixed_s = max(mean_s - self.per_row_s * mean_r, 0.0)

    def _fit_batch(self, batch: int) -> None:
        plain = [s for b, r, s in self.steps if b == batch and r == batch]
        extra = [(r - batch, s) for b, r, s in self.steps if b == batch and r > batch]
        if len(plain) < MIN_BATCH_STEPS or len(extra) < MIN_BATCH_STEPS:
            return
        base = statistics.median(plain)
        self.batches[batch] = (base, max(statistics.median((s - base) / k for k, s in extra), 0.0))

    def at(self, batch: int) -> tuple[float, float]:
        """A step of `batch` sequences without proposals, and each row more, in seconds."""
        return self.batches.get(batch) or (self.fixed_s + self.per_row_s * batch, self.per_row_s)


class SpecGate:
    def __init__(self, cost: StepCost) -> None:
        self.cost = cost
        self.stats: dict[str, SeqStats] = {}

    def acceptance(self, request_id: str) -> float:
        s = self.stats.get(request_id)
        return PRIOR if s is None else min(s.rate, s.top1)

    def draft_lengths(self, available: dict[str, int], base_rows: int, budget: int) -> dict[str, int]:
        """Tokens to verify per sequence, of the `available` proposals, in a step of `base_rows` rows without
        them and at most `budget` more."""
        lengths = dict.fromkeys(available, 0)
        candidates = []  # (probability kept, request id, j)
        for rid, num in available.items():
            a = self.acceptance(rid)
            candidates += [(a ** j, rid, j) for j in range(1, num + 1)]
        candidates.sort(key=lambda c: -c[0])
        step_s, per_row_s = self.cost.at(base_rows)
        expected = float(base_rows)
        for p, rid, j in candidates:
            if budget <= 0 or lengths[rid] != j - 1 or p * step_s <= MIN_GAIN * per_row_s * expected:
                continue
            lengths[rid] = j
            step_s, expected, budget = step_s + per_row_s, expected + p, budget - 1
        probe_every = self.probe_every(len(available), base_rows)
        for rid, num in available.items():
            s = self.stats.setdefault(rid, SeqStats())
            if lengths[rid]:
                s.steps_without = 0
            elif num and budget > 0 and s.steps_without + 1 >= probe_every:
                lengths[rid], s.steps_without, budget = 1, 0, budget - 1
            else:
                s.steps_without += 1
        return lengths

    def probe_every(self, num_sequences: int, base_rows: int) -> int:
        """Steps between two probes of a sequence, so that `num_sequences` probing cost at most MAX_PROBE_SHARE of
        steps of `base_rows` rows."""
        step_s, per_row_s = self.cost.at(base_rows)
        share = num_sequences * per_row_s / max(step_s, 1e-9)
        return max(PROBE_EVERY, math.ceil(share / MAX_PROBE_SHARE))

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification's outcome: tokens past the first rejected one say nothing, so they do not count."""
        s = self.stats.setdefault(request_id, SeqStats())
        judged = min(proposed, accepted + 1)
        s.rate += RATE_WEIGHT * (accepted / judged - s.rate)

    def distribution(self, request_id: str, top1: float) -> None:
        """The top-1 probability of the (tempered) distribution the target just drew this sampled sequence's
        token from."""
        s = self.stats.setdefault(request_id, SeqStats())
        s.top1 += TOP1_WEIGHT * (top1 - s.top1)

    def forget(self, request_id: str) -> None:
        self.stats.pop(request_id, None)
