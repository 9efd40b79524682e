"""The KV managers alone: block tables, the admission check, prefix hits, copy-on-write, swapping, rollback.

Each test builds a ``PagedKVCacheManager`` (or a ``ReservedKVCacheManager``) and a few ``Request``s by hand,
with no scheduler and no engine, and checks the block tables, the free list and the counts against values
worked out in the comments from ``minillm/core/kv_cache.py`` and ``block_pool.py``: blocks come from the front
of the free list; a table is freed last block first; without caching a freed block goes to the back, with
caching a block holding nothing reusable goes to the front and a cached one to the back.
"""

from __future__ import annotations

from minillm.core.kv_cache import PagedKVCacheManager
from minillm.core.request import Request, RequestStatus
from minillm.core.reserved_kv_cache import ReservedKVCacheManager
from minillm.sampling_params import SamplingParams


def request(rid: str, tokens, max_tokens: int = 8) -> Request:
    tokens = list(range(10, 10 + tokens)) if isinstance(tokens, int) else list(tokens)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


def tables(kv: PagedKVCacheManager) -> dict[str, list[int]]:
    return {rid: kv.block_table(rid) for rid in kv.req_blocks}


def free_order(kv: PagedKVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def refs(kv: PagedKVCacheManager) -> list[int]:
    return [b.ref_count for b in kv.pool.blocks]


def test_a_table_grows_a_block_only_when_the_next_position_crosses_a_boundary():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    a = request("a", 6)
    assert kv.can_allocate(a, 6) == (True, 2, 8)  # ceil(6 / 4) = 2 of 8 free
    assert kv.allocate(a, 6) and tables(kv) == {"a": [0, 1]} and kv.num_free_blocks == 6
    a.advance(6)
    # positions 6 and 7 are in block 1 (positions 4..7): nothing new; position 8 starts block 2
    for position, need in ((6, 0), (7, 0), (8, 1)):
        assert a.num_computed_tokens == position and kv.num_blocks_needed(a, 1) == need
        assert kv.allocate(a, 1)
        a.advance(1)
    assert tables(kv) == {"a": [0, 1, 2]} and kv.num_free_blocks == 5 and kv.num_held_blocks("a") == 3
    # a prefill of 9 more positions from 9 computed: ceil(18 / 4) = 5 blocks, 3 held: 2 new
    assert kv.num_blocks_needed(a, 9) == 2


def test_admission_leaves_the_watermark_free_for_a_new_request_only():
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, watermark=0.2)  # int(0.2 * 10) = 2 blocks
    a, b = request("a", 32), request("b", 36)
    assert kv.watermark_blocks == 2 and kv.headroom(a) == 2 and kv.headroom(a, reserve_blocks=1) == 3
    assert kv.can_allocate(a, 32) == (True, 8, 10)  # 8 <= 10 - 2
    assert kv.can_allocate(b, 36) == (False, 9, 10)  # 9 > 10 - 2
    assert kv.explain_wait(b, 36) == "needs 9 blocks, 10 free (2 kept as headroom)"
    assert not kv.allocate(b, 36) and tables(kv) == {}  # refused: nothing changes
    assert kv.allocate(a, 32)
    a.advance(32)
    # a holds blocks now: its growth may use the headroom (1 block needed, 2 free)
    assert kv.headroom(a) == 0 and kv.can_allocate(a, 1) == (True, 1, 2)


def test_a_freed_table_goes_back_last_block_first_and_free_is_idempotent():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    a, b = request("a", 12), request("b", 8)
    kv.allocate(a, 12)
    assert tables(kv) == {"a": [0, 1, 2]} and free_order(kv) == [3]
    kv.free(a)
    assert free_order(kv) == [3, 2, 1, 0] and tables(kv) == {} and refs(kv) == [0, 0, 0, 0]
    kv.free(a)  # nothing held: nothing happens
    assert free_order(kv) == [3, 2, 1, 0]
    kv.allocate(b, 8)
    assert tables(kv) == {"b": [3, 2]}


def test_truncate_gives_back_the_blocks_of_rejected_guesses():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4)
    a = request("a", 12)
    kv.allocate(a, 12)
    kv.truncate(a, 5)  # ceil(5 / 4) = 2 blocks kept
    assert tables(kv) == {"a": [0, 1]} and free_order(kv) == [3, 4, 5, 2]
    kv.truncate(a, 8)  # 2 blocks hold 8: nothing to give back
    assert tables(kv) == {"a": [0, 1]}


