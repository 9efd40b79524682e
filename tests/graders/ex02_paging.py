"""Graders of notebook 02's exercises (``exercises/ex02_paging.py``): ``make grade EX=02``.

The allocators are graded twice: on their own (small cases worked by hand,
Figure 4 of notebook 02), and inside the engine: the same requests run with minillm's own KV manager and
with yours must give the same steps, pass the engine's invariant checks after every step,
and leave nothing allocated at the end.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest

from minillm import LLM, SamplingParams, impl
from minillm.core.block_pool import BlockPool
from minillm.core.reserved_kv_cache import ReservedKVCacheManager
from minillm.core.invariants import check_all_free, check_invariants

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ex():
    return impl.load("ex02_paging")


def _tripwire(*args, **kwargs):
    raise AssertionError(
        "your allocator called the engine's own (minillm.core.block_pool.BlockPool or "
        "ReservedKVCacheManager._gaps); the exercise is to write it yourself"
    )


@contextlib.contextmanager
def _engine_allocators_switched_off():
    """The engine's block pool and gap finder raise while the block runs (your classes are untouched)."""
    with pytest.MonkeyPatch.context() as mp:
        for f in (
            BlockPool.get_new_blocks,
            BlockPool.touch,
            BlockPool.free_blocks,
            BlockPool._to_free_list,
            ReservedKVCacheManager._gaps,
        ):
            mp.setattr(f, "__code__", _tripwire.__code__)
        yield


def _workload(engine, seed, n=10, max_prompt=20, max_out=12):
    rng = random.Random(seed)
    for i in range(n):
        engine.add_request(
            [10 + (i * 7 + j) % 400 for j in range(rng.randint(1, max_prompt))],
            SamplingParams(max_tokens=rng.randint(1, max_out), **GREEDY),
            request_id=f"r{i}",
            arrival_time=0.0,
        )


def _digest(rec):
    """What a step decided, without block ids (an allocator may hand out other ids)."""
    return dict(
        batch=[(e.request_id, e.phase, e.num_new_tokens) for e in rec.batch],
        admitted=list(rec.admitted),
        finished=sorted(rec.finished),
        preempted=[p.request_id for p in rec.preempted],
        waiting=[w.request_id for w in rec.waiting],
        kv_used=rec.kv.used,
        kv_free=rec.kv.free,
        blocks_free=rec.kv.blocks_free,
    )


def _compare_runs(reference, yours, what):
    steps = 0
    while reference.has_unfinished_requests() or yours.has_unfinished_requests():
        assert reference.has_unfinished_requests() and yours.has_unfinished_requests(), (
            f"{what}: after {steps} steps one engine has finished and the other has not"
        )
        a, b = reference.step(), yours.step()
        check_invariants(yours, b)
        da, db = _digest(a), _digest(b)
        assert da == db, (
            f"{what}, step {steps}: minillm's own KV manager decided\n  {da}\nwith yours the "
            f"engine decided\n  {db}\n(waiting reasons with yours: "
            f"{[w.reason for w in b.waiting]})"
        )
        steps += 1
    check_all_free(yours)
    return steps


# --- Exercise 1: blocks_needed ---------------------------------------------------------------


def test_blocks_needed_by_hand():
    for bs in (1, 2, 3, 4, 16, 32):
        for n in range(0, 70):
            want = math.ceil(n / bs)
            got = ex().blocks_needed(n, bs)
            assert got == want, f"blocks_needed({n}, block_size={bs}): expected {want}, got {got}"


def test_blocks_needed_matches_the_engines_block_tables():
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
    )
    _workload(llm.engine, seed=5)
    seen = 0
    while llm.engine.has_unfinished_requests():
        rec = llm.engine.step()
        for rid, rk in rec.kv.per_request.items():
            got = ex().blocks_needed(rk.used, 4)
            assert got == rk.num_blocks, (
                f"step {rec.step}: request {rid} holds {rk.used} positions of KV in "
                f"{rk.num_blocks} blocks of 4; blocks_needed({rk.used}, 4) gave {got}"
            )
            seen += 1
    assert seen


# --- Exercise 2: partial_block_waste ----------------------------------------------------------------


def test_partial_block_waste_by_hand():
    f = ex().partial_block_waste
    for lens, bs, want in (([5, 16, 17], 16, 26), ([], 16, 0), ([1, 2, 3], 1, 0), ([0], 8, 0), ([7], 8, 1)):
        got = f(lens, bs)
        assert got == want, f"partial_block_waste({lens}, block_size={bs}): expected {want}, got {got}"


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_partial_block_waste_matches_the_engines_kv_snapshot(block_size):
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=block_size,
        num_kv_blocks=256 // block_size,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        max_model_len=64,
    )
    _workload(llm.engine, seed=block_size)
    while llm.engine.has_unfinished_requests():
        rec = llm.engine.step()
        lens = [rk.used for rk in rec.kv.per_request.values()]
        got = ex().partial_block_waste(lens, block_size)
        assert got == rec.kv.partial_waste, (
            f"step {rec.step}: requests hold {lens} positions in blocks of {block_size}; the engine counts "
            f"{rec.kv.partial_waste} empty positions in their last blocks, partial_block_waste gave {got}"
        )


