"""Exercises of notebook 02, "Reservation vs paging": the two ways to hand out KV memory.

* ``blocks_needed`` and ``partial_block_waste``: the arithmetic of a paged cache.
* ``BlockAllocator``: the free list of a paged cache (PagedAttention's block allocator).
* ``FirstFitAllocator``: max-length reservation in one contiguous address space (what
  engines did before paging, Figure 4 of notebook 02).

The two allocators plug into the real engine: ``paged_engine(...)`` and ``reserved_engine(...)``
at the bottom of this file build an ``LLM`` whose KV memory is managed by *your* code, so
every scheduler decision of a run goes through it. Each docstring states the contract (what
comes in, what goes out, the rules, an example); notebook 02's exercise cells have optional
hints. Check your work with

    make grade EX=02            # or: MINILLM_IMPL=exercises pytest -m ex02 tests/test_exercises.py
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from minillm.core.block_pool import Block
from minillm.core.kv_cache import PagedKVCacheManager
from minillm.core.reserved_kv_cache import ReservedKVCacheManager

__all__ = ["blocks_needed", "partial_block_waste", "BlockAllocator", "FirstFitAllocator",
           "YourPagedKVCacheManager", "YourReservedKVCacheManager", "paged_engine", "reserved_engine"]


# =====================================================================================
# Exercise 1: how many blocks a request needs
# =====================================================================================

def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` positions that hold ``num_tokens`` positions of KV.

    A paged cache gives a request a new block only when its last one is full, so this is
    the smallest number of blocks whose positions cover ``num_tokens`` (0 for 0 tokens).

    >>> blocks_needed(17, 16)
    2
    """
    ### BEGIN SOLUTION
    return -(-int(num_tokens) // int(block_size))
    ### END SOLUTION


# =====================================================================================
# Exercise 2: the only waste paging leaves
# =====================================================================================

def partial_block_waste(context_lens: Sequence[int], block_size: int) -> int:
    """Empty positions in the last, partly filled block of each request, summed.

    ``context_lens``: the positions of KV each request holds. A request of n positions holds
    ``blocks_needed(n, block_size)`` blocks; whatever those blocks hold beyond n is empty and
    no other request can use it. This is the engine's ``StepRecord.kv.partial_waste``: "at
    most ``block_size - 1`` positions per request sit empty".

    >>> partial_block_waste([5, 16, 17], block_size=16)     # 11 + 0 + 15
    26
    """
    ### BEGIN SOLUTION
    return sum(blocks_needed(n, block_size) * block_size - int(n) for n in context_lens)
    ### END SOLUTION


# =====================================================================================
# Exercise 3: the block allocator of a paged cache
# =====================================================================================

class BlockAllocator:
    """Hands out fixed-size KV blocks and takes them back (PagedAttention's allocator).

    Every block exists from the start (``self.blocks``, indexed by block id). Free blocks
    wait in ``self.free_queue``, an ``OrderedDict`` block id -> ``Block``: the front is handed
    out next, a freed block joins at the back. A block in use has ``ref_count >= 1`` (the
    number of requests holding it; more than one only when a prefix is shared, notebook 04)
    and is not in the free queue.

    The engine's paged KV manager calls ``get_new_blocks(n)`` whenever a request needs ``n``
    more blocks (its last one is full), and ``free_blocks(blocks)`` with a request's whole block
    table when the request finishes or is preempted (vLLM's names for the two moves).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: "OrderedDict[int, Block]" = OrderedDict((b.block_id, b) for b in self.blocks)
        # Read by the engine's KV snapshot and invariant checks; prefix caching is off here.
        self.enable_caching = False
        self.cached: dict = {}
        self.num_cached_free = 0
        self.stats = dict(lookups=0, queried_blocks=0, hit_blocks=0, evictions=0)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now."""
        return len(self.free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """``num_blocks`` blocks for one request, in order: each taken from the front of the free
        queue, now held once (``ref_count == 1``) and out of the queue.

        With fewer than ``num_blocks`` free, raise ``RuntimeError`` and hand out nothing (the
        scheduler checks ``num_free`` first, so this means a bug somewhere).

        >>> a = BlockAllocator(4); [b.block_id for b in a.get_new_blocks(2)], a.num_free
        ([0, 1], 2)
        """
        ### BEGIN SOLUTION
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"BlockAllocator.get_new_blocks: {num_blocks} asked for, {len(self.free_queue)} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            block.ref_count = 1
            blocks.append(block)
        return blocks
        ### END SOLUTION

    def free_blocks(self, blocks: Sequence[Block]) -> None:
        """A request lets go of its block table ``blocks`` (in table order): each block loses
        one holder.

        Rules: a block nobody holds any more is free again, at the *back* of the free queue; a
        block another request still holds stays in use. The table's blocks join the queue last
        block first, so a request's last block is handed out again before its first (notebook
        04 relies on that order). Freeing a block that is already free is a bug:
        ``RuntimeError``.

        >>> a = BlockAllocator(4); t = a.get_new_blocks(2); a.free_blocks(t); list(a.free_queue)
        [2, 3, 1, 0]
        """
        ### BEGIN SOLUTION
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"BlockAllocator.free_blocks: block {block.block_id} is already free")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block
        ### END SOLUTION


# =====================================================================================
# Exercise 4: max-length reservation, first fit
# =====================================================================================

class FirstFitAllocator:
    """One contiguous region per request in an address space of ``capacity`` KV positions.

    ``self.regions`` maps request id -> ``(start, length)``: the request owns positions
    ``start .. start + length - 1``. Regions never overlap and stay inside the capacity.
    A new request reserves its *maximum* length up front (prompt + max_tokens), in the first
    gap, in address order, that is large enough (*first fit*). The positions it reserved but
    has not filled yet are "reserved but unused": no one else can have them (Figure 4
    of notebook 02), and gaps too small for the next reservation are *fragmentation*.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.regions: dict[str, tuple[int, int]] = {}

    def gaps(self) -> list[tuple[int, int]]:
        """The free runs of positions, as ``(start, length)`` in address order (no empty runs).

        >>> a = FirstFitAllocator(24); a.regions = {"B": (0, 20)}; a.gaps()
        [(20, 4)]
        """
        ### BEGIN SOLUTION
        gaps, pos = [], 0
        for start, length in sorted(self.regions.values()):
            if start > pos:
                gaps.append((pos, start - pos))
            pos = max(pos, start + length)
        if pos < self.capacity:
            gaps.append((pos, self.capacity - pos))
        return gaps
        ### END SOLUTION

    def largest_gap(self) -> int:
        """The longest reservation that fits now."""
        return max((length for _, length in self.gaps()), default=0)

    def reserve(self, request_id: str, length: int) -> Optional[int]:
        """Reserve ``length`` positions for ``request_id``; returns the region's start.

        Rules: the region goes into the *first* gap, in address order, that holds it: not the
        tightest one (best fit), not the largest (worst fit). It is recorded in
        ``self.regions``. When no gap is long enough: return ``None`` and change nothing. A
        request reserves at most once: asking again for a request that holds a region is a
        bug (``RuntimeError``).

        >>> a = FirstFitAllocator(24); a.regions = {"A": (4, 4), "B": (12, 12)}     # gaps: 0..3, 8..11
        >>> a.reserve("C", 3), a.reserve("D", 2), a.regions["D"]
        (0, 8, (8, 2))
        """
        ### BEGIN SOLUTION
        if request_id in self.regions:
            raise RuntimeError(f"FirstFitAllocator.reserve: {request_id!r} already holds a region")
        for start, size in self.gaps():
            if size >= length:
                self.regions[request_id] = (start, int(length))
                return start
        return None
        ### END SOLUTION

    def release(self, request_id: str) -> None:
        """Give the request's region back (nothing happens if it holds none)."""
        ### BEGIN SOLUTION
        self.regions.pop(request_id, None)
        ### END SOLUTION


# =====================================================================================
# Given: how your allocators plug into minillm (nothing to write below)
# =====================================================================================

class YourPagedKVCacheManager(PagedKVCacheManager):
    """minillm's paged KV manager, counting blocks with your ``blocks_needed`` and taking
    them from your ``BlockAllocator`` (prefix caching and swapping stay off)."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0):
        super().__init__(num_blocks, block_size, watermark=watermark)
        self.pool = BlockAllocator(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)


class YourReservedKVCacheManager(ReservedKVCacheManager):
    """minillm's reservation manager, placing regions with your ``FirstFitAllocator``."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, watermark: float = 0.0):
        super().__init__(num_blocks, block_size, max_model_len, watermark)
        self.fit = FirstFitAllocator(self.capacity)
        self.regions = self.fit.regions          # one dict: the engine reads what your code writes

    def _gaps(self) -> list[tuple[int, int]]:
        return self.fit.gaps()

    def allocate(self, req, num_new_tokens: int, cached=()) -> bool:
        if req.request_id in self.regions:       # a running request grows inside its own region
            return super().allocate(req, num_new_tokens)
        ok, _, _ = self.can_allocate(req, num_new_tokens)
        return ok and self.fit.reserve(req.request_id, self.reservation_len(req)) is not None

    def free(self, req) -> None:
        self.fit.release(req.request_id)


def paged_engine(model: str = "random", **config):
    """An ``LLM`` with ``kv_allocation="paged"`` whose KV blocks your code hands out: your manager
    plugs in through ``EngineConfig.kv_manager``, a factory ``(config, num_blocks) -> manager``."""
    from minillm import LLM

    for knob in ("enable_prefix_caching", "num_swap_blocks"):
        if config.get(knob):
            raise ValueError(f"paged_engine: {knob} is not supported by this exercise's allocator")
    return LLM(model=model, kv_allocation="paged", **config,
               kv_manager=lambda cfg, num_blocks: YourPagedKVCacheManager(num_blocks, cfg.block_size,
                                                                          cfg.watermark))


def reserved_engine(model: str = "random", **config):
    """An ``LLM`` with ``kv_allocation="reserved"`` whose regions your code places."""
    from minillm import LLM

    return LLM(model=model, kv_allocation="reserved", **config,
               kv_manager=lambda cfg, num_blocks: YourReservedKVCacheManager(num_blocks, cfg.block_size,
                                                                             cfg.max_model_len, cfg.watermark))
