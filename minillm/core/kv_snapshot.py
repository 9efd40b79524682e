"""The KV snapshot a StepRecord carries (``StepRecord.kv``): who holds which positions, block by block.
Beside it, what a paged KV manager says about itself: why a request waits, the prefix cache's counts.

Built from a KV manager after each step for the widgets and the invariant checks: positions used,
free, cached, reserved but unused, the empty tails of last blocks, and (``detail``) every block's owners.
"""

from __future__ import annotations

import math

from ..step_record import BlockInfo, KVSnapshot, RequestKV


def may_share_blocks(kv) -> bool:
    """Can a block have two holders now? Always with prefix caching (a cache hit); without it only
    after a parallel-sampling fork, and then the block tables hold more entries than blocks are in use."""
    return kv.enable_prefix_caching or sum(map(len, kv.req_blocks.values())) > kv.num_blocks - kv.pool.num_free


def paged_snapshot(kv, requests: dict, detail: bool = True) -> KVSnapshot:
    """The snapshot of a ``PagedKVCacheManager``; ``detail`` adds the per-block map (O(blocks))."""
    bs = kv.block_size
    filled = [0] * kv.num_blocks if detail else []  # (read with detail only)
    owners: dict[int, list[str]] = {}
    per_request = {}
    used = partial = 0
    seen: set[int] = set()
    shared = detail or may_share_blocks(kv)  # else no block has two owners
    for rid, blocks in kv.req_blocks.items():
        req = requests.get(rid)
        n = req.num_computed_tokens if req is not None else 0
        per_request[rid] = RequestKV(used=n, num_blocks=len(blocks), cached_prefix=req.num_cached_tokens if req else 0)
        partial += len(blocks) * bs - n
        if not shared:  # fast path (long simulations): O(requests), not O(blocks)
            used += max(0, min(n, len(blocks) * bs))
            continue
        for i, b in enumerate(blocks):
            f = max(0, min(bs, n - i * bs))
            if b.block_id not in seen:
                seen.add(b.block_id)
                used += f
            elif detail:
                used += max(0, f - filled[b.block_id])
            if detail:
                filled[b.block_id] = max(filled[b.block_id], f)
                owners.setdefault(b.block_id, []).append(rid)
    cached_free = kv.pool.num_cached_free
    blocks_used = kv.num_blocks - kv.pool.num_free
    snap = KVSnapshot(
        total=kv.num_blocks * bs,
        used=used,
        free=kv.pool.num_free * bs,
        blocks_total=kv.num_blocks,
        blocks_used=blocks_used,
        blocks_free=kv.pool.num_free,
        block_size=bs,
        cached=cached_free * bs,
        partial_waste=partial,
        per_request=per_request,
        swap_used_blocks=kv.swap_used,
        swap_total_blocks=kv.num_swap_blocks,
    )
    if detail:
        for b in kv.pool.blocks:
            snap.blocks.append(
                BlockInfo(
                    block_id=b.block_id,
                    owners=owners.get(b.block_id, []),
                    num_filled=filled[b.block_id] if b.ref_count else (bs if b.block_hash is not None else 0),
                    ref_count=b.ref_count,
                    cached=b.block_hash is not None,
                )
            )
    return snap


