"""BlockManager on hand-built sequences: reference counts, the prefix cache, lazy eviction and stable keys."""

import json
import os
import subprocess
import sys

from pdrt.engine import SamplingParams, prefix_hash
from pdrt.engine.block_manager import BlockManager
from pdrt.engine.prefix_hash import ROOT_PARENT, block_key, prefix_keys
from pdrt.engine.sequence import Sequence

BLOCK_SIZE = 4
HASH_SEED = 1234


def make_seq(token_ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(token_ids), len(token_ids), SamplingParams(), seed=0)


def make_manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True, hash_seed=HASH_SEED)


def compute(manager: BlockManager, seq: Sequence) -> None:
    """What a prefill does to the books: blocks for every token, all computed, full blocks cached."""
    manager.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)


def ref_counts(manager: BlockManager, block_ids: list[int]) -> list[int]:
    return [manager.blocks[b].ref_count for b in block_ids]


PREFIX = list(range(100, 112))  # three full blocks


def test_allocate_takes_blocks_with_one_reference_and_free_returns_them():
    manager = make_manager()
    seq = make_seq(list(range(10)))
    manager.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert ref_counts(manager, seq.block_table) == [1, 1, 1]
    assert manager.num_free_blocks == 5
    assert not set(seq.block_table) & set(manager.free_blocks)
    taken = list(seq.block_table)
    manager.free(seq)
    assert seq.block_table == []
    assert ref_counts(manager, taken) == [0, 0, 0]
    assert manager.num_free_blocks == 8
    assert set(taken) <= set(manager.free_blocks)


def test_allocate_adds_only_the_blocks_that_new_tokens_need():
    manager = make_manager()
    seq = make_seq(list(range(5)))
    manager.allocate(seq, 5)
    seq.num_computed_tokens = 5
    assert len(seq.block_table) == 2
    manager.allocate(seq, 3)  # fills the second block
    assert len(seq.block_table) == 2
    manager.allocate(seq, 4)
    assert len(seq.block_table) == 3
    assert not manager.can_allocate(seq, 100)


def test_shared_blocks_are_counted_per_sequence_and_freed_by_the_last_holder():
    manager = make_manager()
    first = make_seq(PREFIX + [1], "first")
    compute(manager, first)
    second = make_seq(PREFIX + [2], "second")
    manager.match_prefix(second, max_tokens=second.num_tokens - 1)
    shared = first.block_table[:3]
    assert second.block_table == shared
    assert ref_counts(manager, shared) == [2, 2, 2]
    manager.free(first)
    assert ref_counts(manager, shared) == [1, 1, 1]
    assert not set(shared) & set(manager.free_blocks)
    manager.free(second)
    assert ref_counts(manager, shared) == [0, 0, 0]
    assert manager.num_free_blocks == manager.num_blocks


def test_freed_prefix_is_matched_by_a_new_sequence_with_the_same_prefix():
    manager = make_manager()
    first = make_seq(PREFIX)
    compute(manager, first)
    cached_blocks = list(first.block_table)
    assert first.block_hashes == prefix_keys(PREFIX, BLOCK_SIZE, HASH_SEED)
    manager.free(first)
    assert manager.num_free_blocks == manager.num_blocks

    second = make_seq(PREFIX + [7, 8])
    manager.match_prefix(second, max_tokens=second.num_tokens - 1)
    assert second.block_table == cached_blocks
    assert second.num_computed_tokens == second.num_cached_tokens == 12
    assert ref_counts(manager, cached_blocks) == [1, 1, 1]
    assert manager.num_free_blocks == manager.num_blocks - 3
    assert (manager.num_prefix_hits, manager.num_prefix_queries) == (3, 3)


def test_a_different_token_in_block_two_matches_only_block_one():
    manager = make_manager()
    first = make_seq(PREFIX)
    compute(manager, first)
    cached = list(first.block_table)
    manager.free(first)
    changed = list(PREFIX)
    changed[5] = 999
    second = make_seq(changed + [7])
    manager.match_prefix(second, max_tokens=second.num_tokens - 1)
    assert second.num_computed_tokens == 4
    assert second.block_table == cached[:1]


def test_match_prefix_stops_before_max_tokens():
    manager = make_manager()
    first = make_seq(PREFIX)
    compute(manager, first)
    manager.free(first)
    second = make_seq(PREFIX)
    manager.match_prefix(second, max_tokens=11)  # the last block is not full within 11 tokens
    assert second.num_computed_tokens == 8


def test_reusing_a_freed_block_for_other_tokens_evicts_its_key():
    manager = make_manager(num_blocks=3)
    first = make_seq(PREFIX)
    compute(manager, first)
    keys, blocks = list(first.block_hashes), list(first.block_table)
    manager.free(first)
    assert all(key in manager.cached for key in keys)  # lazy: freed blocks keep their keys

    other = make_seq([1, 2, 3])
    manager.allocate(other, 3)
    # The tail block of the freed prefix is the first to be reused.
    assert other.block_table == [blocks[2]]
    assert keys[2] not in manager.cached
    assert keys[0] in manager.cached and keys[1] in manager.cached
    manager.free(other)

    again = make_seq(PREFIX + [5])
    manager.match_prefix(again, max_tokens=again.num_tokens - 1)
    assert again.num_computed_tokens == 8


