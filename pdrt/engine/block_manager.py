"""Paged KV block bookkeeping: allocation, reference counts and the prefix cache."""

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdrt.engine.prefix_hash import block_key
from pdrt.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None  # prefix-cache key once the block is full and registered
    parent_block: int | None = None  # the block before this one when it was registered
    root: int = 0  # the cache root (salt) of the sequence that registered it
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    """Owns which pool block belongs to which sequence.

    A full block is registered in the prefix cache under its chained key.
    Freed blocks keep their key (lazy eviction) and go to the back of an LRU
    free list; a later request with the same prefix takes them back, and only
    reuse for other tokens evicts them. A hit is confirmed by comparing the
    stored token ids and the parent *block* (the block just matched), not only
    keys: by induction from the first block, a hit then holds KV computed after
    exactly this prefix, so even a hash collision cannot alias KV. A sequence's
    first block chains from its cache root (its salt), which a hit must match
    too: requests of different salts share no block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, hash_seed: int) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # key -> block id
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> Block:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None and self.cached.get(block.key) == block_id:
            del self.cached[block.key]
        block.key, block.parent_block, block.token_ids, block.root = None, None, [], 0
        block.ref_count = 1
        return block

    def _lookup(self, root: int, parent: int, parent_block: int | None,
                token_ids: list[int]) -> tuple[int, Block | None]:
        key = block_key(parent, token_ids, self.hash_seed)
        block_id = self.cached.get(key)
        if block_id is None:
            return key, None
        block = self.blocks[block_id]
        if block.parent_block != parent_block or block.root != root or block.token_ids != token_ids:
            return key, None
        return key, block

    def _cached_prefix(self, seq: Sequence, max_tokens: int) -> Iterator[tuple[int, Block]]:
        """The cached blocks of `seq`'s longest cached prefix within its first `max_tokens` tokens, with their keys."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent, parent_block = seq.cache_root, None
        for start in range(0, max_tokens - bs + 1, bs):
            key, block = self._lookup(seq.cache_root, parent, parent_block, seq.token_ids[start : start + bs])
            if block is None:
                return
            yield key, block
            parent, parent_block = key, block.block_id

    def num_cached_prefix_tokens(self, seq: Sequence, max_tokens: int) -> int:
        """The tokens `match_prefix` would attach now, without attaching them."""
        return sum(1 for _ in self._cached_prefix(seq, max_tokens)) * self.block_size

    def match_prefix(self, seq: Sequence, max_tokens: int) -> None:
        """Attach cached blocks for the longest cached prefix of `seq`'s first `max_tokens` tokens.

        Only called on a sequence that holds no blocks yet. Sets
        `num_computed_tokens` to the tokens covered by the hits.
        """
        assert not seq.block_table
        hits = 0
        for key, block in self._cached_prefix(seq, max_tokens):
            hits += 1
            if block.ref_count == 0:
                del self.free_blocks[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            seq.block_hashes.append(key)
        if self.enable_prefix_caching:  # every lookup counts: the hits and the miss that ended them, if any
            self.num_prefix_queries += hits + (hits < max_tokens // self.block_size)
            self.num_prefix_hits += hits
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` enough blocks to hold `num_new_tokens` more tokens."""
        for _ in range(self.num_new_blocks(seq, num_new_tokens)):
            seq.block_table.append(self._take_free().block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.cache_root
            token_ids = seq.token_ids[i * bs : (i + 1) * bs]
            key = block_key(parent, token_ids, self.hash_seed)
            block = self.blocks[seq.block_table[i]]
            block.key, block.token_ids, block.root = key, token_ids, seq.cache_root
            block.parent_block = seq.block_table[i - 1] if i else None
            # A block with equal content may already be cached (two requests
            # computed the same prefix at once); keep the first, both stay valid.
            self.cached.setdefault(key, block.block_id)
            seq.block_hashes.append(key)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks of `seq` past those that hold its first `num_tokens` tokens (KV it computed ahead
        and does not keep: never registered, as it lies past the sequence's computed tokens)."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = None

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks are freed first so the LRU evicts them first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
