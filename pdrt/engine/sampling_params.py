"""How one request wants its tokens chosen and when it wants to stop."""

import msgspec

from pdrt.errors import InvalidSamplingParamsError

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256
GREEDY_BELOW = 1e-5
MAX_INT = 2**31 - 1  # counts and token ids are int32 inside the engine and on every wire


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Sampling parameters, validated at construction and on every decode.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1` disable
    those filters. `seed` makes sampling reproducible: the draw for output
    token i depends only on (seed, i) and the logits, so a request gives the
    same tokens whatever batch it lands in, after preemption, when its
    prefill and decode run in different processes, and with speculative
    decoding on or off (`speculate`). Requests share cached prompt KV only
    with requests of an equal `cache_salt` (the gateway folds the client's
    tenant into it: pdrt/roles/tenants.py).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    speculate: bool = True  # verify proposed tokens where the engine finds it pays; False: one token a step
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0):
            raise InvalidSamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 <= self.top_k <= MAX_INT:
            raise InvalidSamplingParamsError(f"top_k must be in [0, {MAX_INT}] (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidSamplingParamsError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 1 <= self.max_tokens <= MAX_INT:
            raise InvalidSamplingParamsError(f"max_tokens must be in [1, {MAX_INT}], got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParamsError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidSamplingParamsError(
                    f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {s!r}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # each sampled token is looked up in them
            raise InvalidSamplingParamsError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got "
                                             f"{len(self.stop_token_ids)}")
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidSamplingParamsError(f"cache_salt has at most {MAX_CACHE_SALT_CHARS} characters")
        if any(not 0 <= t <= MAX_INT for t in self.stop_token_ids):
            raise InvalidSamplingParamsError(f"stop_token_ids must be in [0, {MAX_INT}]")

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_BELOW the tempered logits overflow float32 (or the temperature rounds to 0 there): such
        # a temperature means the most likely token, which is what greedy picks.
        return self.temperature < GREEDY_BELOW
