"""Invariants of the engine's memory and batch, checked after any step.

The tests call ``check_invariants(engine, record)`` after every step of random
workloads; notebooks and exercise graders can too. Each failure says what broke.
"""

from __future__ import annotations

from .block_pool import hash_block
from .kv_cache import PagedKVCacheManager
from .reserved_kv_cache import ReservedKVCacheManager
from .request import RequestStatus


class InvariantError(AssertionError):
    pass


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvariantError(msg)


def check_paged(kv: PagedKVCacheManager, requests: dict) -> None:
    pool = kv.pool
    owners: dict[int, list[str]] = {}
    for rid, blocks in kv.req_blocks.items():
        ids = [b.block_id for b in blocks]
        _check(len(ids) == len(set(ids)), f"request {rid} holds a block twice: {ids}")
        for bid in ids:
            owners.setdefault(bid, []).append(rid)
    for b in pool.blocks:
        n = len(owners.get(b.block_id, []))
        _check(b.ref_count == n, f"block {b.block_id}: ref_count {b.ref_count} but {n} owners")
        in_free = b.block_id in pool.free_queue
        _check(
            in_free == (b.ref_count == 0), f"block {b.block_id}: ref_count {b.ref_count} but in free list = {in_free}"
        )
    cached_free = sum(b.block_hash is not None for b in pool.free_queue.values())
    _check(
        pool.num_cached_free == cached_free,
        f"{pool.num_cached_free} cached free blocks counted, {cached_free} in the free list",
    )
    used = sum(1 for b in pool.blocks if b.ref_count > 0)
    _check(used + pool.num_free == kv.num_blocks, f"free {pool.num_free} + used {used} != total {kv.num_blocks}")
    # Every cached block's hash matches its tokens, and the KV it holds is those tokens'.
    for h, b in pool.cached.items():
        _check(b.block_hash == h, f"block {b.block_id} indexed under a hash it does not carry")
        _check(
            b.token_ids is not None and hash_block(b.parent_hash, b.token_ids) == h,
            f"block {b.block_id}: hash does not match tokens",
        )
    bs = kv.block_size
    for rid, blocks in kv.req_blocks.items():
        req = requests.get(rid)
        if req is None:
            continue
        _check(
            len(blocks) * bs >= req.num_computed_tokens,
            f"request {rid}: {req.num_computed_tokens} positions computed but only {len(blocks)} blocks",
        )
        toks = None
        for i, b in enumerate(blocks):
            if b.block_hash is not None and (i + 1) * bs <= req.num_computed_tokens:
                toks = toks if toks is not None else req.all_token_ids
                _check(
                    tuple(toks[i * bs : (i + 1) * bs]) == b.token_ids,
                    f"request {rid} block {i} (#{b.block_id}) is cached with other tokens",
                )
    # Copy-on-write: a block held by several sequences (a shared prefix, or the blocks of a
    # parallel-sampling fork) holds the same KV for each, so none of them wrote into it alone:
    # each holder has computed the same positions of it, over the same tokens, and a block
    # shared by a fork (no prefix hash) holds prompt positions only.
    seen: dict[int, tuple[str, int, list]] = {}
    for rid, blocks in kv.req_blocks.items():
        req = requests.get(rid)
        if req is None:
            continue
        for i, b in enumerate(blocks):
            if b.ref_count < 2:
                continue
            filled = max(0, min(bs, req.num_computed_tokens - i * bs))
            toks = req.all_token_ids[i * bs : i * bs + filled]
            _check(
                b.block_hash is not None or i * bs + filled <= req.num_prompt_tokens,
                f"request {rid} wrote output KV into block {b.block_id}, which {b.ref_count} sequences "
                "share (a forked block must be copied before a sequence writes into it)",
            )
            first = seen.setdefault(b.block_id, (rid, filled, toks))
            _check(
                first[1:] == (filled, toks),
                f"block {b.block_id} is shared by {first[0]} and {rid} but holds {first[1]} positions "
                f"for one and {filled} for the other (a write into a shared block: copy-on-write missed)",
            )
    # A parent is never evicted before its children (free-list order).
    order = {bid: i for i, bid in enumerate(pool.free_queue)}
    by_hash = {b.block_hash: b for b in pool.free_queue.values() if b.block_hash is not None}
    for b in pool.free_queue.values():
        if b.parent_hash is not None and b.parent_hash in by_hash:
            p = by_hash[b.parent_hash]
            if p.token_ids is not None and pool.cached.get(b.parent_hash) is p:
                _check(
                    order[p.block_id] > order[b.block_id],
                    f"cached parent block {p.block_id} would be evicted before its child {b.block_id}",
                )
    # The swap pool is never overfilled and no host block is used twice.
    host = [h for hs in kv.swapped.values() for h in hs]
    _check(len(host) == len(set(host)), "a host swap block is used twice")
    _check(not set(host) & set(kv.swap_free), "a host swap block is both held and free")
    _check(
        len(host) + len(kv.swap_free) == kv.num_swap_blocks,
        f"swap pool: {len(host)} used + {len(kv.swap_free)} free != {kv.num_swap_blocks}",
    )


def check_reserved(kv: ReservedKVCacheManager, requests: dict) -> None:
    regions = sorted((s, l, rid) for rid, (s, l) in kv.regions.items())
    end = 0
    for s, l, rid in regions:
        _check(s >= end, f"reservation of {rid} at {s} overlaps the previous one ending at {end}")
        _check(s + l <= kv.capacity, f"reservation of {rid} runs past the capacity {kv.capacity}")
        end = s + l
        req = requests.get(rid)
        if req is not None:
            _check(
                req.num_computed_tokens <= l,
                f"request {rid} wrote {req.num_computed_tokens} positions into a {l}-position region",
            )


