"""Graders of notebook 04's exercises (``exercises/ex04_prefix_cache.py``): ``make grade EX=04``.

The hash and the lookup are held against minillm's own (``minillm.core.block_pool``,
``PagedKVCacheManager.find_cached_prefix``) on the caches real runs leave behind; the pool against
cases worked by hand; and all three together inside the engine: the same requests with minillm's
prefix cache and with yours must make the same decisions every step (the same hits, the same
evictions), keep the engine's invariants, and leak nothing. What an edit invalidates is held against
cases worked by hand and against the tokens minillm's prefix cache reuses for the edited prompt.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest

from minillm import LLM, SamplingParams, impl
from minillm.core import block_pool
from minillm.core.block_pool import Block, BlockPool
from minillm.core.kv_cache import PagedKVCacheManager
from minillm.core.block_pool import hash_block as engine_hash_block
from minillm.core.invariants import check_all_free, check_invariants
from minillm.analysis.workloads import multi_turn_trace, shared_prefix_trace, submit_trace

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ex():
    return impl.load("ex04_prefix_cache")


def _tripwire(*args, **kwargs):
    raise AssertionError(
        "your answer called the engine's own prefix cache (minillm.core.block_pool.hash_block, "
        "BlockPool's get_new_blocks / touch / free_blocks, or "
        "PagedKVCacheManager.find_cached_prefix): "
        "the exercise is to write it yourself"
    )


@contextlib.contextmanager
def _engine_prefix_cache_switched_off():
    """The engine's hash, lookup and block-pool moves raise while the block runs. (EvictingBlockPool
    inherits BlockPool: ``super().get_new_blocks(n)`` would be the engine's answer, not yours.)"""
    with pytest.MonkeyPatch.context() as mp:
        for f in (
            block_pool.hash_block,
            BlockPool.get_new_blocks,
            BlockPool.touch,
            BlockPool.free_blocks,
            BlockPool._evict,
            BlockPool._to_free_list,
            PagedKVCacheManager.find_cached_prefix,
        ):
            mp.setattr(f, "__code__", _tripwire.__code__)
        yield


def _engine_chain(tokens, bs):
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = engine_hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs]))
        out.append(parent)
    return out


# --- Exercise 1: hash_block, block_hashes ----------------------------------------------------------


def test_hash_block_is_the_engines_key():
    rng = random.Random(0)
    parent = None
    for _ in range(50):
        toks = [rng.randrange(1000) for _ in range(rng.choice((1, 4, 16)))]
        want = engine_hash_block(parent, tuple(toks))
        got = ex().hash_block(parent, toks)
        assert got == want, f"hash_block({parent}, {toks}): the engine's key is {want}, yours {got}"
        parent = want
    a, b = ex().hash_block(None, [1, 2, 3, 4]), ex().hash_block(12345, [1, 2, 3, 4])
    assert a != b, "the same tokens after a different parent must get a different key (the chain)"


def test_block_hashes_chain_full_blocks_only():
    rng = random.Random(1)
    for bs in (1, 2, 4, 16):
        for n in (0, 1, bs - 1, bs, 3 * bs + 1, 5 * bs):
            toks = [rng.randrange(500) for _ in range(max(0, n))]
            want = _engine_chain(toks, bs)
            got = ex().block_hashes(toks, bs)
            assert list(got) == want, (
                f"block_hashes of {len(toks)} tokens in blocks of {bs}: expected "
                f"{len(want)} chained keys (full blocks only), got {len(got)}: {got}"
            )
    toks = list(range(100, 132))
    base = ex().block_hashes(toks, 4)
    for pos in (0, 5, 17, 31):
        edited = list(toks)
        edited[pos] += 1
        h = ex().block_hashes(edited, 4)
        first = pos // 4
        assert h[:first] == base[:first], f"editing token {pos} must not change the keys of blocks before {first}"
        assert all(x != y for x, y in zip(h[first:], base[first:])), (
            f"editing token {pos} must change the key of block {first} and of every block after it"
        )