# --- Exercise 3: BlockAllocator ------------------------------------------------------------------------


def test_block_allocator_hands_out_and_takes_back():
    a = ex().BlockAllocator(4)
    got = a.get_new_blocks(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3], (
        f"a fresh allocator hands out blocks from the front of its free queue: expected ids [0, 1, 2, 3], "
        f"got {[b.block_id for b in got]}"
    )
    assert all(b.ref_count == 1 for b in got), f"an allocated block has ref_count 1, got {[b.ref_count for b in got]}"
    assert a.num_free == 0, f"after handing out all 4 blocks num_free should be 0, got {a.num_free}"
    with pytest.raises(RuntimeError):
        a.get_new_blocks(1)
    a.free_blocks([got[1], got[2]])
    assert a.num_free == 2 and got[1].ref_count == 0 and got[2].ref_count == 0, (
        f"freeing blocks 1 and 2: expected 2 free with ref_count 0, got num_free={a.num_free}, "
        f"ref_counts={[got[1].ref_count, got[2].ref_count]}"
    )
    with pytest.raises(RuntimeError):
        a.get_new_blocks(3)
    assert a.num_free == 2, f"asking for 3 blocks with 2 free must hand out none; num_free is now {a.num_free}"
    (nxt,) = a.get_new_blocks(1)
    assert nxt.block_id == 2, (
        f"a block table is freed last block first, so block 2 joins the free queue before "
        f"block 1 and is handed out first; got block {nxt.block_id}"
    )


def test_block_allocator_counts_references():
    a = ex().BlockAllocator(3)
    (b,) = a.get_new_blocks(1)
    b.ref_count += 1  # a second request shares it (a prefix-cache hit, notebook 04)
    a.free_blocks([b])
    assert b.ref_count == 1 and b.block_id not in a.free_queue and a.num_free == 2, (
        f"a block held by two requests stays in use when one frees it: expected ref_count 1 and not free, got "
        f"ref_count {b.ref_count}, free={b.block_id in a.free_queue}"
    )
    a.free_blocks([b])
    assert b.ref_count == 0 and b.block_id in a.free_queue and a.num_free == 3, (
        "when its last holder frees it, the block is free again"
    )
    with pytest.raises(RuntimeError):
        a.free_blocks([b])


