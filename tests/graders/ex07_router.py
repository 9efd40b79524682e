"""Graders of notebook 07's exercises (``exercises/ex07_router.py``): ``make grade EX=07``.

The router's pieces are held against rings and loads worked by hand and against minillm's own
``minillm.sim.cluster`` on random rings, loads and keys (keys that sit exactly on a ring point
included); the whole router then runs at small scale over simulated replicas and must send every
request where minillm's ``PrefixAwareRouter`` sends it. The KV-transfer arithmetic is checked by
hand and by its defining inequality.
"""

from __future__ import annotations

import math
import random

import pytest

from minillm.sim import cluster
from minillm import impl
from minillm.analysis.workloads import Fixed, shared_prefix_trace


def ex():
    return impl.load("ex07_router")


# --- Exercise 1: prefix_key ---------------------------------------------------------------------------


def test_prefix_key_by_hand():
    f, h = ex().prefix_key, cluster.stable_hash
    a = list(range(100, 180))  # 5 full blocks of 16
    assert f(a, 16, 4) == h(a[:64])  # the first 4 blocks only
    assert f(a, 16, 2) == h(a[:32])
    assert f(a[:40], 16, 4) == h(a[:32])  # 2 full blocks; the partial one left out
    assert f(a[:5], 16, 4) == h(a[:5])  # no full block: the whole prompt
    assert f(a[:16], 16, 4) == h(a[:16])
    assert f(a, 8, 3) == h(a[:24])
    b = a[:64] + [1] * 16
    assert f(a, 16, 4) == f(b, 16, 4) and f(a, 16, 5) != f(b, 16, 5)


def test_prefix_key_matches_minillm_on_random_prompts():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(1, 120)
        toks = [rng.randrange(10, 500) for _ in range(n)]
        bs, pb = rng.choice([4, 8, 16]), rng.randrange(1, 6)
        assert ex().prefix_key(toks, bs, pb) == cluster.prefix_key(toks, bs, pb), (n, bs, pb)


# --- Exercise 2: route_on_ring -----------------------------------------------------------------------


def test_route_on_ring_by_hand():
    f = ex().route_on_ring
    ring = [(10, 0), (20, 1), (30, 2), (40, 1)]
    idle = [0, 0, 0]
    assert f(15, ring, idle) == 1
    assert f(20, ring, idle) == 1  # a point equal to the key counts
    assert f(21, ring, idle) == 2
    assert f(41, ring, idle) == 0  # past the last point: wrap around
    assert f(3, ring, idle) == 0
    assert f(15, ring, [0, 10, 2]) == 2  # mean 4, bound 5: replica 1 passed over
    assert f(15, ring, [0, 10, 8]) == 0  # 1 and 2 over 7.5: 1 met again, then wrap to 0
    assert f(15, ring, [0, 5, 7]) == 1  # exactly at the bound: taken
    assert f(35, ring, [9, 0, 0], load_factor=1.0) == 1
    assert f(15, ring, [0, 10, 2], load_factor=math.inf) == 1
    assert f(25, ring, [0, 0, 0], load_factor=math.inf) == 2  # unbounded, on an idle fleet
    assert f(45, ring, [30, 1, 1]) == 1  # wrap lands on 0 (over 13.3), next is 1
    assert f(15, ring, [3, 3, 3]) == 1  # equal loads: all within the bound


def test_route_on_ring_matches_minillm_at_random():
    rng = random.Random(11)
    for trial in range(400):
        n = rng.randrange(2, 7)
        ring = cluster.ring_points(n, rng.randrange(1, 6))
        loads = [rng.choice([0, 0, 1, 5, 20, 100]) * rng.random() for _ in range(n)]
        key = rng.choice([rng.randrange(2**64), ring[rng.randrange(len(ring))][0], 0, 2**64 - 1])
        lf = rng.choice([1.0, 1.25, 2.0, math.inf])
        assert ex().route_on_ring(key, ring, loads, lf) == cluster.route_on_ring(key, ring, loads, lf), (
            trial,
            key,
            loads,
            lf,
        )


def test_router_sends_every_request_where_minillm_does():
    trace = shared_prefix_trace(
        120,
        prefix_len=96,
        suffix_len=Fixed(20),
        output_len=Fixed(6),
        vocab_size=32000,
        rate=80.0,
        num_prefixes=9,
        seed=5,
    )
    mine, s_mine = cluster.run_replicas(trace, ex().ExerciseRouter(), 3, model="llama-2-7b")
    ref, s_ref = cluster.run_replicas(trace, cluster.PrefixAwareRouter(), 3, model="llama-2-7b")
    for a, b in zip(mine, ref):
        assert sorted(a.engine.requests) == sorted(b.engine.requests), (
            "your router must send each request to the replica PrefixAwareRouter picks"
        )
    assert s_mine["prefix_cache_hit_rate"] == s_ref["prefix_cache_hit_rate"], (
        f"prefix-cache hit rate {s_mine['prefix_cache_hit_rate']}, PrefixAwareRouter's {s_ref['prefix_cache_hit_rate']}"
    )