# --- Exercise 2: longest_prefix_match ---------------------------------------------------------------


def _cache_after(prompts, bs, blocks=64):
    e = LLM(
        "random",
        executor="simulated",
        enable_prefix_caching=True,
        block_size=bs,
        num_kv_blocks=blocks,
        max_model_len=256,
        max_num_seqs=2,
    ).engine
    for p in prompts:
        e.add_request(p, SamplingParams(max_tokens=3, **GREEDY))
    e.run()
    return e


def test_longest_prefix_match_agrees_with_the_engine():
    rng = random.Random(2)
    system = [rng.randrange(10, 500) for _ in range(20)]
    prompts = [system + [rng.randrange(10, 500) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    for bs in (2, 4, 8):
        e = _cache_after(prompts, bs)
        queries = prompts + [
            system,
            system[:bs],
            system[: 2 * bs],
            system[: 2 * bs + 1],
            system + [7] * 10,
            [1] + system[1:],
            system[:5] + [3] + system[6:],
            [9] * 30,
            list(prompts[0]) + [5, 6],
        ]
        for q in queries:
            want = [b.block_id for b in e.kv.find_cached_prefix(SimpleNamespace(all_token_ids=list(q)))]
            got = [b.block_id for b in ex().longest_prefix_match(list(q), bs, e.kv.pool.cached)]
            assert got == want, (
                f"block size {bs}, a query of {len(q)} tokens: the engine reuses blocks {want}, "
                f"your longest_prefix_match returned {got}"
            )


def test_longest_prefix_match_never_reuses_the_last_token():
    e = _cache_after([list(range(10, 18))], 4)  # two full blocks cached
    got = ex().longest_prefix_match(list(range(10, 18)), 4, e.kv.pool.cached)
    assert len(got) == 1, (
        "an 8-token prompt in blocks of 4 may reuse at most (8 - 1) // 4 = 1 block: its last "
        f"token must be computed for its logits; got {len(got)} blocks"
    )


def test_longest_prefix_match_guards_against_collisions():
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    h0 = engine_hash_block(None, (5, 6, 7, 8))
    impostor = Block(3)
    impostor.block_hash, impostor.token_ids, impostor.parent_hash = h0, (1, 2, 3, 4), None
    got = ex().longest_prefix_match(toks, 4, {h0: impostor})
    assert got == [], "a block found under the key but holding other tokens is a hash collision, not a hit"
    real = Block(4)
    real.block_hash, real.token_ids, real.parent_hash = h0, (5, 6, 7, 8), None
    h1 = engine_hash_block(h0, (9, 10, 11, 12))
    orphan = Block(5)
    orphan.block_hash, orphan.token_ids, orphan.parent_hash = h1, (9, 10, 11, 12), 999
    got = ex().longest_prefix_match(toks, 4, {h0: real, h1: orphan})
    assert [b.block_id for b in got] == [4], (
        "block 1 is found under its key but records another parent: "
        f"only block 0 is a hit; got {[b.block_id for b in got]}"
    )


def test_longest_prefix_match_stops_at_the_first_miss():
    """Blocks 0 and 2 of a prompt are cached, block 1 is not: only block 0 can be reused (block 2's KV
    was computed after block 1's tokens, whose KV is not there)."""
    toks = list(range(40, 53))
    keys = _engine_chain(toks, 4)
    cached = {}
    for i in (0, 2):
        b = Block(10 + i)
        b.block_hash, b.token_ids, b.parent_hash = keys[i], tuple(toks[4 * i : 4 * i + 4]), keys[i - 1] if i else None
        cached[keys[i]] = b
    got = [b.block_id for b in ex().longest_prefix_match(toks, 4, cached)]
    assert got == [10], f"blocks 0 and 2 cached, block 1 missing: expected only block 0 (id 10), got ids {got}"


# --- Exercise 3: EvictingBlockPool ------------------------------------------------------------------


def test_pool_counts_references_and_evicts_lru_by_hand():
    pool = ex().EvictingBlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id, a.ref_count) == (0, 1, 1), (
        f"a fresh pool hands out the front of its free queue with ref_count 1: got ids {a.block_id}, {b.block_id}, "
        f"ref_count {a.ref_count}"
    )
    keys: list = []
    pool.cache_full_blocks([a, b], keys, (1, 2, 3, 4), 2, 2)  # a request's table [a, b], blocks of 2
    h0, h1 = keys
    pool.free_blocks([a, b])
    assert list(pool.free_queue) == [2, 3, 1, 0], (
        f"freed last block first, at the back of the queue: expected free queue [2, 3, 1, 0], got "
        f"{list(pool.free_queue)}"
    )
    assert a.block_hash == h0 and pool.get_cached_block(h0) is a, "a freed block keeps its cached prefix"
    pool.touch([a])
    pool.touch([a])
    assert a.ref_count == 2 and a.block_id not in pool.free_queue, (
        f"two hits on block 0: expected ref_count 2 and out of the free queue, got ref_count {a.ref_count}, "
        f"free={a.block_id in pool.free_queue}"
    )
    pool.free_blocks([a])
    assert a.ref_count == 1 and a.block_id not in pool.free_queue, "still held by one request"
    pool.free_blocks([a])
    assert list(pool.free_queue) == [2, 3, 1, 0], f"block 0 back at the end: got {list(pool.free_queue)}"
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)
    assert list(pool.free_queue) == [2, 3, 1, 0], "asking for more blocks than are free must hand out none"
    got = [blk.block_id for blk in pool.get_new_blocks(3)]
    assert got == [2, 3, 1], f"LRU: expected blocks 2, 3, then 1, got {got}"
    assert b.block_hash is None and b.token_ids is None and b.parent_hash is None, (
        "handing out block 1 again must evict its cached prefix (clear its hash fields)"
    )
    assert pool.get_cached_block(h1) is None and pool.stats["evictions"] == 1, (
        f"the evicted prefix must leave the cache index and be counted: evictions={pool.stats['evictions']}"
    )
    assert pool.get_cached_block(h0) is a, "block 0 was not evicted: its prefix is still cached"
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[0], pool.blocks[0]])
    fresh = ex().EvictingBlockPool(1)
    fresh.get_new_blocks(1)
    with pytest.raises(RuntimeError):
        fresh.get_new_blocks(1)


