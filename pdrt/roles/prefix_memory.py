"""What a gateway knows of its workers' prefix caches: the blocks of the prompts it had computed there.

A worker's prefix cache keeps the full KV blocks of the prompts it computed
(a decode worker's: also those it imported) until it needs their room. The
gateway cannot see it, but it knows where each prompt went: a prompt's block
keys (pdrt.engine.prefix_hash, the workers' own keys) go into a bounded LRU
for each worker that holds its KV, and a prompt's cached part on a worker is
estimated as its leading blocks found there. An estimate: the worker may
have evicted them since.
"""

from collections import OrderedDict

from pdrt.engine.prefix_hash import prefix_keys, salt_root

MAX_BLOCKS_PER_WORKER = 1 << 16


class PrefixMemory:
    def __init__(self, block_size: int, hash_seed: int, max_blocks: int = MAX_BLOCKS_PER_WORKER) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.max_blocks = max_blocks
        self.workers: dict[str, OrderedDict[int, None]] = {}  # process id -> block keys, least recent first

    def keys(self, token_ids: list[int], cache_salt: str = "") -> list[int]:
        return prefix_keys(token_ids, self.block_size, self.hash_seed, salt_root(cache_salt, self.hash_seed))

    def remember(self, process_id: str, keys: list[int]) -> None:
        blocks = self.workers.setdefault(process_id, OrderedDict())
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def cached_tokens(self, process_id: str, keys: list[int]) -> int:
        """Tokens of the prompt of `keys` that the worker likely has cached: its leading blocks remembered there."""
        blocks = self.workers.get(process_id, {})
        num_blocks = 0
        for key in keys:
            if key not in blocks:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def forget(self, process_id: str) -> None:
        self.workers.pop(process_id, None)