# --- Exercise 3: the KV transfer ----------------------------------------------------------------------


def test_kv_transfer_time_by_hand():
    f = ex().kv_transfer_time
    # Llama-2-13B (819,200 bytes per position), 1,000 positions over InfiniBand NDR (50 GB/s, 30 us).
    assert f(1000, 819_200, 50e9, 30e-6) == pytest.approx(0.016414)
    # Llama-2-7B (524,288 bytes), 2,048 positions over PCIe Gen5 (64 GB/s, 20 us): 16.797 ms.
    assert f(2048, 524_288, 64e9, 20e-6) == pytest.approx(20e-6 + 2048 * 524_288 / 64e9)
    assert f(0, 819_200, 50e9, 30e-6) == pytest.approx(30e-6)
    assert f(10, 100, 1000.0, 0.0) == pytest.approx(1.0)


def test_max_prompt_for_transfer_by_hand_and_by_its_definition():
    f, t = ex().max_prompt_for_transfer, cluster.kv_transfer_time
    # By hand: Llama-2-13B over InfiniBand, 30 us + 1,000 x 819,200 B / 50 GB/s = 16.414 ms
    # (kv_transfer_time's example).
    for budget, want in ((0.016414, 1000), (0.016413, 999)):
        got = f(budget, 819_200, 50e9, 30e-6)
        assert got == want, (
            f"a budget of {budget * 1e3:.3f} ms over InfiniBand (50 GB/s, 30 us) fits {want} positions of "
            f"Llama-2-13B's KV (30 us + {want} x 819,200 B / 50 GB/s <= the budget, worked by hand); yours says "
            f"{got}. Does your answer leave the fixed latency out of the budget, or round up?"
        )
    for budget in (1.0, 1.05):
        got = f(budget, 100, 1000.0, 0.0)
        assert got == 10, (
            f"a budget of {budget} s at 1,000 B/s, no latency, 100 B per position fits 10 positions (an 11th "
            f"needs 1.1 s); yours says {got}"
        )
    got = f(20e-6, 819_200, 50e9, 30e-6)
    assert got == 0, (
        f"a budget of 20 us is below the link's 30 us latency: nothing crosses, the answer is 0; yours says {got}"
    )
    # A budget that is exactly the time of 7 positions (NVLink, 128 KiB each): (budget - latency) x
    # bandwidth / bytes comes out a hair under 7 in floating point; the answer is still 7.
    budget7 = 10e-6 + 7 * 131_072 / 450e9
    got = f(budget7, 131_072, 450e9, 10e-6)
    assert got == 7, (
        f"the budget is exactly the transfer time of 7 positions (10 us + 7 x 131,072 B / 450 GB/s), so the "
        f"answer is 7; yours says {got} (the division lands a hair under 7 in floating point: check n + 1 with "
        "kv_transfer_time before you trust a floor)"
    )
    got = f(0.05, 524_288, 64e9, 20e-6)
    assert isinstance(got, int), (
        f"the answer is a number of positions, an int; yours returned {type(got).__name__} {got!r}"
    )
    link = cluster.LinkSpec("x", bandwidth=64e9, latency=20e-6)
    rng = random.Random(3)
    for _ in range(200):
        budget = rng.uniform(1e-5, 0.2)
        n = f(budget, 524_288, 64e9, 20e-6)
        assert n >= 0, f"budget {budget * 1e3:.4f} ms: a count of positions is never negative; yours says {n}"
        if n:
            assert t(n, 524_288, link) <= budget * (1 + 1e-12), (
                f"budget {budget * 1e3:.4f} ms over PCIe 5.0 (64 GB/s, 20 us): your {n} positions of Llama-2-7B's KV "
                f"take {t(n, 524_288, link) * 1e3:.4f} ms by minillm's kv_transfer_time, over the budget"
            )
        assert t(n + 1, 524_288, link) > budget * (1 - 1e-12), (
            f"budget {budget * 1e3:.4f} ms over PCIe 5.0 (64 GB/s, 20 us): {n + 1} positions still fit "
            f"({t(n + 1, 524_288, link) * 1e3:.4f} ms by minillm's kv_transfer_time), so {n} is not the largest"
        )
