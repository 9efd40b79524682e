"""Graders of notebook 04's parallel-sampling exercise (``exercises/ex04b_parallel_sampling.py``):
``make grade EX=04b``.

The three functions against cases worked by hand (a 10-token prompt in blocks of 4 forked four
ways: which block each sample copies, and every reference count after), then inside the engine:
with your fork and copy-on-write, n samples must make the same forks and the same copies as
minillm's own, step by step, keep the engine's invariants (no sequence writes into a block it
shares), leak nothing, and, on a real model, give the same samples as separate requests.
"""

from __future__ import annotations

import pytest

from minillm import LLM, SamplingParams, impl
from minillm.core.invariants import check_all_free, check_invariants
from minillm.core.parallel_sampling import completion_seed


def ex():
    return impl.load("ex04b_parallel_sampling")


def no_new_block():
    raise AssertionError("new_block() was called, but nothing had to be copied")


# --- Exercise 1: fork ------------------------------------------------------------------------------


def test_fork_by_hand():
    counts = {3: 1, 7: 1, 9: 1, 5: 1}
    table = [3, 7, 9]
    child = ex().fork(table, counts)
    assert child == [3, 7, 9], "the new sequence holds the same blocks, in order"
    assert child is not table, "the new sequence needs its own list (its copies must not change the other's table)"
    assert counts == {3: 2, 7: 2, 9: 2, 5: 1}
    again = ex().fork(table, counts)
    assert again == [3, 7, 9] and again is not child and counts == {3: 3, 7: 3, 9: 3, 5: 1}
    assert table == [3, 7, 9], "the forked table is not changed"
    assert ex().fork([], counts) == []


# --- Exercise 2: block_to_write ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "computed, size, held, want",
    [
        (10, 4, 3, 2),  # positions 8, 9 of the third block hold KV: the next one, 10, goes there too
        (8, 4, 3, 2),  # the third block is empty so far
        (8, 4, 2, None),  # two full blocks: the next position needs a new block
        (12, 4, 3, None),
        (7, 4, 2, 1),
        (0, 16, 0, None),
        (0, 16, 1, 0),
        (511, 16, 32, 31),
    ],
)
def test_block_to_write_by_hand(computed, size, held, want):
    assert ex().block_to_write(computed, size, held) == want


# --- Exercise 3: copy_on_write ---------------------------------------------------------------------------


def test_copy_on_write_four_samples_by_hand():
    # A 10-token prompt in blocks of 4 (blocks 0, 1 full; block 2 holds 2 positions), forked 4 ways.
    counts = {0: 4, 1: 4, 2: 4}
    fresh = iter([5, 6, 7])

    def new_block():
        b = next(fresh)
        counts[b] = 1
        return b

    tables = [[0, 1, 2] for _ in range(4)]
    assert ex().copy_on_write(tables[0], 10, 4, counts, new_block) == (2, 5)
    assert tables[0] == [0, 1, 5] and counts == {0: 4, 1: 4, 2: 3, 5: 1}
    assert ex().copy_on_write(tables[1], 10, 4, counts, new_block) == (2, 6)
    assert ex().copy_on_write(tables[2], 10, 4, counts, new_block) == (2, 7)
    assert tables[1] == [0, 1, 6] and tables[2] == [0, 1, 7] and counts[2] == 1
    # The last holder writes in place: no copy, nothing allocated, nothing changed.
    assert ex().copy_on_write(tables[3], 10, 4, counts, no_new_block) is None
    assert tables[3] == [0, 1, 2] and counts == {0: 4, 1: 4, 2: 1, 5: 1, 6: 1, 7: 1}
    # A sequence writing into its own block (count 1) never copies.
    assert ex().copy_on_write(tables[0], 11, 4, counts, no_new_block) is None and tables[0] == [0, 1, 5]


