"""What one engine step costs, fitted from a profile's measurements.

A step's time on a CPU (and on a GPU at small batches) is close to linear
in three quantities: a fixed cost (Python, kernel launches, the weights read
once), the tokens it computes (the linears), and the attention work, which
for a prompt of n new tokens over c cached ones is n·(c + n/2) and for a
decode step is the sum of its sequences' contexts. So

    prefill_s(n, c)       = a_p + b_p·n + g_p·n·(c + n/2)
    decode_step_s(B, S)   = a_d + b_d·B + g_d·S
    mixed step            = max(a_p, a_d) + the rest of both

each fitted per thread count by least squares on relative error (short steps
count as much as long ones). A thread count that was not measured takes the
nearest one measured, scaled by the thread ratio for its arithmetic (the
fixed cost stays): stated as a prediction, never as a measurement.
"""

from dataclasses import dataclass

import numpy as np

from pdrt.errors import ConfigError


@dataclass(slots=True, frozen=True)
class StepFit:
    """Seconds = fixed + per_token·tokens + per_attention·attention work."""

    fixed: float
    per_token: float
    per_attention: float

    def __call__(self, tokens: float, attention: float) -> float:
        return self.fixed + self.per_token * tokens + self.per_attention * attention

    def scaled(self, factor: float) -> "StepFit":
        """The same step with its arithmetic `factor` times as fast."""
        return StepFit(self.fixed, self.per_token / factor, self.per_attention / factor)


def fit_step(samples: list[tuple[float, float, float]]) -> StepFit:
    """A StepFit from (tokens, attention work, seconds) samples, none of its coefficients negative."""
    if len(samples) < 3:
        raise ConfigError(f"a fit needs at least 3 samples, got {len(samples)}")
    x = np.array([[1.0, t, a] for t, a, _ in samples])
    y = np.array([s for _, _, s in samples])
    weights = 1.0 / y
    active = [0, 1, 2]
    # Non-negative least squares by elimination: a negative coefficient is noise around zero; drop it, refit.
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = [0.0, 0.0, 0.0]
    for i, c in zip(active, coef, strict=True):
        full[i] = max(0.0, float(c))
    return StepFit(*full)


def prefill_attention(new_tokens: float, cached_tokens: float) -> float:
    return new_tokens * (cached_tokens + new_tokens / 2)


@dataclass(slots=True, frozen=True)
class ThreadsFit:
    prefill: StepFit
    decode: StepFit


@dataclass(slots=True)
class CostModel:
    """Step times of one model on one machine, by the threads a worker runs with."""

    fits: dict[int, ThreadsFit]
    kv_bytes_per_token: int = 0
    num_params: int = 1 << 40  # the model's; below SMALL_MODEL_PARAMS its steps are bound by Python

    def _fit(self, threads: int) -> ThreadsFit:
        if threads in self.fits:
            return self.fits[threads]
        if not self.fits:
            raise ConfigError("the cost model has no measurements")
        nearest = min(self.fits, key=lambda t: (abs(t - threads), -t))
        fit = self.fits[nearest]
        factor = threads / nearest
        return ThreadsFit(fit.prefill.scaled(factor), fit.decode.scaled(factor))

    def slower(self, prefill: float = 1.0, decode: float = 1.0) -> "CostModel":
        """The same model with every prompt `prefill` times and every decode step `decode` times as long (as
        measured on a loaded machine, or on a shared host slower now than when it was profiled)."""

        def scaled(fit: StepFit, factor: float) -> StepFit:
            return StepFit(fit.fixed * factor, fit.per_token * factor, fit.per_attention * factor)

        fits = {t: ThreadsFit(scaled(f.prefill, prefill), scaled(f.decode, decode)) for t, f in self.fits.items()}
        return CostModel(fits, self.kv_bytes_per_token, self.num_params)

    def parallelism(self, threads: int) -> float:
        """The cores a worker of `threads` threads keeps busy: the speed-up its threads gave a long prompt over
        one thread (a small model's step is bound by Python, and its second thread mostly waits)."""
        if threads <= 1 or 1 not in self.fits:
            return float(max(1, threads))
        long_prompt = 1024
        speedup = self.prefill_s(long_prompt, 0, 1) / self.prefill_s(long_prompt, 0, threads)
        return min(float(threads), max(1.0, speedup))

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0, threads: int = 1) -> float:
        return self._fit(threads).prefill(new_tokens, prefill_attention(new_tokens, cached_tokens))

    def decode_step_s(self, batch: int, context_tokens: int, threads: int = 1) -> float:
        return self._fit(threads).decode(batch, context_tokens)

    def mixed_step_s(self, batch: int, context_tokens: int, chunks: list[tuple[int, int]], threads: int = 1) -> float:
        """A step that decodes `batch` sequences and prefills `chunks` of (new, cached) tokens."""
        fit = self._fit(threads)
        if not chunks:
            return fit.decode(batch, context_tokens) if batch else 0.0
        prefill = sum(fit.prefill.per_token * n + fit.prefill.per_attention * prefill_attention(n, c)
                      for n, c in chunks)
        if not batch:
            return fit.prefill.fixed + prefill
        decode = fit.decode.per_token * batch + fit.decode.per_attention * context_tokens
        return max(fit.prefill.fixed, fit.decode.fixed) + prefill + decode