def test_evict_leaves_another_canonical_copy_alone():
    pool = ex().EvictingBlockPool(3)
    a, b = pool.get_new_blocks(2)
    keys: list = []
    pool.cache_full_blocks([a], keys, (7, 7), 1, 2)
    pool.cache_full_blocks([b], [], (7, 7), 1, 2)  # the same prefix written twice: a is canonical
    pool.free_blocks([b])
    pool.free_blocks([a])
    pool.get_new_blocks(1)  # block 2 (never cached)
    pool.get_new_blocks(1)  # block 1 (b): evicted
    assert pool.cached.get(keys[0]) is a, "evicting a duplicate copy must not remove the canonical block from the index"
    assert pool.stats["evictions"] == 1, (
        f"evicting the duplicate copy counts one eviction; stats['evictions'] = {pool.stats['evictions']}"
    )


# --- All three, inside the engine ----------------------------------------------------------------------


def _digest(rec, eng):
    st = eng.kv.stats()
    return dict(
        batch=[(e.request_id, e.phase, e.num_new_tokens, e.num_computed_before) for e in rec.batch],
        admitted=list(rec.admitted),
        finished=sorted(rec.finished),
        preempted=[p.request_id for p in rec.preempted],
        waiting=[w.request_id for w in rec.waiting],
        kv_used=rec.kv.used,
        kv_free=rec.kv.free,
        kv_cached=rec.kv.cached,
        hits=st["hit_blocks"],
        evictions=st["evictions"],
    )


