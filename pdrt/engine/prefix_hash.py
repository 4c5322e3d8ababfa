"""The prefix-cache key of a full KV block.

A block's key chains its parent's key with its own token ids, so equal keys
mean equal prefixes. A request's first block chains from its cache salt's
root (`salt_root`; ROOT_PARENT without a salt), so requests with different
salts never share a block. The function and its seed are fixed (BLAKE2b keyed by
`hash_seed`, not Python's per-process randomized `hash`), because a prefill
and a decode process must compute the same key for the same prefix.
"""

import hashlib
from array import array

ROOT_PARENT = 0


def block_key(parent: int, token_ids: list[int], hash_seed: int) -> int:
    """Key of a full block holding `token_ids` after the prefix keyed `parent`."""
    h = hashlib.blake2b(digest_size=8, key=hash_seed.to_bytes(8, "little"))
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(cache_salt: str, hash_seed: int) -> int:
    """The parent key of the first block of a request salted with `cache_salt`."""
    if not cache_salt:
        return ROOT_PARENT
    h = hashlib.blake2b(digest_size=8, key=hash_seed.to_bytes(8, "little"), person=b"pdrt-cache-salt")
    h.update(cache_salt.encode())
    return int.from_bytes(h.digest(), "little")


def prefix_keys(token_ids: list[int], block_size: int, hash_seed: int, parent: int = ROOT_PARENT) -> list[int]:
    """Keys of every full block of `token_ids`, in order."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], hash_seed)
        keys.append(parent)
    return keys
