"""Parallel sampling (SamplingParams.n): one prompt, n completions sharing the prompt's KV
blocks, with copy-on-write for the partly filled last block.

Proof: greedy n=1 is unchanged; n=k with a seed gives the k completions of k separate
requests seeded with ``completion_seed(seed, i)``; the blocks held at the first decode
step are the prompt's once plus at most one per sample; the engine's invariants hold
after every step with forks, copies, the abort of one sample and the preemption of the group.
"""

import math

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.core.invariants import check_all_free, check_invariants
from minillm.core.parallel_sampling import completion_id, completion_seed
from minillm.core.policies import FCFS

from helpers import drive_through_faults, run_to_end

torch.set_num_threads(1)

SMALL_GROUPS = dict(block_size=4, num_kv_blocks=64, max_model_len=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def shakespeare():
    return LLM(max_model_len=256, block_size=8, num_kv_blocks=200)


def test_n1_greedy_unchanged(shakespeare):
    sp = dict(temperature=0, max_tokens=20)
    a = shakespeare.generate(["ROMEO:", "JULIET:"], SamplingParams(**sp))
    b = shakespeare.generate(["ROMEO:", "JULIET:"], SamplingParams(**sp, n=1))
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and len(y.outputs) == 1
        assert y.outputs[0].token_ids == y.token_ids and y.outputs[0].text == y.text


@pytest.mark.parametrize("prompt", ["ROMEO:", "KING RICHARD III:\nNow is the winter of our discontent"])
def test_n_samples_equal_separate_requests_with_derived_seeds(shakespeare, prompt):
    k, seed = 4, 1234
    sp = dict(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
    group = shakespeare.generate([prompt], SamplingParams(**sp, n=k, seed=seed, logprobs=1))[0]
    assert [c.index for c in group.outputs] == list(range(k))
    separate = shakespeare.generate(
        [prompt] * k, [SamplingParams(**sp, seed=completion_seed(seed, i), logprobs=1) for i in range(k)]
    )
    for c, s in zip(group.outputs, separate):
        assert c.token_ids == s.token_ids and c.text == s.text
        assert c.cumulative_logprob == pytest.approx(s.outputs[0].cumulative_logprob, abs=1e-4)
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1  # the samples do differ
    assert group.token_ids == group.outputs[0].token_ids and group.text == group.outputs[0].text
    assert completion_seed(seed, 0) == seed


def held_blocks(engine):
    return {b.block_id for blocks in engine.kv.req_blocks.values() for b in blocks}


@pytest.mark.parametrize("prompt_len", [512, 500])
def test_blocks_at_first_decode_prompt_once_plus_one_per_sample(prompt_len):
    bs, n = 16, 8
    llm = LLM(
        "random", executor="simulated", block_size=bs, num_kv_blocks=100, max_model_len=600, max_num_batched_tokens=600
    )
    e = llm.engine
    e.add_request(
        [1 + i % 400 for i in range(prompt_len)], SamplingParams(n=n, max_tokens=4, ignore_eos=True), request_id="g"
    )
    first = e.step()  # the prompt, then the fork
    check_invariants(e, first)
    prompt_blocks = math.ceil(prompt_len / bs)
    assert [f.request_id for f in first.forks] == ["g"] and len(first.forks[0].sequences) == n
    assert len(first.forks[0].shared_blocks) == prompt_blocks
    assert len(held_blocks(e)) == prompt_blocks
    assert all(e.kv.pool.blocks[b].ref_count == n for b in first.forks[0].shared_blocks)
    decode = e.step()  # every sample writes its first token's KV
    check_invariants(e, decode)
    assert sorted(x.request_id for x in decode.batch) == sorted(completion_id("g", i) for i in range(n))
    held = len(held_blocks(e))
    assert held <= prompt_blocks + n
    if prompt_len % bs:  # the last block was partly filled: copy-on-write
        assert len(decode.copies) == n - 1 and held == prompt_blocks + n - 1
        srcs = {c.src_block for c in decode.copies}
        assert srcs == {first.forks[0].shared_blocks[-1]}
    else:  # all full: each sample starts a new block
        assert not decode.copies and held == prompt_blocks + n
    # Without sharing, the same 8 samples would hold 8 copies of the prompt.
    assert n * prompt_blocks > 2 * held
    run_to_end(e)


def test_copy_on_write_copies_the_kv_through_the_triton_kernel():
    """On a real model (Triton's interpreter on the CPU): the copies happen, and the samples
    still equal separate requests, so every copied block held the prompt's KV."""
    llm = LLM("random", attention_backend="triton", dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=64)
    e = llm.engine
    prompt = [5, 9, 2, 7, 3, 8]  # 6 tokens: the second block is half full
    sp = dict(temperature=1.0, max_tokens=5, ignore_eos=True)
    e.add_request(prompt, SamplingParams(**sp, n=3, seed=5), request_id="g")
    recs = run_to_end(e)
    assert sum(len(r.copies) for r in recs) == 2
    got = e.get_output("g").outputs
    for i in range(3):
        e.add_request(prompt, SamplingParams(**sp, seed=completion_seed(5, i)), request_id=f"s{i}")
    run_to_end(e)
    assert [c.token_ids for c in got] == [e.get_output(f"s{i}").token_ids for i in range(3)]


def test_group_counts_n_against_max_num_seqs_and_is_admitted_whole():
    llm = LLM("random", executor="simulated", block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=64)
    e = llm.engine
    e.add_request([1] * 5, SamplingParams(max_tokens=6, ignore_eos=True), request_id="a")
    e.add_request([2] * 5, SamplingParams(n=4, max_tokens=6, ignore_eos=True), request_id="g")
    first = e.step()
    assert first.admitted == ["a"]
    w = {x.request_id: x.reason for x in first.waiting}
    assert "needs 4" in w[completion_id("g", 0)]
    recs = run_to_end(e)
    admitted = next(r for r in recs if completion_id("g", 0) in r.admitted)
    assert all(len(r.running) <= 4 for r in recs)
    assert "a" in [x for r in recs[: recs.index(admitted)] for x in r.finished] or "a" in first.finished
    out = e.get_output("g")
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 6 for c in out.outputs)


def test_abort_one_sample_then_the_rest():
    llm = LLM("random", executor="simulated", block_size=4, num_kv_blocks=64, max_model_len=64)
    e = llm.engine
    e.add_request([3] * 6, SamplingParams(n=3, max_tokens=10, ignore_eos=True), request_id="g")
    for _ in range(3):
        check_invariants(e, e.step())
    e.abort_request(completion_id("g", 1))
    check_invariants(e)
    rec = e.step()
    assert completion_id("g", 1) in rec.aborted
    check_invariants(e, rec)
    e.abort_request("g")  # the request: all its samples
    run_to_end(e)
    out = e.get_output("g")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and out.finished


@pytest.mark.parametrize("first_done", [True, False], ids=["cached-copy-free", "cached-copy-held"])
def test_a_sample_leaving_alone_frees_its_child_before_the_cached_copy_of_its_prompt(first_done):
    """A group whose prompt is cached already computes the prompt's last full block again (its
    last token must be): the samples share a second copy of that prefix, and the block a sample
    fills next is chained on it, so its parent in the cache is the first request's copy. When one
    sample leaves alone (aborted; in the fuzzer, a failed draw), its child must reach the free
    list before that copy, whether the copy was already free or is freed by its own request
    meanwhile: evicting the parent first would strand the child (seeds 191 and 288 of the fuzzer)."""
    llm = LLM(
        "random", executor="simulated", block_size=2, num_kv_blocks=16, max_model_len=32, enable_prefix_caching=True
    )
    e = llm.engine
    e.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1 if first_done else 5, ignore_eos=True), request_id="a")
    check_invariants(e, e.step())
    e.add_request([5, 6, 7, 8], SamplingParams(n=2, max_tokens=8, ignore_eos=True), request_id="g")
    while not e.is_finished("a") or len(e.kv.req_blocks.get(completion_id("g", 0), ())) < 4:
        check_invariants(e, e.step())
    pool, g0, g1 = e.kv.pool, e.kv.req_blocks[completion_id("g", 0)], e.kv.req_blocks[completion_id("g", 1)]
    copy, child = pool.cached[g0[1].block_hash], g0[2]
    assert copy is not g0[1] and copy.ref_count == 0 and g1[1] is g0[1]  # the samples hold a second copy
    assert child.parent_hash == copy.block_hash and child.block_id in {b.block_id for b in g0}
    e.abort_request(completion_id("g", 0))
    check_invariants(e, e.step())
    order = list(pool.free_queue)
    assert order.index(child.block_id) < order.index(copy.block_id)
    run_to_end(e)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_group_is_preempted_together_and_invariants_hold(mode):
    llm = LLM(
        "random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=24,
        max_model_len=64,
        preemption_mode=mode,
        num_swap_blocks=40 if mode == "swap" else 0,
        watermark=0.0,
    )
    e = llm.engine
    e.add_request([2] * 10, SamplingParams(max_tokens=20, ignore_eos=True), request_id="b")
    e.add_request([1] * 10, SamplingParams(n=3, max_tokens=20, ignore_eos=True), request_id="g")
    group = {completion_id("g", i) for i in range(3)}
    seen = []

    def together(rec):
        hit = {p.request_id for p in rec.preempted} & group
        if hit:
            seen.append(hit)
            running = set(rec.running) & group
            assert not running, f"part of the group kept running: {running}"

    run_to_end(e, on_step=together)
    assert seen, "the small cache was meant to force a preemption of the group"
    out = e.get_output("g")
    assert all(len(c.token_ids) == 20 for c in out.outputs)
    assert len(e.get_output("b").token_ids) == 20


