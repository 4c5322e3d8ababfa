"""Synthetic workloads modelled on DistServe's evaluation: chat, code completion, summarization.

DistServe (OSDI '24) measured OPT models, whose context is 2048 tokens, on
three datasets: ShareGPT (chat: prompts of a few hundred tokens, answers of
a few hundred), HumanEval (code completion: short prompts, longer answers)
and LongBench (summarization: long documents, short summaries). The
distributions below have those shapes. They are written for a 2048-token
context and shrink with a smaller one, so that every request fits; the long
prompts of summarization always sit near the context limit. `length_scale`
shrinks everything further, for quick runs on small machines.

Chat has a multi-turn flavour: requests come in conversations whose later
turns repeat the earlier prompt (and answer) and add a new message, so a
server with a prefix cache sees the reuse a real chat service gives it.
Turns of one conversation are spread over the run, in order.
"""

import math
import random
from dataclasses import dataclass

from pdrt.errors import ConfigError

WORKLOADS = ("chat", "code", "summarization")
REFERENCE_CONTEXT = 2048  # DistServe's OPT models
MIN_INPUT_TOKENS = 4
CONTEXT_MARGIN = 8  # room for a BOS token or a template the server adds


@dataclass(slots=True, frozen=True)
class RequestShape:
    """The lengths of one request; requests of one `conversation` (>= 0) share their prompts' prefixes."""

    input_tokens: int
    output_tokens: int
    conversation: int = -1


@dataclass(slots=True, frozen=True)
class LengthLimits:
    """How long requests may be: the server's context (capped by `max_context`), caps on either side, a scale."""

    max_model_len: int
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 2 * MIN_INPUT_TOKENS + CONTEXT_MARGIN:
            raise ConfigError(f"a context of {self.max_model_len} tokens is too short to benchmark")
        if not 0.0 < self.length_scale <= 1.0:
            raise ConfigError(f"length scale must be in (0, 1], got {self.length_scale}")

    @property
    def context(self) -> int:
        """The tokens one request may use, prompt and output together."""
        cap = self.max_model_len if self.max_context is None else min(self.max_model_len, self.max_context)
        return cap - CONTEXT_MARGIN

    @property
    def scale(self) -> float:
        """Lengths are multiplied by this: the context relative to DistServe's, never above 1, times the scale."""
        return min(1.0, self.context / REFERENCE_CONTEXT) * self.length_scale

    def fit(self, input_tokens: float, output_tokens: float) -> tuple[int, int]:
        """Lengths rounded, capped and cut so that prompt plus output fit the context (the output is kept)."""
        out = max(1, round(output_tokens))
        if self.max_output_tokens is not None:
            out = min(out, self.max_output_tokens)
        out = min(out, self.context - MIN_INPUT_TOKENS)
        inp = max(MIN_INPUT_TOKENS, round(input_tokens))
        if self.max_input_tokens is not None:
            inp = min(inp, self.max_input_tokens)
        return min(inp, self.context - out), out


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(median), sigma)))


def _code(rng: random.Random, limits: LengthLimits) -> RequestShape:
    s = limits.scale
    inp = _lognormal(rng, 150 * s, 0.5, 16 * s, 512 * s)
    out = _lognormal(rng, 250 * s, 0.4, 64 * s, 600 * s)
    return RequestShape(*limits.fit(inp, out))


def _summarization(rng: random.Random, limits: LengthLimits) -> RequestShape:
    out = rng.uniform(32, 128) * limits.scale
    _, out_fitted = limits.fit(MIN_INPUT_TOKENS, out)
    room = min(limits.context, limits.max_input_tokens or limits.context) - out_fitted
    inp = rng.uniform(0.55, 0.9) * room * limits.length_scale
    return RequestShape(*limits.fit(inp, out))


def _chat(num_requests: int, limits: LengthLimits, rng: random.Random) -> list[RequestShape]:
    """Conversations of 1 to 4 turns: each turn's prompt is the last one, its answer and a new message."""
    s = limits.scale
    turns: list[list[RequestShape]] = []
    while sum(map(len, turns)) < num_requests:
        conversation, prompt, shapes = len(turns), 0.0, []
        for _ in range(rng.randint(1, 4)):
            new_message = _lognormal(rng, (200 if not shapes else 80) * s, 0.6, 16 * s, 1024 * s)
            out = rng.uniform(100, 300) * s
            prompt += new_message
            inp, out_fitted = limits.fit(prompt, out)
            if inp < round(prompt) and shapes:  # the conversation outgrew the context: it ends here
                break
            shapes.append(RequestShape(inp, out_fitted, conversation))
            prompt = inp + out_fitted
        turns.append(shapes)
    # Spread the turns over the run: a random order of conversations, each conversation's turns in order.
    order = [c for c, shapes in enumerate(turns) for _ in shapes]
    rng.shuffle(order)
    taken = [0] * len(turns)
    out_shapes = []
    for c in order:
        out_shapes.append(turns[c][taken[c]])
        taken[c] += 1
    return out_shapes[:num_requests]


def sample_shapes(workload: str, num_requests: int, limits: LengthLimits, seed: int) -> list[RequestShape]:
    """`num_requests` request lengths of a built-in workload, the same for the same seed."""
    rng = random.Random(f"{workload}:{seed}")
    if workload == "chat":
        return _chat(num_requests, limits, rng)
    if workload == "code":
        return [_code(rng, limits) for _ in range(num_requests)]
    if workload == "summarization":
        return [_summarization(rng, limits) for _ in range(num_requests)]
    raise ConfigError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)} or give a trace file")
