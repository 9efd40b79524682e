"""Replicas behind a router and disaggregated prefill/decode (minillm/sim/cluster.py), on small traces.

Routing decisions are checked against rings and loads worked by hand; the runs check what must
hold whatever the timing: every request finishes with its length, a shared prefix meets its
cache, and a decode never starts before its KV has landed.
"""

import math

import pytest

from minillm.sim.cluster import (
    KVArrivedCostModel,
    LeastOutstandingTokensRouter,
    Load,
    PrefixAwareRouter,
    RoundRobinRouter,
    kv_transfer_time,
    prefix_key,
    route_on_ring,
    run_colocated,
    run_disaggregated,
    run_replicas,
    stable_hash,
)
from minillm.sim.costmodel import RooflineCostModel
from minillm.analysis.workloads import Fixed, shared_prefix_trace, synthetic_trace


def test_prefix_key_reads_only_the_first_full_blocks():
    a = list(range(100, 180))  # 80 tokens = 5 blocks of 16
    b = a[:64] + [7] * 16  # same first 4 blocks, different 5th
    c = [1] + a[1:]  # differs in the first token
    assert prefix_key(a, 16, 4) == prefix_key(b, 16, 4) == stable_hash(a[:64])
    assert prefix_key(a, 16, 4) != prefix_key(c, 16, 4)
    assert prefix_key(a, 16, 5) != prefix_key(b, 16, 5)
    assert prefix_key(a[:40], 16, 4) == stable_hash(a[:32])  # 2 full blocks, the partial one left out
    assert prefix_key(a[:5], 16, 4) == stable_hash(a[:5])  # no full block: the whole prompt
    assert stable_hash([1, 2, 3]) == stable_hash((1, 2, 3)) != stable_hash([1, 2, 4])


def test_route_on_ring_by_hand():
    ring = [(10, 0), (20, 1), (30, 2), (40, 1)]
    idle = [0, 0, 0]
    assert route_on_ring(15, ring, idle) == 1
    assert route_on_ring(20, ring, idle) == 1  # a point at the key itself is "at or after"
    assert route_on_ring(25, ring, idle) == 2
    assert route_on_ring(41, ring, idle) == 0  # past the last point: wrap around
    assert route_on_ring(5, ring, idle) == 0
    # loads 0, 10, 2: mean 4, bound 1.25 * 4 = 5. Replica 1 is over it: the walk goes on to 2.
    assert route_on_ring(15, ring, [0, 10, 2]) == 2
    # loads 0, 10, 8: mean 6, bound 7.5; replicas 1 and 2 are over it: the walk passes 1 again
    # (at 40, already seen), wraps, and takes 0.
    assert route_on_ring(15, ring, [0, 10, 8]) == 0
    # at exactly the bound a replica is still taken: loads 0, 5, 7 -> mean 4, bound 5.
    assert route_on_ring(15, ring, [0, 5, 7]) == 1
    assert route_on_ring(15, ring, [0, 10, 2], load_factor=math.inf) == 1  # unbounded


def test_round_robin_and_least_tokens():
    rr = RoundRobinRouter()
    loads = [Load(0, 0)] * 3
    assert [rr.route([1], loads) for _ in range(5)] == [0, 1, 2, 0, 1]
    lot = LeastOutstandingTokensRouter()
    assert lot.route([1], [Load(1, 50), Load(5, 20), Load(0, 20)]) == 1  # tokens, not requests; tie -> lower
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAwareRouter(load_factor=0.5)


def _shared(n=140, rate=40.0):
    return shared_prefix_trace(
        n,
        prefix_len=128,
        suffix_len=Fixed(16),
        output_len=Fixed(8),
        vocab_size=32000,
        rate=rate,
        num_prefixes=7,
        seed=3,
    )


def test_replicas_every_request_finishes_and_prefix_routing_keeps_prefixes_together():
    trace = _shared()
    hit = {}
    for name in ("round-robin", "least-tokens", "prefix-aware"):
        insts, s = run_replicas(trace, name, 4, model="llama-2-7b", hardware="H100-SXM", slo_ttft=1.0)
        assert s["num_finished"] == len(trace) and sum(s["requests_per_instance"]) == len(trace)
        assert s["total_output_tokens"] == 8 * len(trace)
        hit[name] = s["prefix_cache_hit_rate"]
    assert hit["prefix-aware"] > hit["round-robin"]
    # Unbounded consistent hashing: every request of one prefix lands on one replica.
    insts, s = run_replicas(trace, PrefixAwareRouter(load_factor=math.inf), 4, model="llama-2-7b")
    where = {rid: i for i, inst in enumerate(insts) for rid in inst.engine.requests}
    for p in range(7):
        assert len({where[r.request_id] for k, r in enumerate(trace) if k % 7 == p}) == 1


def test_kv_transfer_time_by_hand():
    # Llama-2-13B: M_KV = 2 * 40 layers * 40 heads * 128 * 2 bytes = 819,200 bytes per position.
    # 1,000 positions over InfiniBand NDR (50 GB/s, 30 us): 30 us + 819.2 MB / 50 GB/s = 16.414 ms.
    assert kv_transfer_time(1000, 819_200, "InfiniBand") == pytest.approx(30e-6 + 819.2e6 / 50e9)
    inner = RooflineCostModel("A100-80GB", "llama-2-13b")
    arrived = KVArrivedCostModel(inner)
    assert arrived.step_time([512, 1], [512, 900]) == inner.step_time([1, 1], [512, 900])
    assert arrived.kv_capacity_tokens() == inner.kv_capacity_tokens()


def test_disaggregated_joins_both_halves_and_waits_for_the_kv():
    trace = synthetic_trace(40, rate=4.0, prompt_len=Fixed(300), output_len=Fixed(12), vocab_size=32000, seed=2)
    trace[0].output_len = 1  # done at the prefill pool
    pre, dec, s = run_disaggregated(
        trace, 1, 2, model="llama-2-13b", hardware="A100-80GB", kv_link="PCIe", slo_ttft=1.0, slo_tpot=0.1
    )
    assert s["num_finished"] == 40 and s["total_output_tokens"] == 39 * 12 + 1
    assert sum(d.num_routed for d in dec) == 39 and pre[0].num_routed == 40
    moved = kv_transfer_time(300, 819_200, "PCIe")
    for d in dec:
        for rid, req in d.engine.requests.items():
            first = pre[0].engine.requests[rid].metrics.first_token_time
            assert req.metrics.arrival_time == pytest.approx(first + moved)
            assert req.metrics.token_times[0] > first + moved
    _, c = run_colocated(trace, 3, model="llama-2-13b", hardware="A100-80GB", slo_ttft=1.0, slo_tpot=0.1)
    assert c["num_finished"] == 40 and c["total_output_tokens"] == s["total_output_tokens"]
