"""Turns the logits of one step into one token per sequence."""

import torch

from pdrt.engine.sequence import Sequence

_MASK64 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def draw_seed(seed: int, output_index: int) -> int:
    """The generator seed for a request's `output_index`-th token: a pure function of both."""
    return ((seed + 1) * _GOLDEN ^ (output_index * 0xBF58476D1CE4E5B9)) & _MASK64


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's `top_k` largest logits (0 keeps all); ties at the threshold are kept."""
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
    sorted_desc = logits.sort(dim=-1, descending=True).values
    threshold = sorted_desc.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches `top_p`."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop_sorted[..., 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """Greedy rows take the argmax; the others are tempered, filtered, and drawn with a per-token seed."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
        logits = logits.float()
        # max().indices, like argmax, picks the first of tied maxima, and is faster on CPU.
        tokens = logits.max(dim=-1).indices
        random_rows, wants_logprobs = [], False
        for i, s in enumerate(seqs):
            if not s.params.is_greedy:
                random_rows.append(i)
            wants_logprobs = wants_logprobs or s.params.logprobs
        if random_rows:
            tokens[random_rows] = self._sample(logits[random_rows], [seqs[i] for i in random_rows])
        token_list = tokens.tolist()
        logprobs = None
        if wants_logprobs:
            # Log-probabilities of the raw model distribution, before temperature and filters.
            logprobs = logits.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        return token_list, logprobs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temperature.unsqueeze(-1)
        top_k = torch.tensor([s.params.top_k for s in seqs], device=logits.device)
        if bool((top_k > 0).any()):
            logits = apply_top_k(logits, top_k)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=logits.device)
        if bool((top_p < 1.0).any()):
            logits = apply_top_p(logits, top_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. Each
        # row's noise comes from its own generator, seeded per output token.
        noise = torch.empty_like(probs)
        generator = torch.Generator(device=logits.device)
        for row, seq in enumerate(seqs):
            generator.manual_seed(draw_seed(seq.seed, seq.output_index))
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)
