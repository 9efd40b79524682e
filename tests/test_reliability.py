"""Nothing lost, nothing wrong: the step is all or nothing, and the scheduler's choices match
vLLM's where the concept is the same.

Each test reproduces one way the engine used to go wrong: a request receiving another's KV
when one pass swaps in and out, a step that raises losing requests or KV, a victim chosen
only among requests not yet scheduled, an abort no record mentions, a cached prefix evicted
while empty blocks were free, a prefix computed twice in one pass, step records without
bound. Outputs are checked against the same request run alone (greedy, batch-independent).
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.core.invariants import InvariantError, check_all_free, check_invariants, check_places
from minillm.core.policies import Priority

from helpers import drive_through_faults, run_to_end

SMALL = dict(model="random", block_size=2, max_num_batched_tokens=64, max_model_len=128)


def alone(prompt, max_tokens, **config):
    """The tokens a request gets when it has the engine to itself (lots of KV, no contention)."""
    cfg = dict(SMALL, num_kv_blocks=256, max_num_seqs=4)
    cfg.update({k: v for k, v in config.items() if k in ("seed",)})
    llm = LLM(**cfg)
    return llm.generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].token_ids


def prompts(n, length=10, seed=0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


# --- 1. swap-in and swap-out in one pass -------------------------------------------------------


def test_swap_in_and_out_in_one_pass_keep_each_requests_kv():
    """Random priority / MLFQ workloads under swap preemption: a pass that swaps one request back
    in may swap another out (the admission check's priority preemption). Every request must
    get exactly the tokens it gets alone (seed 4 gave request 1 another request's KV)."""
    import fuzz_engine as fe

    def swap_config(rng):
        cfg = fe.random_config(rng)
        cfg.update(
            policy=rng.choice(["priority", "mlfq"]),
            kv_allocation="paged",
            preemption_mode="swap",
            num_swap_blocks=200,
            batching="continuous",
            schedule_every=1,
        )
        for k in ("speculative_model", "num_speculative_tokens", "max_queue_len"):
            cfg.pop(k, None)
        return cfg

    for seed in range(8):
        stats = fe.fuzz_run(seed, num_requests=8, fault_rate=0.0, abort_rate=0.0, config=swap_config, group_rate=0.0)
        assert stats.mismatches == 0 and not stats.problems, stats.problems[:2]


def test_a_host_block_freed_by_a_swap_in_is_not_reused_in_the_same_pass():
    llm = LLM(**SMALL, num_kv_blocks=16, max_num_seqs=8, policy="priority", preemption_mode="swap", num_swap_blocks=8)
    kv = llm.engine.kv
    kv.begin_step()
    from minillm.core.request import Request

    r = Request("x", [5, 6, 7, 8], SamplingParams(max_tokens=2), 0.0)
    r.num_computed_tokens = 4
    assert kv.allocate(r, 0) or True
    kv.allocate(r, 4)
    kv.end_step()
    kv.begin_step()
    host = [h for _, h in kv.swap_out(r)]
    kv.end_step()
    kv.begin_step()
    kv.swap_in(r)
    assert not set(host) & set(kv.swap_free), "host blocks handed out again before the copies ran"
    kv.end_step()
    assert set(host) <= set(kv.swap_free)


# --- 2, 3. a step that raises: nothing lost, nothing half-done --------------------------------


class Boom(Exception):
    pass


class FlakyPriority(Priority):
    """A priority policy with a bug: a chosen hook raises on some calls."""

    def __init__(self, hook, fail_on):
        super().__init__()
        self.hook, self.fail_on, self.calls = hook, set(fail_on), 0

    def _maybe(self):
        self.calls += 1
        if self.calls in self.fail_on:
            raise Boom(f"{self.hook} call {self.calls}")

    def on_step(self, scheduled, now):
        if self.hook == "on_step":
            self._maybe()

    def preempt_for(self, request, running, now):
        victim = super().preempt_for(request, running, now)
        if self.hook == "preempt_for" and victim is not None:
            self._maybe()
        return victim

    def pick_victim(self, candidates, now):
        if self.hook == "pick_victim":
            self._maybe()
        return super().pick_victim(candidates, now)


@pytest.mark.parametrize(
    "hook,fail_on", [("on_step", range(2, 60, 3)), ("preempt_for", (1, 2, 4)), ("pick_victim", (1, 3))]
)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_policy_that_raises_loses_nothing_and_corrupts_nothing(hook, fail_on, mode):
    pol = FlakyPriority(hook, fail_on)
    llm = LLM(
        **SMALL,
        num_kv_blocks=24,
        max_num_seqs=8,
        policy=pol,
        preemption_mode=mode,
        num_swap_blocks=40 if mode == "swap" else 0,
        clock="modeled",
        cost_model=0.01,
    )
    eng = llm.engine
    ps = prompts(6, length=8, seed=2)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # The low class runs first; the high class arrives later and pushes it out.
    ids = [eng.add_request(p, sp, priority=1 - i % 2, arrival_time=0.05 * (i % 2)) for i, p in enumerate(ps)]
    faults = drive_through_faults(eng, Boom)
    assert faults >= 1
    for rid, p in zip(ids, ps):
        assert eng.requests[rid].output_token_ids == alone(p, 12)


def _request_state(eng) -> dict:
    """What a step may change in each request: positions, output, token times, first token time,
    log-probabilities, status and finish reason."""
    return {
        rid: (
            r.num_computed_tokens,
            list(r.output_token_ids),
            list(r.metrics.token_times),
            r.metrics.first_token_time,
            None if r.output_logprobs is None else list(r.output_logprobs),
            r.status,
            r.finish_reason,
        )
        for rid, r in eng.requests.items()
    }


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_step_that_raises_after_applying_results_leaves_every_request_as_before(logprobs):
    """The policy's on_step runs after the step's tokens were appended and its first tokens timed:
    when it raises, each request is exactly as before the step (compared field by field). The
    prompts are chunked over several steps, so a first token also comes in a step after admission."""
    pol = FlakyPriority("on_step", range(1, 200, 3))
    eng = LLM(
        **dict(SMALL, max_num_batched_tokens=16),
        num_kv_blocks=64,
        max_num_seqs=4,
        policy=pol,
        clock="modeled",
        cost_model=0.01,
    ).engine
    for i, p in enumerate(prompts(6, length=30, seed=5)):
        eng.add_request(
            p,
            SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True, logprobs=logprobs),
            arrival_time=0.02 * i,
        )
    faults = steps = 0
    while eng.has_unfinished_requests():
        assert steps < 500, "the run does not end"
        steps += 1
        before = _request_state(eng)
        try:
            eng.step()
        except Boom:
            faults += 1
            assert _request_state(eng) == before
    assert faults >= 5


class FlakyExecutorError(Exception):
    pass


@pytest.mark.parametrize(
    "config", [dict(schedule_every=2), dict(batching="static"), dict(max_queue_len=1), dict(max_queue_delay=0.0)]
)
def test_a_forward_that_raises_loses_no_request(config):
    """Requests the pass released (static / every-N) or rejected (queue cap/delay) must not fall
    out of every queue when a later part of the step raises."""
    llm = LLM(
        **dict(SMALL, max_num_batched_tokens=128),
        num_kv_blocks=64,
        max_num_seqs=3,
        clock="modeled",
        cost_model=0.01,
        **config,
    )
    eng = llm.engine
    real_execute, calls = eng.executor.execute, {"n": 0}

    def execute(out):  # every other forward raises after it ran (fault injection)
        res = real_execute(out)
        calls["n"] += 1
        if calls["n"] % 2:
            raise Boom("after the forward")
        return res

    eng.executor.execute = execute
    ps = prompts(7, length=6, seed=3)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, sp, arrival_time=0.001 * i) for i, p in enumerate(ps)]
    faults = drive_through_faults(eng, Boom)
    assert faults >= 2
    for rid, p in zip(ids, ps):
        r = eng.requests[rid]
        assert r.is_finished
        if r.finish_reason != "rejected":
            assert r.output_token_ids == alone(p, 5)


