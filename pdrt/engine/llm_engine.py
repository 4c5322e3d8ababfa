"""The engine of one worker: a model replica, its paged KV pool, a scheduler and a sampler.

Three ways in, one per kind of worker:

* colocated: `add_request`, then `step` until `has_unfinished` is False;
* prefill-only: `add_prefill`, `step`; the output carrying the first token
  also carries the block ids of the prompt KV, kept until `release`;
* a prompt still being typed: `add_draft`, `update_draft` as it changes,
  `submit_draft` when it is complete (then as either of the above);
* decode from imported KV: `reserve_import` returns the blocks to fill,
  `commit_import` starts decoding after the first token.

The engine's whole public surface is this one class, which is why the module is long; the work it
names lives in the scheduler, block manager, model runner and sampler.
"""

import random
from collections.abc import Callable

import msgspec
import structlog
import torch

from pdrt.devices import activation_reserve_bytes, gpu_pool_bytes
from pdrt.engine.block_manager import BlockManager
from pdrt.engine.config import EngineConfig
from pdrt.engine.detokenizer import IncrementalDetokenizer
from pdrt.engine.kv_pool import KVLayout, KVPool
from pdrt.engine.model_loader import LoadedModel, load_model
from pdrt.engine.model_runner import ModelRunner
from pdrt.engine.outputs import ImportReservation, RequestOutput
from pdrt.engine.prefix_hash import salt_root
from pdrt.engine.proposers import DraftModel
from pdrt.engine.sampler import Sampled, Sampler
from pdrt.engine.sampling_params import SamplingParams
from pdrt.engine.scheduler import DraftLimits, ScheduledBatch, Scheduler
from pdrt.engine.sequence import FinishReason, Sequence, SequenceMode, SequenceStatus
from pdrt.engine.speculation import CALIBRATION_ROWS, Speculator, calibrated_cost, make_proposer
from pdrt.errors import (
    ConfigError,
    DuplicateRequestError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    KVPoolFullError,
    PromptTooLongError,
    RequestTooLargeError,
    UnknownRequestError,
)

log = structlog.get_logger(__name__)

