"""The block pool: fixed-size KV blocks, a free list and a reference count per block.

This is PagedAttention's memory allocator. The KV cache is cut into blocks of
``block_size`` token positions. A request holds a *block table* (a list of block
ids, in order); it needs a new block only when its last one is full, so at most
``block_size - 1`` positions per request sit empty.

Automatic prefix caching lives here too. A *full* block gets a hash chained on
its parent's hash and its own tokens, so equal hashes mean equal prefixes. When a
request frees a block that carries a hash, the block goes to the free list but
keeps its KV and its hash: a later request with the same prefix can take it back
(reference count +1, nothing recomputed). A fresh block is a free block that holds
nothing reusable when there is one (those sit at the front of the free list); only
when none is left is the least recently freed cached block evicted. Blocks of one
request are returned in reverse order (last block first), so a child is always
evicted before its parent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


def hash_block(parent_hash: Optional[int], token_ids: Sequence[int]) -> int:
    """The prefix-cache key of one full block: chained on the parent block's hash."""
    return hash((parent_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Optional[int] = None     # set once the block is full (prefix caching)
        self.token_ids: Optional[tuple] = None    # kept to guard against hash collisions
        self.parent_hash: Optional[int] = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block; hands them out and takes them back."""

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). Cached-free blocks are here too.
        self.free_queue: "OrderedDict[int, Block]" = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}        # block hash -> block holding that prefix
        self.stats = dict(lookups=0, queried_blocks=0, hit_blocks=0, evictions=0)

    # --- counting ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached-free blocks count: they can be evicted)."""
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        if not self.enable_caching:
            return 0                 # nothing is ever hashed: skip the O(blocks) count
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    # --- allocation -----------------------------------------------------------------
    def allocate(self) -> Block:
        """A fresh block: the front of the free list (one holding nothing reusable if any is free,
        else the least recently freed cached block, whose prefix is evicted)."""
        if not self.free_queue:
            raise RuntimeError("BlockPool.allocate: no free block (the scheduler should have checked)")
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            self._evict(block)
        block.ref_count = 1
        return block

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent_hash = None
        self.stats["evictions"] += 1

    def take(self, block: Block) -> None:
        """Share a cached block with one more request (prefix-cache hit)."""
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block; blocks that reach 0 go to the free list.
        Reversed, so a request's last (child) blocks are evicted before its first (parent) ones."""
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                self._to_free_list(block)

    def _to_free_list(self, block: Block) -> None:
        """A block nobody holds: cached ones at the back (least recently freed evicted first),
        ones holding nothing reusable at the front (handed out before any cached prefix)."""
        self.free_queue[block.block_id] = block
        if block.block_hash is None or not self.enable_caching:
            block.block_hash = block.token_ids = block.parent_hash = None
            if self.enable_caching:
                self.free_queue.move_to_end(block.block_id, last=False)

    def set_ref_count(self, block: Block, ref_count: int) -> None:
        """Rollback of a failed step: give a block the reference count its holders imply."""
        block.ref_count = ref_count
        if ref_count == 0 and block.block_id not in self.free_queue:
            self._to_free_list(block)
        elif ref_count > 0 and block.block_id in self.free_queue:
            del self.free_queue[block.block_id]

    # --- prefix cache -----------------------------------------------------------------
    def lookup(self, parent_hash: Optional[int], token_ids: tuple) -> Optional[Block]:
        block = self.cached.get(hash_block(parent_hash, token_ids))
        if block is None or block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None                                   # miss (or a hash collision)
        return block

    def cache(self, block: Block, parent_hash: Optional[int], token_ids: tuple) -> int:
        """Give a block that just became full its prefix hash. Returns the hash."""
        h = hash_block(parent_hash, token_ids)
        if block.block_hash is None:
            block.block_hash, block.token_ids, block.parent_hash = h, token_ids, parent_hash
            self.cached.setdefault(h, block)              # keep the first copy as the canonical one
        return h

    def uncache(self, block: Block) -> None:
        """Forget a block's prefix hash (its KV was never computed: a step that failed, a
        registration whose owner was preempted before computing it)."""
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent_hash = None
        if block.ref_count == 0 and self.enable_caching:
            self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            if block.ref_count == 0:
                self._evict(block)
