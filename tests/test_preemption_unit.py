"""Preemption alone: a victim by swap goes to host memory and comes back, by recompute starts over.

The scheduler is built without an engine and driven with hand-made runner outputs (the helpers of
``tests/test_scheduler_unit.py``); the block and host-block ids below are worked out by hand from
``minillm/core/preemption.py`` and ``kv_cache.py``: host blocks are taken from the end of the host free list
``[3, 2, 1, 0]``; a freed table goes back last block first.
"""

from __future__ import annotations

from minillm.core.request import RequestStatus
from test_scheduler_unit import TOKEN, grants, request, scheduler, step, tables


def test_a_victim_by_swap_keeps_its_kv_in_host_memory_and_comes_back_when_blocks_are_free():
    # Blocks of 2, 4 in all: a and b (4-token prompts) fill them at step 0.
    s = scheduler(
        block_size=2,
        num_kv_blocks=4,
        max_num_batched_tokens=8,
        max_model_len=12,
        preemption_mode="swap",
        num_swap_blocks=4,
    )
    a, b = request("a", 4, max_tokens=3), request("b", 4, max_tokens=3)
    s.add(a)
    s.add(b)
    step(s, 0.0)
    assert tables(s) == {"a": [0, 1], "b": [2, 3]}
    # Step 1: a's position 4 needs a block; b (admitted last) goes to host blocks 0 and 1, its device blocks
    # are freed last first (3, 2), and a takes block 3.
    out, _ = step(s, 1.0)
    assert [(p.request_id, p.mode) for p in out.preempted] == [("b", "swap")]
    assert out.swap_out == [(2, 0), (3, 1)] and s.kv.swapped == {"b": [0, 1]}
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 4 and b.output_token_ids == [TOKEN]
    assert tables(s) == {"a": [0, 1, 3]} and [r.request_id for r in s.swapped] == ["b"]
    assert s.counters["preemptions_swap"] == 1 and s.counters["swapped_out_blocks"] == 2
    # Step 2: b needs max(2, ceil(5 / 2) = 3) blocks, 1 is free: it stays out; a's third token ends it.
    out, upd = step(s, 2.0)
    assert grants(out) == [("a", 1, 5, "decode")] and out.swap_in == []
    assert [r.request_id for r in upd.finished] == ["a"]
    # a's blocks went back 3, 1, 0 behind 2. Step 3: b's host blocks come back into 2 and 3, its position 4
    # takes block 1, and it decodes where it stopped (nothing recomputed).
    out, _ = step(s, 3.0)
    assert out.swapped_in == ["b"] and out.swap_in == [(0, 2), (1, 3)]
    assert grants(out) == [("b", 1, 4, "decode")] and tables(s) == {"b": [2, 3, 1]}
    assert b.status is RequestStatus.RUNNING and b.metrics.num_recomputed_tokens == 0
    assert s.kv.swap_used == 0 and s.counters["swapped_in_blocks"] == 2


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    # 1 host block: b's 2 blocks do not fit, so b is recomputed instead.
    s = scheduler(
        block_size=2,
        num_kv_blocks=4,
        max_num_batched_tokens=8,
        max_model_len=12,
        preemption_mode="swap",
        num_swap_blocks=1,
    )
    a, b, c = request("a", 4, max_tokens=3), request("b", 4, max_tokens=3), request("c", 4, max_tokens=3)
    for r in (a, b, c):
        s.add(r)
    step(s, 0.0)  # a and b fill the blocks; c waits
    out, _ = step(s, 1.0)
    assert [(p.request_id, p.mode) for p in out.preempted] == [("b", "recompute")] and out.swap_out == []
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    # b waits at the front of the queue, ahead of c, which arrived after it was first admitted
    assert [r.request_id for r in s.waiting] == ["b", "c"] and s.kv.swap_used == 0
