"""Exercise of notebook 04, section 7 ("Parallel sampling"): the fork and the copy-on-write decision.

``SamplingParams(n=k)`` asks for k samples of one prompt. The prompt runs once; when its last
position is computed, k - 1 new sequences are *forked*: each gets a block table that points at
the same physical blocks, and every block's reference count goes up. Nothing is copied. Later a
sequence about to write into a block that others still hold (the prompt's partly filled last
block) must first get its own copy: a fresh block replaces the shared one in its table, the
runner copies the contents before the forward, and the shared block loses one reference. This
is how PagedAttention serves parallel sampling (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP 2023, section 4.4).

Block tables here are lists of block ids; ``ref_counts`` maps a block id to the number of
sequences holding it.

* ``fork``: the new sequence's table, and the reference counts after the fork.
* ``block_to_write``: which entry of a table the next KV position falls in.
* ``copy_on_write``: the decision and the move: copy or not, which block, and the counts after.

``cow_kv_manager`` (given, at the bottom) is a factory for ``EngineConfig.kv_manager``: the
engine's paged KV manager, forking and copying with *your* three functions.
``LLM(kv_manager=cow_kv_manager)`` runs parallel sampling on them. Each docstring states the
contract; notebook 04's exercise cell runs them in the engine. Check your work with

    make grade EX=04b           # or: MINILLM_IMPL=exercises pytest -m ex04b tests/test_exercises.py
"""

from __future__ import annotations

from typing import Callable, MutableMapping, Optional

from minillm.core.kv_cache import PagedKVCacheManager

__all__ = ["fork", "block_to_write", "copy_on_write", "CopyOnWriteKVCacheManager", "cow_kv_manager"]


# =====================================================================================
# Exercise 1: the fork
# =====================================================================================

def fork(table: list[int], ref_counts: MutableMapping[int, int]) -> list[int]:
    """A new sequence shares every block of ``table`` (the block ids of the sequence that ran the
    prompt). Returns the new sequence's block table: the same ids, in the same order, but a *new
    list* (from now on each sequence changes its own table: a copy-on-write replaces an entry in
    one table only). Every shared block is now held once more: add 1 to its ``ref_counts`` entry.

    >>> counts = {4: 1, 9: 1}
    >>> fork([4, 9], counts), counts
    ([4, 9], {4: 2, 9: 2})
    """
    ### BEGIN SOLUTION
    for block in table:
        ref_counts[block] += 1
    return list(table)
    ### END SOLUTION


# =====================================================================================
# Exercise 2: where the next position goes
# =====================================================================================

def block_to_write(num_computed_tokens: int, block_size: int, num_blocks_held: int) -> Optional[int]:
    """The index, in a table of ``num_blocks_held`` blocks, of the block the sequence's next KV
    position falls in. Positions ``0 .. num_computed_tokens - 1`` hold KV already, so the next one
    is position ``num_computed_tokens``; block i holds positions ``i * block_size`` to
    ``(i + 1) * block_size - 1``. None when that position is past the last block held (the
    sequence needs a new block anyway, and no existing block is written).

    >>> block_to_write(10, 4, 3), block_to_write(12, 4, 3)
    (2, None)
    """
    ### BEGIN SOLUTION
    index = num_computed_tokens // block_size
    return index if index < num_blocks_held else None
    ### END SOLUTION


# =====================================================================================
# Exercise 3: copy-on-write
# =====================================================================================

def copy_on_write(table: list[int], num_computed_tokens: int, block_size: int,
                  ref_counts: MutableMapping[int, int], new_block: Callable[[], int]) -> Optional[tuple[int, int]]:
    """Called before a sequence writes its next position's KV (``block_to_write``). If that
    position falls in a block of ``table`` that other sequences also hold (reference count above
    1), the sequence gets its own copy:

    * ``new_block()`` returns a fresh block id (already counted once: it is this sequence's);
    * the fresh block replaces the shared one in ``table`` (in place: ``table`` is the sequence's
      own list);
    * the shared block is held once less: subtract 1 from its ``ref_counts`` entry.

    Returns the copy the runner must make, ``(shared block, fresh block)``: source, then
    destination. Returns None, and changes nothing (no ``new_block()`` either), when nothing must
    be copied: the position lies past the last block of ``table`` (it will go into a block not yet
    allocated), or the block is held by this sequence alone (the last holder writes in place). A
    shared block whose *first* position is next is written too, so it is copied like any other.
    """
    ### BEGIN SOLUTION
    index = block_to_write(num_computed_tokens, block_size, len(table))
    if index is None or ref_counts[table[index]] <= 1:
        return None
    shared, fresh = table[index], new_block()
    table[index] = fresh
    ref_counts[shared] -= 1
    return shared, fresh
    ### END SOLUTION


# =====================================================================================
# Given: your functions inside the engine
# =====================================================================================

class _RefCounts(MutableMapping):
    """The block pool's reference counts, as a mapping from block id to count."""

    def __init__(self, pool):
        self.pool = pool

    def __getitem__(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_count

    def __setitem__(self, block_id: int, count: int) -> None:
        self.pool.set_ref_count(self.pool.blocks[block_id], count)   # a block at 0 goes to the free list

    def __delitem__(self, block_id: int) -> None:
        raise TypeError("a block's reference count cannot be deleted")

    def __iter__(self):
        return (b.block_id for b in self.pool.blocks)

    def __len__(self) -> int:
        return len(self.pool.blocks)


class CopyOnWriteKVCacheManager(PagedKVCacheManager):
    """minillm's paged KV manager whose fork and copy-on-write are the three functions above."""

    def fork(self, parent, child) -> list[int]:
        self._save_table(child.request_id)
        parent_ids = self.block_table(parent.request_id)
        table = fork(parent_ids, _RefCounts(self.pool))
        self.req_blocks[child.request_id] = [self.pool.blocks[b] for b in table]
        hashes = self.req_hashes.get(parent.request_id)
        if hashes is not None:
            self.req_hashes[child.request_id] = list(hashes)
        return parent_ids

    def _writes_shared_block(self, req, held) -> bool:
        if not held:
            return False
        index = block_to_write(req.num_computed_tokens, self.block_size, len(held))
        return index is not None and held[index].ref_count > 1

    def _copy_on_write(self, req, blocks) -> None:
        table = [b.block_id for b in blocks]
        copy = copy_on_write(table, req.num_computed_tokens, self.block_size, _RefCounts(self.pool),
                             lambda: self._new_block().block_id)
        blocks[:] = [self.pool.blocks[b] for b in table]
        if copy is not None:
            self.copies.append((req.request_id, *copy))


def cow_kv_manager(config, num_blocks: int) -> CopyOnWriteKVCacheManager:
    """An ``EngineConfig.kv_manager`` factory: ``LLM(kv_manager=cow_kv_manager, ...)``."""
    return CopyOnWriteKVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                     config.num_swap_blocks, config.watermark)
