"""KV memory management: reservation vs paging (Figure 4 of notebook 02), automatic prefix
caching, preemption by recompute or swap, all checked after every step."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.invariants import check_all_free, check_invariants
from minillm.analysis.workloads import multi_turn_trace, shared_prefix_trace, submit_trace

from helpers import run_to_end

GREEDY = dict(temperature=0, ignore_eos=True)


# --- Figure 4 -----------------------------------------------------------------------------------


def figure4(kv_allocation, block_size):
    """KV capacity 24 positions, budget 8 tokens, max_num_seqs=2. B: a 5-token prompt with
    max_tokens=15 (a 20-position reservation); after two steps it holds 6 positions of KV.
    Then C arrives with a 6-token prompt."""
    llm = LLM(
        "random",
        kv_allocation=kv_allocation,
        block_size=block_size,
        num_kv_blocks=24 // block_size,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        max_model_len=32,
    )
    e = llm.engine
    e.add_request([10, 11, 12, 13, 14], SamplingParams(max_tokens=15, **GREEDY), request_id="B")
    e.step()
    e.step()
    assert e.requests["B"].num_computed_tokens == 6
    e.add_request([20, 21, 22, 23, 24, 25], SamplingParams(max_tokens=4, **GREEDY), request_id="C")
    return e, e.step()


def test_figure4_reserved_c_waits():
    e, rec = figure4("reserved", 1)
    assert [(b.request_id, b.phase, b.num_new_tokens) for b in rec.batch] == [("B", "decode", 1)]
    (w,) = rec.waiting
    assert w.request_id == "C"
    assert "needs 6 positions" in w.reason and "4 free" in w.reason and "14 reserved by B but unused" in w.reason
    assert rec.kv.used == 7 and rec.kv.reserved_unused == 13 and rec.kv.free == 4
    assert rec.kv.per_request["B"].used == 7 and rec.kv.per_request["B"].reserved_unused == 13
    cells = rec.kv.blocks
    assert sum(b.num_filled for b in cells) == 7 and sum(b.reserved for b in cells) == 13
    run_to_end(e)


@pytest.mark.parametrize("block_size", [1, 2])
def test_figure4_paged_b_and_c_together(block_size):
    e, rec = figure4("paged", block_size)
    assert [(b.request_id, b.phase, b.num_new_tokens) for b in rec.batch] == [("B", "decode", 1), ("C", "prefill", 6)]
    assert rec.num_batched_tokens == 1 + 6 == 7
    assert rec.kv.used == 7 + 6 == 13 and rec.kv.total == 24
    assert rec.waiting == []
    # Block-granular waste: B's 7 positions in blocks of 2 leave one empty position.
    assert rec.kv.partial_waste == (1 if block_size == 2 else 0)
    owners = {o for b in rec.kv.blocks for o in b.owners}
    assert owners == {"B", "C"}
    run_to_end(e)


def test_reserved_regions_first_fit_and_fragmentation():
    llm = LLM(
        "random", kv_allocation="reserved", block_size=1, num_kv_blocks=30, max_model_len=30, max_num_batched_tokens=64
    )
    e = llm.engine
    for rid, mt in (("a", 8), ("b", 2), ("c", 8)):
        e.add_request([3, 4], SamplingParams(max_tokens=mt, **GREEDY), request_id=rid)
    rec = e.step()
    assert e.kv.regions == {"a": (0, 10), "b": (10, 4), "c": (14, 10)}
    while "b" not in rec.finished:
        rec = e.step()
    # b's region is now a 4-position hole between a and c: free but fragmented.
    assert rec.kv.free == 30 - 20 and rec.kv.fragmentation == 4
    run_to_end(e)


# --- prefix caching -----------------------------------------------------------------------------


def test_prefix_caching_shared_system_prompt_saves_90_percent():
    trace = shared_prefix_trace(8, prefix_len=64, suffix_len=5, output_len=4, vocab_size=500, seed=0)
    llm = LLM("random", enable_prefix_caching=True, block_size=8, max_model_len=128, max_num_seqs=1)
    e = llm.engine
    submit_trace(e, trace)
    run_to_end(e)
    later = [e.requests[t.request_id] for t in trace[1:]]
    saved = sum(r.metrics.num_cached_tokens for r in later)
    assert saved >= 0.9 * 64 * len(later)
    st_ = e.kv.stats()
    assert st_["hit_blocks"] == 8 * len(later) and st_["prefill_tokens_saved"] == saved
    assert 0 < st_["hit_rate"] <= 1


def test_prefix_cache_always_computes_last_token():
    llm = LLM("random", enable_prefix_caching=True, block_size=4, max_model_len=64)
    e = llm.engine
    p = list(range(3, 11))  # 8 tokens: exactly two full blocks
    e.add_request(p, SamplingParams(max_tokens=2, **GREEDY), request_id="x")
    run_to_end(e)
    e.add_request(p, SamplingParams(max_tokens=2, **GREEDY), request_id="y")
    rec = e.step()
    assert rec.batch[0].num_computed_before == 4 and rec.batch[0].num_new_tokens == 4
    run_to_end(e)


def test_multi_turn_computes_only_new_tokens():
    llm = LLM("random", enable_prefix_caching=True, block_size=4, max_model_len=256)
    e = llm.engine
    sp = SamplingParams(max_tokens=8, **GREEDY)
    turn1 = list(range(3, 23))
    e.add_request(turn1, sp, request_id="t1")
    run_to_end(e)
    answer = e.get_output("t1").token_ids
    turn2 = turn1 + answer + [40, 41, 42, 43, 44]  # prompt + answer + new message
    e.add_request(turn2, sp, request_id="t2")
    rec = e.step()
    # Turn 1 computed KV for its prompt and 7 of its 8 answer tokens (27 positions):
    # 6 full blocks of 4 = 24 positions are reused; only what follows is prefilled.
    assert rec.batch[0].num_computed_before == 24
    assert rec.batch[0].num_new_tokens == len(turn2) - 24
    run_to_end(e)


def test_multi_turn_trace_hits_cache():
    trace = multi_turn_trace(2, turns=3, system_len=16, user_len=6, answer_len=6, vocab_size=300, seed=1)
    # Modeled time: turn k arrives k "think times" later on the engine's own clock, so the
    # test does not depend on how fast this machine is.
    e = LLM(
        "random", enable_prefix_caching=True, block_size=4, max_model_len=256, clock="modeled", cost_model=0.01
    ).engine
    submit_trace(e, trace)
    run_to_end(e)
    for t in trace:
        if t.turn and t.turn > 0:
            assert e.requests[t.request_id].metrics.num_cached_tokens >= 16


def test_prefix_eviction_lru_and_children_first():
    e = LLM("random", enable_prefix_caching=True, block_size=2, num_kv_blocks=6, max_model_len=12).engine
    e.add_request([3, 4, 5, 6, 7], SamplingParams(max_tokens=1, **GREEDY), request_id="a")
    run_to_end(e)
    pool = e.kv.pool
    order = list(pool.free_queue)
    a_blocks = [b for b in pool.blocks if b.block_hash is not None]
    assert len(a_blocks) == 2
    child = next(b for b in a_blocks if b.parent_hash is not None)
    parent = next(b for b in a_blocks if b.parent_hash is None)
    assert order.index(child.block_id) < order.index(parent.block_id)


# --- preemption ----------------------------------------------------------------------------------

PROMPTS = [[3 + i, 4 + i, 5 + i, 6 + i, 7 + i, 8 + i] for i in range(6)]


def outputs(**kw):
    llm = LLM("random", block_size=2, max_model_len=64, **kw)
    e = llm.engine
    ids = [e.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in PROMPTS]
    recs = run_to_end(e)
    return [e.get_output(i).token_ids for i in ids], recs, e


def test_greedy_identical_under_recompute_swap_prefix_and_no_pressure():
    base, _, _ = outputs()
    rec_out, recs, e = outputs(num_kv_blocks=20, preemption_mode="recompute")
    assert any(p.mode == "recompute" for r in recs for p in r.preempted)
    assert e.stats()["preemptions_recompute"] > 0 and e.stats()["recomputed_tokens"] > 0
    swap_out, recs_s, es = outputs(num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=40)
    assert any(p.mode == "swap" for r in recs_s for p in r.preempted)
    assert es.stats()["swapped_out_blocks"] > 0
    pc_out, _, _ = outputs(num_kv_blocks=20, enable_prefix_caching=True)
    assert base == rec_out == swap_out == pc_out


def test_swap_pool_full_falls_back_to_recompute():
    out, recs, e = outputs(num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=3)
    modes = {p.mode for r in recs for p in r.preempted}
    assert "recompute" in modes


def test_auto_mode_uses_the_cost_rule():
    from minillm.sim.costmodel import ConstantStepTime

    # Swapping costs nothing here, so the rule picks swap whenever the pool has room.
    cm = ConstantStepTime(0.01, swap_bandwidth=1e12, kv_bytes_per_token=1000)
    out, recs, e = outputs(num_kv_blocks=20, preemption_mode="auto", num_swap_blocks=40, clock="modeled", cost_model=cm)
    assert {p.mode for r in recs for p in r.preempted} == {"swap"}


def test_watermark_keeps_headroom():
    e = LLM("random", block_size=2, num_kv_blocks=20, watermark=0.25, max_model_len=64).engine
    for p in PROMPTS:
        e.add_request(p, SamplingParams(max_tokens=12, **GREEDY))
    rec = e.step()
    assert rec.kv.blocks_free >= 5
    assert any("headroom" in w.reason for w in rec.waiting)
    run_to_end(e)


def test_the_kv_manager_holds_the_watermark():
    """10 blocks of 4 positions, watermark 0.2: the manager keeps int(0.2 * 10) = 2 blocks free beside a
    new request (and beside a group's other samples), lets a running request grow into them, and brings
    a swapped-out request back only beside them (worked by hand)."""
    from minillm.core.kv_cache import PagedKVCacheManager
    from minillm.core.request import Request

    kv = PagedKVCacheManager(10, 4, num_swap_blocks=10, watermark=0.2)
    new = Request("new", list(range(32)), SamplingParams(max_tokens=4), 0.0)  # 32 positions: 8 blocks
    assert kv.can_allocate(new, 32) == (True, 8, 10)  # 8 <= 10 - 2
    assert kv.can_allocate(new, 32, reserve_blocks=1) == (False, 8, 10)  # 8 > 10 - 2 - 1
    assert not kv.can_allocate(new, 33)[0]  # 9 blocks > 10 - 2
    assert "(2 kept as headroom)" in kv.explain_wait(new, 33)
    assert kv.allocate(new, 32)
    new.num_computed_tokens = 32
    assert kv.can_allocate(new, 8) == (True, 2, 2)  # running: grows into the headroom
    assert kv.allocate(new, 8) and kv.num_free_blocks == 0
    new.num_computed_tokens = 40
    kv.swap_out(new)
    assert kv.can_swap_in(new, 1) == (False, 11, 10)  # 11 blocks for 41 positions; 10 - 2 usable
    kv.free(new)
    back = Request("back", list(range(20)), SamplingParams(max_tokens=4), 0.0)
    kv.allocate(back, 20)
    back.num_computed_tokens = 20
    kv.swap_out(back)  # 5 blocks in host memory, 10 free
    assert kv.can_swap_in(back, 4) == (True, 6, 10)  # 24 positions: 6 blocks <= 10 - 2
    assert kv.can_swap_in(back, 16) == (False, 9, 10)  # 36 positions: 9 blocks > 10 - 2


def test_a_full_table_grows_by_one_block_and_a_subclass_rule_still_decides():
    """4 blocks of 4 positions; a request holding 2 full blocks (8 positions computed): no new position
    takes nothing, one more takes one block; at 12 of 12, 4 more take the last block and 5 more (two blocks)
    are refused (worked by hand). A subclass that changes
    a sizing rule (every table needs one block more) is asked, not bypassed: its 3 full blocks need 2
    more for one position, and 1 is free."""
    from minillm.core.kv_cache import PagedKVCacheManager
    from minillm.core.request import Request

    class OneMore(PagedKVCacheManager):
        def blocks_for(self, num_tokens):
            return super().blocks_for(num_tokens) + 1

    kv = PagedKVCacheManager(4, 4)
    req = Request("r", list(range(8)), SamplingParams(max_tokens=8), 0.0)
    assert kv.allocate(req, 8) and kv.num_held_blocks("r") == 2
    req.num_computed_tokens = 8
    assert kv.allocate(req, 0) and kv.num_held_blocks("r") == 2
    assert kv.allocate(req, 1) and kv.num_held_blocks("r") == 3
    req.num_computed_tokens = 12
    assert not kv.allocate(req, 5) and kv.num_held_blocks("r") == 3  # 17 positions: 2 more blocks, 1 free
    assert kv.allocate(req, 4) and kv.num_held_blocks("r") == 4 and kv.num_free_blocks == 0
    kv = OneMore(4, 4)
    req = Request("r", list(range(8)), SamplingParams(max_tokens=8), 0.0)
    assert kv.allocate(req, 8) and kv.num_held_blocks("r") == 3
    req.num_computed_tokens = 12
    assert not kv.allocate(req, 1) and kv.num_held_blocks("r") == 3


# --- random workloads -------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_memory_workloads_keep_invariants(data):
    alloc = data.draw(st.sampled_from(["paged", "reserved"]))
    bs = data.draw(st.sampled_from([1, 2, 4]))
    caching = alloc == "paged" and data.draw(st.booleans())
    mode = data.draw(st.sampled_from(["recompute", "swap"]))
    nblocks = data.draw(st.integers(16, 48)) // bs + 2
    llm = LLM(
        "random",
        executor="simulated",
        kv_allocation=alloc,
        block_size=bs,
        num_kv_blocks=nblocks,
        enable_prefix_caching=caching,
        preemption_mode=mode,
        num_swap_blocks=data.draw(st.integers(0, 12)) if mode == "swap" else 0,
        max_num_batched_tokens=data.draw(st.integers(4, 24)),
        max_num_seqs=data.draw(st.integers(1, 5)),
        max_model_len=40,
        watermark=data.draw(st.sampled_from([0.0, 0.1])),
        clock="modeled",
        cost_model=0.01,
    )  # arrivals in modeled seconds: no real waiting
    e = llm.engine
    shared = [7] * data.draw(st.integers(0, 12))
    ids = []
    for i in range(data.draw(st.integers(1, 8))):
        p = shared + [3 + i] * data.draw(st.integers(1, 8))
        mt = data.draw(st.integers(1, 12))
        try:
            ids.append(
                e.add_request(
                    p, SamplingParams(max_tokens=mt, **GREEDY), arrival_time=float(data.draw(st.integers(0, 3)))
                )
            )
        except ValueError:
            pass  # cannot fit even alone: rejected with a reason
    abort = data.draw(st.sampled_from(ids)) if ids and data.draw(st.booleans()) else None
    steps = 0
    while e.has_unfinished_requests():
        rec = e.step()
        check_invariants(e, rec)
        steps += 1
        if steps == 2 and abort is not None:
            e.abort_request(abort)
        assert steps < 3000
    check_all_free(e)


def test_swap_counts_bytes():
    _, _, e = outputs(num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=40)
    st_ = e.stats()
    per_block = e.executor.bytes_per_block
    assert st_["swapped_bytes"] == (st_["swapped_out_blocks"] + st_["swapped_in_blocks"]) * per_block > 0


def test_block_pool_is_injected_through_the_config():
    """``EngineConfig.block_pool`` is the paged KV manager's pool factory: the engine's manager
    builds its pool with it (so a pool written elsewhere, exercise 04's, runs the real engine), hands
    out every block through it, and frees them all by the end; the config refuses a value that is
    not a factory, or a pool for a reservation."""
    from minillm.core.block_pool import BlockPool

    handed_out = []

    class CountingPool(BlockPool):
        def get_new_blocks(self, num_blocks):
            blocks = super().get_new_blocks(num_blocks)
            handed_out.extend(b.block_id for b in blocks)
            return blocks

    llm = LLM(
        model="random",
        executor="simulated",
        clock="modeled",
        cost_model=0.01,
        block_size=4,
        num_kv_blocks=32,
        enable_prefix_caching=True,
        block_pool=CountingPool,
    )
    assert type(llm.engine.kv.pool) is CountingPool and llm.engine.kv.pool.enable_caching
    outs = llm.generate([[5] * 10, [7] * 6], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert len(handed_out) >= 3 + 2  # the prompts' blocks (3 + 2), then growth
    check_all_free(llm.engine)
    with pytest.raises(TypeError, match="block_pool"):
        LLM(model="random", executor="simulated", block_pool="mine")
    with pytest.raises(ValueError, match="block_pool.*kv_allocation='paged'"):
        LLM(model="random", executor="simulated", kv_allocation="reserved", block_pool=CountingPool)
