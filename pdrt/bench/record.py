"""What one benchmark request did: when it was due, sent, answered, and how many tokens came back.

Times are seconds on one monotonic clock, from the start of the run.
Latencies count from the moment the request was *due* (its arrival time),
not from when it left: in an open loop, a request the client sent late
(a busy event loop, the in-flight cap) was still waiting, and hiding that
wait would flatter the server. `send_lag_s` says how late it left.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline. A driver calls `sent`, `tokens` per frame, then `finish` or `fail`."""

    index: int
    due_s: float
    input_tokens: int  # what the workload asked for
    max_output_tokens: int
    conversation: int = -1
    sent_s: float | None = None
    done_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token seen, by arrival of its frame
    num_output_tokens: int = 0  # what the server produced (its usage when it reports one)
    prompt_tokens: int | None = None  # what the server counted, when it says
    finish_reason: str | None = None
    error: str | None = None

    def sent(self, now: float) -> None:
        self.sent_s = now

    def tokens(self, count: int, now: float) -> None:
        """`count` output tokens arrived at `now` (one frame or chunk)."""
        self.token_times.extend([now] * count)
        self.num_output_tokens += count

    def finish(self, now: float, num_output_tokens: int | None = None, prompt_tokens: int | None = None,
               finish_reason: str | None = None) -> None:
        """The request ended well; the server's own count of output tokens, when given, is the one kept."""
        self.done_s = now
        if num_output_tokens is not None:
            self.num_output_tokens = num_output_tokens
        self.prompt_tokens = prompt_tokens
        self.finish_reason = finish_reason
        if self.num_output_tokens == 0:
            self.error = "no_output"
        elif not self.token_times:  # everything came at the end (no text in the chunks): the first token too
            self.token_times.append(now)

    def fail(self, now: float, error: str) -> None:
        self.done_s = now
        self.error = error

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def send_lag_s(self) -> float | None:
        return None if self.sent_s is None else self.sent_s - self.due_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: from due to the first output token."""
        return self.token_times[0] - self.due_s if self.ok and self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.done_s - self.due_s if self.ok and self.done_s is not None else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (tokens - 1); 0 for a one-token answer."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None:
            return None
        return (e2e - ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive frames that brought tokens (tokens of one frame make no zero gaps)."""
        times = sorted(set(self.token_times))
        return [b - a for a, b in zip(times, times[1:], strict=False)] if self.ok else []

    def to_json(self) -> dict:
        return {"index": self.index, "due_s": self.due_s, "sent_s": self.sent_s, "done_s": self.done_s,
                "input_tokens": self.input_tokens, "max_output_tokens": self.max_output_tokens,
                "conversation": self.conversation, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.num_output_tokens, "finish_reason": self.finish_reason, "error": self.error,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
                "token_times_s": [round(t - self.due_s, 6) for t in self.token_times]}