def test_random_groups_keep_invariants():
    """Many groups, tiny blocks, chunked prefill, aborts and preemption, invariants every step."""
    import random

    rng = random.Random(0)
    for trial in range(6):
        llm = LLM(
            "random",
            executor="simulated",
            block_size=rng.choice([1, 2, 4]),
            num_kv_blocks=30,
            max_model_len=48,
            max_num_seqs=6,
            max_num_batched_tokens=rng.choice([8, 64]),
            enable_chunked_prefill=True,
            enable_prefix_caching=trial % 2 == 1,
        )
        e = llm.engine
        ids = [
            e.add_request(
                [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))],
                SamplingParams(n=rng.randint(1, 4), max_tokens=rng.randint(1, 12), ignore_eos=True),
            )
            for _ in range(6)
        ]
        steps = 0
        while e.has_unfinished_requests():
            check_invariants(e, e.step())
            steps += 1
            if steps == 4:
                victim = rng.choice(ids)
                seqs = [r for r in e.requests if e.parent_id(r) == victim]
                e.abort_request(rng.choice(seqs))
            assert steps < 3000
        check_all_free(e)
        for rid in ids:
            assert e.is_finished(rid)


def test_fork_and_copies_in_the_record():
    llm = LLM("random", executor="simulated", block_size=4, num_kv_blocks=32, max_model_len=64)
    e = llm.engine
    e.add_request([7] * 6, SamplingParams(n=2, max_tokens=3, ignore_eos=True), request_id="g")
    r0 = e.step()
    assert "forked g into 2 sequences" in r0.summary()
    shared = r0.forks[0].shared_blocks
    assert [b.ref_count for b in r0.kv.blocks if b.block_id in shared] == [2, 2]
    r1 = e.step()
    assert len(r1.copies) == 1 and r1.copies[0].src_block == shared[-1]
    assert "copy-on-write" in r1.summary()
    run_to_end(e)