def reserved_snapshot(kv, requests: dict, detail: bool = True) -> KVSnapshot:
    """The snapshot of a ``ReservedKVCacheManager``: reserved-but-unused positions and fragmentation."""
    bs = kv.block_size
    used = reserved_unused = 0
    per_request = {}
    for rid, (start, length) in kv.regions.items():
        req = requests.get(rid)
        n = req.num_computed_tokens if req else 0
        used += n
        reserved_unused += length - n
        per_request[rid] = RequestKV(used=n, reserved_unused=length - n, num_blocks=math.ceil(length / bs))
    free = kv.capacity - used - reserved_unused
    largest = kv.largest_gap()
    blocks_free = kv.num_gap_blocks()
    snap = KVSnapshot(
        total=kv.capacity,
        used=used,
        free=free,
        blocks_total=kv.num_blocks,
        blocks_used=kv.num_blocks - blocks_free,
        blocks_free=blocks_free,
        block_size=bs,
        reserved_unused=reserved_unused,
        fragmentation=free - largest,
        per_request=per_request,
    )
    if detail:
        for blk in range(kv.num_blocks):
            lo, hi = blk * bs, (blk + 1) * bs
            owners, filled, reserved = [], 0, 0
            for rid, (start, length) in kv.regions.items():
                a, b = max(lo, start), min(hi, start + length)
                if a < b:
                    owners.append(rid)
                    req = requests.get(rid)
                    n = req.num_computed_tokens if req else 0
                    f = max(0, min(b, start + n) - a)
                    filled += f
                    reserved += (b - a) - f
            snap.blocks.append(
                BlockInfo(block_id=blk, owners=owners, num_filled=filled, ref_count=len(owners), reserved=reserved)
            )
    return snap


def paged_totals(kv, requests: dict) -> KVSnapshot:
    """The snapshot's counts without its per-request entries or block map (``record="totals"``):
    the block counts are the pool's own counters, and positions holding KV one pass of additions
    over the block tables, no object per request. A block several requests hold (a prefix-cache hit,
    a fork) counts once, as in ``paged_snapshot``; such a block has the same fill for all its holders
    (nobody writes into a shared block), so only each request's blocks that are not full (usually its
    last) are looked at one by one, and the full shared ones are counted from the pool: every
    reference beyond the first (references minus blocks in use, as the invariants hold) is a
    repeated full block."""
    bs = kv.block_size
    used = held = computed = repeats = 0
    shared = may_share_blocks(kv)  # else no block has two owners
    seen: set[int] = set()
    for rid, blocks in kv.req_blocks.items():
        req = requests.get(rid)
        n = req.num_computed_tokens if req is not None else 0
        held += len(blocks)
        computed += n
        used += min(n, len(blocks) * bs)
        if shared:
            for i in range(n // bs, len(blocks)):  # its blocks that are not full
                b = blocks[i]
                if b.ref_count > 1:
                    if b.block_id in seen:
                        used -= max(0, n - i * bs)
                        repeats += 1
                    else:
                        seen.add(b.block_id)
    if shared:
        used -= bs * (held - (kv.num_blocks - kv.pool.num_free) - repeats)
    num_free = kv.pool.num_free
    return KVSnapshot(
        total=kv.num_blocks * bs,
        used=used,
        free=num_free * bs,
        blocks_total=kv.num_blocks,
        blocks_used=kv.num_blocks - num_free,
        blocks_free=num_free,
        block_size=bs,
        cached=kv.pool.num_cached_free * bs,
        partial_waste=held * bs - computed,
        swap_used_blocks=kv.swap_used,
        swap_total_blocks=kv.num_swap_blocks,
    )


def paged_wait_reason(kv, req, num_new_tokens: int, cached=(), reserve_blocks: int = 0) -> str:
    """Why a ``PagedKVCacheManager`` cannot take ``req`` now (``explain_wait``): "needs 3 blocks, 1 free"."""
    ok, need, free = kv.can_allocate(req, num_new_tokens, cached)
    headroom = kv.headroom(req, reserve_blocks)
    return f"needs {need} block{'s' if need != 1 else ''}, {free} free" + (
        f" ({headroom} kept as headroom)" if headroom else ""
    )


def prefix_cache_stats(kv) -> dict:
    """The prefix cache's counters, its hit rate and the prefill tokens it saved (``kv.stats()``)."""
    st = dict(kv.pool.stats)
    q = st["queried_blocks"]
    st["hit_rate"] = st["hit_blocks"] / q if q else 0.0
    st["prefill_tokens_saved"] = kv.prefill_tokens_saved
    return st