def test_keyboard_interrupt_in_the_forward_rolls_back_swaps_and_sampling():
    """Ctrl-C after the forward and the sampling, in passes that swap requests out: the bookkeeping
    goes back (a victim keeps its device blocks) and seeded sampling draws the same tokens again."""
    base = dict(SMALL, num_kv_blocks=14, max_num_seqs=8, policy="priority", preemption_mode="swap", num_swap_blocks=40)
    ps = prompts(4, length=8, seed=4)
    sps = [SamplingParams(max_tokens=10, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(4)]

    def run(interrupt_at):
        llm = LLM(**base)
        eng = llm.engine
        ids = [eng.add_request(p, s, priority=1 - i // 2, arrival_time=0.0) for i, (p, s) in enumerate(zip(ps, sps))]
        sampler = eng.executor.sampler
        real_sample = sampler.sample
        calls = {"n": 0}

        def sample(*a, **k):  # Ctrl-C just after the step drew its random numbers
            toks = real_sample(*a, **k)
            calls["n"] += 1
            if calls["n"] in interrupt_at:
                raise KeyboardInterrupt
            return toks

        sampler.sample = sample
        interrupts = 0
        while eng.has_unfinished_requests():
            try:
                rec = eng.step()
            except KeyboardInterrupt:
                interrupts += 1
                check_invariants(eng)
                continue
            check_invariants(eng, rec)
        check_all_free(eng)
        return [eng.requests[i].output_token_ids for i in ids], interrupts

    clean, _ = run(())
    broken, n = run(set(range(2, 40, 3)))
    assert n >= 3
    assert broken == clean


def test_places_invariant_catches_a_lost_request():
    llm = LLM(**SMALL, num_kv_blocks=32)
    eng = llm.engine
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    check_places(eng)
    eng.scheduler.waiting.clear()  # a request in no queue
    eng.scheduler.incoming.clear()
    with pytest.raises(InvariantError, match="in no queue"):
        check_places(eng)
    eng.scheduler.waiting.append(eng.requests[rid])
    eng.scheduler.waiting.append(eng.requests[rid])  # a request in two places
    with pytest.raises(InvariantError, match="places at once"):
        check_places(eng)


# --- 10. priority preemption picks the victim among all running requests -------------------------


def test_priority_preemption_chooses_among_all_running_requests():
    """vLLM's test_priority_scheduling_preemption: a running high-priority request that needs
    a block preempts the running low-priority one, even if the pass scheduled it already."""
    llm = LLM(**dict(SMALL, block_size=4), num_kv_blocks=5, max_num_seqs=4, policy="priority")
    eng = llm.engine
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    low = eng.add_request(list(range(10, 16)), sp, priority=5)  # admitted first: first in running
    eng.step()
    high = eng.add_request(list(range(20, 27)), sp, priority=0)
    # Both reach position 8 in the same step; the low one is granted its block first, and the
    # high one, short of a block, must take it from the low one rather than preempt itself.
    events = []
    while eng.has_unfinished_requests() and not events:
        rec = eng.step()
        check_invariants(eng, rec)
        events += [(rec.step, p.request_id) for p in rec.preempted]
    assert events and all(rid == low for _, rid in events), f"victims: {events}"
    assert eng.requests[high].num_preemptions == 0


# --- 11. aborts reach the records ---------------------------------------------------------------


def test_an_abort_is_reported_in_the_next_record():
    llm = LLM(**SMALL, num_kv_blocks=32)
    eng = llm.engine
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = eng.add_request([5, 6, 7], sp), eng.add_request([8, 9, 10], sp)
    eng.step()
    eng.abort_request(a)
    eng.abort_request(a)  # twice: reported once
    rec = eng.step()
    assert rec.aborted == [a]
    assert "aborted " + a in rec.summary()
    assert eng.step().aborted == []
    assert eng.requests[a].finish_reason == "abort"
    run_to_end(eng)
    assert eng.requests[b].finish_reason == "length"


# --- 12. eviction order: blocks holding nothing reusable go first -----------------------------------


def test_blocks_without_a_cached_prefix_are_handed_out_before_cached_ones():
    """vLLM's test_evict: a cached prefix survives while blocks holding nothing reusable are free.
    A request's partly filled last block holds nothing a lookup can find; freed after the
    prefix, it must still be handed out before the prefix's blocks."""
    llm = LLM(**dict(SMALL, block_size=4), num_kv_blocks=8, max_num_seqs=1, enable_prefix_caching=True)
    eng = llm.engine
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    shared = list(range(40, 56))  # 4 full blocks, cached once computed
    llm.generate([shared], sp, use_tqdm=False)  # 4 of the 8 blocks, then free (cached)
    llm.generate([list(range(100, 106))], sp, use_tqdm=False)  # 1 full block + 1 partly filled one
    llm.generate([list(range(200, 209))], sp, use_tqdm=False)  # needs 3 blocks: 2 never used + the partial one
    out = llm.generate([shared + [9]], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 16, "a cached prefix was evicted while a block holding nothing was free"
    check_all_free(eng)


# --- 13. a prefix is registered when its blocks are granted --------------------------------------


def test_two_requests_with_one_prefix_admitted_in_one_pass_compute_it_once():
    prefix = list(range(60, 92))  # 32 tokens = 8 blocks of 4
    ps = [prefix + [5, 6, 7], prefix + [8, 9]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(**dict(SMALL, block_size=4), num_kv_blocks=64, max_num_seqs=4, enable_prefix_caching=True)
    eng = llm.engine
    ids = [eng.add_request(p, sp, arrival_time=0.0) for p in ps]
    first = eng.step()
    assert sorted(first.admitted) == sorted(ids)
    assert first.num_batched_tokens == 35 + 2, "the second request recomputed the shared prefix"
    assert eng.requests[ids[1]].num_cached_tokens == 32
    run_to_end(eng)
    for rid, p in zip(ids, ps):
        assert eng.requests[rid].output_token_ids == alone(p, 6, seed=0)
    assert eng.stats()["prefix_cache"]["prefill_tokens_saved"] == 32


def test_a_prefix_registered_by_a_request_preempted_in_the_same_pass_is_not_offered():
    """A running request registers its next full block when granted; if the same pass then
    preempts it, that block was never computed and must not be found by anyone."""
    llm = LLM(
        **dict(SMALL, block_size=2), num_kv_blocks=10, max_num_seqs=4, enable_prefix_caching=True, policy="priority"
    )
    eng = llm.engine
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ps = prompts(4, length=5, seed=7)
    ids = [eng.add_request(p, sp, priority=i % 2, arrival_time=0.0) for i, p in enumerate(ps)]
    ids.append(eng.add_request(ps[0][:4] + [3], sp, priority=0, arrival_time=0.0))
    run_to_end(eng)
    for rid, p in zip(ids, ps + [ps[0][:4] + [3]]):
        assert eng.requests[rid].output_token_ids == alone(p, 12)


# --- 14. step records: bounded, and only what is asked for --------------------------------------


def test_step_records_are_bounded_and_configured_through_engine_config():
    llm = LLM(**SMALL, num_kv_blocks=32, record_history=10)
    eng = llm.engine
    for p in prompts(3, seed=5):
        eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    records = run_to_end(eng)
    assert len(records) > 20 and len(eng.step_records) <= 20
    assert eng.step_records[-1] is records[-1]
    assert records[-1].kv.blocks, "32 blocks: the per-block map by default"

    big = LLM(**SMALL, num_kv_blocks=1024).engine
    big.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    assert big.step().kv.blocks == [], "no per-block map at 1,024 blocks unless asked for"
    full = LLM(**SMALL, num_kv_blocks=1024, record="full").engine
    full.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    assert len(full.step().kv.blocks) == 1024

    none = LLM(**SMALL, num_kv_blocks=32, record="none").engine
    none.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    rec = none.step()
    assert rec.kv is None and none.step_records == []
    assert rec.running == [] and none.scheduler.running  # nothing per request recorded ...
    assert rec.batch_size == 1 and rec.num_batched_tokens == 3 and rec.batch == []  # ... the batch's size is
    check_invariants(none, rec)


@pytest.mark.parametrize(
    "field,value",
    [("record", "everything"), ("record_history", -1), ("record_history", 2.5), ("record_max_waiting", True)],
)
def test_bad_record_options_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}="):
        LLM(**SMALL, num_kv_blocks=32, **{field: value})


def test_an_executor_that_returns_too_few_token_lists_is_refused_and_changes_nothing():
    """``ExecutionResult.sampled`` holds one token list per grant, in the grants' order. An executor
    that drops one is refused before a token is applied (no request advances on another's tokens):
    the step raises, every request is as before, and the next step with a sound executor carries on."""
    eng = LLM(**SMALL, num_kv_blocks=64, max_num_seqs=4, clock="modeled", cost_model=0.01).engine
    ps = prompts(4, length=6, seed=2)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ps]
    eng.step()
    real_execute = eng.executor.execute

    def execute(out):  # the last grant's tokens missing (fault injection)
        res = real_execute(out)
        res.sampled = res.sampled[:-1]
        return res

    eng.executor.execute = execute
    before = _request_state(eng)
    with pytest.raises(RuntimeError, match="executor: 3 token lists for 4 grants"):
        eng.step()
    assert _request_state(eng) == before
    eng.executor.execute = real_execute
    run_to_end(eng)
    assert [eng.requests[rid].output_token_ids for rid in ids] == [alone(p, 4) for p in ps]


def test_a_step_undone_after_its_tokens_were_appended_rolls_their_text_back():
    """A stop string is matched on the incremental text. A step whose on_step hook raises has
    appended its tokens and decoded their text; the rollback cuts both back, so the text always
    decodes the output's tokens, and the retried step finds the stop string the first try had
    found (the text once kept the undone token, the retry added nothing, and the stop was missed)."""

    def run(policy):
        eng = LLM(max_model_len=256, block_size=8, num_kv_blocks=64, policy=policy).engine
        eng.add_request("ROMEO:", SamplingParams(max_tokens=30, temperature=0.0, stop=["ot"]), request_id="a")
        req, faults = eng.requests["a"], 0
        while eng.has_unfinished_requests():
            try:
                eng.step()
            except Boom:
                faults += 1
            if req.detokenizer is not None:
                assert req.detokenizer.text == eng.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        out = eng.get_output("a")
        return (out.token_ids, out.text, out.finish_reason, req.stop_reason), faults

    clean, _ = run(Priority())
    assert clean[2:] == ("stop", "ot")
    flaky, faults = run(FlakyPriority("on_step", range(1, 100, 2)))
    assert faults >= 3 and flaky == clean


@pytest.mark.parametrize("ask", ["get_output", "is_finished", "output_text", "abort_request"])
def test_an_unknown_request_id_is_a_key_error_naming_it(ask):
    eng = LLM(**SMALL, num_kv_blocks=32).engine
    with pytest.raises(KeyError) as e:
        getattr(eng, ask)("nope")
    assert str(e.value).startswith("unknown request_id='nope'")


@pytest.mark.parametrize("config", [dict(batching="static"), dict(schedule_every=4)])
def test_aborting_a_request_done_but_held_back_keeps_its_finish_reason(config):
    """Static and every-N batching hold a finished request back until its batch is returned: an abort
    then changes nothing, it finishes with its own reason and tokens, and nothing leaks."""
    eng = LLM(**SMALL, num_kv_blocks=32, **config).engine
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True), request_id="short")
    eng.add_request([4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True), request_id="long")
    while not eng.scheduler.held:
        eng.step()
    assert [r.request_id for r in eng.scheduler.held] == ["short"]
    eng.abort_request("short")
    rec = eng.step()
    assert "short" not in rec.aborted
    run_to_end(eng)
    assert eng.get_output("short").finish_reason == "length" and len(eng.get_output("short").token_ids) == 1
    assert eng.get_output("long").finish_reason == "length"


def _poison(eng, rid):
    """Give the engine's own copy of ``rid``'s params a repetition penalty the door refuses (1e-300):
    its logits overflow float32 to +inf, as they did before SamplingParams refused such values."""
    for seq in eng.parents[rid].members if rid in eng.parents else [eng.requests[rid]]:
        seq.sampling_params.repetition_penalty = 1e-300
    if rid in eng.parents:
        for p in eng.parents[rid].params:
            p.repetition_penalty = 1e-300


def _serve(goods, bads=(), poison_late=None, failing_draw=None):
    """Run ``goods`` (prompt, SamplingParams) with the ``bads`` (poisoned at arrival) and ``poison_late``
    (poisoned after two steps) beside them; invariants after every step. Returns the engine."""
    eng = LLM(**SMALL, num_kv_blocks=128, max_num_seqs=8).engine
    for i, (p, sp) in enumerate(goods):
        eng.add_request(p, sp, request_id=f"good{i}")
    for i, (p, sp) in enumerate(bads):
        eng.add_request(p, sp, request_id=f"bad{i}")
        _poison(eng, f"bad{i}")
    if poison_late is not None:
        eng.add_request(poison_late[0], poison_late[1], request_id="late")
    steps = 0

    def on_step(rec):
        nonlocal steps
        steps += 1
        if steps == 2 and poison_late is not None:
            _poison(eng, "late")

    run_to_end(eng, on_step=on_step)
    return eng


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_request_whose_sampling_fails_ends_alone_and_the_batch_is_unchanged(kind):
    """A request whose logits overflow (inf/NaN) ends with finish_reason 'abort' and a finish_detail
    saying why; the requests beside it (greedy, or seeded sampling) get exactly the tokens they get
    without it, and the step does not fail."""
    ps = prompts(4, length=8, seed=7)

    def sp(i, **kw):
        if kind == "greedy":
            return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw)
        return SamplingParams(max_tokens=8, temperature=0.9, seed=40 + i, ignore_eos=True, **kw)

    goods = [(p, sp(i)) for i, p in enumerate(ps[:2])]
    clean = _serve(goods)
    bads = [(ps[2], sp(2)), (ps[3], sp(3, n=2))]
    late = (ps[3], sp(5))
    eng = _serve(goods, bads, poison_late=late)
    for i in range(len(goods)):
        assert eng.get_output(f"good{i}").token_ids == clean.get_output(f"good{i}").token_ids
        assert eng.get_output(f"good{i}").finish_reason == "length"
    for rid in ("bad0", "bad1", "late"):
        out = eng.get_output(rid)
        assert out.finish_reason == "abort", rid
        assert out.finish_detail.startswith("sampling failed: its logits contain"), out.finish_detail
    assert eng.get_output("bad0").token_ids == []
    assert len(eng.get_output("late").token_ids) in (1, 2, 3)  # it failed at a decode


