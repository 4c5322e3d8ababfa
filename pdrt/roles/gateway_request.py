"""One client request as the gateway sees it: where it runs, what it produced, what the client has been sent.

Text is produced here, not in the workers: the gateway decodes the output
tokens incrementally (never splitting a UTF-8 character) and applies stop
strings. While streaming it holds back the last `len(longest stop) - 1`
characters, since they could turn out to be the start of a stop string that
the client must never see.
"""

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pdrt.engine.detokenizer import IncrementalDetokenizer
from pdrt.engine.outputs import RequestOutput
from pdrt.engine.sampling_params import SamplingParams
from pdrt.engine.sequence import FinishReason
from pdrt.roles.prefix_memory import PrefixMemory
from pdrt.wire import Tokens, Usage, WorkerInfo

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "cancelled"}


def new_internal_id(process_id: str) -> str:
    """An id the workers know a request (or draft) attempt by: the gateway's name, then 64 random bits, so that
    no one can guess the id of another client's request to abort it or to claim its output."""
    return f"{process_id}-{secrets.token_hex(8)}"


@dataclass(slots=True, eq=False)
class GatewayRequest:
    identity: bytes  # the client's ZeroMQ identity
    request_id: str  # the client's id
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    deadline: float
    detokenizer: IncrementalDetokenizer | None
    internal_id: str = ""  # changes with every attempt, so late outputs of an abandoned attempt are ignored
    attempt: int = 0
    num_attempt_tokens: int = 0  # tokens the current attempt produced
    failures: int = 0  # times a worker it ran on died or failed it (moves for other reasons aside)
    unrouted_at: float = 0.0  # when it last began to wait for a worker that can take it
    prefill: WorkerInfo | None = None
    decode: WorkerInfo | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_chars_sent: int = 0
    num_tokens_sent: int = 0
    early_decode_outputs: list[RequestOutput] = field(default_factory=list)
    session_id: str = ""
    messages: list[dict[str, str]] | None = None  # a chat request's messages, remembered for its session
    preferred: WorkerInfo | None = None  # the prefill worker holding this session's warmup or draft
    pinned: bool = False  # its prefill worker holds its draft's KV, or has started it: it is not moved
    withdrawing: float | None = None  # when it was asked back from its prefill worker, to go to its decode worker
    _block_keys: list[int] | None = None
    admitted_at: float = field(default_factory=time.monotonic)  # these four time the request's metrics
    sent_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def answer(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @classmethod
    def create(cls, identity: bytes, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               stream: bool, deadline: float, tokenizer: Any | None) -> "GatewayRequest":
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop) if tokenizer is not None else None
        return cls(identity, request_id, prompt_token_ids, params, stream, deadline, detok)

    def resume(self, output: list[int], logprobs: list[float] | None = None) -> None:
        """Take `output` (and its `logprobs`, when the request asks for them) as this request's output so far,
        already streamed to its client by a gateway that was lost: it is not sent again, and the stream goes on
        after it."""
        if self.params.logprobs:
            self.logprobs.extend(logprobs or ())
        for token in output:
            self.token_ids.append(token)
            if self.detokenizer is not None:
                self.detokenizer.add(token)
        self.num_tokens_sent = len(self.token_ids)
        text = self.detokenizer.text if self.detokenizer is not None else ""
        stop_chars = self.detokenizer.max_stop_chars if self.detokenizer is not None else 0
        self.num_chars_sent = max(0, len(text) - stop_chars + 1) if stop_chars else len(text)

    def block_keys(self, prefixes: PrefixMemory) -> list[int]:
        """The prefix-cache keys of the prompt's full blocks, computed once."""
        if self._block_keys is None:
            self._block_keys = prefixes.keys(self.prompt_token_ids, self.params.cache_salt)
        return self._block_keys

    @property
    def awaits_first_token(self) -> bool:
        """Whether the current attempt has produced nothing yet: its prompt is still being prefilled."""
        return self.num_attempt_tokens == 0

    def route_token_ids(self) -> list[int]:
        """What a worker computes for a new attempt: the prompt, and the output so far (a continuation)."""
        return self.prompt_token_ids + self.token_ids if self.token_ids else self.prompt_token_ids

    def workers(self) -> list[WorkerInfo]:
        return [w for w in (self.prefill, self.decode) if w is not None]

    def runs_on(self, process_id: str) -> bool:
        """Whether worker `process_id` serves this attempt: the only one whose outputs count for it."""
        return any(w.process_id == process_id for w in self.workers())

    def add(self, out: RequestOutput) -> tuple[Tokens | None, bool]:
        """Take a worker's output; returns the frame to send (if any) and whether the request ended."""
        if not self.token_ids:
            self.num_cached_tokens = out.num_cached_tokens
        self.num_attempt_tokens += len(out.new_token_ids)
        finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        for i, token in enumerate(out.new_token_ids):
            self.token_ids.append(token)
            if out.new_logprobs is not None:
                self.logprobs.append(out.new_logprobs[i])
            if self.detokenizer is not None:
                delta = self.detokenizer.add(token)
                stop = self.detokenizer.find_stop(len(delta))
                if stop is not None:  # the worker stops on the same token; do not wait for it to say so
                    finished, reason, stop_reason = True, FinishReason.STOP, stop
                    break
        if finished and self.detokenizer is not None and not isinstance(stop_reason, str):
            self.detokenizer.finish()
        if not finished and not self.stream:
            return None, False
        return self._frame(finished, FINISH_REASONS.get(FinishReason(reason)) if finished and reason else None,
                           stop_reason), finished

    def _frame(self, finished: bool, finish_reason: str | None, stop_reason: str | int | None = None) -> Tokens:
        text = self.detokenizer.text if self.detokenizer is not None else ""
        end = len(text)
        if not finished and self.detokenizer is not None and self.detokenizer.max_stop_chars:
            end = max(self.num_chars_sent, end - self.detokenizer.max_stop_chars + 1)
        first = 0 if not self.stream else self.num_tokens_sent
        frame = Tokens(self.request_id, self.token_ids[first:], text[self.num_chars_sent if self.stream else 0:end],
                       finished, finish_reason, stop_reason,
                       self.usage() if finished else None,
                       self.logprobs[first:] if self.params.logprobs else None)
        self.num_tokens_sent = len(self.token_ids)
        self.num_chars_sent = end
        return frame

    def cancelled(self) -> Tokens:
        return self._frame(True, "cancelled")

    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), len(self.token_ids), self.num_cached_tokens)
