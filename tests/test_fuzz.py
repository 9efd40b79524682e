"""The randomized differential test (``tests/fuzz_engine.py``) under a bounded budget: random
configurations (policies x preemption modes x allocators x prefix caching x speculation x
static / every-N batching x queue caps x int8 / fp8 KV), random workloads (greedy, seeded
sampling with top-p / top-k, logprobs, penalties, stop strings and stop token ids), aborts and
faults injected into policy hooks, the forward and the sampler; the invariants hold after every
step and every request's tokens match the same request run alone (a parallel-sampling group's
samples: each run alone with its own seed; on a quantized cache, the sequences written in the
same pieces as alone). The same through ``AsyncLLM`` with cancelled and aborted streams, and a
few runs on 2 tensor-parallel ranks. ``make fuzz`` runs a long campaign."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_engine import FuzzStats, async_fuzz_run, fuzz_run

pytestmark = pytest.mark.slow  # randomized campaigns of thousands of engine steps


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
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
    stats = fuzz_run(
        seed, num_requests=16, group_rate=0.0, feature_rate=0.0, quantized_rate=0.0, sampler_fault_rate=0.0
    )
    assert stats.problems == [], "\n".join(stats.problems[:3])


def test_seed_where_a_rolled_back_fork_recomputed_into_shared_blocks():
    """A step that preempted a forked group and gave its blocks away raised: the rollback gave the
    group its blocks back, and every sample recomputed from the first block handed away while the
    samples still shared it (one copy-on-write, then writes into a shared block). Each now gives
    that block and the ones after it back first."""
    stats = fuzz_run(373, num_requests=16, feature_rate=0.0, quantized_rate=0.0, sampler_fault_rate=0.0)
    assert stats.problems == [], "\n".join(stats.problems[:3])


def test_the_features_are_exercised_and_compared():
    """Seeds 0-19 reach every feature the fuzzer draws: a bound on what a passing run above means."""
    total = FuzzStats()
    for seed in range(20):
        total.add(fuzz_run(seed))
    assert total.problems == [], "\n".join(total.problems[:3])
    for name in (
        "groups",
        "sampled",
        "logprobs",
        "penalties",
        "stopped",
        "quantized",
        "quantized_compared",
        "sampler_faults",
        "sampling_failed",
        "aborts",
        "faults",
        "cpu_attention_runs",
        "exercise_pool_runs",
    ):
        assert getattr(total, name) > 0, f"no {name}: {total.line()}"


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_async_streams_with_cancels_and_aborts_end_with_their_tokens_or_abort(seed):
    stats = async_fuzz_run(seed)
    assert stats.problems == [], "\n".join(stats.problems[:3])
    assert stats.mismatches == stats.lost == stats.leaks == 0


@pytest.mark.parametrize("seed", [3, 5])
def test_random_runs_on_two_tensor_parallel_ranks(seed):
    """Seed 3: int8 KV, groups, a sampling failure; seed 5: int8 KV, stop strings, seeded sampling."""
    stats = fuzz_run(seed, num_requests=6, tensor_parallel=True)
    assert stats.problems == [], "\n".join(stats.problems[:3])
    assert stats.tp_runs == 1 and stats.mismatches == stats.leaks == 0


def test_written_like_alone_by_hand():
    """The quantized oracle compares a sequence only when its positions were written in the pieces the
    run alone writes them in (docs/architecture.md, KV-cache quantization): the prompt whole or cut at block
    boundaries, then one position per step; a verify step's guesses (several positions past the
    prompt at once) are not, nor a rewrite, nor a prefix-cache hit (seed 512 of a long campaign had
    fp8 with n-gram speculation compared)."""
    from fuzz_engine import written_like_alone

    assert written_like_alone([(0, 6), (6, 7), (7, 8)], prompt_len=6, block_size=2)  # whole, then decodes
    assert written_like_alone([(0, 4), (4, 6), (6, 7)], prompt_len=6, block_size=2)  # cut at a boundary
    assert not written_like_alone([(0, 3), (3, 6)], prompt_len=6, block_size=2)  # cut inside a block
    assert not written_like_alone([(0, 6), (6, 10)], prompt_len=6, block_size=2)  # guesses verified
    assert not written_like_alone([(0, 6), (6, 7), (6, 7)], prompt_len=6, block_size=2)  # written twice
    assert not written_like_alone([(4, 6), (6, 7)], prompt_len=6, block_size=2)  # a cache hit


@pytest.mark.parametrize("seed", [104])
def test_a_run_proposing_with_a_draft_model(seed):
    """Speculation with a draft model (the shipped pair) rather than n-gram lookup: the same checks,
    and the run is one (``draw_draft_model`` picks it for about 5% of the speculative runs)."""
    stats = fuzz_run(seed)
    assert stats.draft_runs == 1
    assert stats.problems == [], "\n".join(stats.problems[:3])
    assert stats.mismatches == stats.lost == stats.leaks == 0
