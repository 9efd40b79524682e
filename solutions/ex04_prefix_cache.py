"""Exercises of notebook 04, "Prefix caching": the block hash, the longest-prefix match, and eviction.

Each full block of tokens gets a key, a hash of its tokens chained on the previous block's
key, which indexes the cached KV block. When a new request arrives, the keys of its prefix
blocks are computed; if the first 10 match (blocks of 16 tokens), the KV of those 160 tokens is
reused. Each physical block keeps a reference count of the requests using it, and a block whose
count reaches zero can be recycled (vLLM's automatic prefix caching).

* ``hash_block`` / ``block_hashes``: the key of a full block, chained on its parent's key.
* ``longest_prefix_match``: the cached blocks a new request can reuse.
* ``EvictingBlockPool``: reference counts, a free list in LRU order, and eviction of cached
  prefixes only when a fresh block is needed.
* ``tokens_reused_after_edit``: what an edit invalidates; how much of a cached prompt is reused
  once some of its tokens have changed.

They plug into the real engine: ``prefix_engine(...)`` at the bottom builds an ``LLM`` with
prefix caching whose block hashes, prefix lookups and block pool are *yours*. Each docstring
states the contract; notebook 04's exercise cells have optional hints. Check your work with

    make grade EX=04            # or: MINILLM_IMPL=exercises pytest -m ex04 tests/test_exercises.py
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from minillm.core.block_pool import Block, BlockPool
from minillm.core.kv_cache import PagedKVCacheManager

__all__ = ["hash_block", "block_hashes", "longest_prefix_match", "EvictingBlockPool", "tokens_reused_after_edit",
           "YourPrefixCachingKVCacheManager", "prefix_engine"]


# =====================================================================================
# Exercise 1: the block hash, a chain
# =====================================================================================

def hash_block(parent_hash: Optional[int], token_ids: Sequence[int]) -> int:
    """The prefix-cache key of one full block of tokens: Python's ``hash`` of the pair
    ``(parent_hash, tuple(token_ids))`` (the recipe minillm's engine uses, so your keys and its
    keys agree). ``parent_hash`` is the key of the block before it, ``None`` for the first block.

    Chaining on the parent makes the key stand for the *whole prefix* up to the end of this
    block, not just its own tokens: two blocks with the same tokens after different prefixes
    get different keys, because their KV differs (attention saw different context).
    (Production engines use a cryptographic hash such as SHA-256 so that collisions cannot be
    provoked; minillm also keeps each cached block's tokens and checks them on a hit.)
    """
    ### BEGIN SOLUTION
    return hash((parent_hash, tuple(token_ids)))
    ### END SOLUTION


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of every *full* block of ``token_ids``, in order.

    Block i holds tokens ``i * block_size .. (i + 1) * block_size - 1``; a last block that is
    not full has no key yet (its tokens may still change: it is the one being written).

    >>> len(block_hashes(list(range(10)), 4))       # two full blocks; tokens 8, 9 are not hashed
    2
    """
    ### BEGIN SOLUTION
    out: list[int] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
    ### END SOLUTION


# =====================================================================================
# Exercise 2: the longest cached prefix
# =====================================================================================

def longest_prefix_match(token_ids: Sequence[int], block_size: int, cached: Mapping[int, Block]) -> list[Block]:
    """The cached blocks a request with prompt ``token_ids`` can reuse, in order: the longest
    run of its full blocks, from the first, found in ``cached`` (chained key -> ``Block``).

    Rules:

    * a block is reused only if every block before it is (its KV was computed after theirs:
      its key is chained on theirs), so the run ends at the first block that is not a hit;
    * a hit needs ``cached`` to have the block's key **and** the block found there to hold the
      same tokens (``block.token_ids``, a tuple) after the same parent (``block.parent_hash``,
      the key of the block before, ``None`` for the first): a guard against hash collisions;
    * the last prompt token is always computed, because its logits choose the first output
      token: never more than ``(len(token_ids) - 1) // block_size`` blocks.

    Example: block size 4, an 8-token prompt whose two blocks are both cached: only the first
    is reused (the second holds the last prompt token).
    """
    ### BEGIN SOLUTION
    hits: list[Block] = []
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        h = hash_block(parent, tokens)
        block = cached.get(h)
        if block is None or block.token_ids != tokens or block.parent_hash != parent:
            break
        hits.append(block)
        parent = h
    return hits
    ### END SOLUTION


# =====================================================================================
# Exercise 3: reference counts and LRU eviction
# =====================================================================================

class EvictingBlockPool(BlockPool):
    """minillm's block pool (``minillm.core.block_pool.BlockPool``) with its four moving parts written
    by you. What you inherit:

    * ``self.blocks``: every ``Block`` (``block_id``, ``ref_count``, and for a cached block its
      ``block_hash``, ``token_ids``, ``parent_hash``);
    * ``self.free_queue``: an ``OrderedDict`` block id -> ``Block`` of the blocks nobody holds
      (``ref_count == 0``), in eviction order: the front is handed out first. A free block may
      still carry a cached prefix (its hash): it keeps its KV until it is handed out again;
    * ``self.cached``: key -> the block holding that prefix (``cache_full_blocks`` fills it, keyed
      by your ``hash_block``; ``get_cached_block(key)`` reads it);
    * ``self.stats["evictions"]``: how many cached prefixes were dropped;
    * ``self.enable_caching``: whether prefixes are cached at all (``EngineConfig.enable_prefix_caching``).

    The engine calls ``touch(blocks)`` with the blocks of a prefix-cache hit, ``get_new_blocks(n)``
    when a request needs ``n`` fresh blocks, and ``free_blocks(blocks)`` with a request's block
    table when it finishes or is preempted (vLLM's names for the three moves).
    """

    hash_block = staticmethod(hash_block)      # given: the pool's keys are your hash_block's

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        super().__init__(num_blocks, enable_caching)

    def evict(self, block: Block) -> None:
        """Drop the cached prefix ``block`` carries (it is about to hold other tokens): remove its
        key from ``self.cached`` if the entry there is this very block (another block may be
        the canonical copy of the same prefix), clear ``block_hash``, ``token_ids`` and
        ``parent_hash`` (set them to None), and count one eviction in ``self.stats``."""
        ### BEGIN SOLUTION
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent_hash = None
        self.stats["evictions"] += 1
        ### END SOLUTION

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """``num_blocks`` fresh blocks, in order: each the one at the *front* of the free queue (one
        holding nothing if any, else the least recently freed cached block: LRU), its cached prefix
        evicted if it carries one, with ``ref_count = 1``.
        With fewer than ``num_blocks`` free, raise ``RuntimeError`` and hand out nothing."""
        ### BEGIN SOLUTION
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"EvictingBlockPool.get_new_blocks: {num_blocks} asked for, {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self.evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks
        ### END SOLUTION

    def touch(self, blocks: Sequence[Block]) -> None:
        """A prefix-cache hit: one more request holds each of ``blocks``. A block nobody held (it sat
        in the free queue, cached) leaves the free queue; each gains one reference."""
        ### BEGIN SOLUTION
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
        ### END SOLUTION

    def free_blocks(self, blocks: Sequence[Block]) -> None:
        """A request lets go of its block table ``blocks``. Go through them in *reverse* order
        (last block first) and drop one reference from each. A block whose count reaches 0 joins
        the free queue: at the *back* if it keeps a cached prefix (caching on and a hash set), at
        the *front* if it holds nothing reusable (clear its hash fields), so a fresh block is
        one holding nothing before any cached prefix is evicted (as in vLLM). With caching off,
        every freed block joins the back. Freeing a block nobody holds is a bug: ``RuntimeError``.

        Why reverse: a request's blocks then reach the free queue child first, so the LRU order
        evicts a prefix's *last* block before its first. Evicting a parent first would strand
        its children: still cached, but unreachable, since a lookup walks from the first block.
        """
        ### BEGIN SOLUTION
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"EvictingBlockPool.free_blocks: block {block.block_id} is not held")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None or not self.enable_caching:
                    block.block_hash = block.token_ids = block.parent_hash = None
                    if self.enable_caching:
                        self.free_queue.move_to_end(block.block_id, last=False)
        ### END SOLUTION


