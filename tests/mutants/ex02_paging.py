"""Plausible wrong answers to notebook 02's exercises; each must fail tests/graders/ex02_paging.py.

Each entry: (what the mistake is, old text of solutions/ex02_paging.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # blocks_needed
    (
        "blocks: rounds down",
        "return -(-int(num_tokens) // int(block_size))",
        "return int(num_tokens) // int(block_size)",
    ),
    (
        "blocks: n // size + 1 (one too many on a full block, and for 0)",
        "return -(-int(num_tokens) // int(block_size))",
        "return int(num_tokens) // int(block_size) + 1",
    ),
    # partial_block_waste
    (
        "waste: a full last block counted as a whole empty block",
        "return sum(blocks_needed(n, block_size) * block_size - int(n) for n in context_lens)",
        "return sum(block_size - int(n) % block_size for n in context_lens)",
    ),
    (
        "waste: the used positions of the last block, not the empty ones",
        "return sum(blocks_needed(n, block_size) * block_size - int(n) for n in context_lens)",
        "return sum(int(n) % block_size for n in context_lens)",
    ),
    # BlockAllocator.get_new_blocks
    (
        "get_new_blocks: takes the most recently freed block (the back of the queue)",
        "_, block = self.free_queue.popitem(last=False)",
        "_, block = self.free_queue.popitem(last=True)",
    ),
    (
        "get_new_blocks: adds a reference instead of setting it to 1 (a stale count survives)",
        "            block.ref_count = 1\n            blocks.append(block)\n",
        "            block.ref_count += 2\n            blocks.append(block)\n",
    ),
    (
        "get_new_blocks: no RuntimeError when too few are free",
        '        if num_blocks > len(self.free_queue):\n            raise RuntimeError(f"BlockAllocator.get_new_blocks:',
        '        if False:\n            raise RuntimeError(f"BlockAllocator.get_new_blocks:',
    ),
    (
        "get_new_blocks: hands out what is free before finding too few",
        '        if num_blocks > len(self.free_queue):\n            raise RuntimeError(f"BlockAllocator.get_new_blocks:',
        '        if not self.free_queue:\n            raise RuntimeError(f"BlockAllocator.get_new_blocks:',
    ),
    (
        "get_new_blocks: delegated to the engine's BlockPool",
        "        if num_blocks > len(self.free_queue):\n",
        "        from minillm.core.block_pool import BlockPool\n        return BlockPool.get_new_blocks(self, num_blocks)\n"
        "        if num_blocks > len(self.free_queue):\n",
    ),
    (
        "gaps: delegated to the engine's reservation manager",
        "        gaps, pos = [], 0\n",
        "        from minillm.core.reserved_kv_cache import ReservedKVCacheManager\n"
        "        return ReservedKVCacheManager._gaps(self)\n",
    ),
    # BlockAllocator.free_blocks
    (
        "free: first block first (not in reverse)",
        '        for block in reversed(blocks):\n            if block.ref_count <= 0:\n                raise RuntimeError(f"BlockAllocator',
        '        for block in blocks:\n            if block.ref_count <= 0:\n                raise RuntimeError(f"BlockAllocator',
    ),
    (
        "free: a shared block is freed while another request still holds it",
        "            block.ref_count -= 1\n            if block.ref_count == 0:\n                self.free_queue[block.block_id] = block",
        "            block.ref_count = 0\n            if block.ref_count == 0:\n                self.free_queue[block.block_id] = block",
    ),
    (
        "free: freed blocks join the front of the queue",
        "                self.free_queue[block.block_id] = block\n        ### END SOLUTION\n\n\n# =",
        "                self.free_queue[block.block_id] = block\n                self.free_queue.move_to_end(block.block_id, last=False)\n"
        "        ### END SOLUTION\n\n\n# =",
    ),
    (
        "free: freeing a free block is not refused",
        '            if block.ref_count <= 0:\n                raise RuntimeError(f"BlockAllocator.free_blocks: block {block.block_id} is already free")\n',
        "            if block.ref_count <= 0:\n                continue\n",
    ),
    # FirstFitAllocator.gaps
    (
        "gaps: regions taken in insertion order, not address order",
        "for start, length in sorted(self.regions.values()):",
        "for start, length in self.regions.values():",
    ),
    ("gaps: empty runs included", "            if start > pos:\n", "            if start >= pos:\n"),
    (
        "gaps: forgets the run after the last region",
        "        if pos < self.capacity:\n            gaps.append((pos, self.capacity - pos))\n",
        "",
    ),
    # FirstFitAllocator.reserve
    (
        "reserve: best fit (the smallest gap that holds it)",
        "        for start, size in self.gaps():\n            if size >= length:",
        "        for start, size in sorted(self.gaps(), key=lambda g: (g[1], g[0])):\n            if size >= length:",
    ),
    (
        "reserve: worst fit (the largest gap)",
        "        for start, size in self.gaps():\n            if size >= length:",
        "        for start, size in sorted(self.gaps(), key=lambda g: -g[1]):\n            if size >= length:",
    ),
    (
        "reserve: a gap of exactly the length is refused",
        "            if size >= length:",
        "            if size > length:",
    ),
    (
        "reserve: a second reservation for the same request is allowed",
        '        if request_id in self.regions:\n            raise RuntimeError(f"FirstFitAllocator.reserve: {request_id!r} already holds a region")\n',
        "",
    ),
    # FirstFitAllocator.release
    (
        "release: a request without a region raises KeyError",
        "self.regions.pop(request_id, None)",
        "del self.regions[request_id]",
    ),
    (
        "release: the region is kept (nothing released)",
        "self.regions.pop(request_id, None)",
        "self.regions.get(request_id)",
    ),
]
