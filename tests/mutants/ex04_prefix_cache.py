"""Plausible wrong answers to notebook 04's exercises; each must fail tests/graders/ex04_prefix_cache.py.

Each entry: (what the mistake is, old text of solutions/ex04_prefix_cache.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # hash_block / block_hashes
    (
        "hash: the block's own tokens only (no chain)",
        "return hash((parent_hash, tuple(token_ids)))",
        "return hash((None, tuple(token_ids)))",
    ),
    (
        "hash: the pair in the other order",
        "return hash((parent_hash, tuple(token_ids)))",
        "return hash((tuple(token_ids), parent_hash))",
    ),
    (
        "hash: delegated to the engine's hash_block",
        "    return hash((parent_hash, tuple(token_ids)))\n",
        "    from minillm.core.block_pool import hash_block as engine_hash\n    return engine_hash(parent_hash, token_ids)\n",
    ),
    (
        "hashes: the partly filled last block gets a key too",
        "for i in range(len(token_ids) // block_size):\n        parent = hash_block(",
        "for i in range(-(-len(token_ids) // block_size)):\n        parent = hash_block(",
    ),
    (
        "hashes: every block hashed after no parent",
        "        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])",
        "        parent = hash_block(None, token_ids[i * block_size:(i + 1) * block_size])",
    ),
    # longest_prefix_match
    (
        "match: may reuse the block holding the last prompt token",
        "for i in range((len(token_ids) - 1) // block_size):",
        "for i in range(len(token_ids) // block_size):",
    ),
    (
        "match: no check of the cached block's tokens (a collision counts as a hit)",
        "if block is None or block.token_ids != tokens or block.parent_hash != parent:\n            break\n        hits",
        "if block is None or block.parent_hash != parent:\n            break\n        hits",
    ),
    (
        "match: no check of the cached block's parent",
        "if block is None or block.token_ids != tokens or block.parent_hash != parent:\n            break\n        hits",
        "if block is None or block.token_ids != tokens:\n            break\n        hits",
    ),
    (
        "match: skips a miss and goes on matching later blocks",
        "            break\n        hits.append(block)",
        "            parent = h\n            continue\n        hits.append(block)",
    ),
    # EvictingBlockPool.evict
    (
        "evict: removes the index entry even when it is another block's",
        "        if self.cached.get(block.block_hash) is block:\n            del self.cached[block.block_hash]",
        "        if block.block_hash in self.cached:\n            del self.cached[block.block_hash]",
    ),
    (
        "evict: keeps the block's hash fields",
        '        block.block_hash = block.token_ids = block.parent_hash = None\n        self.stats["evictions"] += 1',
        '        self.stats["evictions"] += 1',
    ),
    ("evict: not counted", '        self.stats["evictions"] += 1\n', ""),
    # get_new_blocks
    (
        "get_new_blocks: hands out the most recently freed block (MRU, not LRU)",
        "            _, block = self.free_queue.popitem(last=False)\n            if block.block_hash is not None:",
        "            _, block = self.free_queue.popitem(last=True)\n            if block.block_hash is not None:",
    ),
    (
        "get_new_blocks: hands out a cached block without evicting its prefix",
        "            if block.block_hash is not None:\n                self.evict(block)\n",
        "",
    ),
    (
        "get_new_blocks: hands out what is free before finding too few",
        '        if num_blocks > len(self.free_queue):\n            raise RuntimeError(f"EvictingBlockPool.get_new_blocks:',
        '        if not self.free_queue:\n            raise RuntimeError(f"EvictingBlockPool.get_new_blocks:',
    ),
    (
        "get_new_blocks: delegated to the engine's BlockPool",
        "        if num_blocks > len(self.free_queue):\n",
        "        return super().get_new_blocks(num_blocks)\n        if num_blocks > len(self.free_queue):\n",
    ),
    (
        "touch: delegated to the engine's BlockPool",
        "        for block in blocks:\n            if block.ref_count == 0:\n                del self.free_queue[block.block_id]\n"
        "            block.ref_count += 1\n",
        "        super().touch(blocks)\n",
    ),
    # touch
    (
        "touch: a hit on a free cached block leaves it in the free queue",
        "            if block.ref_count == 0:\n                del self.free_queue[block.block_id]\n",
        "",
    ),
    (
        "touch: sets the count to 1 instead of adding a reference",
        "                del self.free_queue[block.block_id]\n            block.ref_count += 1",
        "                del self.free_queue[block.block_id]\n            block.ref_count = 1",
    ),
    # free_blocks
    (
        "free: first block first (a prefix's parent is evicted before its children)",
        '        for block in reversed(blocks):\n            if block.ref_count <= 0:\n                raise RuntimeError(f"EvictingBlockPool',
        '        for block in blocks:\n            if block.ref_count <= 0:\n                raise RuntimeError(f"EvictingBlockPool',
    ),
    (
        "free: a freed block forgets its cached prefix",
        "                if block.block_hash is None or not self.enable_caching:",
        "                if True:",
    ),
    (
        "free: a block still held by another request joins the free queue",
        "            block.ref_count -= 1\n            if block.ref_count == 0:\n",
        "            block.ref_count -= 1\n            if True:\n",
    ),
    (
        "free: freeing a block nobody holds is not refused",
        '            if block.ref_count <= 0:\n                raise RuntimeError(f"EvictingBlockPool.free_blocks: block {block.block_id} is not held")\n',
        "            if block.ref_count <= 0:\n                continue\n",
    ),
    # tokens_reused_after_edit
    (
        "edit: token granularity (everything before the edit reused, not whole blocks)",
        "        blocks = min(blocks, min(edited_positions) // block_size)\n    return blocks * block_size\n",
        "        return min(blocks * block_size, min(edited_positions))\n    return blocks * block_size\n",
    ),
    (
        "edit: the block holding the edit is reused too",
        "blocks = min(blocks, min(edited_positions) // block_size)",
        "blocks = min(blocks, min(edited_positions) // block_size + 1)",
    ),
    (
        "edit: the latest edit decides",
        "blocks = min(blocks, min(edited_positions) // block_size)",
        "blocks = min(blocks, max(edited_positions) // block_size)",
    ),
    (
        "edit: no edit reuses every full block (the last token's logits forgotten)",
        "    blocks = (num_tokens - 1) // block_size\n",
        "    blocks = num_tokens // block_size\n",
    ),
    (
        "edit: chain ignored (every block without an edit is reused)",
        "    if edited_positions:\n        blocks = min(blocks, min(edited_positions) // block_size)\n",
        "    blocks -= len({p // block_size for p in edited_positions if p // block_size < blocks})\n",
    ),
    (
        "edit: positions outside the prompt accepted",
        "        if not 0 <= p < num_tokens:",
        "        if p >= num_tokens + block_size:",
    ),
]