# A sequence in this many steps that raised is to blame, even where it never raised alone.
MAX_FAILED_STEPS = 3
# A draft is never sampled before it is submitted; these only satisfy the checks until then.
DRAFT_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 kv_allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
        """`kv_allocator(shape, dtype)` supplies the pool's storage (shared memory, for a KV source)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model, config.device, config.dtype)
        model_config = self.loaded.model.config
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.vocab_size = int(model_config.vocab_size)
        self.max_model_len = min(config.max_model_len or self.loaded.context_length, self.loaded.context_length)
        layout = KVLayout.for_model(model_config, config.block_size, self.loaded.model.dtype)
        pool_bytes = config.kv_cache_memory_bytes or self._gpu_pool_bytes(config, layout)
        num_blocks = config.num_blocks or layout.num_blocks_for_bytes(pool_bytes)
        if num_blocks < 1:
            raise ConfigError(f"a KV pool of {pool_bytes} bytes holds no block of {layout.bytes_per_block} bytes: "
                              "raise [engine] kv_cache_bytes")
        storage = None
        if kv_allocator is not None:
            storage = kv_allocator(KVPool.shape_for(layout, num_blocks), layout.dtype)
            wanted = torch.device(config.device)
            if storage.device.type != wanted.type or wanted.index not in (None, storage.device.index):
                raise ConfigError(f"the KV transfer backend keeps the pool on {storage.device}, the model is on "
                                  f"{config.device}")
        self.pool = KVPool(layout, num_blocks, device=config.device, storage=storage)
        log.info("kv pool ready", blocks=num_blocks, block_size=config.block_size,
                 capacity_tokens=self.pool.capacity_tokens, bytes=self.pool.num_bytes, dtype=str(layout.dtype))
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.hash_seed)
        max_draft_tokens = min(config.max_draft_tokens or self.max_model_len, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk_size,
                                   DraftLimits(config.min_draft_chunk, config.min_draft_step, max_draft_tokens,
                                               int(num_blocks * config.max_draft_pool_fraction)),
                                   config.prompt_batch_tokens)
        self.runner = ModelRunner(self.loaded.decoder, self.pool, self.max_model_len)
        self.sampler = Sampler()
        self.speculator = self._speculator(config)
        self.sequences: dict[str, Sequence] = {}
        self.num_computed_prompt_tokens = 0
        self.last_step_ran = False  # False when the last step found nothing it could schedule
        self.last_batch = ScheduledBatch()  # what the last step ran, for the worker's metrics
        self.last_tokens_per_stream = 1.0  # tokens each decoding sequence got in the last step, on average
        self.num_draft_rollbacks = 0
        self.num_draft_tokens_rolled_back = 0
        self.num_draft_tokens_ahead = 0  # draft tokens whose KV was computed before submit
        self.failed: list[tuple[str, Exception]] = []  # requests a step failed on, not yet taken

    def _gpu_pool_bytes(self, config: EngineConfig, layout: KVLayout) -> int:
        """The pool a GPU's memory leaves this worker once its weights are loaded (pdrt/devices.py)."""
        model_config = self.loaded.model.config
        free, total = torch.cuda.mem_get_info()
        used = torch.cuda.memory_allocated()
        reserve = activation_reserve_bytes(config.max_num_batched_tokens, model_config.hidden_size,
                                           model_config.intermediate_size, self.vocab_size,
                                           layout.dtype.itemsize)
        pool = min(gpu_pool_bytes(total, config.gpu_memory_utilization, config.gpu_sharing, used, reserve),
                   free - reserve)
        log.info("kv pool sized from GPU memory", total_bytes=total, free_bytes=free, weights_bytes=used,
                 reserve_bytes=reserve, utilization=config.gpu_memory_utilization, sharing=config.gpu_sharing,
                 pool_bytes=pool)
        return pool

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        """Speculative decoding as `config.speculate` asks, its step cost timed on this model before any request
        (the pool holds nothing yet)."""
        proposer = make_proposer(config.speculate, config.device, config.dtype)
        if proposer is None or self.pool.capacity_tokens < CALIBRATION_ROWS[1]:
            return None
        if isinstance(proposer, DraftModel) and proposer.model.config.vocab_size != self.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({proposer.model.config.vocab_size} tokens) is not "
                              f"the target's ({self.vocab_size}): [engine] speculate needs a draft model of the same "
                              "vocabulary")
        return Speculator(proposer, calibrated_cost(self.runner.forward_rows), self.block_manager,
                          self.max_model_len, config.max_num_batched_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    # -- request creation -------------------------------------------------

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      mode: SequenceMode, prompt_is_final: bool = True, num_prior_outputs: int = 0) -> Sequence:
        """Validate a request completely, so that nothing about it can fail later.

        A continuation's last `num_prior_outputs` prompt tokens are the outputs it produced before it moved
        here: it samples and stops as if it had never moved (`Sequence.num_prior_outputs`)."""
        if request_id in self.sequences:
            raise DuplicateRequestError(f"request {request_id!r} already exists")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt has no tokens")
        num_prompt = len(prompt_token_ids)
        if not 0 <= num_prior_outputs < min(num_prompt, params.max_tokens):
            raise InvalidRequestError(f"a continuation of {num_prompt} tokens with max_tokens {params.max_tokens} "
                                      f"cannot carry {num_prior_outputs} outputs")
        self._check_prompt(prompt_token_ids, num_prompt, num_prompt + params.max_tokens - num_prior_outputs)
        if params.stop and self.tokenizer is None:
            raise InvalidSamplingParamsError("stop strings need a tokenizer, and this model has none")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidSamplingParamsError(f"stop_token_ids must be < {self.vocab_size}")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params, seed, mode,
                       prompt_is_final, num_prior_outputs=num_prior_outputs,
                       cache_root=salt_root(params.cache_salt, self.block_manager.hash_seed))
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        return seq

    def _check_prompt(self, new_token_ids: list[int], num_prompt_tokens: int, max_total_tokens: int) -> None:
        """Token ids in the vocabulary, the prompt within the context, the request within the pool."""
        if any(not (0 <= t < self.vocab_size) for t in new_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                                     f"{self.max_model_len} tokens, including at least one generated token")
        needed = self.block_manager.num_blocks_for(min(max_total_tokens, self.max_model_len))
        if needed > self.block_manager.num_blocks:
            raise RequestTooLargeError(
                f"the request may need {needed} KV blocks and this worker's pool has "
                f"{self.block_manager.num_blocks} ({self.capacity_tokens} tokens); lower max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_prior_outputs: int = 0) -> None:
        """Colocated: prefill and decode here."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, SequenceMode.COLOCATED,
                                 num_prior_outputs=num_prior_outputs)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_prior_outputs: int = 0) -> None:
        """Prefill-only: compute the prompt KV and the first token, then hold the blocks."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, SequenceMode.PREFILL_ONLY,
                                 num_prior_outputs=num_prior_outputs)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    # -- drafts: prompts still being typed ----------------------------------------

    def add_draft(self, request_id: str, token_ids: list[int], colocated: bool = False, cache_salt: str = "") -> None:
        """Start prefilling the stable part of a prompt that is still being typed.

        A draft's tokens are computed once `min_draft_chunk` of them wait,
        then in steps of at least `min_draft_step` (any size once the typist
        pauses), after every submitted request's work, within the draft caps. It is
        sampled only after `submit_draft`; then it goes on as a prefill-only
        request (or, `colocated`, decodes here). Its prefix cache is that of
        `cache_salt`, which its submit's parameters keep.
        """
        mode = SequenceMode.COLOCATED if colocated else SequenceMode.PREFILL_ONLY
        params = msgspec.structs.replace(DRAFT_PARAMS, cache_salt=cache_salt) if cache_salt else DRAFT_PARAMS
        seq = self._new_sequence(request_id, token_ids, params, mode, prompt_is_final=False)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def update_draft(self, request_id: str, num_kept: int, new_token_ids: list[int]) -> None:
        """Keep the draft's first `num_kept` tokens and append `new_token_ids`.

        Dropping tokens whose KV is computed rolls the draft back: its blocks
        are freed and it is scheduled again, and the prefix cache gives back
        every full block of the kept prefix, so only the rest is recomputed.
        """
        seq = self._get_draft(request_id)
        self._check_prompt(new_token_ids, num_kept + len(new_token_ids), num_kept + len(new_token_ids))
        if num_kept < 1 and not new_token_ids:
            raise InvalidRequestError("a draft cannot become empty; abort it instead")
        if num_kept > seq.num_tokens:
            raise InvalidRequestError(f"draft {request_id!r} has {seq.num_tokens} tokens, cannot keep {num_kept}")
        if num_kept < seq.num_computed_tokens:
            self.num_draft_rollbacks += 1
            self.num_draft_tokens_rolled_back += seq.num_computed_tokens - num_kept
            self.scheduler.remove(seq)
            self.block_manager.free(seq)
            seq.reset_for_recompute()
            self.scheduler.add(seq)
        del seq.token_ids[num_kept:]
        seq.token_ids.extend(new_token_ids)
        seq.num_prompt_tokens = seq.num_tokens
        seq.draft_is_idle = False

    def draft_idle(self, request_id: str) -> None:
        """The typist paused: prefill what the draft has, however little, rather than wait for a full chunk."""
        seq = self.sequences.get(request_id)
        if seq is not None and seq.is_draft:
            seq.draft_is_idle = True

    def submit_draft(self, request_id: str, num_kept: int, new_token_ids: list[int], params: SamplingParams) -> None:
        """The prompt is complete: its last tokens and the sampling parameters arrive; it is a request now."""
        seq = self._get_draft(request_id)
        if params.cache_salt != seq.params.cache_salt:
            raise InvalidRequestError(f"draft {request_id!r} was opened with another cache_salt")
        total = num_kept + len(new_token_ids)
        self._check_prompt(new_token_ids, total, total + params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise InvalidSamplingParamsError("stop strings need a tokenizer, and this model has none")
        ahead = min(num_kept, seq.num_computed_tokens)
        self.num_draft_tokens_ahead += ahead
        self.update_draft(request_id, num_kept, new_token_ids)
        # For the request, the prompt computed ahead is as good as cached: usage reports it so.
        seq.num_cached_tokens = max(seq.num_cached_tokens, min(ahead, seq.num_computed_tokens))
        seq.params = params
        seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq.prompt_is_final = True
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids, params.stop)

    def _get_draft(self, request_id: str) -> Sequence:
        seq = self._get(request_id)
        if seq.prompt_is_final:
            raise InvalidRequestError(f"request {request_id!r} is not a draft")
        return seq

    def release(self, request_id: str) -> None:
        """Free the KV of a held prefill (the decode worker has it now)."""
        seq = self._get(request_id)
        if seq.status is not SequenceStatus.HELD:
            raise InvalidRequestError(f"request {request_id!r} holds no finished prefill")
        self.block_manager.free(seq)
        del self.sequences[request_id]

    def reserve_import(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                       params: SamplingParams, first_logprob: float | None = None,
                       num_prior_outputs: int = 0) -> ImportReservation:
        """Decode from imported KV: reserve blocks for the prompt; cached prefix blocks need no filling.

        With `params.logprobs`, `first_logprob` is the first token's (the prefill worker reported it), so that
        the outputs here carry one log-probability per token as a colocated request's do.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params, SequenceMode.IMPORTED,
                                 num_prior_outputs=num_prior_outputs)
        if not (0 <= first_token_id < self.vocab_size):
            raise InvalidRequestError(f"first token id must be in [0, {self.vocab_size})")
        if params.logprobs and first_logprob is None:
            raise InvalidRequestError("a request with logprobs needs its first token's log-probability")
        self.block_manager.match_prefix(seq, max_tokens=seq.num_tokens)
        num_cached_blocks = len(seq.block_table)
        remaining = seq.num_tokens - seq.num_computed_tokens
        if not self.block_manager.can_allocate(seq, remaining):
            self.block_manager.free(seq)
            raise KVPoolFullError(f"no room for {seq.num_tokens} imported tokens "
                                  f"({self.block_manager.num_free_blocks} free blocks)")
        self.block_manager.allocate(seq, remaining)
        seq.token_ids.append(first_token_id)
        if params.logprobs:
            seq.output_logprobs.append(first_logprob)
        if seq.detokenizer is not None:
            seq.detokenizer.add(first_token_id)
        seq.status = SequenceStatus.IMPORTING
        self.sequences[request_id] = seq
        return ImportReservation(list(seq.block_table), num_cached_blocks)

    def commit_import(self, request_id: str) -> None:
        """The reserved blocks now hold the prompt KV: start decoding."""
        seq = self._get(request_id)
        if seq.status is not SequenceStatus.IMPORTING:
            raise InvalidRequestError(f"request {request_id!r} has no import in progress")
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_full_blocks(seq)
        seq.num_emitted_tokens = 1  # the first token was reported by the prefill worker
        self.scheduler.add_running(seq)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is and free its blocks. Unknown ids are ignored."""
        seq = self.sequences.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.ABORT)

    def _get(self, request_id: str) -> Sequence:
        try:
            return self.sequences[request_id]
        except KeyError:
            raise UnknownRequestError(f"no request {request_id!r}") from None

    # -- stepping ---------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One forward pass: schedule, propose, run the model, apply the sampled tokens. A step that raises
        costs the request to blame, never the others (`_isolate`)."""
        batch = self.scheduler.schedule()
        self.last_step_ran = not batch.is_empty
        self.last_batch = batch
        if batch.is_empty:
            return []
        outputs: list[RequestOutput] = []
        try:
            self._run(batch, outputs)
        except Exception as exc:
            self._isolate(batch, outputs, exc)
        return outputs

    def _run(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        spec = self.speculator
        if spec is not None:
            spec.plan(batch)
        rows, indices = self._sample_rows(batch)
        sampled = self.sampler(self.runner.run(batch), rows, indices)
        self._postprocess(batch, sampled, outputs)
        for seq in batch.sequences():
            seq.is_suspect = False  # it ran a step that did not raise
        num_streams = len(batch.decode_samples)
        decode_tokens = sum(len(o.new_token_ids) for o in outputs[:num_streams])
        self.last_tokens_per_stream = decode_tokens / num_streams if num_streams else 1.0
        if spec is not None:
            spec.stepped(batch, decode_tokens, sampled.top1, rows)

    def _isolate(self, batch: ScheduledBatch, outputs: list[RequestOutput], exc: Exception) -> None:
        """A step raised. Its sequences whose outputs were not made yet are suspects: alone in the step, or in
        MAX_FAILED_STEPS such steps, one is to blame and fails (`take_failed`); otherwise each goes back to its
        last emitted token and runs alone next (Scheduler.isolate), where the one to blame raises again."""
        made = {out.request_id for out in outputs}
        suspects = [seq for seq in batch.sequences()
                    if seq.request_id not in made and self.sequences.get(seq.request_id) is seq]
        log.error("an engine step raised", error=repr(exc), suspects=[seq.request_id for seq in suspects],
                  exc_info=exc)
        for seq in suspects:
            seq.num_failed_steps += 1
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
            if len(suspects) == 1 or seq.num_failed_steps >= MAX_FAILED_STEPS or seq.is_draft:
                del self.sequences[seq.request_id]
                self.scheduler.finish(seq, FinishReason.ABORT)
                self.failed.append((seq.request_id, exc))
            else:
                seq.forget_unsent()
                self.scheduler.isolate(seq)

    def take_failed(self) -> list[tuple[str, Exception]]:
        """The requests that steps failed on since the last call, each with what it raised."""
        failed, self.failed = self.failed, []
        return failed

    @staticmethod
    def _sample_rows(batch: ScheduledBatch) -> tuple[list[Sequence], list[int]]:
        """The sequence and output index of each row whose logits the runner keeps, in its order."""
        rows, indices = [], []
        for seq in batch.decode_samples:
            rows += [seq] * (1 + len(seq.proposal))
            indices += range(seq.output_index, seq.output_index + 1 + len(seq.proposal))
        for seq in batch.prefill_samples:
            rows.append(seq)
            indices.append(seq.output_index)
        return rows, indices

    def _postprocess(self, batch: ScheduledBatch, sampled: Sampled, outputs: list[RequestOutput]) -> None:
        row = 0
        sampling = {id(seq) for seq in batch.decode_samples}
        for seq in batch.decodes:
            if id(seq) not in sampling:
                self._advance(seq, 1)
        for seq in batch.decode_samples:  # each decode's token, then the proposals it verified
            num_rows = 1 + len(seq.proposal)
            targets = sampled.tokens[row : row + num_rows]
            accepted = self.speculator.accept(seq, targets) if seq.proposal else 0
            new_tokens = seq.proposal[:accepted] + [targets[accepted]]
            logprobs = sampled.logprobs[row : row + accepted + 1] if sampled.logprobs is not None else None
            row += num_rows
            # The KV of the decode's own token and of the proposals kept is the sequence's now.
            self._take(seq, new_tokens, logprobs, num_computed=1 + accepted)
            outputs.append(self._sampled_output(seq))
        for seq, n in batch.prefills:
            self._advance(seq, n)
        for seq in batch.prefill_samples:
            logprobs = sampled.logprobs[row : row + 1] if sampled.logprobs is not None else None
            self._take(seq, [sampled.tokens[row]], logprobs)
            row += 1
            outputs.append(self._sampled_output(seq))

    def _sampled_output(self, seq: Sequence) -> RequestOutput:
        """The output of a sequence that got tokens; a prefill-only one holds its KV from its first."""
        if seq.mode is SequenceMode.PREFILL_ONLY and not seq.is_finished:
            self.scheduler.remove(seq)
            seq.status = SequenceStatus.HELD
        return self._output(seq)

    def _take(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None, num_computed: int = 0) -> None:
        """Append `tokens` up to the first that stops `seq`. A decode's `num_computed` tokens from its first
        uncomputed one got their KV this step (its own and the proposals kept); they count once the tokens are
        appended, as the prefix cache registers a full block by its tokens. KV past them, a rejected
        proposal's, is rolled back: blocks only it used are freed."""
        stop = None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            if logprobs is not None and seq.params.logprobs:
                seq.output_logprobs.append(logprobs[i])
            stop = self._stop(seq)
            if stop is not None:
                break
        if num_computed:
            self._advance(seq, min(num_computed, len(seq.token_ids) - seq.num_computed_tokens))
        if stop is not None:
            seq.stop_reason = stop[1]
            self.scheduler.finish(seq, stop[0])
        elif seq.proposal:
            self.block_manager.trim(seq, seq.num_computed_tokens + 1)

    def _advance(self, seq: Sequence, n: int) -> None:
        """`n` more tokens of `seq` are in the pool now; register the blocks they filled."""
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.num_computed_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens += n
        if seq.num_computed_tokens >= (len(seq.block_hashes) + 1) * self.block_manager.block_size:
            self.block_manager.cache_full_blocks(seq)

    def _stop(self, seq: Sequence) -> tuple[FinishReason, str | int | None] | None:
        """Whether the token just appended ends `seq`, why, and the stop token or string that did."""
        token = seq.token_ids[-1]
        params = seq.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if params.stop_token_ids and token in params.stop_token_ids:
            return FinishReason.STOP, token
        if seq.detokenizer is not None:
            delta = seq.detokenizer.add(token)
            stop_reason = seq.detokenizer.find_stop(len(delta))
            if stop_reason is not None:
                return FinishReason.STOP, stop_reason
        if seq.output_index >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        start = seq.num_prompt_tokens + seq.num_emitted_tokens
        seq.num_emitted_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        finished = seq.status is SequenceStatus.FINISHED
        out = RequestOutput(
            seq.request_id,
            seq.token_ids[start:],
            seq.output_logprobs[start - seq.num_prompt_tokens :] if seq.params.logprobs else None,
            finished,
            int(seq.finish_reason) if finished else None,
            seq.stop_reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            list(seq.block_table) if seq.status is SequenceStatus.HELD else None,
        )
        if finished:
            del self.sequences[seq.request_id]
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
        return out

    # -- convenience ------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run `prompts` to completion together and return each one's output tokens."""
        ids = [f"generate-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(request_id, prompt, params)
        results: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[request_id] for request_id in ids]
