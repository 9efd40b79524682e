"""The simulated executor and ``simulate()``: a 70B-shaped model on modeled H100s.

Expected capacities are worked out here by hand from datasheet figures and the model's
shape (as in test_costmodel.py), never read from the code under test.
"""

import dataclasses
import gc
import time

import pytest

from minillm import LLM, SamplingParams
from minillm.sim.costmodel import HARDWARE, MODELS, ConstantStepTime, RooflineCostModel
from minillm.analysis.metrics import summarize
from minillm.core.policies import MLFQ, SJF, Fair, Priority
from minillm.sim.sim_executor import PLACEHOLDER_TOKEN
from minillm.sim.simulated import StepSummary, gpus_needed, simulate, tensor_parallel
from minillm.analysis.workloads import (
    LogNormal,
    TraceRequest,
    Uniform,
    shared_prefix_trace,
    submit_trace,
    synthetic_trace,
)

# Llama-2-70B: 68,976,648,192 parameters in bf16; KV per token 2 x 80 layers x 8 KV heads x 128 x 2 B.
W70 = 68_976_648_192 * 2
KV70 = 2 * 80 * 8 * 128 * 2  # 327,680 bytes per position
# 4 x H100 (80 GB each), 90% of memory usable: (288e9 - weights) / KV per position
CAP_4xH100 = int((4 * 80e9 * 0.9 - W70) // KV70)  # 150,046,703,616 / 327,680 = 457,906 positions


def test_tensor_parallel_and_gpus_needed():
    hw = tensor_parallel("H100-SXM", 4)
    h1 = HARDWARE["H100-SXM"]
    assert hw.name == "4xH100-SXM"
    assert hw.peak_flops == 4 * h1.peak_flops and hw.hbm_bandwidth == 4 * h1.hbm_bandwidth
    assert hw.hbm_bytes == 4 * h1.hbm_bytes
    assert tensor_parallel("H100-SXM", 1) is h1
    assert gpus_needed("H100-SXM", "llama-2-70b") == 4  # 138 GB of weights: half of 4 x 80 GB
    assert gpus_needed("H100-SXM", "llama-2-7b") == 1
    with pytest.raises(ValueError):
        tensor_parallel("H100-SXM", 0)


def test_the_70b_shape_sizes_the_kv_cache_and_prices_swaps():
    cm = RooflineCostModel(tensor_parallel("H100-SXM", 4), MODELS["llama-2-70b"])
    eng = LLM(model="random", executor="simulated", clock="modeled", cost_model=cm).engine
    assert CAP_4xH100 == 457_906 and CAP_4xH100 // 16 == 28_619
    assert eng.num_kv_blocks == CAP_4xH100 // 16
    assert eng.executor.bytes_per_block == KV70 * 16  # not the tiny random model's
    # the same through a preset name: the engine prices its own (70B) shape
    eng = LLM(
        model="llama-2-70b", executor="simulated", clock="modeled", cost_model=tensor_parallel("H100-SXM", 4)
    ).engine
    assert eng.model_spec is MODELS["llama-2-70b"]
    assert eng.cost_model.model is MODELS["llama-2-70b"]
    assert eng.num_kv_blocks == CAP_4xH100 // 16
    assert eng.vocab_size == 32000
    # one H100 cannot even hold the weights (138 GB > 72 GB usable): no KV at all, said clearly
    with pytest.raises(ValueError, match="no memory for a KV cache"):
        LLM(model="llama-2-70b", executor="simulated", clock="modeled", cost_model="H100-SXM")


def test_simulated_executor_generates_placeholders_to_max_tokens():
    eng = LLM(model="random", executor="simulated", clock="modeled", cost_model=ConstantStepTime(0.01)).engine
    trace = [TraceRequest("a", 0.0, 30, 7), TraceRequest("b", 0.0, 5, 40)]
    submit_trace(eng, trace, vocab_size=eng.vocab_size)
    eng.run()
    for r in trace:
        out = eng.get_output(r.request_id)
        assert out.token_ids == [PLACEHOLDER_TOKEN] * r.output_len
        assert out.finish_reason == "length"
    assert eng.step_count == 40 and eng.clock.now() == pytest.approx(0.40)


def test_future_arrivals_wait_outside_the_queue_and_the_idle_clock_jumps():
    eng = LLM(model="random", executor="simulated", clock="modeled", cost_model=ConstantStepTime(0.01)).engine
    submit_trace(eng, [TraceRequest("now", 0.0, 8, 3), TraceRequest("later", 5.0, 8, 3)], vocab_size=eng.vocab_size)
    assert [r.request_id for r in eng.scheduler.waiting] == ["now"]
    assert eng.scheduler.next_arrival() == 5.0
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == []
    eng.run()
    m = eng.requests["later"].metrics
    assert m.first_scheduled_time == pytest.approx(5.0) and m.queue_wait == pytest.approx(0.0)
    assert eng.clock.now() == pytest.approx(5.03)
    # nothing is charged for waiting: 3 + 3 steps of 10 ms, and the jump
    assert sum(r.duration for r in eng.step_records) == pytest.approx(0.06)
    # an aborted future request leaves no trace in the arrival heap
    eng.add_request([11, 12], request_id="x", arrival_time=9.0)
    eng.abort_request("x")
    assert not eng.has_unfinished_requests()


def test_simulate_records_modes_agree():
    trace = synthetic_trace(
        300, rate=40, prompt_len=LogNormal(128, 1.0, 4, 1024), output_len=LogNormal(64, 0.8, 2, 512), seed=5
    )
    eng_f, s_full = simulate(trace, records="full")
    eng_s, s_sum = simulate(trace, records="summary")
    assert len(eng_f.step_records) == eng_f.step_count and not eng_f.step_summaries
    assert not eng_s.step_records and len(eng_s.step_summaries) == eng_s.step_count
    assert isinstance(eng_s.step_summaries[0], StepSummary)
    for k in (
        "num_finished",
        "duration",
        "output_throughput",
        "ttft_mean",
        "e2e_p99",
        "batch_size_mean",
        "kv_util_mean",
        "schedule_overhead_fraction",
        "num_steps",
    ):
        assert s_full[k] == s_sum[k], k
    assert s_full["num_gpus"] == 4 and s_full["cost_model"] == "roofline(4xH100-SXM, llama-2-70b)"
    assert s_full["num_finished"] == 300
    # its own cost: CPU seconds of the call, of which stepping the engine is most; the collector,
    # paused while it ran, is on again
    assert 0 < s_sum["step_cpu_time"] <= s_sum["cpu_time"] and gc.isenabled()
    # StepSummary matches the full record it came from; its KV totals (record="totals": no
    # per-request entries) are the full snapshot's at every step
    rec, summ = eng_f.step_records[10], eng_s.step_summaries[10]
    assert summ.batch_size == len(rec.batch) and summ.kv.used == rec.kv.used
    assert [s.kv for s in eng_s.step_summaries] == [
        (r.kv.used, r.kv.total, r.kv.free, r.kv.blocks_used * r.kv.block_size) for r in eng_f.step_records
    ]
    assert eng_s.record_mode == "totals"
    assert summ.num_prefill_tokens == rec.num_prefill_tokens
    assert summ.num_decode_tokens == rec.num_decode_tokens


def test_simulate_under_overload_loses_nothing():
    # 3x what 8 slots can serve, with a queue cap: every request is either served or rejected
    trace = synthetic_trace(400, rate=200, prompt_len=Uniform(32, 512), output_len=Uniform(16, 256), seed=6)
    eng, s = simulate(trace, max_num_seqs=8, max_queue_len=20, policy="sjf")
    assert s["num_finished"] + s["num_rejected"] == 400 and s["num_unfinished"] == 0
    assert s["num_rejected"] == eng.stats()["rejected"] > 0
    # records keep at most max_waiting_entries reasons per step, even with a long queue
    assert max(len(r.waiting) for r in eng.step_records) <= 32
    assert summarize(eng.request_metrics())["num_rejected"] == s["num_rejected"]


def test_ten_thousand_requests_of_a_70b_model():
    """The at-scale replay: 10,000 chat-like requests (ShareGPT-sized: ~200 tokens in, ~190 out)
    at 20 req/s on 4 modeled H100s. Prints the wall time; asserts only that it completes."""
    trace = synthetic_trace(
        10_000, rate=20, prompt_len=LogNormal(128, 1.0, 4, 2048), output_len=LogNormal(128, 0.9, 4, 1024), seed=0
    )
    t0 = time.perf_counter()
    eng, s = simulate(trace, model="llama-2-70b", hardware="H100-SXM")
    wall = time.perf_counter() - t0
    print(
        f"\n10,000 requests of llama-2-70b on 4 x H100 (modeled): {eng.step_count} steps, "
        f"{s['duration']:.0f} s modeled, {wall:.1f} s wall; "
        f"{s['output_throughput']:.0f} output tok/s, TTFT p99 {s['ttft_p99'] * 1e3:.0f} ms"
    )
    assert s["num_finished"] == 10_000 and s["num_unfinished"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in trace)


def test_records_off_changes_no_decision():
    """``records=False`` runs the engine with ``record="none"`` (no KV snapshot, no batch
    entries): every request's metrics and every count must equal the fully recorded run's,
    under preemption (recompute and swap), chunked prefill and a long FCFS queue."""
    trace = synthetic_trace(
        300, rate=60.0, prompt_len=LogNormal(300, 1.0, 8, 1500), output_len=LogNormal(100, 1.0, 4, 400), seed=11
    )
    for cfg in (
        dict(num_kv_blocks=300, max_num_batched_tokens=1024),
        dict(num_kv_blocks=300, preemption_mode="swap", num_swap_blocks=200, policy="sjf"),
        dict(max_num_seqs=8, enable_chunked_prefill=False),
    ):
        full_eng, full = simulate(trace, records="full", **cfg)
        off_eng, off = simulate(trace, records=False, **cfg)
        assert off_eng.record_mode == "none" and off_eng.step_records == []
        assert full_eng.step_count == off_eng.step_count
        assert {k: r.metrics for k, r in full_eng.requests.items()} == {
            k: r.metrics for k, r in off_eng.requests.items()
        }
        assert full_eng.stats() == off_eng.stats()
        from_requests = ("ttft_p99", "tpot_p50", "e2e_max", "num_finished", "output_throughput", "num_preemptions")
        assert {k: full[k] for k in from_requests} == {k: off[k] for k in from_requests}
        assert (full["num_preemptions"] > 0) == ("num_kv_blocks" in cfg)
    assert max(len(r.waiting) for r in full_eng.step_records) > 8


def _engine(trace, **cfg):
    """The engine ``simulate(records=False)`` steps, with ``trace`` submitted."""
    cfg = {"record": "none", **cfg}
    eng = LLM(
        "random",
        executor="simulated",
        clock="modeled",
        cost_model=RooflineCostModel(tensor_parallel("H100-SXM", 4), MODELS["llama-2-70b"]),
        **cfg,
    ).engine
    submit_trace(eng, trace, vocab_size=eng.vocab_size)
    return eng


def _requests(eng):
    return {
        k: (r.output_token_ids, r.num_computed_tokens, r.status, r.finish_reason, r.metrics)
        for k, r in eng.requests.items()
    }


def _policy_states(eng):
    return {k: r.policy_state for k, r in eng.requests.items()}


def _lockstep(trace, stepper=None, sync_every: int = 50, **cfg):
    """Two engines alike, one stepped by ``FastForward`` (or ``stepper``, a subclass), one by ``engine.step()``,
    compared after every step: the records (and with record="totals" the ``StepSummary`` that
    ``simulate(records="summary")`` keeps of each), every block table and the free list; every request's
    tokens, token times, computed positions and metrics every ``sync_every`` steps and at the end (the fast
    one's lazy requests brought up to date first), then the clock and the counters. Returns the fast stepper."""
    from minillm.sim.fast_forward import FastForward

    def build():  # (a policy given as a factory: one object per engine)
        policy = cfg.get("policy")
        return _engine(trace, **{**cfg, "policy": policy()} if callable(policy) else cfg)

    fast, plain = build(), build()
    ff = (stepper or FastForward)(fast)
    totals = fast.record_mode == "totals"
    i = 0
    while plain.has_unfinished_requests():
        assert fast.has_unfinished_requests(), i
        rec, want = ff.step(), plain.step()
        assert dataclasses.asdict(rec) == dataclasses.asdict(want), (cfg, i)
        if totals:
            assert StepSummary.from_record(rec, len(fast.scheduler.waiting)) == StepSummary.from_record(
                want, len(plain.scheduler.waiting)
            ), (cfg, i)
        assert {r: [b.block_id for b in bl] for r, bl in fast.kv.req_blocks.items()} == {
            r: [b.block_id for b in bl] for r, bl in plain.kv.req_blocks.items()
        }, (cfg, i)
        assert list(fast.kv.pool.free_queue) == list(plain.kv.pool.free_queue), (cfg, i)
        if isinstance(fast.policy, (Fair, MLFQ)):  # the tenants' counters and who ran; MLFQ's boosts
            assert vars(fast.policy) == vars(plain.policy), (cfg, i)
        i += 1
        if i % sync_every == 0:
            ff.sync()
            assert _requests(fast) == _requests(plain), (cfg, i)
            if isinstance(fast.policy, MLFQ):  # every request's level and tokens at it
                assert _policy_states(fast) == _policy_states(plain), (cfg, i)
    assert not fast.has_unfinished_requests()
    ff.sync()
    assert _requests(fast) == _requests(plain)
    assert fast.step_count == plain.step_count and fast.clock.now() == plain.clock.now()
    assert fast.stats() == plain.stats() and fast.scheduler.num_passes == plain.scheduler.num_passes
    assert [dataclasses.asdict(r) for r in fast.step_records] == [dataclasses.asdict(r) for r in plain.step_records]
    assert list(fast.active) == list(plain.active) == []
    return ff


FF_TRACE = dict(
    n=150,
    rate=8.0,
    prompt_len=LogNormal(300, 1.0, 8, 1500),
    output_len=LogNormal(150, 1.0, 4, 800),
    priority_mix={0: 0.3, 1: 0.7},
    tenant_mix={"a": 0.6, "b": 0.4},
    seed=5,
)


@pytest.mark.parametrize(
    "cfg, passed_on",
    [
        (dict(), False),  # seats to spare: decodes, arrivals
        (dict(max_num_seqs=4), False),  # a queue behind full seats
        (dict(num_kv_blocks=300), True),  # preemption (steps passed on)
        (dict(num_kv_blocks=300, preemption_mode="swap", num_swap_blocks=100), True),  # swapping out and back
        (dict(max_num_batched_tokens=512), False),  # prompts in chunks, capped by the budget left at their turn
        (dict(max_num_batched_tokens=40, max_num_seqs=48), False),  # a budget as small as the batch
        (dict(enable_chunked_prefill=False, num_kv_blocks=400, max_num_batched_tokens=4096), True),
        (dict(watermark=0.3, num_kv_blocks=500, block_size=8), False),  # admission's headroom, other blocks
        (dict(max_model_len=600), False),  # max_model_len ends requests
        (dict(policy="sjf", max_num_seqs=8), False),  # SJF: the queue in its order, with aging
        (dict(policy=lambda: SJF(predictor="history"), num_kv_blocks=300), True),  # it learns from finishes
        (dict(policy="priority", max_num_seqs=8), True),  # classes: preempting for a seat (undone, passed on)
        (dict(policy="priority", num_kv_blocks=400, max_num_batched_tokens=1024), True),  # ... for KV memory
        (dict(policy=lambda: Priority(preempt=False), max_num_seqs=8), False),  # classes, no preemption
        (dict(policy="fair", max_num_seqs=8, max_num_batched_tokens=512), False),  # tenants' counters, chunks
        (dict(policy="fair", num_kv_blocks=300), True),  # ... under preemption
        (dict(policy="mlfq", max_num_seqs=16), "most"),  # levels: preempting for a seat, most steps (passed on)
        (dict(policy=lambda: MLFQ(quanta=(4, 16), boost_interval=3.0)), False),  # boosts every 3 s
        (dict(policy=lambda: MLFQ(boost_interval=40, boost_unit="steps"), num_kv_blocks=400), "most"),
    ],
    ids=[
        "seats",
        "queue",
        "preempt",
        "swap",
        "chunks",
        "small-budget",
        "no-chunking",
        "watermark",
        "max-model-len",
        "sjf",
        "sjf-history",
        "priority-seats",
        "priority-memory",
        "priority-no-preempt",
        "fair",
        "fair-preempt",
        "mlfq-seats",
        "mlfq-boosts",
        "mlfq-step-boosts",
    ],
)
@pytest.mark.parametrize("record", ["none", "totals"])
def test_fast_forward_changes_no_decision(cfg, passed_on, record):
    """``minillm/sim/fast_forward.py`` against the same engine stepped by ``engine.step()``: the same
    records step by step, the same block tables and free list after every step (so the same blocks in
    the same order), every request's tokens, token times and metrics, the same clock and counters; with
    arrivals, a queue behind full seats, prompt chunks under the budget, admission blocked by memory, the
    watermark, length limits, SJF's order (its predictor learning from what finishes), priority classes,
    and (passed on to ``engine.step()``) preemption by recompute and by swapping, and a priority class
    pushing a running request out (the fast step undone first). In both
    record modes it covers: "none" (``simulate(records=False)``) and "totals" (``records="summary"``:
    the step's token and request counts, the KV totals, and up to 16 waiting reasons)."""
    cfg = {"max_model_len": 4096, "record": record, "record_max_waiting": 16, "record_history": 0, **cfg}
    trace = synthetic_trace(**FF_TRACE)
    if cfg["max_model_len"] < 4096:
        trace = [r for r in trace if r.prompt_len < cfg["max_model_len"] - 100]
    ff = _lockstep(trace, **cfg)
    assert (ff.steps_taken > ff.steps_passed_on) == (passed_on != "most")  # most steps fast-forwarded, or not
    assert (ff.steps_passed_on > 0) == bool(passed_on), ff.steps_passed_on


@pytest.mark.parametrize("seed", range(6))
def test_fast_forward_on_random_settings(seed):
    """Settings drawn at random (seeded: the same draws every run) from what the what-if widget offers and
    beyond it: seats, budget, chunking, KV blocks and block size, headroom, preemption mode, policy, and a
    trace of its own; fast-forward against ``engine.step()`` as above, in both record modes."""
    import random

    rng = random.Random(seed)
    budget = rng.choice([64, 256, 512, 2048])
    block_size = rng.choice([1, 4, 16, 32])
    cfg = dict(
        max_num_seqs=rng.choice([2, 8, 32, 128]),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=budget < 1600 or rng.random() < 0.5,
        block_size=block_size,
        num_kv_blocks=rng.choice([3000, 6000, 40000]) // block_size,
        watermark=rng.choice([0.0, 0.05, 0.2]),
        policy=rng.choice(["fcfs", "sjf", "priority", "fair", "mlfq"]),
        max_model_len=2048,
        record=rng.choice(["none", "totals"]),
        record_max_waiting=rng.choice([0, 4, 16]),
        record_history=0,
    )
    mode = rng.choice(["recompute", "swap"])
    if mode == "swap":
        cfg.update(preemption_mode="swap", num_swap_blocks=cfg["num_kv_blocks"])
    trace = synthetic_trace(
        n=60,
        rate=rng.choice([2.0, 8.0, 30.0]),
        prompt_len=LogNormal(rng.choice([64, 300]), 1.0, 4, 1500),
        output_len=LogNormal(rng.choice([20, 120]), 1.0, 2, 400),
        priority_mix={0: 0.3, 1: 0.7},
        tenant_mix={"a": 0.7, "b": 0.2, "c": 0.1},
        seed=seed,
    )
    if not cfg["enable_chunked_prefill"]:
        trace = [r for r in trace if r.prompt_len <= budget]
    _lockstep(trace, sync_every=7, **cfg)


def test_the_fast_forward_check_catches_a_planted_bug():
    """The comparison above can fail: a stepper that hands out one step's new blocks in the reverse of the
    running order (everything else the same) is caught, and so is one whose requests catch up a step late."""
    from minillm.sim.fast_forward import FastForward

    class ReversedBlocks(FastForward):
        def _due(self, table, step, field):
            return super()._due(table, step, field)[::-1]

    class LateTimes(FastForward):
        def _catch_up(self, req, lazy, step, tokens=True):
            super()._catch_up(req, lazy, step, tokens)
            if tokens and req.metrics.token_times:
                req.metrics.token_times[-1] += 1e-9

    class KVBehind(FastForward):  # record="totals": the KV used as if the lazy requests' step were not taken
        def _kv_totals(self):
            kv = super()._kv_totals()
            return dataclasses.replace(kv, used=kv.used - self.num_lazy)

    class ArrivalOrder(FastForward):  # SJF's queue admitted in arrival order
        def __init__(self, engine):
            super().__init__(engine)
            self.keeps_order = True

    class TenantsUncharged(FastForward):  # fair queuing: the lazy requests' tokens charged to nobody
        def _charge_tenants(self, out, end, lazy_by_tenant, lazy_prefill):
            super()._charge_tenants(out, end, {}, {})

    trace = synthetic_trace(**{**FF_TRACE, "n": 40})
    for planted, cfg in (
        (ReversedBlocks, dict(record="none")),
        (LateTimes, dict(record="none")),
        (KVBehind, dict(record="totals", record_history=0)),
        (ArrivalOrder, dict(record="none", policy=lambda: SJF(aging=0.0), max_num_seqs=8)),
        (TenantsUncharged, dict(record="none", policy="fair", max_num_seqs=8)),
    ):
        with pytest.raises(AssertionError):
            _lockstep(trace, stepper=planted, sync_every=10, max_model_len=4096, **cfg)


def test_fast_forward_counts_a_prompts_last_token_as_prefill():
    """record="totals": a prompt chunked so that one token is left computes it alone in the next step, where
    fast-forward counts one token for it as for a decode; that token is a prefill (the request has no output
    yet). Hand-derived with a budget of 256: "a" (257 tokens) takes 256 in step 0; in step 1 its last prompt
    token and 255 of "b"'s 300 are prefill, nothing decodes; "c" comes alone later, the same way. A stepper
    that counts every one-token grant as a decode is caught."""
    from minillm.sim.fast_forward import FastForward

    trace = [
        TraceRequest("a", 0.0, 257, 4),
        TraceRequest("b", 0.0, 300, 3),
        TraceRequest("c", 30.0, 257, 2),
    ]
    cfg = dict(max_num_batched_tokens=256, max_model_len=4096, record="totals", record_history=0)
    eng = _engine(trace, **cfg)
    ff, recs = FastForward(eng), []
    while eng.has_unfinished_requests():
        recs.append(ff.step())
    step1 = recs[1]
    assert (step1.num_prefill_tokens, step1.num_decode_tokens, step1.admitted) == (256, 0, ["b"])
    c_last = next(r for r in recs if r.time > 30.0 and r.num_batched_tokens == 1)  # "c"'s last prompt token
    assert (c_last.num_prefill_tokens, c_last.num_decode_tokens) == (1, 0)
    _lockstep(trace, sync_every=1, **cfg)

    class PromptEndsAsDecode(FastForward):
        def _track(self, req, step):
            super()._track(req, step)
            self.num_lazy_prefill = 0

    with pytest.raises(AssertionError):
        _lockstep(trace, stepper=PromptEndsAsDecode, **cfg)


def test_append_tokens_is_append_token_for_each():
    """``Request.append_tokens`` (the fast path's catch-up) leaves a request as ``append_token`` per token does:
    the tokens, their times and the first token's time."""
    from minillm.core.request import Request

    one, many = (Request("a", [5, 6, 7], SamplingParams(max_tokens=9), arrival_time=1.0) for _ in range(2))
    for tok, t in zip([3, 4, 5], [2.0, 2.5, 3.25]):
        one.append_token(tok, t)
    many.append_tokens([3, 4], [2.0, 2.5])
    many.append_tokens([], [])
    many.append_tokens([5], [3.25])
    assert (many.output_token_ids, many.metrics) == (one.output_token_ids, one.metrics) == (
        [3, 4, 5],
        many.metrics,
    ) and many.metrics.first_token_time == 2.0


def test_fast_forward_covers_only_its_configuration():
    """``FastForward.covers``: the long-simulation configuration (records of counts or none); another policy,
    prefix caching, a constant cost model or an entry per request in the records are stepped by
    ``engine.step()`` (``simulate`` checks before it uses it)."""
    from minillm.sim.fast_forward import FastForward

    trace = synthetic_trace(**{**FF_TRACE, "n": 10})
    for covered in (
        dict(),
        dict(record="totals", record_history=0),
        dict(policy="sjf"),
        dict(policy="priority"),
        dict(policy="fair"),
    ):
        assert FastForward.covers(_engine(trace, **covered)), covered
    for other in (
        dict(policy=Fair(tenant_weights={"a": 3.0})),
        dict(policy=Fair(output_weight=1.5)),
        dict(enable_prefix_caching=True),
        dict(interference="decode-priority"),
        dict(max_queue_len=5),
        dict(record="summary"),
        dict(record="full"),
        dict(record="totals"),  # (its records kept in engine.step_records)
    ):
        assert not FastForward.covers(_engine(trace, **other)), other
    const = LLM("random", executor="simulated", clock="modeled", record="none", cost_model=0.01).engine
    assert not FastForward.covers(const)
    with pytest.raises(ValueError, match="covers"):
        FastForward(const)


@pytest.mark.parametrize("records", [False, "summary"])
def test_simulate_with_and_without_fast_forward(records):
    """``simulate(records=False)`` and ``simulate(records="summary")`` with and without fast-forward: the
    same metrics, summary, step summaries and records passed to ``progress``."""
    from minillm.sim.fast_forward import FastForward

    trace = synthetic_trace(**{**FF_TRACE, "n": 120, "rate": 4.0})
    runs = []
    for ff in (True, False):
        recs: list = []
        eng, summ = simulate(trace, records=records, fast_forward=ff, num_kv_blocks=400, progress=recs.append)
        runs.append((eng, summ, [dataclasses.asdict(r) for r in recs]))
    (a, sa, ra), (b, sb, rb) = runs
    assert FastForward.covers(a)  # (the configuration fast-forward steps)
    assert ra == rb and len(ra) == a.step_count
    assert a.step_summaries == b.step_summaries and len(a.step_summaries) == (a.step_count if records else 0)
    assert {k: r.metrics for k, r in a.requests.items()} == {k: r.metrics for k, r in b.requests.items()}
    timings = ("wall_time", "cpu_time", "step_cpu_time")
    assert {k: v for k, v in sa.items() if k not in timings} == {k: v for k, v in sb.items() if k not in timings}
    # No progress (a quiet step then makes no record, only its summary): the same; on_finished hears of every
    # step that finished requests
    finished: list = []
    c, sc = simulate(trace, records=records, num_kv_blocks=400, on_finished=finished.append)
    assert c.step_summaries == b.step_summaries
    assert {k: r.metrics for k, r in c.requests.items()} == {k: r.metrics for k, r in b.requests.items()}
    assert {k: v for k, v in sc.items() if k not in timings} == {k: v for k, v in sb.items() if k not in timings}
    assert finished == [len(r["finished"]) for r in rb if r["finished"]]


@pytest.mark.parametrize("caching", [False, True])
def test_kv_totals_are_the_full_snapshots_counts(caching):
    """record="totals" (what simulate(records="summary") runs with) keeps the snapshot's counts,
    taken from the pool's counters, and drops its per-request entries and block map: step for
    step, every count equals the full snapshot's, under swapping preemption and (with prefix
    caching) blocks shared between requests."""
    trace = shared_prefix_trace(
        150,
        prefix_len=64,
        suffix_len=LogNormal(96, 0.8, 4, 512),
        output_len=LogNormal(64, 0.8, 2, 256),
        vocab_size=1000,
        rate=60,
        seed=3,
    )
    cfg = dict(
        records="full",
        record_history=None,
        num_kv_blocks=160,
        preemption_mode="swap",
        num_swap_blocks=160,
        enable_prefix_caching=caching,
    )
    full, _ = simulate(trace, **cfg)
    totals, _ = simulate(trace, **{**cfg, "record": "totals"})
    assert totals.record_mode == "totals" and len(totals.step_records) == full.step_count
    assert sum(len(r.preempted) for r in full.step_records) > 0
    counts = (
        "total",
        "used",
        "free",
        "blocks_total",
        "blocks_used",
        "blocks_free",
        "cached",
        "partial_waste",
        "swap_used_blocks",
        "swap_total_blocks",
    )
    for f, t in zip(full.step_records, totals.step_records):
        assert {k: getattr(t.kv, k) for k in counts} == {k: getattr(f.kv, k) for k in counts}
        assert not t.kv.per_request and not t.kv.blocks
        # no batch entry per request, the batch in counts: the full record's, from its entries
        assert not t.batch and (t.batch_size, t.num_prefill_tokens, t.num_decode_tokens) == (
            len(f.batch),
            sum(e.num_new_tokens for e in f.batch if e.phase == "prefill"),
            sum(e.num_new_tokens for e in f.batch if e.phase == "decode"),
        )
    assert any(t.num_prefill_tokens and t.num_decode_tokens for t in totals.step_records)  # mixed steps too
    assert any(f.kv.per_request for f in full.step_records)
    assert any(f.kv.cached for f in full.step_records) == caching  # freed prefix blocks kept for reuse


def test_kv_totals_with_forked_sequences():
    """Parallel sampling with prefix caching: sequences share their prompt's blocks, the last one
    partly filled, until copy-on-write; record="totals" still counts each shared block once,
    exactly as the full snapshot does."""
    import random

    def run(record):
        llm = LLM(
            model="random",
            executor="simulated",
            clock="modeled",
            cost_model=0.01,
            enable_prefix_caching=True,
            num_kv_blocks=40,
            block_size=4,
            max_num_seqs=8,
            record=record,
            record_history=None,
            max_model_len=256,
        )
        rng = random.Random(0)
        system = [rng.randrange(10, 100) for _ in range(9)]
        for i in range(6):
            prompt = system + [rng.randrange(10, 100) for _ in range(rng.randrange(1, 7))]
            llm.engine.add_request(
                prompt,
                SamplingParams(n=3 if i % 2 == 0 else 1, max_tokens=10 + i, ignore_eos=True, temperature=1.0, seed=i),
            )
        return llm.engine.run()

    full, totals = run("full"), run("totals")
    assert sum(len(r.forks) for r in full) == 3 and sum(len(r.copies) for r in full) > 0
    counts = ("used", "free", "blocks_used", "cached", "partial_waste")
    assert [[getattr(r.kv, k) for k in counts] for r in totals] == [[getattr(r.kv, k) for k in counts] for r in full]


def test_every_decode_asks_allocate_for_its_one_token():
    """One decode path: every running request's next token goes through ``kv.allocate(req, 1)``, also
    when it fits the block the request is part way through (a KV manager that overrides ``allocate``
    is asked for every running request every step)."""
    from minillm.core.kv_cache import PagedKVCacheManager
    from minillm.sampling_params import SamplingParams

    calls = []

    class CountingKV(PagedKVCacheManager):
        def allocate(self, req, num_new_tokens, cached=()):
            calls.append((req.request_id, num_new_tokens))
            return super().allocate(req, num_new_tokens, cached)

    engine = LLM(
        "random",
        executor="simulated",
        clock="modeled",
        cost_model=ConstantStepTime(0.01),
        num_kv_blocks=64,
        kv_manager=lambda cfg, n: CountingKV(n, cfg.block_size),
    ).engine
    for _ in range(3):
        engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()  # the 20-token prompts: each now 4 positions into its second block
    calls.clear()
    engine.step()
    assert sorted(calls) == sorted((r.request_id, 1) for r in engine.scheduler.running)
    assert len(calls) == 3


def test_side_by_side_script_steps_two_copies_to_the_same_decisions():
    """``scripts/sim_ab.py A B`` (the side-by-side timing of docs/performance.md) builds both checkouts' engines
    under their own package names in one process and steps them alternately; a checkout against
    itself takes the same steps to the same modeled time, and the script says so."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "scripts/sim_ab.py", str(root), str(root), "--requests", "150", "--chunk", "7"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "B/A" in proc.stdout and "not the same decisions" not in proc.stdout, proc.stdout
