"""Reproducible synthetic prompts for benchmarks."""

import random


def random_prompts(n: int, length: int | tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids (avoiding the first ids, where special tokens live).

    `length` is a fixed length or an inclusive (low, high) range.
    """
    rng = random.Random(seed)
    lengths = [length if isinstance(length, int) else rng.randint(*length) for _ in range(n)]
    return [[rng.randrange(10, vocab_size) for _ in range(k)] for k in lengths]
