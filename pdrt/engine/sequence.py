"""One request's whole state inside an engine."""

import enum
from dataclasses import dataclass, field

from pdrt.engine.detokenizer import IncrementalDetokenizer
from pdrt.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued for (re)scheduling; holds no blocks
    RUNNING = enum.auto()  # holds blocks, scheduled every step it has work
    HELD = enum.auto()  # prefill-only and done: blocks kept until released
    IMPORTING = enum.auto()  # decode-from-imported-KV: blocks reserved, being filled
    FINISHED = enum.auto()


class SequenceMode(enum.Enum):
    COLOCATED = enum.auto()  # prefill then decode in this engine
    PREFILL_ONLY = enum.auto()  # stop after the first token and hold the KV
    IMPORTED = enum.auto()  # prompt KV came from elsewhere; decode only


class FinishReason(enum.IntEnum):
    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens or the context length
    ABORT = 3


@dataclass(slots=True, eq=False)
class Sequence:
    """Per-request state: tokens, progress, block table, stop detection.

    `token_ids` holds the prompt followed by the outputs. `num_computed_tokens`
    counts the tokens whose KV is in the pool; the tokens after it are the
    work left. `prompt_is_final` is False while a prefill-only prompt is still
    arriving in pieces.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    mode: SequenceMode = SequenceMode.COLOCATED
    prompt_is_final: bool = True
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    cache_root: int = 0  # the parent key of its first block: its cache salt's (pdrt.engine.prefix_hash.salt_root)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    num_emitted_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    detokenizer: IncrementalDetokenizer | None = None
    draft_is_idle: bool = False  # a draft whose typist paused: its pending tokens go in any chunk size
    queued_at_work: int = 0  # the scheduler's work_done (tokens computed) when it was queued
    # A continuation (a request moved here after its worker died) carries its outputs so far at the end of its
    # prompt: they count as outputs for its sampling and its max_tokens, so it goes on as if never moved.
    num_prior_outputs: int = 0
    # Demoted (Scheduler.demote): decoded in every `decode_every`-th step only, `num_skipped_steps` skipped so far.
    decode_every: int = 1
    num_skipped_steps: int = 0
    # Tokens proposed for verification in the coming step, after its own (pdrt/engine/speculation.py).
    proposal: list[int] = field(default_factory=list)
    # Steps that raised with this sequence in them; while `is_suspect` it runs alone (Scheduler.isolate).
    num_failed_steps: int = 0
    is_suspect: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_index(self) -> int:
        """The index of the next output token in the request's whole output, continuations included."""
        return self.num_prior_outputs + self.num_output_tokens

    @property
    def is_draft(self) -> bool:
        """A prompt still being typed: prefilled ahead, never sampled until it is submitted."""
        return not self.prompt_is_final

    @property
    def is_decoding(self) -> bool:
        """A submitted prompt wholly computed: each step gives it one token."""
        return self.prompt_is_final and self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def needs_sample_after(self, num_new_tokens: int) -> bool:
        """True when computing `num_new_tokens` more reaches the end of a final prompt or output."""
        reaches_end = self.num_computed_tokens + num_new_tokens == len(self.token_ids)
        return reaches_end and self.prompt_is_final

    def forget_unsent(self) -> None:
        """Drop the output tokens not yet emitted (a step that raised appended them, or not all of them): the
        recompute samples them again, the same ones, since a token is drawn from its seed and index alone."""
        end = self.num_prompt_tokens + self.num_emitted_tokens
        del self.token_ids[end:]
        del self.output_logprobs[self.num_emitted_tokens:]
        self.proposal = []
        if self.detokenizer is not None:  # it may have seen a token dropped here
            old = self.detokenizer
            self.detokenizer = IncrementalDetokenizer(old.tokenizer, self.token_ids[:self.num_prompt_tokens], old.stop)
            for token in self.token_ids[self.num_prompt_tokens:]:
                self.detokenizer.add(token)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the KV, keep every token."""
        self.status = SequenceStatus.WAITING
        self.block_table = []
        self.block_hashes = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