# =====================================================================================
# Exercise 5: what an edit invalidates
# =====================================================================================

def tokens_reused_after_edit(num_tokens: int, edited_positions: Sequence[int], block_size: int) -> int:
    """How many prompt tokens the prefix cache serves when a prompt of ``num_tokens`` tokens,
    cached in full (every full block of it), is sent again with the tokens at
    ``edited_positions`` (0-based; possibly none) changed.

    Rules: a block's key is chained on every block before it, so a changed token changes the key
    of its own block and of every block after it: only the full blocks strictly before the block
    holding the earliest edit are reused. The last prompt token is always computed (its logits
    choose the first output token), so at most ``(num_tokens - 1) // block_size`` blocks are
    reused, even with no edit. Raise ``ValueError`` naming the position if one is outside
    ``0 .. num_tokens - 1``.

    >>> tokens_reused_after_edit(2048, [300], 16)      # 300 is in block 18: blocks 0..17 reused
    288
    """
    ### BEGIN SOLUTION
    for p in edited_positions:
        if not 0 <= p < num_tokens:
            raise ValueError(f"edited position {p!r} is outside the prompt's 0 .. {num_tokens - 1}")
    blocks = (num_tokens - 1) // block_size
    if edited_positions:
        blocks = min(blocks, min(edited_positions) // block_size)
    return blocks * block_size
    ### END SOLUTION


# =====================================================================================
# Given: how your code plugs into minillm (nothing to write below)
# =====================================================================================

class YourPrefixCachingKVCacheManager(PagedKVCacheManager):
    """minillm's paged KV manager with prefix caching, whose blocks come from your
    ``EvictingBlockPool`` (hashed with your ``hash_block``) and whose prefix lookups are your
    ``longest_prefix_match``."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0, watermark: float = 0.0):
        super().__init__(num_blocks, block_size, enable_prefix_caching=True, num_swap_blocks=num_swap_blocks,
                         watermark=watermark, block_pool=EvictingBlockPool)

    def find_cached_prefix(self, req) -> list[Block]:
        return longest_prefix_match(req.all_token_ids, self.block_size, self.pool.cached)


def prefix_engine(model: str = "random", **config):
    """An ``LLM`` with automatic prefix caching run by your code (every other knob as usual)."""
    from minillm import LLM

    if config.get("kv_allocation", "paged") != "paged":
        raise ValueError("prefix_engine: prefix caching needs kv_allocation='paged'")
    config["enable_prefix_caching"] = True
    return LLM(model=model, **config,
               kv_manager=lambda cfg, num_blocks: YourPrefixCachingKVCacheManager(num_blocks, cfg.block_size,
                                                                                  cfg.num_swap_blocks, cfg.watermark))