def test_a_draw_that_raises_ends_only_its_request(monkeypatch):
    """A sampling error in one row (here: the draw of one seeded request raises) ends that request;
    the other seeded requests draw the same tokens as without it."""
    ps = prompts(3, length=8, seed=9)
    goods = [
        (p, SamplingParams(max_tokens=6, temperature=1.0, seed=3 + i, ignore_eos=True)) for i, p in enumerate(ps[:2])
    ]
    clean = _serve(goods)
    eng = LLM(**SMALL, num_kv_blocks=128, max_num_seqs=8).engine
    for i, (p, sp) in enumerate(goods):
        eng.add_request(p, sp, request_id=f"good{i}")
    eng.add_request(ps[2], SamplingParams(max_tokens=6, temperature=1.0, seed=99), request_id="bad0")
    sampler, real = eng.executor.sampler, torch.multinomial

    def multinomial(probs, num, generator=None, **kw):
        if generator is not None and generator is sampler.generators.get("bad0"):
            raise RuntimeError("injected: this row's draw fails")
        return real(probs, num, generator=generator, **kw)

    monkeypatch.setattr(torch, "multinomial", multinomial)
    run_to_end(eng)
    assert eng.get_output("bad0").finish_reason == "abort" and eng.get_output("bad0").token_ids == []
    assert eng.get_output("bad0").finish_detail == "sampling failed: the draw failed: injected: this row's draw fails"
    for i in range(len(goods)):
        assert eng.get_output(f"good{i}").token_ids == clean.get_output(f"good{i}").token_ids