def test_a_hash_collision_is_no_prefix_hit(monkeypatch):
    monkeypatch.setattr("pdrt.engine.block_manager.block_key", lambda parent, token_ids, hash_seed: 42)
    manager = make_manager()
    first = make_seq(PREFIX)
    compute(manager, first)
    manager.free(first)

    other = make_seq([7, 7, 7, 7, 8, 8, 8, 8, 9])
    manager.match_prefix(other, max_tokens=other.num_tokens - 1)
    assert other.block_table == [] and other.num_computed_tokens == 0

    # The same prefix hits its first block; the second has the same key but
    # another parent and other tokens, so it must not be taken for a hit.
    same = make_seq(PREFIX + [1])
    manager.match_prefix(same, max_tokens=same.num_tokens - 1)
    assert same.num_computed_tokens == 4


def test_a_hash_collision_in_the_parent_is_no_prefix_hit(monkeypatch):
    # Every first block collides; deeper blocks keep their real keys.
    def colliding_root(parent: int, token_ids: list[int], hash_seed: int) -> int:
        return 42 if parent == ROOT_PARENT else block_key(parent, token_ids, hash_seed)

    monkeypatch.setattr("pdrt.engine.block_manager.block_key", colliding_root)
    manager = make_manager()
    cached_first = make_seq([1, 1, 1, 1])
    compute(manager, cached_first)
    # Another first block with the same key, and a child computed after it.
    other = make_seq([2, 2, 2, 2, 3, 3, 3, 3])
    compute(manager, other)
    manager.free(cached_first)
    manager.free(other)

    # [1, 1, 1, 1] then [3, 3, 3, 3] was never computed: only its first block may hit.
    probe = make_seq([1, 1, 1, 1, 3, 3, 3, 3, 5])
    manager.match_prefix(probe, max_tokens=probe.num_tokens - 1)
    assert probe.num_computed_tokens == 4


def test_prefix_cache_disabled_never_matches():
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=False, hash_seed=HASH_SEED)
    first = make_seq(PREFIX)
    compute(manager, first)
    manager.free(first)
    assert manager.cached == {}
    second = make_seq(PREFIX + [1])
    manager.match_prefix(second, max_tokens=second.num_tokens - 1)
    assert second.num_computed_tokens == 0


def test_prefix_keys_are_the_same_in_another_process_whatever_its_hash_seed():
    token_ids = list(range(3, 40))
    here = prefix_keys(token_ids, BLOCK_SIZE, HASH_SEED)
    assert len(here) == 9
    # The child loads the module from its file: importing the `pdrt` package
    # would pull in torch and transformers, seconds per process, for nothing.
    code = ("import importlib.util, json, sys; "
            "spec = importlib.util.spec_from_file_location('prefix_hash', sys.argv[1]); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            f"print(json.dumps(module.prefix_keys({token_ids!r}, {BLOCK_SIZE}, {HASH_SEED})))")
    for python_hash_seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": python_hash_seed}
        out = subprocess.run([sys.executable, "-c", code, prefix_hash.__file__], env=env, capture_output=True,
                             text=True, check=True)
        assert json.loads(out.stdout) == here


def test_a_different_hash_seed_gives_different_keys():
    token_ids = list(range(3, 40))
    one = prefix_keys(token_ids, BLOCK_SIZE, hash_seed=1)
    two = prefix_keys(token_ids, BLOCK_SIZE, hash_seed=2)
    assert len(one) == len(two) == 9
    assert not set(one) & set(two)


def test_a_prefix_is_shared_only_among_sequences_of_one_salt():
    manager = make_manager(16)
    salted = make_seq(PREFIX, "a")
    salted.cache_root = prefix_hash.salt_root("tenant-a", HASH_SEED)
    compute(manager, salted)
    assert salted.block_hashes == prefix_keys(PREFIX, BLOCK_SIZE, HASH_SEED, salted.cache_root)
    plain = make_seq(PREFIX + [7], "b")
    manager.match_prefix(plain, max_tokens=plain.num_tokens)
    assert plain.block_table == []  # the same tokens without the salt: no hit
    other = make_seq(PREFIX + [7], "c")
    other.cache_root = prefix_hash.salt_root("tenant-b", HASH_SEED)
    manager.match_prefix(other, max_tokens=other.num_tokens)
    assert other.block_table == []
    same = make_seq(PREFIX + [7], "d")
    same.cache_root = salted.cache_root
    manager.match_prefix(same, max_tokens=same.num_tokens)
    assert same.block_table == salted.block_table[:3]
    # Even a key that collides across salts finds no block: the hit must match the root too.
    manager.cached[prefix_keys(PREFIX, BLOCK_SIZE, HASH_SEED)[0]] = salted.block_table[0]
    manager.match_prefix(plain, max_tokens=plain.num_tokens)
    assert plain.block_table == []
    assert prefix_hash.salt_root("", HASH_SEED) == ROOT_PARENT
