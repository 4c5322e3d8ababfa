"""Where speculative decoding's proposed tokens come from: the text so far (prompt lookup) or a small draft model.

A proposer answers two questions about a decoding sequence each step:
`available(seq)`, how many tokens it could propose now (at most
MAX_PROPOSAL), and `propose(seq, k)`, those tokens. The gate
(pdrt/engine/spec_gate.py) picks k in between, and the engine verifies
them (pdrt/engine/speculation.py). Proposals are point guesses, never
distributions: verification keeps one exactly when the target model would
have produced it, so a proposer only decides how often that happens.

* `PromptLookup` finds the sequence's last few tokens earlier in the prompt
  or the output and proposes what followed them there: free, and right
  often where the answer quotes its input (summaries, edits of code).
* `DraftModel` runs a smaller checkpoint with the same tokenizer greedily,
  with a transformers KV cache per sequence, cut back to the sequence's
  tokens after each proposal.
"""

from typing import Protocol

import torch

from pdrt.engine.sequence import Sequence

MAX_PROPOSAL = 8
NGRAMS = (3, 2)  # longest first: a longer match is likelier to go on the same way


class Proposer(Protocol):
    def available(self, seq: Sequence) -> int: ...

    def propose(self, seq: Sequence, k: int) -> list[int]: ...

    def forget(self, request_id: str) -> None: ...


class _Index:
    """One sequence's n-grams -> where each last ended, with a token after it; built as the sequence grows."""

    __slots__ = ("ends", "indexed", "match")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.match = 0  # where the continuation found by the last `available` starts


class PromptLookup:
    def __init__(self) -> None:
        self.indexes: dict[str, _Index] = {}

    def available(self, seq: Sequence) -> int:
        tokens = seq.token_ids
        index = self.indexes.get(seq.request_id)
        if index is None:
            index = self.indexes[seq.request_id] = _Index()
        last = len(tokens)
        for end in range(max(index.indexed, 1), last):  # every n-gram with a token after it
            for n in NGRAMS:
                if end >= n:
                    index.ends[tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, last)
        for n in NGRAMS:
            if last > n:
                end = index.ends.get(tuple(tokens[last - n :]))
                if end is not None:
                    index.match = end
                    return min(MAX_PROPOSAL, last - end)
        return 0

    def propose(self, seq: Sequence, k: int) -> list[int]:
        start = self.indexes[seq.request_id].match
        return seq.token_ids[start : start + k]

    def forget(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)


class DraftModel:
    """Greedy proposals of a small causal LM that shares the target's tokenizer."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.new_cache = lambda: DynamicCache(config=model.config)
        self.caches: dict[str, tuple[object, int]] = {}  # request id -> (cache, tokens in it)

    def available(self, seq: Sequence) -> int:
        return MAX_PROPOSAL

    @torch.inference_mode()
    def propose(self, seq: Sequence, k: int) -> list[int]:
        cache, cached = self.caches.get(seq.request_id) or (self.new_cache(), 0)
        tokens = seq.token_ids
        cached = min(cached, len(tokens) - 1)  # at least the last token goes in, for its next-token logits
        _keep(cache, cached)
        device = next(self.model.parameters()).device
        step = torch.tensor([tokens[cached:]], device=device)
        proposal: list[int] = []
        position = cached
        while len(proposal) < k:
            positions = torch.arange(position, position + step.shape[1], device=device).unsqueeze(0)
            out = self.model(input_ids=step, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
            position += step.shape[1]
            token = int(out.logits[0, -1].argmax())
            proposal.append(token)
            step = torch.tensor([[token]], device=device)
        _keep(cache, len(tokens))  # the proposals are not the sequence's, whatever verification keeps
        self.caches[seq.request_id] = (cache, len(tokens))
        return proposal

    def forget(self, request_id: str) -> None:
        self.caches.pop(request_id, None)


def _keep(cache, num_tokens: int) -> None:
    """Cut a transformers cache back to its first `num_tokens` tokens."""
    extra = cache.get_seq_length() - num_tokens
    if extra > 0:
        cache.crop(-extra)
