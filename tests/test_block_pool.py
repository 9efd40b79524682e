"""The block pool alone: the free list's order, reference counts, prefix hashes and eviction.

Every expected block id below is worked out by hand from the rules in ``minillm/core/block_pool.py``: blocks
are handed out from the front of the free list; a table is freed last block first; without caching a freed
block goes to the back; with caching a block holding nothing reusable goes to the front and a cached one to
the back (the least recently freed cached block is evicted first).
"""

from __future__ import annotations

import pytest

from minillm.core.block_pool import BlockPool, hash_block


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_blocks_come_from_the_front_and_a_freed_table_goes_back_last_block_first():
    pool = BlockPool(4)
    table = pool.get_new_blocks(3)
    assert ids(table) == [0, 1, 2] and [b.ref_count for b in table] == [1, 1, 1] and pool.num_free == 1
    pool.free_blocks(table)
    assert free_order(pool) == [3, 2, 1, 0]
    assert ids(pool.get_new_blocks(2)) == [3, 2]


def test_a_shared_block_is_free_only_when_its_last_holder_lets_go():
    pool = BlockPool(3)
    a = pool.get_new_blocks(2)
    pool.touch(a[:1])  # a fork shares the first block
    assert [b.ref_count for b in a] == [2, 1]
    pool.free_blocks(a)
    assert [b.ref_count for b in a] == [1, 0] and free_order(pool) == [2, 1]
    pool.free_blocks(a[:1])
    assert free_order(pool) == [2, 1, 0]


def test_mistakes_are_refused_with_the_numbers():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="3 blocks asked for, 2 free"):
        pool.get_new_blocks(3)
    table = pool.get_new_blocks(1)
    pool.free_blocks(table)
    with pytest.raises(RuntimeError, match="block 0 is not held"):
        pool.free_blocks(table)


def test_full_blocks_get_chained_hashes_and_a_later_prompt_finds_them():
    pool = BlockPool(4, enable_caching=True)
    tokens = [1, 2, 3, 4, 5]  # blocks of 2: two full blocks, then one token
    table = pool.get_new_blocks(3)
    hashes: list[int] = []
    new = pool.cache_full_blocks(table, hashes, tokens, num_full_blocks=2, block_size=2)
    h0 = hash_block(None, (1, 2))
    h1 = hash_block(h0, (3, 4))
    assert ids(new) == [0, 1] and hashes == [h0, h1]
    assert pool.get_cached_block(h0) is table[0] and pool.get_cached_block(h1) is table[1]
    assert pool.get_cached_block(hash_block(None, (3, 4))) is None  # the same tokens, another parent
    # Freed: block 2 (nothing reusable) to the front; the cached ones to the back, child (1) before parent (0).
    pool.free_blocks(table)
    assert free_order(pool) == [2, 3, 1, 0] and pool.num_cached_free == 2
    # A later request with the same prefix takes the cached blocks back: no eviction, no new block.
    hit = [pool.get_cached_block(h0), pool.get_cached_block(h1)]
    pool.touch(hit)
    assert ids(hit) == [0, 1] and [b.ref_count for b in hit] == [1, 1] and free_order(pool) == [2, 3]
    assert pool.stats["evictions"] == 0


def test_cached_blocks_are_evicted_last_and_child_before_parent():
    pool = BlockPool(3, enable_caching=True)
    table = pool.get_new_blocks(2)
    pool.cache_full_blocks(table, [], [7, 8, 9, 10], num_full_blocks=2, block_size=2)
    pool.free_blocks(table)
    assert free_order(pool) == [2, 1, 0]
    assert ids(pool.get_new_blocks(1)) == [2] and pool.stats["evictions"] == 0  # nothing reusable first
    assert ids(pool.get_new_blocks(1)) == [1] and pool.stats["evictions"] == 1  # then the child
    assert pool.get_cached_block(hash_block(None, (7, 8))) is pool.blocks[0]  # its parent still cached
    assert pool.blocks[1].block_hash is None


def test_forgetting_a_hash_sends_a_free_block_to_the_front():
    pool = BlockPool(3, enable_caching=True)
    table = pool.get_new_blocks(1)
    hashes: list[int] = []
    pool.cache_full_blocks(table, hashes, [5, 6], num_full_blocks=1, block_size=2)
    pool.free_blocks(table)
    assert free_order(pool) == [1, 2, 0]
    pool.forget_hash(pool.blocks[0])  # its KV was never computed (a failed step)
    assert free_order(pool) == [0, 1, 2] and pool.get_cached_block(hashes[0]) is None


def test_set_ref_count_restores_what_the_holders_imply():
    pool = BlockPool(3)
    table = pool.get_new_blocks(2)
    pool.set_ref_count(table[1], 0)  # a rollback: nobody holds block 1 any more
    assert free_order(pool) == [2, 1]
    pool.set_ref_count(table[1], 2)  # and back: held twice, out of the free list
    assert free_order(pool) == [2] and table[1].ref_count == 2