def _compare(cfg, add, what):
    ref = LLM(model="random", enable_prefix_caching=True, **cfg).engine
    yours = ex().prefix_engine(model="random", **cfg).engine
    assert isinstance(yours.kv.pool, ex().EvictingBlockPool)
    add(ref)
    add(yours)
    steps = 0
    while ref.has_unfinished_requests() or yours.has_unfinished_requests():
        assert ref.has_unfinished_requests() and yours.has_unfinished_requests(), (
            f"{what}: after {steps} steps one engine has finished and the other has not"
        )
        a, b = ref.step(), yours.step()
        check_invariants(yours, b)
        da, db = _digest(a, ref), _digest(b, yours)
        assert da == db, f"{what}, step {steps}: with minillm's prefix cache\n  {da}\nwith yours\n  {db}"
        steps += 1
    check_all_free(yours)
    return ref.kv.stats()


def test_your_prefix_cache_in_the_engine_shared_system_prompt():
    trace = shared_prefix_trace(
        12, prefix_len=24, suffix_len=6, output_len=5, vocab_size=500, rate=200, num_prefixes=2, seed=3
    )
    for bs, blocks in ((4, 40), (4, 18), (8, 12)):  # roomy, then tight: evictions and preemptions
        cfg = dict(
            executor="simulated",
            block_size=bs,
            num_kv_blocks=blocks,
            max_num_seqs=3,
            max_num_batched_tokens=32,
            max_model_len=64,
            clock="modeled",
            cost_model=0.01,
        )
        st = _compare(cfg, lambda e: submit_trace(e, trace), f"shared prompts, block {bs}, {blocks} blocks")
        assert st["hit_blocks"] > 0


def test_your_prefix_cache_in_the_engine_multi_turn():
    trace = multi_turn_trace(
        3, turns=3, system_len=12, user_len=5, answer_len=4, vocab_size=300, seed=4, think_time=0.05
    )
    cfg = dict(
        executor="simulated",
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=3,
        max_num_batched_tokens=24,
        max_model_len=128,
        clock="modeled",
        cost_model=0.01,
    )
    st = _compare(cfg, lambda e: submit_trace(e, trace), "multi-turn conversations")
    assert st["hit_blocks"] > 0 and st["evictions"] > 0


def test_your_prefix_cache_is_your_own():
    """Your three pieces, by hand and inside the engine, with the engine's own switched off."""
    trace = shared_prefix_trace(
        8, prefix_len=16, suffix_len=5, output_len=4, vocab_size=300, rate=200, num_prefixes=2, seed=5
    )
    cfg = dict(
        executor="simulated",
        block_size=4,
        num_kv_blocks=16,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        max_model_len=64,
        clock="modeled",
        cost_model=0.01,
    )
    toks = list(range(20, 33))
    with _engine_prefix_cache_switched_off():
        keys = ex().block_hashes(toks, 4)
        pool = ex().EvictingBlockPool(2)
        (a,) = pool.get_new_blocks(1)
        pool.cache_full_blocks([a], [], toks, 1, 4)
        pool.free_blocks([a])
        pool.touch([a])
        pool.free_blocks([a])
        pool.get_new_blocks(2)
        eng = ex().prefix_engine(model="random", **cfg).engine
        submit_trace(eng, trace)
        while eng.has_unfinished_requests():
            eng.step()  # (the invariant checks use the engine's hash: checked elsewhere)
    check_all_free(eng)
    assert keys == _engine_chain(toks, 4), "block_hashes under the switch-off: not the engine's keys"
    assert pool.stats["evictions"] == 1 and a.block_hash is None, "the cached block handed out again is evicted"
    assert eng.kv.stats()["hit_blocks"] > 0, "(the trace must hit the prefix cache)"


