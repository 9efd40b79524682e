"""Exercises of notebook 07, "Beyond one GPU": a prefix-aware router and the KV-transfer break-even.

A fleet of data-parallel replicas only reuses a prompt's prefix if the request reaches the
replica whose prefix cache holds it. Consistent hashing sends every prompt with the same first
KV blocks to the same replica, and keeps most keys where they were when a replica joins or
leaves; a load bound (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded
Loads", SODA 2018) passes over a replica that already holds more than its share, so one hot
prefix cannot bury one replica.

* ``prefix_key``: the ring position of a prompt, from its first full KV blocks.
* ``route_on_ring``: walk the ring from the key to the first replica within the load bound.
* ``kv_transfer_time`` and ``max_prompt_for_transfer``: disaggregated serving moves each
  prompt's KV from a prefill GPU to a decode GPU; how long that takes, and the longest prompt
  whose KV crosses within a time budget (the break-even of the transfer against, say, a TPOT).

``ExerciseRouter`` (given, at the bottom) is a ``minillm.sim.cluster.Router`` that routes with *your*
functions, so ``minillm.sim.cluster.run_replicas(trace, ExerciseRouter(), 4)`` runs them at scale.
Each docstring states the contract; notebook 07's exercise cell has optional hints. Check your
work with

    make grade EX=07            # or: MINILLM_IMPL=exercises pytest -m ex07 tests/test_exercises.py
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from minillm.sim.cluster import Router, ring_points, stable_hash

__all__ = ["prefix_key", "route_on_ring", "kv_transfer_time", "max_prompt_for_transfer", "ExerciseRouter"]


# =====================================================================================
# Exercise 1: the key of a prompt
# =====================================================================================

def prefix_key(prompt_token_ids: Sequence[int], block_size: int = 16, prefix_blocks: int = 4) -> int:
    """``stable_hash`` (given, from ``minillm.sim.cluster``) of the prompt's first ``prefix_blocks``
    *full* KV blocks of ``block_size`` tokens, as a list of token ids.

    A prompt with fewer full blocks uses the full blocks it has (a trailing partial block is
    left out: it is never cached); a prompt without one full block uses the whole prompt.

    >>> prefix_key(list(range(40)), 16, 4) == stable_hash(list(range(32)))    # 2 full blocks
    True
    >>> prefix_key([5, 6, 7], 16, 4) == stable_hash([5, 6, 7])
    True
    """
    ### BEGIN SOLUTION
    full = min(prefix_blocks, len(prompt_token_ids) // block_size)
    head = list(prompt_token_ids[:full * block_size]) if full else list(prompt_token_ids)
    return stable_hash(head)
    ### END SOLUTION


# =====================================================================================
# Exercise 2: consistent hashing with bounded loads
# =====================================================================================

def route_on_ring(key: int, ring: Sequence[tuple[int, int]], loads: Sequence[float],
                  load_factor: float = 1.25) -> int:
    """The replica for ``key``.

    ``ring``: ``(point, replica)`` pairs sorted by point (several points per replica: its
    virtual nodes). ``loads[i]``: replica i's outstanding load. Rules:

    1. Start at the first point at or after ``key`` (a point equal to the key counts); past the
       last point, wrap around to the first.
    2. Walk clockwise; the first replica met whose load is at most ``load_factor`` x the mean
       load is the answer. A replica met again (another of its virtual nodes) is not looked at
       twice. ``load_factor=math.inf`` means no bound at all (plain consistent hashing).

    >>> route_on_ring(15, [(10, 0), (20, 1), (30, 2)], [0, 0, 0])
    1
    >>> route_on_ring(15, [(10, 0), (20, 1), (30, 2)], [0, 10, 2])   # bound 1.25 * 4 = 5: 1 is over
    2
    """
    ### BEGIN SOLUTION
    bound = math.inf if load_factor == math.inf else load_factor * sum(loads) / len(loads)
    start = bisect.bisect_left([p for p, _ in ring], key)
    seen = set()
    for j in range(len(ring)):
        replica = ring[(start + j) % len(ring)][1]
        if replica in seen:
            continue
        seen.add(replica)
        if loads[replica] <= bound:
            return replica
    return min(range(len(loads)), key=lambda i: (loads[i], i))
    ### END SOLUTION


# =====================================================================================
# Exercise 3: the KV transfer of disaggregated serving
# =====================================================================================

def kv_transfer_time(num_tokens: int, kv_bytes_per_token: int, bandwidth: float, latency: float) -> float:
    """Seconds to copy ``num_tokens`` positions of KV (``kv_bytes_per_token`` bytes each: M_KV per
    position) over a link of ``bandwidth`` bytes/s with a fixed ``latency`` (s) per copy.

    >>> round(kv_transfer_time(1000, 819_200, 50e9, 30e-6), 9)   # Llama-2-13B, 1,000 positions, InfiniBand
    0.016414
    """
    ### BEGIN SOLUTION
    return latency + num_tokens * kv_bytes_per_token / bandwidth
    ### END SOLUTION


def max_prompt_for_transfer(budget: float, kv_bytes_per_token: int, bandwidth: float, latency: float) -> int:
    """The longest prompt (in tokens, an integer) whose KV crosses within ``budget`` seconds:
    the largest n with ``kv_transfer_time(n, ...) <= budget``; 0 when even the latency does not fit.

    >>> max_prompt_for_transfer(0.016414, 819_200, 50e9, 30e-6)
    1000
    """
    ### BEGIN SOLUTION
    if budget < latency:
        return 0
    n = int((budget - latency) * bandwidth // kv_bytes_per_token)
    while kv_transfer_time(n + 1, kv_bytes_per_token, bandwidth, latency) <= budget:   # float rounding
        n += 1
    while n > 0 and kv_transfer_time(n, kv_bytes_per_token, bandwidth, latency) > budget:
        n -= 1
    return n
    ### END SOLUTION


# =====================================================================================
# Given: your functions as a router of minillm.sim.cluster
# =====================================================================================

class ExerciseRouter(Router):
    """``PrefixAwareRouter`` built from this module's ``prefix_key`` and ``route_on_ring``."""
    name = "prefix-aware (ex07)"

    def __init__(self, block_size: int = 16, prefix_blocks: int = 4, load_factor: float = 1.25,
                 virtual_nodes: int = 64):
        self.block_size, self.prefix_blocks = block_size, prefix_blocks
        self.load_factor, self.virtual_nodes = load_factor, virtual_nodes
        self._ring = None

    def route(self, prompt_token_ids, loads):
        if self._ring is None or len({i for _, i in self._ring}) != len(loads):
            self._ring = ring_points(len(loads), self.virtual_nodes)
        key = prefix_key(prompt_token_ids, self.block_size, self.prefix_blocks)
        return route_on_ring(key, self._ring, [ld.tokens for ld in loads], self.load_factor)