def test_a_later_prompt_shares_the_full_blocks_of_an_earlier_one():
    kv = PagedKVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = request("a", [1, 2, 3, 4, 5]), request("b", [1, 2, 3, 4, 9, 9])
    assert kv.find_cached_prefix(a) == []
    kv.allocate(a, 5)
    kv.cache_full_blocks(a, 5)  # 5 // 2 = 2 full blocks: 0 and 1
    hits = kv.find_cached_prefix(b)  # b's blocks (1, 2), (3, 4) match; (9, 9) is new
    assert [h.block_id for h in hits] == [0, 1]
    # the last token is always computed: a 4-token prompt looks up (4 - 1) // 2 = 1 block only
    assert [h.block_id for h in kv.find_cached_prefix(request("c", [1, 2, 3, 4]))] == [0]
    # b needs ceil(6 / 2) = 3 blocks, 2 of them the hits: 1 new of 8 - 3 = 5 free
    assert kv.can_allocate(b, 2, hits) == (True, 1, 5)
    kv.allocate(b, 2, hits)
    kv.record_lookup(b, hits)
    assert tables(kv) == {"a": [0, 1, 2], "b": [0, 1, 3]} and refs(kv)[:4] == [2, 2, 1, 1]
    st = kv.stats()
    assert (st["lookups"], st["queried_blocks"], st["hit_blocks"], st["hit_rate"]) == (1, 2, 2, 1.0)
    assert st["prefill_tokens_saved"] == 4
    # Freed: a's block 2 (no prefix) to the front; then b's 3 (no prefix) to the front, 1 and 0 (cached) to
    # the back, the child before its parent, so the parent is evicted last.
    kv.free(a)
    kv.free(b)
    assert free_order(kv) == [3, 2, 4, 5, 6, 7, 1, 0]
    # cached and free, they are still found; taking them makes them not free: 8 - 2 = 6 free for the rest
    d = request("d", [1, 2, 3, 4, 7])
    hits = kv.find_cached_prefix(d)
    assert [h.block_id for h in hits] == [0, 1] and kv.can_allocate(d, 1, hits) == (True, 1, 6)


def test_a_fork_shares_every_block_and_the_first_write_into_a_shared_block_copies_it():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4)
    p = request("p", 6)
    p.admit(0, 1, 0.0)
    kv.allocate(p, 6)
    p.advance(6)
    child = p.fork("p#1", SamplingParams(max_tokens=8), index=1)
    assert kv.fork(p, child) == [0, 1] and tables(kv) == {"p": [0, 1], "p#1": [0, 1]} and refs(kv)[:2] == [2, 2]
    # the child's next position 6 falls in block 1 (positions 4..7), which p also holds: one block to copy into
    assert kv.num_blocks_needed(child, 1) == 1
    assert kv.allocate(child, 1)
    assert tables(kv) == {"p": [0, 1], "p#1": [0, 2]} and refs(kv)[:3] == [2, 1, 1]
    assert kv.take_copies() == [("p#1", 1, 2)] and kv.take_copies() == []
    # block 1 is p's alone now: p writes into it without a copy
    assert kv.num_blocks_needed(p, 1) == 0 and kv.allocate(p, 1) and kv.take_copies() == []


def test_a_swapped_out_request_gives_its_blocks_back_and_comes_back_into_new_ones():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4, num_swap_blocks=4)
    a, b = request("a", 6), request("b", 4)
    a.admit(0, 1, 0.0)
    kv.allocate(a, 6)
    a.advance(6)
    assert kv.can_swap_out(a)  # 2 blocks, 4 host blocks free
    assert kv.swap_out(a) == [(0, 0), (1, 1)]  # host blocks from the end of [3, 2, 1, 0]
    assert tables(kv) == {} and kv.swapped == {"a": [0, 1]} and kv.swap_used == 2
    assert free_order(kv) == [2, 3, 4, 5, 1, 0]
    kv.allocate(b, 4)  # b takes block 2
    # a back and one position more: max(2 held, ceil(7 / 4) = 2) = 2 blocks of 5 free
    assert kv.can_swap_in(a, 1) == (True, 2, 5)
    kv.begin_step()
    assert kv.swap_in(a) == [(0, 3), (1, 4)]
    assert tables(kv) == {"b": [2], "a": [3, 4]}
    assert kv.swap_used == 2  # host blocks are reused only after the step's copies
    kv.end_step()
    assert kv.swap_used == 0 and kv.swapped == {}