def test_the_undo_log_puts_back_every_field_of_a_request():
    """``StepJournal.save`` keeps every field a request has (``Request.__slots__``) and every field of its
    metrics, so a field added later is rolled back with the rest without being listed anywhere: here every
    field is changed after the save, and ``restore`` brings each one back, the output cut to its length."""
    from minillm.core.request import Request, RequestMetrics
    from minillm.core.step_journal import StepJournal

    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=8, logprobs=1), arrival_time=0.5)
    req.append_token(7, 1.0)
    req.output_logprobs.append({7: -0.1})
    before = {f: getattr(req, f) for f in Request.__slots__}
    before_metrics = {f: getattr(req.metrics, f) for f in RequestMetrics.__slots__}
    journal = StepJournal()
    journal.save(req)
    req.append_token(9, 2.0)
    req.output_logprobs.append({9: -0.2})
    for f in Request.__slots__:
        if f not in ("output_token_ids", "output_logprobs", "metrics"):
            object.__setattr__(req, f, ("changed", f))
    for f in RequestMetrics.__slots__:
        if f != "token_times":
            object.__setattr__(req.metrics, f, ("changed", f))
    journal.restore()
    assert {f: getattr(req, f) for f in Request.__slots__} == before
    assert {f: getattr(req.metrics, f) for f in RequestMetrics.__slots__} == before_metrics
    assert req.output_token_ids == [7] and req.metrics.token_times == [1.0] and req.output_logprobs == [{7: -0.1}]
