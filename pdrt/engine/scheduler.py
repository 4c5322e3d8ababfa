"""Chooses the work of each engine step and applies its results."""

import itertools
from collections import deque
from dataclasses import dataclass, field

from pdrt.engine.block_manager import BlockManager
from pdrt.engine.prompt_order import PromptOrder, default_order
from pdrt.engine.sequence import FinishReason, Sequence, SequenceStatus

MAX_FORETOLD = 64  # waiting prompts in `Scheduler.first_token_work`


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work. Decodes (one token each) come first in the packed step, then prefill chunks."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decode_samples: list[Sequence] = field(default_factory=list)  # decodes that get a new token
    prefill_samples: list[Sequence] = field(default_factory=list)  # prefills whose last chunk this is

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def sequences(self) -> list[Sequence]:
        return self.decodes + [seq for seq, _ in self.prefills]


@dataclass(frozen=True, slots=True)
class DraftLimits:
    """How much of a step and of the pool prompts still being typed may take."""

    min_chunk: int = 128  # a draft's first chunk waits until this many stable tokens are pending
    min_step: int = 16  # and each later one until this many
    max_tokens_per_draft: int = 1 << 30
    max_blocks: int = 1 << 30  # all drafts together


class Scheduler:
    """Token-budgeted continuous batching with chunked prefill and preemption by recompute.

    Each step it first serves the running sequences in arrival order, drafts
    (prompts still being typed) after everything else and only in steps that
    prefill no submitted prompt: a decode costs one
    token, an unfinished prompt a chunk of at most `max_prefill_chunk_size`.
    When the pool has no block for a running sequence, a sequence not yet
    served this step is preempted, a draft first, else the most recently
    admitted one (its blocks freed, its tokens kept, back to the front of the
    queue to be recomputed); a draft itself grows only into free blocks. The
    remaining budget admits waiting sequences, submitted ones before drafts,
    reusing any cached prefix; a submitted one that does not fit (the pool,
    or `max_num_seqs`) takes the place of running drafts.

    With `prompt_batch_tokens` set, prompts run one after another: a step
    takes a chunk of its first prompt, and a later prompt only whole and only
    while the step stays within that many tokens. Where a step's time grows
    with its tokens (a CPU), every token of a later prompt in the step delays
    the first one's first token; batched side by side, prompts that came
    together all got their first tokens at the end of them all. Which prompt
    goes next is the `prompt_order` policy's choice (pdrt/engine/prompt_order.py):
    by default the highest response ratio when prompts go one by one, arrival
    order when they go side by side.

    A sequence of a step that raised is a suspect (`isolate`): it gives its
    blocks back and waits apart, and each step runs one suspect alone, as
    long as it fits the pool, until every one has run a step of its own; the
    one that raises again alone is the request to blame.

    A demoted sequence (`demote`) keeps its blocks and its place but decodes
    only in every `decode_every`-th step: the steps that skip it are shorter
    for every other stream. A step skips it only while a sequence that is not
    demoted runs too (so that no step goes empty for it), and counts it as
    served: it is not preempted for a newer one.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk_size: int, draft_limits: DraftLimits | None = None,
                 prompt_batch_tokens: int | None = None, prompt_order: PromptOrder | None = None) -> None:
        self.block_manager = block_manager
        self.draft_limits = draft_limits or DraftLimits()
        self.prompt_batch_tokens = prompt_batch_tokens
        self.prompt_order = prompt_order or default_order(prompt_batch_tokens)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk_size = max_prefill_chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.suspects: deque[Sequence] = deque()  # of a step that raised: each runs alone next
        self._is_prefilling_requests = False  # during `schedule`: a submitted prompt's chunk is in the batch
        self.num_preemptions = 0
        self.demoted: list[Sequence] = []  # in the order they were demoted
        self.num_demotions = 0
        self.num_promotions = 0
        self.work_done = 0  # tokens put into steps so far: the clock that waits are counted in

    def batch_prompts(self, prompt_batch_tokens: int | None) -> None:
        """Between steps: batch prompts as `prompt_batch_tokens` says from now on, in that way's default order."""
        self.prompt_batch_tokens = prompt_batch_tokens
        self.prompt_order = default_order(prompt_batch_tokens)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.queued_at_work = self.work_done
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in the pool (imported)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def demote(self, seq: Sequence, decode_every: int) -> None:
        """Decode running `seq` only every `decode_every`-th step from now on."""
        if seq.decode_every == 1:
            self.demoted.append(seq)
            self.num_demotions += 1
        seq.decode_every = decode_every

    def promote(self, seq: Sequence) -> None:
        """Decode `seq` every step again."""
        self._undemote(seq)
        self.num_promotions += 1

    def _undemote(self, seq: Sequence) -> None:
        self.demoted.remove(seq)
        seq.decode_every = 1
        seq.num_skipped_steps = 0

    def _skips(self, seq: Sequence) -> bool:
        """Whether demoted `seq` sits out a step that has other work; it counts the steps it sat out."""
        if seq.num_skipped_steps + 1 < seq.decode_every:
            seq.num_skipped_steps += 1
            return True
        seq.num_skipped_steps = 0
        return False

    def isolate(self, seq: Sequence) -> None:
        """`seq` was in a step that raised: free its blocks and keep it apart, to run alone (its tokens stay)."""
        self.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        seq.is_suspect = True
        self.suspects.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq.decode_every > 1:
            self._undemote(seq)
        if seq.is_suspect and seq in self.suspects:
            self.suspects.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)

    def has_work(self) -> bool:
        """True when a step would do something (a prompt still arriving is not work yet)."""
        budget = self.max_num_batched_tokens
        return bool(self.waiting or self.suspects) or any(self._num_new_tokens(s, budget) > 0 for s in self.running)

    def _num_computable(self, seq: Sequence) -> int:
        # An unfinished prompt keeps its last token back, so that the step
        # that finalizes it always has a token to compute logits from.
        return seq.num_tokens if seq.prompt_is_final else seq.num_tokens - 1

    def num_pending_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` whose KV could be computed now (a draft's below-threshold tail counts)."""
        return max(0, self._num_computable(seq) - seq.num_computed_tokens)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        n = self._num_computable(seq) - seq.num_computed_tokens
        if seq.is_draft:
            if self._is_prefilling_requests:
                return 0  # drafts use only steps that no submitted prompt needs: never slow a TTFT
            limits = self.draft_limits
            n = min(n, limits.max_tokens_per_draft - seq.num_computed_tokens)
            num_draft_blocks = sum(len(s.block_table) for s in self.running if s.is_draft)
            room = (limits.max_blocks - num_draft_blocks) * self.block_manager.block_size
            n = min(n, room + len(seq.block_table) * self.block_manager.block_size - seq.num_computed_tokens)
            threshold = limits.min_step if seq.num_computed_tokens else limits.min_chunk
            if n < min(threshold, self.max_prefill_chunk_size, budget) and not seq.draft_is_idle:
                return 0
        return max(0, min(n, self.max_prefill_chunk_size, budget))

    def _joins(self, batch: ScheduledBatch, seq: Sequence, n: int, budget: int) -> bool:
        """Whether `n` tokens of `seq` may go into `batch`, where `budget` tokens are left (prompts one by one)."""
        if self.prompt_batch_tokens is None or n == 0 or not batch.prefills:
            return True
        if seq.num_computed_tokens >= seq.num_prompt_tokens and not seq.is_draft:
            return True  # a decode
        whole = n == self.num_pending_tokens(seq)
        return whole and self.max_num_batched_tokens - budget + n <= self.prompt_batch_tokens

    def _work(self, seq: Sequence) -> int:
        """Tokens left to compute of a waiting prompt, its cached prefix aside (at least 1)."""
        cached = 0 if seq.block_table else self.block_manager.num_cached_prefix_tokens(seq, seq.num_tokens - 1)
        return max(1, self._num_computable(seq) - max(cached, seq.num_computed_tokens))

    def _admission_key(self, seq: Sequence) -> tuple[float, ...]:
        """Submitted prompts before drafts; among them, the prompt order's choice."""
        if seq.is_draft:
            return (True,)
        if not self.prompt_order.ranks_by_work:
            return (False,)
        return False, *self.prompt_order.key(self.work_done - seq.queued_at_work, self._work(seq))

    def first_token_work(self) -> dict[str, int]:
        """Each submitted prompt without its first token -> the prompt tokens this scheduler computes until
        that first token, if no other arrives: the started prompts' rest first (`started_prompts`), then the
        waiting ones in the order it would start them, the prompt order asked again as its clock advances.
        Only the first MAX_FORETOLD waiting in the queue's last order count: the account costs their number
        squared."""
        done, until = 0, {}
        for seq in self.started_prompts():
            done += self.num_pending_tokens(seq)
            until[seq.request_id] = done
        prompts = list(itertools.islice((seq for seq in self.waiting if not seq.is_draft), MAX_FORETOLD))
        clock = self.work_done + done
        pending = {seq.request_id: (seq.queued_at_work, self._work(seq)) for seq in prompts}
        order = self.prompt_order
        while pending:
            request_id = min(pending, key=lambda r: order.key(clock - pending[r][0], pending[r][1]))
            work = pending.pop(request_id)[1]
            clock, done = clock + work, done + work
            until[request_id] = done
        return until

    def started_prompts(self) -> list[Sequence]:
        """Submitted prompts whose prefill has begun and not yet ended, in the order they are served."""
        return [s for s in self.running if not s.is_draft and s.num_computed_tokens < s.num_prompt_tokens]

    def _victim(self, seq: Sequence, served: set[int]) -> Sequence:
        """Whom to preempt so that `seq` fits: not one served this step; a draft first, then the newest."""
        candidates = [s for s in reversed(self.running) if s is not seq and id(s) not in served]
        for candidate in candidates:
            if candidate.is_draft:
                return candidate
        return candidates[0] if candidates else seq

    def _make_room(self, seq: Sequence, n: int, served: set[int]) -> None:
        """Preempt running drafts, the newest first and none served this step, until submitted `seq` has a
        sequence slot and `n` of its tokens fit the pool: a prompt being typed never holds back one that was
        sent."""
        manager = self.block_manager
        while len(self.running) >= self.max_num_seqs or not manager.can_allocate(seq, n):
            draft = next((s for s in reversed(self.running) if s.is_draft and id(s) not in served), None)
            if draft is None:
                return
            self._preempt(draft)
            self.waiting.append(self.waiting.popleft())  # behind the prompt that took its place

    def _preempt(self, seq: Sequence) -> None:
        if seq.decode_every > 1:
            self._undemote(seq)  # it gives its blocks back; it costs nothing until it is recomputed
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _place(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        """Put `n` tokens of `seq`, whose blocks are allocated, into the batch."""
        if not seq.is_draft and seq.num_computed_tokens < seq.num_prompt_tokens:
            self._is_prefilling_requests = True
        self.work_done += n
        samples = seq.needs_sample_after(n)
        if n == 1:
            batch.decodes.append(seq)
            if samples:
                batch.decode_samples.append(seq)
        else:
            batch.prefills.append((seq, n))
            if samples:
                batch.prefill_samples.append(seq)

    def _alone(self, seq: Sequence) -> ScheduledBatch:
        """A step of suspect `seq` alone, if its next chunk fits the pool now (else an empty one)."""
        batch = ScheduledBatch()
        manager = self.block_manager
        manager.match_prefix(seq, max_tokens=seq.num_tokens - 1)
        n = self._num_new_tokens(seq, self.max_num_batched_tokens)
        if n == 0 or not manager.can_allocate(seq, n):
            manager.free(seq)
            seq.reset_for_recompute()
            return batch
        self.suspects.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        manager.allocate(seq, n)
        self._place(batch, seq, n)
        return batch

    def schedule(self) -> ScheduledBatch:
        for seq in list(self.suspects):
            batch = self._alone(seq)
            if not batch.is_empty:
                return batch
        self._is_prefilling_requests = False
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        manager = self.block_manager
        served: set[int] = set()
        may_skip = bool(self.demoted) and any(s.decode_every == 1 and not s.is_draft for s in self.running)
        for seq in sorted(self.running, key=lambda s: s.is_draft):  # stable: arrival order within each kind
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = self._num_new_tokens(seq, budget)
            if n == 0 or not self._joins(batch, seq, n, budget):
                continue
            if may_skip and seq.decode_every > 1 and self._skips(seq):
                served.add(id(seq))
                continue
            num_new_blocks = manager.num_new_blocks(seq, n)
            if seq.is_draft and num_new_blocks > manager.num_free_blocks:
                continue  # a draft grows into free blocks only: it never preempts
            while num_new_blocks > manager.num_free_blocks:
                victim = self._victim(seq, served)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if num_new_blocks:
                    manager.allocate(seq, n)
                self._place(batch, seq, n)
                served.add(id(seq))
                budget -= n
        if len(self.waiting) > 1 and (self.prompt_order.ranks_by_work or any(s.is_draft for s in self.waiting)):
            self.waiting = deque(sorted(self.waiting, key=self._admission_key))
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                manager.match_prefix(seq, max_tokens=seq.num_tokens - 1)
            n = self._num_new_tokens(seq, budget)
            if not seq.is_draft:
                self._make_room(seq, n, served)
            if len(self.running) >= self.max_num_seqs or not self._joins(batch, seq, n, budget) \
                    or not manager.can_allocate(seq, n):
                manager.free(seq)
                seq.reset_for_recompute()
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            served.add(id(seq))  # in this step's batch: no later admission may preempt it
            if n:
                manager.allocate(seq, n)
                self._place(batch, seq, n)
                budget -= n
        self._is_prefilling_requests = False
        return batch

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq`: take it off the queues and free its blocks."""
        self.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
