"""Prompts of a given length: random token ids for the native protocol, words for HTTP.

The content does not matter to a benchmark, its length and its reuse do.
Token ids give an exact length; they are drawn above the low ids where
special tokens live (as pdrt.testing.prompts does) and below `vocab_size`,
whose default of 1000 fits any tokenizer worth serving. Text is random
common words, and a server's tokenizer turns a word into about
`tokens_per_word` tokens (measured by the driver, since it varies by
tokenizer).

Requests of one conversation draw from one stream, so a later turn's prompt
starts with the earlier turn's prompt, as in a real chat. Every run mixes
a `salt` into the streams: a sweep's second rate must not find its prompts
in the prefix cache the first rate filled.
"""

import random

from pdrt.bench.workloads import RequestShape

LOWEST_TOKEN_ID = 10
DEFAULT_VOCAB_SIZE = 1000
WORDS = ("the of and to in is that for it as with was on be by this are from or at an have not but which one all "
         "were when there can more if out so what up time about into than its only other new some could these "
         "two may first then do any like my now over such our man me even most made after also did many before "
         "must through back years where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against go came right "
         "used take three").split()


class PromptBuilder:
    """Deterministic prompts for the requests of one run."""

    def __init__(self, seed: int, salt: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 tokens_per_word: float = 1.0) -> None:
        self.seed = seed
        self.salt = salt
        self.vocab_size = vocab_size
        self.tokens_per_word = tokens_per_word

    def _rng(self, index: int, shape: RequestShape) -> random.Random:
        stream = f"conversation:{shape.conversation}" if shape.conversation >= 0 else f"request:{index}"
        return random.Random(f"{self.seed}:{self.salt}:{stream}")

    def token_ids(self, index: int, shape: RequestShape) -> list[int]:
        """`shape.input_tokens` random ids; a conversation's prompts are prefixes of one another."""
        rng = self._rng(index, shape)
        high = max(LOWEST_TOKEN_ID + 1, self.vocab_size)
        return [rng.randrange(LOWEST_TOKEN_ID, high) for _ in range(shape.input_tokens)]

    def text(self, index: int, shape: RequestShape) -> str:
        """Random words that the server's tokenizer turns into about `shape.input_tokens` tokens."""
        rng = self._rng(index, shape)
        num_words = max(1, round(shape.input_tokens / self.tokens_per_word))
        return " ".join(rng.choice(WORDS) for _ in range(num_words))


def probe_text(num_words: int) -> str:
    """Text to measure a tokenizer's tokens per word on: the same kind of words the prompts are made of."""
    rng = random.Random("probe")
    return " ".join(rng.choice(WORDS) for _ in range(num_words))