def test_copy_on_write_into_a_shared_block_at_its_first_position():
    """A table may hold a shared block the next position opens (its first position, offset 0): that
    block is written, so the sequence needs its own copy as for any other position inside it."""
    counts = {0: 2, 1: 2, 2: 2}
    table = [0, 1, 2]

    def new_block():
        counts[9] = 1
        return 9

    assert ex().copy_on_write(table, 8, 4, counts, new_block) == (2, 9), (
        "position 8 is block 2's first position, and block 2 is shared: copy it"
    )
    assert table == [0, 1, 9] and counts == {0: 2, 1: 2, 2: 1, 9: 1}


def test_copy_on_write_when_the_prompt_fills_its_blocks():
    counts = {0: 3, 1: 3}
    table = [0, 1]
    assert ex().copy_on_write(table, 8, 4, counts, no_new_block) is None, (
        "position 8 starts a new block: the shared full blocks are never written"
    )
    assert table == [0, 1] and counts == {0: 3, 1: 3}


# --- In the engine -------------------------------------------------------------------------------------


def _run(kv_manager, prompt_len, n, block_size=16, **kw):
    kw.setdefault("num_kv_blocks", 120)
    llm = LLM(
        "random",
        executor="simulated",
        block_size=block_size,
        max_model_len=700,
        max_num_batched_tokens=700,
        kv_manager=kv_manager,
        **kw,
    )
    e = llm.engine
    e.add_request(
        [1 + i % 300 for i in range(prompt_len)], SamplingParams(n=n, max_tokens=20, ignore_eos=True), request_id="g"
    )
    e.add_request([2] * 40, SamplingParams(n=3, max_tokens=30, ignore_eos=True), request_id="h")
    steps = []
    while e.has_unfinished_requests():
        rec = e.step()
        check_invariants(e, rec)
        steps.append(
            (
                [(f.request_id, f.sequences, f.shared_blocks) for f in rec.forks],
                [(c.request_id, c.src_block, c.dst_block) for c in rec.copies],
                rec.kv.blocks_used,
                [p.request_id for p in rec.preempted],
            )
        )
        assert len(steps) < 2000, "no progress"
    check_all_free(e)
    return steps, e


@pytest.mark.parametrize("prompt_len", [500, 512, 7])
def test_engine_forks_and_copies_as_minillm_does(prompt_len):
    mine, e = _run(ex().cow_kv_manager, prompt_len, 8)
    want, _ = _run(None, prompt_len, 8)
    assert mine == want, "your forks / copies / blocks in use differ from minillm's, step by step"
    if prompt_len % 16:
        assert sum(len(step[1]) for step in mine) >= 7
    assert all(len(c.token_ids) == 20 for c in e.get_output("g").outputs), "every sample must generate its 20 tokens"


def test_engine_with_preemption_keeps_its_invariants():
    mine, _ = _run(ex().cow_kv_manager, 100, 6, block_size=8, num_kv_blocks=36, preemption_mode="recompute")
    want, _ = _run(None, 100, 6, block_size=8, num_kv_blocks=36, preemption_mode="recompute")
    assert any(step[3] for step in want), "the small cache was meant to force a preemption"
    assert mine == want, "with preemptions, your forks / copies / blocks in use differ from minillm's, step by step"


def test_real_model_samples_equal_separate_requests():
    """The copies carry the right KV: on a real (tiny, random) model, n seeded samples equal
    separate requests seeded as the engine derives each sample's seed."""
    llm = LLM(
        "random", dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=64, kv_manager=ex().cow_kv_manager
    )
    e = llm.engine
    prompt = [5, 9, 2, 7, 3, 8, 4, 1, 6, 11]
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    e.add_request(prompt, SamplingParams(**sp, n=4, seed=3), request_id="g")
    while e.has_unfinished_requests():
        check_invariants(e, e.step())
    got = [c.token_ids for c in e.get_output("g").outputs]
    for i in range(4):
        e.add_request(prompt, SamplingParams(**sp, seed=completion_seed(3, i)), request_id=f"s{i}")
    while e.has_unfinished_requests():
        e.step()
    assert got == [e.get_output(f"s{i}").token_ids for i in range(4)]