def test_rollback_puts_every_table_reference_count_and_counter_back():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a, b = request("a", 4), request("b", [10, 11, 12, 13, 14])
    kv.allocate(a, 4)
    a.advance(4)
    before = (tables(kv), refs(kv), kv.num_free_blocks, kv.stats())
    kv.begin_step()
    kv.allocate(a, 1)  # position 4: a second block
    kv.allocate(b, 5)
    kv.record_lookup(b, [])
    kv.cache_full_blocks(b, 5)
    assert tables(kv) == {"a": [0, 1], "b": [2, 3]} and kv.stats()["lookups"] == 1
    assert kv.rollback() == {}  # nobody lost KV it had before the step
    assert (tables(kv), refs(kv), kv.num_free_blocks, kv.stats()) == before
    assert kv.find_cached_prefix(request("c", [10, 11, 12, 13, 14])) == []  # b's prefix was never computed


def test_a_block_handed_to_another_request_in_a_failed_step_is_not_trusted_after_rollback():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    a, b = request("a", 8), request("b", 16)
    kv.allocate(a, 8)
    a.advance(8)
    kv.begin_step()
    kv.free(a)  # preempted: its blocks go to the back, 1 then 0
    kv.allocate(b, 16)  # b takes all four, a's among them
    assert tables(kv) == {"b": [2, 3, 1, 0]}
    # a's blocks may have been written over: its table is cut from its first such block (position 0)
    assert kv.rollback() == {"a": 0}
    assert kv.block_table("a") == [] and "b" not in kv.req_blocks and kv.num_free_blocks == 4


def test_forget_uncomputed_prefixes_of_a_request_preempted_before_the_forward():
    kv = PagedKVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = request("a", [1, 2, 3])
    kv.begin_step()
    kv.allocate(a, 3)
    kv.cache_full_blocks(a, 3)  # block 0 registered, its KV not written yet
    kv.free(a)  # preempted in the same pass
    assert kv.find_cached_prefix(request("b", [1, 2, 3])) == []
    kv.end_step()
    # once the forward has run, a registered prefix stays when its owner leaves
    kv.begin_step()
    kv.allocate(a, 3)
    kv.cache_full_blocks(a, 3)
    kv.forward_done()
    kv.free(a)
    kv.end_step()
    assert [h.block_id for h in kv.find_cached_prefix(request("b", [1, 2, 3]))] == [0]


def test_the_snapshot_counts_positions_blocks_and_the_empty_tails():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4)
    a, b = request("a", 6), request("b", 3)
    for r, n in ((a, 6), (b, 3)):
        r.admit(0, 1, 0.0)
        kv.allocate(r, n)
        r.advance(n)
    snap = kv.snapshot({"a": a, "b": b})
    # a: 6 positions in 2 blocks (2 empty), b: 3 in 1 (1 empty); 3 of 6 blocks used
    assert (snap.used, snap.free, snap.partial_waste, snap.blocks_used, snap.blocks_free) == (9, 12, 3, 3, 3)
    assert [(i.block_id, i.owners, i.num_filled) for i in snap.blocks[:3]] == [
        (0, ["a"], 4),
        (1, ["a"], 2),
        (2, ["b"], 3),
    ]
    totals = kv.totals({"a": a, "b": b})
    assert (totals.used, totals.partial_waste, totals.blocks_used) == (9, 3, 3)


def test_reservations_go_first_fit_and_leave_gaps():
    # 4 blocks of 4 = 16 positions. a reserves prompt 3 + max_tokens 2 = 5, b 1 + 2 = 3, c 5.
    kv = ReservedKVCacheManager(num_blocks=4, block_size=4, max_model_len=100)
    a, b, c = request("a", 3, max_tokens=2), request("b", 1, max_tokens=2), request("c", 3, max_tokens=2)
    for r in (a, b, c):
        assert kv.allocate(r, r.num_prompt_tokens)
    assert kv.regions == {"a": (0, 5), "b": (5, 3), "c": (8, 5)} and kv.largest_gap() == 3
    kv.free(a)
    # gaps (0, 5) and (13, 3): 8 positions free, the largest gap 5; whole blocks gap by gap 5 // 4 + 3 // 4 = 1,
    # where the free positions alone would make 8 // 4 = 2
    assert kv.largest_gap() == 5 and kv.num_gap_blocks() == 1 and kv.num_free_blocks == 2
    snap = kv.snapshot({"b": b, "c": c}, detail=False)
    assert (snap.free, snap.blocks_free, snap.fragmentation) == (8, 1, 3)
    d = request("d", 5, max_tokens=1)  # 6 positions: no gap holds them
    assert kv.can_allocate(d, 5) == (False, 6, 8) and not kv.allocate(d, 5)
    assert kv.block_table("b") == [5, 6, 7]
    assert a.status is RequestStatus.WAITING  # the manager never changes a request
