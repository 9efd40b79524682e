"""The randomized differential test (``tests/fuzz_engine.py``) under a bounded budget: random
configurations (policies x preemption modes x allocators x prefix caching x speculation x
static / every-N batching x queue caps), random workloads, aborts and injected faults; the
invariants hold after every step and every request's tokens match the same request
run alone (a parallel-sampling group's samples: each run alone with its own seed). ``make fuzz``
runs a long campaign."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_engine import fuzz_run


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_runs_with_aborts_and_faults_match_each_request_run_alone(seed):
    stats = fuzz_run(seed)
    assert stats.problems == [], "\n".join(stats.problems[:3])
    assert stats.mismatches == stats.lost == stats.leaks == 0


@pytest.mark.parametrize("seed", [206, 434, 69])
def test_seeds_that_once_broke_the_free_list_order(seed):
    """A step rolled back after its forward left the prefixes it registered in the cache; the
    retried step computed them again in other blocks, and a parent block sat ahead of its child
    in the free list (found by a long ``make fuzz`` campaign)."""
    stats = fuzz_run(seed, num_requests=16, group_rate=0.0)
    assert stats.problems == [], "\n".join(stats.problems[:3])


def test_seed_where_a_rolled_back_fork_recomputed_into_shared_blocks():
    """A step that preempted a forked group and gave its blocks away raised: the rollback gave the
    group its blocks back, and every sample recomputed from the first block handed away while the
    samples still shared it (one copy-on-write, then writes into a shared block). Each now gives
    that block and the ones after it back first."""
    stats = fuzz_run(373, num_requests=16)
    assert stats.problems == [], "\n".join(stats.problems[:3])