def test_block_allocator_in_the_engine():
    """The same requests, minillm's allocator vs yours, with preemptions (a tight cache)."""
    for seed, (bs, blocks) in enumerate(((1, 40), (4, 12), (16, 5))):
        cfg = dict(
            executor="simulated",
            block_size=bs,
            num_kv_blocks=blocks,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            max_model_len=64,
        )
        ref = LLM(model="random", **cfg).engine
        yours = ex().paged_engine(model="random", **cfg).engine
        assert isinstance(yours.kv.pool, ex().BlockAllocator)
        for e in (ref, yours):
            _workload(e, seed=seed, max_prompt=min(20, bs * blocks // 2), max_out=8)
        _compare_runs(ref, yours, f"paged, block_size={bs}, {blocks} blocks")


def test_block_allocator_runs_the_real_model():
    """Your allocator under the real forward pass: the same greedy tokens as minillm's own."""
    prompts = [[11, 12, 13, 14, 15], [20, 21, 22], [30] * 9]
    sp = SamplingParams(max_tokens=6, **GREEDY)
    cfg = dict(block_size=4, num_kv_blocks=16, max_num_seqs=3, max_model_len=64)
    want = [o.token_ids for o in LLM(model="random", **cfg).generate(prompts, sp)]
    got = [o.token_ids for o in ex().paged_engine(model="random", **cfg).generate(prompts, sp)]
    assert got == want, f"greedy tokens with your allocator {got} differ from minillm's {want}"


def test_your_allocators_are_your_own():
    """Both allocators, by hand and inside the engine, with the engine's own switched off."""
    cfg = dict(
        executor="simulated",
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=64,
    )
    with _engine_allocators_switched_off():
        a = ex().BlockAllocator(3)
        got = [b.block_id for b in a.get_new_blocks(3)]
        f = ex().FirstFitAllocator(16)
        starts = [f.reserve("A", 4), f.reserve("B", 4)]
        f.release("A")
        gaps = f.gaps()
        for make, what in ((ex().paged_engine, "paged"), (ex().reserved_engine, "reserved")):
            eng = make(model="random", **cfg).engine
            _workload(eng, seed=3, max_prompt=12, max_out=8)
            while eng.has_unfinished_requests():
                check_invariants(eng, eng.step())
            check_all_free(eng)
    assert got == [0, 1, 2] and starts == [0, 4] and gaps == [(0, 4), (8, 8)], (got, starts, gaps)


# --- Exercise 4: FirstFitAllocator ----------------------------------------------------------------------


def test_first_fit_gaps():
    a = ex().FirstFitAllocator(24)
    cases = [
        ({}, [(0, 24)]),
        ({"B": (0, 20)}, [(20, 4)]),
        ({"A": (4, 4), "B": (12, 12)}, [(0, 4), (8, 4)]),
        ({"A": (16, 8), "B": (0, 8)}, [(8, 8)]),
        ({"A": (0, 24)}, []),
    ]
    for regions, want in cases:
        a.regions = dict(regions)
        got = a.gaps()
        assert list(got) == want, f"gaps() of capacity 24 with regions {regions}: expected {want}, got {got}"


def test_first_fit_reserve_and_release():
    a = ex().FirstFitAllocator(24)
    assert a.reserve("B", 20) == 0, "the first reservation starts at position 0"
    assert a.regions == {"B": (0, 20)}, f"reserve must record the region: expected {{'B': (0, 20)}}, got {a.regions}"
    got = a.reserve("C", 6)
    assert got is None and "C" not in a.regions, (
        f"Figure 4: B holds 20 of 24 positions, so C's 6 cannot be reserved: expected None, got {got}"
    )
    assert a.largest_gap() == 4, f"after B's 20 of 24 positions, the largest gap is 4, got {a.largest_gap()}"
    with pytest.raises(RuntimeError):
        a.reserve("B", 2)
    a.release("B")
    a.release("B")  # releasing twice changes nothing
    assert a.regions == {} and a.gaps() == [(0, 24)]
    # Fragmentation: 16 free positions, but in two gaps of 8.
    assert [a.reserve(r, 8) for r in "XYZ"] == [0, 8, 16]
    a.release("X")
    a.release("Z")
    got = a.reserve("W", 10)
    assert got is None, (
        f"16 positions are free but the largest gap is 8: a 10-position reservation must fail, got {got}"
    )
    assert a.reserve("V", 5) == 0, "first fit: the lowest gap that holds 5 positions starts at 0"
    assert a.reserve("U", 8) == 16, "first fit: the gap at 5..7 is too small, so 8 positions go to 16"


def test_first_fit_takes_the_lowest_gap_not_the_tightest_or_the_largest():
    """Gaps of 6 at 0, 3 at 10 and 7 at 23: a 3-position request goes to 0 (first fit), not to the
    exact fit at 10 (best fit) nor to the largest gap at 23 (worst fit)."""
    a = ex().FirstFitAllocator(30)
    starts = [a.reserve(r, n) for r, n in (("a", 6), ("b", 4), ("c", 3), ("d", 8), ("e", 2))]
    assert starts == [0, 6, 10, 13, 21], (
        f"five reservations into an empty space: expected [0, 6, 10, 13, 21], got {starts}"
    )
    a.release("a")
    a.release("c")
    assert a.gaps() == [(0, 6), (10, 3), (23, 7)], f"expected gaps [(0, 6), (10, 3), (23, 7)], got {a.gaps()}"
    got = [a.reserve("x", 3), a.reserve("y", 3), a.reserve("z", 3), a.reserve("w", 5)]
    assert got == [0, 3, 10, 23], (
        f"first fit: each reservation goes to the lowest gap that holds it, so 3, 3, 3 "
        f"and 5 positions start at [0, 3, 10, 23]; got {got}"
    )


def test_first_fit_figure4_in_the_engine():
    """Figure 4 with your allocator: B (5-token prompt, max_tokens 15) reserves 20 of 24; after two steps
    C (6-token prompt) cannot be admitted."""
    llm = ex().reserved_engine(
        model="random",
        executor="simulated",
        block_size=1,
        num_kv_blocks=24,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        max_model_len=64,
    )
    eng = llm.engine
    eng.add_request(list(range(10, 15)), SamplingParams(max_tokens=15, **GREEDY), request_id="B")
    eng.step()
    eng.step()
    eng.add_request(list(range(20, 26)), SamplingParams(max_tokens=4, **GREEDY), request_id="C")
    rec = eng.step()
    check_invariants(eng, rec)
    assert rec.kv.used == 7 and rec.kv.reserved_unused == 13, (
        f"after B's third step: expected 7 positions of KV and 13 reserved but unused, got {rec.kv.used} and "
        f"{rec.kv.reserved_unused}"
    )
    assert [e.request_id for e in rec.batch] == ["B"] and [w.request_id for w in rec.waiting] == ["C"], (
        f"C must wait (only 4 positions are free): batch {[e.request_id for e in rec.batch]}, waiting "
        f"{[(w.request_id, w.reason) for w in rec.waiting]}"
    )


def test_first_fit_in_the_engine():
    """The same requests, minillm's reservation vs yours."""
    for seed, cap in enumerate((48, 64, 96)):
        cfg = dict(
            executor="simulated",
            block_size=1,
            num_kv_blocks=cap,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            max_model_len=64,
        )
        ref = LLM(model="random", kv_allocation="reserved", **cfg).engine
        yours = ex().reserved_engine(model="random", **cfg).engine
        for e in (ref, yours):
            _workload(e, seed=10 + seed, max_prompt=16, max_out=24)
        _compare_runs(ref, yours, f"reserved, capacity {cap}")
