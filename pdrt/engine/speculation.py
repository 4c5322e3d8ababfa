"""Speculative decoding in the engine: proposed tokens verified in the decode step, kept only where the target
model would have made them.

Before a step runs, `plan` gives each decoding sequence of a decode-only
step the proposed tokens the gate chose (pdrt/engine/spec_gate.py) from
its proposer (pdrt/engine/proposers.py), in `Sequence.proposal`, and the
blocks they need, from free blocks only (speculation never preempts). The
model runner then computes the sequence's token and its proposals as
consecutive decode rows over the sequence's blocks, each attending to the
ones before it; their KV goes into the pool as any token's does.

`accept` then reads the target's token at every row: the token the
sampler draws there for that output index, greedy or with the request's
seed for that index (pdrt/engine/sampler.py). Proposals are kept while each
equals the target's token at its row; the first that does not is replaced
by it (or, all kept, the last row's token follows them). The output is the
target's own, token for token, greedy or seeded: a seed gives the same
tokens with speculation on and off. A proposal is kept with the
probability that the target draws it, as with the usual rejection rule for
a proposer that proposes one token for sure.

What the rejected tokens left behind is rolled back by the engine: their
KV lies past the sequence's computed tokens, so no prefix-cache entry is
ever made from it, and blocks that hold only such KV are freed.
"""

import time

import structlog
import torch

from pdrt.engine.proposers import DraftModel, PromptLookup, Proposer
from pdrt.engine.scheduler import ScheduledBatch
from pdrt.engine.sequence import Sequence, SequenceMode
from pdrt.engine.spec_gate import SpecGate, StepCost

log = structlog.get_logger(__name__)

CALIBRATION_ROWS = (1, 17)


def make_proposer(speculate: str, device: str, dtype: str) -> Proposer | None:
    """`speculate` is "off", "prompt_lookup", or the directory of a draft model's checkpoint."""
    if speculate == "off":
        return None
    if speculate == "prompt_lookup":
        return PromptLookup()
    from pdrt.engine.model_loader import load_model

    return DraftModel(load_model(speculate, device, dtype, attention="sdpa").model)


class Speculator:
    def __init__(self, proposer: Proposer, cost: StepCost, block_manager, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.proposer = proposer
        self.gate = SpecGate(cost)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_decode_tokens = 0  # tokens decode rows gave their sequences
        self.num_decode_seq_steps = 0  # one per decoding sequence per step
        self.step_started = 0.0

    def plan(self, batch: ScheduledBatch) -> None:
        """Give the decoding sequences of a decode-only step their proposals, and the blocks those need."""
        self.step_started = time.perf_counter()
        if batch.prefills or not batch.decode_samples:
            return
        manager = self.block_manager
        available = {}
        for seq in batch.decode_samples:
            if not seq.params.speculate or seq.decode_every > 1 or seq.num_output_tokens == 0 \
                    or seq.mode is SequenceMode.PREFILL_ONLY:
                continue  # opted out, demoted, or a prompt's last token, which gives the first
            room = min(seq.params.max_tokens - seq.output_index, self.max_model_len - seq.num_tokens) - 1
            if room > 0:
                available[seq.request_id] = min(room, self.proposer.available(seq))
        if not available:
            return
        budget = self.max_num_batched_tokens - len(batch.decodes)
        lengths = self.gate.draft_lengths(available, len(batch.decodes), budget)
        for seq in batch.decode_samples:
            k = lengths.get(seq.request_id, 0)
            if not k:
                continue
            k = min(k, self._blocks_allow(seq, k))
            if k:
                manager.allocate(seq, 1 + k)
                seq.proposal = self.proposer.propose(seq, k)

    def _blocks_allow(self, seq: Sequence, k: int) -> int:
        manager = self.block_manager
        while k and manager.num_new_blocks(seq, 1 + k) > manager.num_free_blocks:
            k -= 1
        return k

    def accept(self, seq: Sequence, targets: list[int]) -> int:
        """How many of `seq`'s proposals the target's tokens `targets` (one per row) keep."""
        proposal = seq.proposal
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == targets[accepted]:
            accepted += 1
        if proposal:
            self.num_proposed += len(proposal)
            self.num_accepted += accepted
            self.gate.verified(seq.request_id, len(proposal), accepted)
        return accepted

    def stepped(self, batch: ScheduledBatch, num_decode_tokens: int, top1: list[float],
                rows: list[Sequence]) -> None:
        """After the step: its cost, what the decode rows gave, the target's confidence per sequence."""
        if batch.decodes and not batch.prefills:
            batch_size = len(batch.decodes)
            self.gate.cost.observe(batch_size, batch_size + sum(len(s.proposal) for s in batch.decodes),
                                   time.perf_counter() - self.step_started)
        self.num_decode_tokens += num_decode_tokens
        self.num_decode_seq_steps += len(batch.decode_samples)
        # The decodes' rows lead; the prompts' first tokens after them are not counted.
        num_rows = sum(1 + len(seq.proposal) for seq in batch.decode_samples)
        for seq, p in zip(rows[:num_rows], top1[:num_rows], strict=True):
            if not seq.is_finished and not seq.params.is_greedy:  # a finished one is forgotten
                self.gate.distribution(seq.request_id, p)
        for seq in batch.decodes:
            seq.proposal = []

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.gate.forget(request_id)


def time_rows(run, rows: int, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of `run(rows)`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run(rows)
        best = min(best, time.perf_counter() - started)
    return best


def calibrated_cost(run) -> StepCost:
    """A step's cost against its rows from two timed forward passes (`run(rows)`), before any request."""
    with torch.inference_mode():
        run(CALIBRATION_ROWS[0])  # first-call setup is not a step's cost
        seconds = tuple(time_rows(run, rows) for rows in CALIBRATION_ROWS)
    cost = StepCost.from_timings(CALIBRATION_ROWS, seconds)
    log.info("speculation cost calibrated", fixed_ms=round(cost.fixed_s * 1e3, 3),
             per_row_ms=round(cost.per_row_s * 1e3, 4))
    return cost
