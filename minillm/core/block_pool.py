"""The block pool: fixed-size KV blocks, a free list and a reference count per block.

PagedAttention's allocator, with vLLM's verbs (``get_new_blocks``, ``touch``, ``free_blocks``,
``cache_full_blocks``, ``get_cached_block``). A request holds a *block table* (block ids, in
order) and needs a new block only when its last one is full.

Automatic prefix caching lives here too. A *full* block gets a hash chained on its parent's hash
and its own tokens, so equal hashes mean equal prefixes. A freed block that carries a hash keeps
its KV and its hash in the free list: a later request with the same prefix can ``touch`` it
(reference count +1, nothing recomputed). Free blocks holding nothing reusable are handed out
first; only then is the least recently freed cached block evicted. A table is freed last block
first, so a child is always evicted before its parent, and a freed child also moves its cached
parent behind it when that parent is a copy the table does not hold (see ``_to_free_list``).
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
        self.block_hash: Optional[int] = None  # set once the block is full (prefix caching)
        self.token_ids: Optional[tuple] = None  # kept to guard against hash collisions
        self.parent_hash: Optional[int] = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block; hands them out and takes them back."""

    hash_block = staticmethod(hash_block)  # the prefix-cache key (a subclass may bring its own)

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = evicted first). Cached-free blocks are here too.
        self.free_queue: "OrderedDict[int, Block]" = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block holding that prefix
        self._num_cached_free = 0  # free blocks that still hold a prefix (kept as blocks come and go)
        # A subclass may hand blocks out and take them back its own way (exercise 04's pool) without keeping
        # that count: for a subclass, num_cached_free walks the free list.
        self._keeps_count = type(self) is BlockPool
        self.stats = dict(lookups=0, queried_blocks=0, hit_blocks=0, evictions=0)

    @property
    def num_free(self) -> int:  # blocks that can be handed out now (cached-free ones count: they can be evicted)
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix (with caching off there are none)."""
        if self._keeps_count:
            return self._num_cached_free
        return sum(b.block_hash is not None for b in self.free_queue.values())

    # --- allocation -----------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """``num_blocks`` fresh blocks, each held once, from the front of the free list (blocks holding
        nothing reusable first, then the least recently freed cached ones, whose prefix is evicted)."""
        if num_blocks > len(self.free_queue):  # the scheduler checks first: this is a bug
            raise RuntimeError(f"BlockPool.get_new_blocks: {num_blocks} blocks asked for, {len(self.free_queue)} free")
        new = [self.free_queue.popitem(last=False)[1] for _ in range(num_blocks)]
        for block in new:
            if block.block_hash is not None:
                self._num_cached_free -= 1
                self._evict(block)
            block.ref_count = 1
        return new

    def _evict(self, block: Block) -> None:
        self._drop_hash(block)
        self.stats["evictions"] += 1

    def _drop_hash(self, block: Block) -> None:
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            del self.cached[h]
        block.block_hash = block.token_ids = block.parent_hash = None

    def touch(self, blocks: Sequence[Block]) -> None:
        """Share blocks with one more request (a prefix-cache hit, a fork): a block nobody held
        leaves the free list; each gains a reference."""
        for block in blocks:
            if block.ref_count == 0:
                self._take_free(block)
            block.ref_count += 1

    def free_blocks(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each block of a block table (given in table order); blocks that
        reach 0 go to the free list, last block first, so a request's last (child) blocks are
        evicted before its first (parent) ones. (vLLM's caller reverses the table itself.)"""
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"BlockPool.free_blocks: block {block.block_id} is not held (freed twice?)")
            block.ref_count -= 1
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
            return
        self._num_cached_free += 1
        # Its parent in the cache is cached[parent_hash], the first copy of that prefix; its table
        # may hold another (a prompt's last full block is computed again even when cached: its last
        # token must be), so freeing the table last block first does not put that parent behind it.
        # The free cached ancestors move behind it, root last (bounded: colliding keys could loop).
        parent = self.cached_parent(block)
        for _ in range(len(self.free_queue)):
            if parent is None or parent.block_id not in self.free_queue:
                return
            self.free_queue.move_to_end(parent.block_id)
            parent = self.cached_parent(parent)

    def cached_parent(self, block: Block) -> Optional[Block]:
        """The canonical cached copy of the block's parent prefix (None for a first block, or a parent evicted)."""
        return None if block.parent_hash is None else self.cached.get(block.parent_hash)

    def set_ref_count(self, block: Block, ref_count: int) -> None:
        """Rollback of a failed step: give a block the reference count its holders imply."""
        block.ref_count = ref_count
        if ref_count == 0 and block.block_id not in self.free_queue:
            self._to_free_list(block)
        elif ref_count > 0 and block.block_id in self.free_queue:
            self._take_free(block)

    def _take_free(self, block: Block) -> None:
        """A free block is held again (its cached prefix, if any, is kept)."""
        del self.free_queue[block.block_id]
        self._num_cached_free -= block.block_hash is not None

    # --- prefix cache -----------------------------------------------------------------
    def get_cached_block(self, block_hash: int) -> Optional[Block]:
        """The block holding the prefix whose key is ``block_hash``, or None."""
        return self.cached.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: list[int],
        token_ids: Sequence[int],
        num_full_blocks: int,
        block_size: int,
    ) -> list[Block]:
        """A request's blocks ``len(block_hashes) .. num_full_blocks - 1`` just became full: each gets its
        prefix hash (chained), appended to ``block_hashes``. Returns the blocks that had no hash before."""
        new = []
        for i in range(len(block_hashes), num_full_blocks):
            parent, block = block_hashes[-1] if block_hashes else None, blocks[i]
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            h = self.hash_block(parent, tokens)
            if block.block_hash is None:
                block.block_hash, block.token_ids, block.parent_hash = h, tokens, parent
                self.cached.setdefault(h, block)  # keep the first copy as the canonical one
                new.append(block)
            block_hashes.append(h)
        return new

    def forget_hash(self, block: Block) -> None:
        """Forget a block's prefix hash: its KV was never computed (a failed step, an owner preempted first)."""
        if block.block_hash is not None:
            self._drop_hash(block)
            if block.ref_count == 0 and self.enable_caching:
                self._num_cached_free -= 1
                self.free_queue.move_to_end(block.block_id, last=False)