def check_places(engine) -> None:
    """Every unfinished request is in exactly one place (not arrived yet, waiting, running,
    swapped out, held back), its status agrees with the place, and only the requests in a
    place are unfinished: a request that is in no queue would never finish."""
    sched = engine.scheduler
    places: dict[str, list[str]] = {}
    queues = (
        ("not arrived", [item[2] for item in sched.incoming]),
        ("waiting", sched.waiting),
        ("running", sched.running),
        ("swapped", sched.swapped),
        ("held", sched.held),
    )
    allowed = {
        "not arrived": (RequestStatus.WAITING,),
        "waiting": (RequestStatus.WAITING, RequestStatus.PREEMPTED),
        "running": (RequestStatus.RUNNING,),
        "swapped": (RequestStatus.SWAPPED,),
        "held": (RequestStatus.RUNNING,),
    }
    for name, queue in queues:
        for r in queue:
            places.setdefault(r.request_id, []).append(name)
            _check(r.status in allowed[name], f"{r.request_id} is {name} with status {r.status.value}")
            _check(not r.is_finished, f"{r.request_id} is finished but still {name}")
    for rid, where in places.items():
        _check(len(where) == 1, f"{rid} is in {len(where)} places at once: {where}")
    unfinished = {rid for rid, r in engine.requests.items() if not r.is_finished}
    lost = unfinished - set(places)
    _check(not lost, f"unfinished requests in no queue (they would never finish): {sorted(lost)}")
    _check(set(places) <= unfinished, f"finished requests still queued: {sorted(set(places) - unfinished)}")
    _check(
        engine.has_unfinished_requests() == bool(unfinished),
        f"has_unfinished_requests()={engine.has_unfinished_requests()} with {len(unfinished)} unfinished",
    )
    kv = engine.kv
    if isinstance(kv, PagedKVCacheManager):
        swapped = {r.request_id for r in sched.swapped}
        _check(
            set(kv.swapped) == swapped, f"host blocks held by {sorted(kv.swapped)} but swapped out: {sorted(swapped)}"
        )


def check_invariants(engine, record=None) -> None:
    kv = engine.kv
    active = {rid: r for rid, r in engine.requests.items() if not r.is_finished}
    check_places(engine)
    if isinstance(kv, PagedKVCacheManager):
        check_paged(kv, active)
    else:
        check_reserved(kv, active)
    sched = engine.scheduler
    cfg = engine.config
    _check(len(sched.running) <= cfg.max_num_seqs, f"{len(sched.running)} running > max_num_seqs={cfg.max_num_seqs}")
    seqs = sum(r.num_seqs for r in sched.running)  # a group that has not forked counts n
    _check(seqs <= cfg.max_num_seqs, f"{seqs} sequences running > max_num_seqs={cfg.max_num_seqs}")
    for rid, parent in engine.parents.items():
        _check(
            len(parent.members) in ((1, parent.n) if not parent.forked else (parent.n,)),
            f"request {rid}: {len(parent.members)} sequences for n={parent.n} (forked={parent.forked})",
        )
    for r in sched.running:
        _check(r.status == RequestStatus.RUNNING, f"{r.request_id} in running with status {r.status}")
    holders = set(kv.req_blocks if isinstance(kv, PagedKVCacheManager) else kv.regions)
    live = {r.request_id for r in sched.running}
    _check(holders <= live, f"requests hold KV but are not running: {sorted(holders - live)}")
    if record is not None:
        _check(
            record.num_batched_tokens <= record.token_budget,
            f"step {record.step}: {record.num_batched_tokens} tokens > budget {record.token_budget}",
        )
        _check(
            record.batch_size <= cfg.max_num_seqs,
            f"step {record.step}: batch of {record.batch_size} > max_num_seqs={cfg.max_num_seqs}",
        )
        k = record.kv
        if k is None:  # record="none": no KV snapshot
            return
        _check(
            k.blocks_used + k.blocks_free == k.blocks_total,
            f"step {record.step}: blocks used {k.blocks_used} + free {k.blocks_free} != {k.blocks_total}",
        )
        if k.reserved_unused or isinstance(kv, ReservedKVCacheManager):
            _check(
                k.used + k.reserved_unused + k.free == k.total,
                f"step {record.step}: used + reserved_unused + free != total",
            )
        else:
            _check(
                k.used <= k.blocks_used * k.block_size and k.free == k.blocks_free * k.block_size,
                f"step {record.step}: KV positions disagree with block counts",
            )


def check_all_free(engine) -> None:
    """At the end of a run: every block is free (or cached-free) and nothing is lost."""
    kv = engine.kv
    for rid, r in engine.requests.items():
        _check(r.is_finished, f"request {rid} never finished ({r.status})")
        _check(
            r.finish_reason in ("stop", "length", "abort", "rejected"),
            f"request {rid} finished with reason {r.finish_reason!r}",
        )
    if isinstance(kv, PagedKVCacheManager):
        _check(kv.pool.num_free == kv.num_blocks, f"{kv.num_blocks - kv.pool.num_free} blocks leaked")
        _check(not kv.req_blocks, f"block tables left: {list(kv.req_blocks)}")
        _check(not kv.swapped and len(kv.swap_free) == kv.num_swap_blocks, "swap blocks leaked")
    else:
        _check(not kv.regions, f"reservations leaked: {list(kv.regions)}")
