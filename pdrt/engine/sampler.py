"""Turns the logits of one step into one token per row: a sequence's next token, or one it verifies."""

from dataclasses import dataclass

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


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[float] | None  # of each token under the raw model distribution, when any row asks
    top1: list[float]  # the largest probability of each sampled row's tempered distribution; 1.0 for greedy rows


class Sampler:
    """Greedy rows take the argmax; the others are tempered, filtered, and drawn with a per-token seed.

    A row is a sequence and the index of the output token it draws (`output_index`): a sequence verifying
    proposed tokens has a row for each, and each row draws with its own index's seed, as it would have one
    step at a time."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], output_indices: list[int] | None = None
                 ) -> Sampled:
        logits = logits.float()
        indices = output_indices if output_indices is not None else [s.output_index for s in seqs]
        # max().indices, like argmax, picks the first of tied maxima, and is faster on CPU.
        tokens = logits.max(dim=-1).indices
        random_rows, wants_logprobs = [], False
        for i, s in enumerate(seqs):
            if not s.params.is_greedy:
                random_rows.append(i)
            wants_logprobs = wants_logprobs or s.params.logprobs
        top1 = [1.0] * len(seqs)
        if random_rows:
            drawn, tempered_top1 = self._sample(logits[random_rows], [seqs[i] for i in random_rows],
                                                [indices[i] for i in random_rows])
            tokens[random_rows] = drawn
            for row, p in zip(random_rows, tempered_top1.tolist(), strict=True):
                top1[row] = p
        token_list = tokens.tolist()
        logprobs = None
        if wants_logprobs:
            # Log-probabilities of the raw model distribution, before temperature and filters.
            logprobs = logits.log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        return Sampled(token_list, logprobs, top1)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], indices: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draw, and the largest probability of its tempered, filtered distribution."""
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
        for row, (seq, index) in enumerate(zip(seqs, indices, strict=True)):
            generator.manual_seed(draw_seed(seq.seed, index))
            noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1), probs.max(dim=-1).values