class _FlakyFCFS(FCFS):
    """FCFS whose on_step hook raises on every other call: the step (its fork, its copies,
    its sampled tokens) is rolled back, and the next step does it again."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def on_step(self, scheduled, now):
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("on_step fails")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_step_that_raises_undoes_its_fork_and_copies(mode):
    """Every other step raises after the forward: the forks and copies it made are undone (no
    sequence, block reference or random draw left behind), and the samples come out as in a run
    without faults."""

    def run_group(policy):
        llm = LLM(
            "random",
            dtype="float32",
            block_size=4,
            num_kv_blocks=20,
            max_model_len=64,
            policy=policy,
            preemption_mode=mode,
            num_swap_blocks=40 if mode == "swap" else 0,
        )
        e = llm.engine
        e.add_request([5, 9, 2, 7, 3, 8], SamplingParams(n=3, max_tokens=14, seed=9, ignore_eos=True), request_id="g")
        e.add_request([4] * 10, SamplingParams(max_tokens=14, seed=1, ignore_eos=True), request_id="b")
        faults = drive_through_faults(e, RuntimeError, max_steps=500)
        return [c.token_ids for c in e.get_output("g").outputs], e.get_output("b").token_ids, faults

    clean = run_group(FCFS())
    flaky = run_group(_FlakyFCFS())
    assert flaky[2] > 5 and flaky[:2] == clean[:2]


@pytest.mark.parametrize("record", ["summary", "totals"])
def test_a_forked_block_counts_once_in_the_summary_and_totals_records(record):
    """Without prefix caching only a fork shares blocks: the records without the per-block map
    still count a shared block once, as the full one does (they counted it once per sample, and
    ``kv.used`` exceeded the cache). A plain ``LLM()`` keeps "summary" records above 256 blocks."""
    llm = LLM("random", executor="simulated", block_size=4, num_kv_blocks=16, max_model_len=64, record=record)
    e = llm.engine
    e.add_request([3] * 14, SamplingParams(n=4, max_tokens=6, ignore_eos=True), request_id="g")

    def same_as_full(rec):
        assert rec.kv.used == e.kv.snapshot(e.active, detail=True).used

    recs = run_to_end(e, on_step=same_as_full)
    assert recs[0].forks


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_group_swapped_out_in_the_pass_of_its_first_copy_on_write_keeps_its_kv(kv_cache_dtype):
    """The first decode after the fork gives sample 0 a fresh block for its copy-on-write; the
    next sample then finds no block free, and the group (the lower priority) is swapped out in
    the same pass. The fresh block is still empty (the runner swaps out before it copies): the
    host must get the shared block it stands for. Every sample equals its request run alone
    (sample 0 once diverged from its second token). On the trained model: its output depends on the KV."""
    prompt = [15, 40, 33, 17, 38, 11]  # 6 tokens: the second block is half full
    sp = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    cfg = dict(dtype="float32", block_size=4, max_model_len=64, kv_cache_dtype=kv_cache_dtype)
    alone = LLM(**cfg, num_kv_blocks=64).generate(
        [prompt] * 3, [SamplingParams(**sp, seed=completion_seed(5, i)) for i in range(3)], use_tqdm=False
    )
    llm = LLM(**cfg, num_kv_blocks=5, policy="priority", preemption_mode="swap", num_swap_blocks=20)
    e = llm.engine
    e.add_request(prompt, SamplingParams(**sp, n=3, seed=5), request_id="g", priority=1)
    e.add_request([4, 4, 4, 4], SamplingParams(max_tokens=8, ignore_eos=True), request_id="b", priority=0)
    recs = run_to_end(e)
    assert recs[0].forks and completion_id("g", 0) in {p.request_id for p in recs[1].preempted}
    assert [c.token_ids for c in e.get_output("g").outputs] == [o.token_ids for o in alone]


def test_a_sample_swapped_in_is_not_swapped_out_again_in_the_same_pass():
    """Sample 0 of a low-priority group is back on the device and sample 1 still in host memory.
    A pass swaps sample 1 in, then admits a higher-priority arrival that preempts sample 0, and
    with it the whole group: sample 1's swap-out would copy device blocks its swap-in has not
    filled yet (the runner swaps out first). A group with a member placed by the pass is not
    preempted by it. The workload is one a search found; the check is the order of the KV moves."""
    llm = LLM(
        "random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=8,
        max_model_len=64,
        policy="priority",
        preemption_mode="swap",
        num_swap_blocks=40,
        clock="modeled",
        cost_model=0.01,
    )
    e = llm.engine
    e.add_request(
        [7] * 3, SamplingParams(n=2, max_tokens=11, ignore_eos=True), request_id="g", priority=1, arrival_time=0.0
    )
    for i, (plen, max_tokens, t) in enumerate([(4, 6, 0.0557), (2, 7, 0.0661), (5, 5, 0.0869)]):
        e.add_request(
            [5] * plen,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            request_id=f"h{i}",
            priority=0,
            arrival_time=t,
        )
    kv, swapped_in = e.kv, set()
    swap_in, swap_out = kv.swap_in, kv.swap_out

    def logged_swap_in(req):
        swapped_in.add(req.request_id)
        return swap_in(req)

    def checked_swap_out(req):
        assert req.request_id not in swapped_in, f"{req.request_id} swapped in and out in one pass"
        return swap_out(req)

    kv.swap_in, kv.swap_out = logged_swap_in, checked_swap_out
    recs = run_to_end(e, on_step=lambda rec: swapped_in.clear())
    assert sum(len(r.swapped_in) for r in recs) >= 2


@pytest.mark.parametrize(
    "first, then",
    [
        (("a", 2), ("a#1", 1)),  # a sample id the group will give at its fork
        (("a", 3), ("a#2", 2)),  # ... as a group of its own
        (("a#1", 1), ("a", 2)),  # a group whose sample would take an existing id
        (("a", 2), ("a#0", 1)),  # the group's first sequence
    ],
)
def test_an_id_that_collides_with_a_group_or_its_samples_is_refused(first, then):
    """An id that a group's sample has or will have at its fork, or a group whose samples'
    ids are taken, is refused naming request_id before anything changes; the group then
    finishes with all its samples."""
    e = LLM("random", **SMALL_GROUPS).engine
    rid, n = first
    e.add_request([1, 2, 3], SamplingParams(n=n, max_tokens=3, ignore_eos=True), request_id=rid)
    before = (set(e.requests), set(e.parents), len(e.scheduler.waiting))
    with pytest.raises(ValueError, match=f"request_id={then[0]!r}"):
        e.add_request([4, 5, 6], SamplingParams(n=then[1], max_tokens=3, ignore_eos=True), request_id=then[0])
    assert (set(e.requests), set(e.parents), len(e.scheduler.waiting)) == before
    run_to_end(e)
    out = e.get_output(rid)
    assert len(out.outputs) == n and all(len(c.token_ids) == 3 for c in out.outputs)


def test_automatic_ids_never_collide_with_samples_ids():
    """An automatic id skips any id a group holds or will hold at its fork, either way round."""
    e = LLM("random", **SMALL_GROUPS).engine
    auto = e.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    assert auto == "0"
    with pytest.raises(ValueError, match="request_id='0#1'"):
        e.add_request([1, 2], SamplingParams(max_tokens=2), request_id="0#1")
    e.add_request([1, 2], SamplingParams(max_tokens=2), request_id="1#1")
    e.add_request([1, 2], SamplingParams(max_tokens=2), request_id="2")
    later = e.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    assert later not in ("1", "2")  # "1" would fork "1#1"; "2" is taken
    run_to_end(e)
    assert all(e.is_finished(r) for r in (auto, later, "1#1", "2"))
    assert [len(c.token_ids) for c in e.get_output(later).outputs] == [3, 3]