def test_your_prefix_cache_runs_the_real_model():
    """Reused KV must be the right KV: greedy tokens with your cache equal those without any cache."""
    system = list(range(30, 50))
    prompts = [system + [60 + i, 61 + i, 62 + i] for i in range(4)]
    sp = SamplingParams(max_tokens=5, **GREEDY)
    cfg = dict(block_size=4, num_kv_blocks=40, max_num_seqs=1, max_model_len=64)
    want = [o.token_ids for o in LLM(model="random", **cfg).generate(prompts, sp)]
    llm = ex().prefix_engine(model="random", **cfg)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want, f"greedy tokens with your prefix cache {got} differ from those without a cache {want}"
    assert llm.engine.kv.stats()["hit_blocks"] == 3 * 5, "requests 2-4 should each reuse the 5 system-prompt blocks"


# --- Exercise 5: what an edit invalidates --------------------------------------------------------------

# (num_tokens, edited positions, block size) -> tokens reused, worked by hand
EDITS_BY_HAND = [
    ((2048, [300], 16), 288),
    ((2048, [0], 16), 0),
    ((2048, [15], 16), 0),
    ((2048, [16], 16), 16),
    ((2048, [2040], 16), 2032),
    ((2048, [], 16), 2032),
    ((2049, [], 16), 2048),
    ((2048, [1900, 20], 16), 16),
    ((40, [], 16), 32),
    ((32, [31], 16), 16),
    ((10, [9], 4), 8),
    ((10, [4, 9], 4), 4),
    ((3, [], 4), 0),
    ((8, [7], 1), 7),
]


def test_tokens_reused_after_edit_by_hand():
    for (n, edited, bs), want in EDITS_BY_HAND:
        got = ex().tokens_reused_after_edit(n, list(edited), bs)
        assert got == want, (
            f"a {n}-token prompt cached in blocks of {bs}, sent again with positions {edited} "
            f"changed: expected {want} tokens reused, got {got}"
        )
    for bad, named in (([48], "48"), ([-1], "-1"), ([3, 48], "48")):
        with pytest.raises(ValueError, match=named):
            ex().tokens_reused_after_edit(48, bad, 16)


def _engine_reuse(n, edited, bs):
    """The engine's answer: a fresh prefix-caching engine runs the prompt, then its edited copy."""
    llm = LLM(
        model="random",
        executor="simulated",
        enable_prefix_caching=True,
        block_size=bs,
        num_kv_blocks=2 * n // bs + 8,
        max_model_len=2 * n + 16,
        max_num_batched_tokens=max(n + 8, 64),
        record="summary",
    )
    prompt = [1 + i % 250 for i in range(n)]
    changed = list(prompt)
    for p in edited:
        changed[p] = 300 + p % 100
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.engine.add_request(prompt, sp, request_id="original")
    llm.engine.run()
    llm.engine.add_request(changed, sp, request_id="edited")
    llm.engine.run()
    check_all_free(llm.engine)
    return llm.engine.requests["edited"].metrics.num_cached_tokens


def test_tokens_reused_after_edit_matches_the_engine():
    """The real prefix cache, on random edits: one or more changed tokens, or none."""
    rng = random.Random(18)
    cases = [(200, [], 16), (200, [199], 16), (64, [63], 16), (64, [47, 50], 16)]
    for _ in range(12):
        n, bs = rng.randint(9, 300), rng.choice((4, 8, 16))
        cases.append((n, sorted(rng.sample(range(n), rng.randint(0, 3))), bs))
    for n, edited, bs in cases:
        got = ex().tokens_reused_after_edit(n, list(edited), bs)
        want = _engine_reuse(n, edited, bs)
        assert got == want, (
            f"a {n}-token prompt in blocks of {bs}, positions {edited} changed: minillm's prefix "
            f"cache reuses {want} tokens, yours says {got}"
        )
