"""Scheduling policies, interference choices and admission control, on fixed seeded traces.

Every run uses the simulated executor and a modeled clock, so results are exact and
deterministic. Most use ``ConstantStepTime(0.010)`` (the worked examples' 10 ms per step), where a
request of n output tokens is served in exactly n steps (its prefill step samples the first
token); the interference tests need a roofline, where a long prefill costs more than a decode.
Bounds are computed here from the trace, independently of the code under test.
"""

import pytest

from minillm import LLM
from minillm.sim.costmodel import ConstantStepTime, RooflineCostModel
from minillm.analysis.metrics import summarize
from minillm.core.policies import (
    MLFQ,
    POLICIES,
    SJF,
    Fair,
    HistoryPredictor,
    OraclePredictor,
    Policy,
    Priority,
    PromptPredictor,
    make_policy,
)
from minillm.analysis.workloads import TraceRequest, Uniform, submit_trace, synthetic_trace

STEP = 0.010


def _engine(policy="fcfs", cost_model=None, **cfg):
    cfg.setdefault("max_model_len", 2048)
    cfg.setdefault("max_num_batched_tokens", 4096)
    cfg.setdefault("record", "summary")  # per-block maps are for the widgets; not needed here
    engine = LLM(
        model="random",
        executor="simulated",
        clock="modeled",
        policy=policy,
        cost_model=cost_model if cost_model is not None else ConstantStepTime(STEP),
        **cfg,
    ).engine
    return engine


def _run(engine, trace):
    submit_trace(engine, trace, vocab_size=engine.vocab_size)
    engine.run()
    return {rid: r.metrics for rid, r in engine.requests.items()}


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


# =====================================================================================
# The interface
# =====================================================================================


def test_make_policy_names_objects_and_classes():
    assert set(POLICIES) == {"fcfs", "sjf", "priority", "mlfq", "fair"}
    for name, cls in POLICIES.items():
        assert type(make_policy(name)) is cls
        assert make_policy(name).name == name
    p = SJF(predictor="history", aging=5.0)
    assert make_policy(p) is p
    assert isinstance(make_policy(MLFQ), MLFQ)
    m = make_policy("mlfq", quanta=(8, 32), boost_interval=10, boost_unit="steps")
    assert m.quanta == (8, 32) and m.num_levels == 3 and m.boost_interval == 10
    assert isinstance(make_policy("sjf", predictor="prompt").predictor, PromptPredictor)
    with pytest.raises(ValueError, match="policy='lifo'"):
        make_policy("lifo")
    lacks = r"Policy protocol .* lacks name, pick_victim\(\), preempt_for\(\), on_step\(\)"
    with pytest.raises(TypeError, match=lacks):
        make_policy(type("Half", (), {"order_waiting": lambda self, w, now: w})())
    with pytest.raises(ValueError):
        MLFQ(quanta=())
    with pytest.raises(ValueError):
        SJF(aging=-1)
    with pytest.raises(ValueError):
        make_policy("sjf", predictor="crystal-ball")


def test_a_student_policy_plugs_in_like_a_name():
    class LastComeFirstServed(Policy):
        name = "lcfs"

        def __init__(self):
            self.steps = 0

        def order_waiting(self, waiting, now):
            return sorted(waiting, key=lambda r: -r.arrival_time)

        def on_step(self, scheduled, now):
            self.steps += 1

    pol = LastComeFirstServed()
    eng = _engine(pol, max_num_seqs=1)
    assert eng.policy is pol
    trace = [TraceRequest(f"r{i}", 0.001 * i, 8, 5) for i in range(4)]
    m = _run(eng, trace)
    # r0 starts alone (t=0); when it ends, the latest arrival goes first.
    order = sorted(m, key=lambda rid: m[rid].first_scheduled_time)
    assert order == ["r0", "r3", "r2", "r1"]
    assert pol.steps == eng.step_count
    # and FCFS on the same trace keeps arrival order
    m = _run(_engine("fcfs", max_num_seqs=1), trace)
    assert sorted(m, key=lambda rid: m[rid].first_scheduled_time) == ["r0", "r1", "r2", "r3"]


# =====================================================================================
# SJF and its predictors
# =====================================================================================


def test_predictors():
    eng = _engine()
    submit_trace(
        eng,
        [TraceRequest("a", 0.0, 8, 40, tenant="chat"), TraceRequest("b", 0.0, 8, 300, tenant="doc")],
        vocab_size=eng.vocab_size,
    )
    a, b = eng.requests["a"], eng.requests["b"]
    assert OraclePredictor().predict(a) == 40 and OraclePredictor().predict(b) == 300
    h = HistoryPredictor(prior=77)
    assert h.predict(a) == 77  # nothing seen yet: the prior
    eng.run()
    h.observe(a)
    h.observe(b)
    assert h.predict(a) == 40 and h.predict(b) == 300  # per-tenant means
    new = type("R", (), {"tenant": "unknown"})()
    assert h.predict(new) == (40 + 300) / 2  # an unseen class: the global mean
    p = PromptPredictor(base=100)
    mk = lambda text: type("R", (), {"prompt": text})()  # noqa: E731
    assert p.predict(mk("Give a brief answer: what is 1+1?")) == 25
    assert p.predict(mk("Explain in detail the basic principles of quantum mechanics")) == 400
    assert p.predict(mk(None)) == 100


def test_sjf_oracle_beats_fcfs_on_mean_latency():
    # 40 requests arrive together, lengths 5..200 in random order, 4 slots: SJF gives the
    # smallest mean completion time when all job lengths are known.
    trace = synthetic_trace(40, rate=None, prompt_len=16, output_len=Uniform(5, 200), seed=1)
    fcfs = _mean(m.e2e_latency for m in _run(_engine("fcfs", max_num_seqs=4), trace).values())
    sjf = _mean(m.e2e_latency for m in _run(_engine("sjf", max_num_seqs=4), trace).values())
    assert sjf < 0.85 * fcfs
    # sorted by true length, with the same 4 slots, is what SJF did: check against a hand schedule
    lengths = sorted(r.output_len for r in trace)
    slots = [0.0] * 4
    finish = []
    for n in lengths:  # list scheduling, shortest first
        i = min(range(4), key=lambda k: slots[k])
        slots[i] += n * STEP
        finish.append(slots[i])
    assert sjf == pytest.approx(_mean(finish), abs=STEP)


def test_sjf_with_a_history_predictor_beats_fcfs_without_an_oracle():
    # Two kinds of traffic: "chat" always answers in 10 tokens, "doc" in 150. The history
    # predictor learns the per-tenant means from finished requests.
    trace = synthetic_trace(120, rate=30, prompt_len=16, output_len=1, tenant_mix={"chat": 0.7, "doc": 0.3}, seed=2)
    for r in trace:
        r.output_len = 10 if r.tenant == "chat" else 150
    fcfs = _mean(m.e2e_latency for m in _run(_engine("fcfs", max_num_seqs=4), trace).values())
    pol = SJF(predictor="history")
    hist = _mean(m.e2e_latency for m in _run(_engine(pol, max_num_seqs=4), trace).values())
    orac = _mean(m.e2e_latency for m in _run(_engine(SJF(predictor="oracle"), max_num_seqs=4), trace).values())
    assert orac < hist < 0.9 * fcfs
    assert pol.predictor.predict(type("R", (), {"tenant": "chat"})()) == 10


def test_sjf_aging_bounds_the_wait_of_a_long_request():
    """A 200-token request L at t=0 among a stream of 10-token requests, one slot (serial).

    The bound (SJF's docstring): with aging a, L is passed only by requests that arrived by
    (P_L - P_min) / a, so its wait is at most their total service time. Without aging the
    stream starves it until the stream ends.
    """
    gap, n_short, p_long, p_short, aging = 0.08, 150, 200, 10, 95.0
    trace = [TraceRequest("L", 0.0, 8, p_long)]
    trace += [TraceRequest(f"s{j}", round(gap * j, 10), 8, p_short) for j in range(n_short)]
    horizon = (p_long - p_short) / aging  # 2.0 s
    ahead = [r for r in trace if r.request_id != "L" and r.arrival_time <= horizon + 1e-12]
    bound = sum(r.output_len * STEP for r in ahead)  # 26 requests x 0.1 s = 2.6 s
    m = _run(_engine(SJF(aging=aging), max_num_seqs=1), trace)
    assert m["L"].queue_wait <= bound + 1e-9
    m0 = _run(_engine(SJF(aging=0.0), max_num_seqs=1), trace)
    assert m0["L"].queue_wait > 5 * bound  # starved without aging
    assert all(mm.finish_reason == "length" for mm in m.values())


# =====================================================================================
# Priority
# =====================================================================================


def test_priority_serves_the_high_class_first():
    trace = synthetic_trace(
        30, rate=None, prompt_len=16, output_len=Uniform(10, 60), priority_mix={0: 0.3, 1: 0.4, 2: 0.3}, seed=3
    )
    m = _run(_engine("priority", max_num_seqs=3), trace)
    start = {r.request_id: (r.priority, m[r.request_id].first_scheduled_time) for r in trace}
    for p in (0, 1):
        assert max(t for q, t in start.values() if q == p) <= min(t for q, t in start.values() if q > p)
    # FCFS inside a class
    for p in (0, 1, 2):
        cls = [r for r in trace if r.priority == p]
        times = [m[r.request_id].first_scheduled_time for r in cls]
        assert times == sorted(times)


def test_priority_preempts_for_a_slot():
    trace = [TraceRequest(f"low{i}", 0.0, 16, 300, priority=1) for i in range(4)]
    trace += [TraceRequest(f"high{i}", 0.5, 16, 20, priority=0) for i in range(2)]
    eng = _engine("priority", max_num_seqs=4)
    m = _run(eng, trace)
    events = [p for r in eng.step_records for p in r.preempted]
    assert [e.request_id for e in events] == ["low3", "low2"]  # lowest class, most recent first
    assert all("higher priority" in e.reason for e in events)
    assert all(m[f"high{i}"].queue_wait <= STEP for i in range(2))
    assert all(mm.finish_reason == "length" for mm in m.values())  # the victims still finish
    # without preemption (and under FCFS) the high class waits for a low request to finish
    for pol in ("fcfs", Priority(preempt=False)):
        eng = _engine(pol, max_num_seqs=4)
        m = _run(eng, trace)
        assert m["high0"].queue_wait > 2.0
        assert not any(r.preempted for r in eng.step_records)


def test_priority_preempts_under_memory_pressure():
    # Two low-priority requests grow to 400 positions (25 blocks) each in a 50-block cache;
    # at t=1.8 they hold 48 blocks and a high-priority request needs 7 for its prompt.
    trace = [TraceRequest(f"low{i}", 0.0, 200, 200, priority=1) for i in range(2)]
    trace += [TraceRequest("high", 1.8, 100, 20, priority=0)]
    eng = _engine("priority", max_num_seqs=16, num_kv_blocks=50, block_size=16)
    m = _run(eng, trace)
    events = [p for r in eng.step_records for p in r.preempted]
    assert events and events[0].request_id == "low1"
    assert "needs its memory" in events[0].reason
    assert m["high"].queue_wait <= STEP
    eng = _engine("fcfs", max_num_seqs=16, num_kv_blocks=50, block_size=16)
    m_fcfs = _run(eng, trace)
    assert m_fcfs["high"].queue_wait >= 0.15  # waits for a low request to end
    assert all(mm.finish_reason == "length" for mm in list(m.values()) + list(m_fcfs.values()))


# =====================================================================================
# MLFQ
# =====================================================================================


def test_mlfq_beats_fcfs_for_short_requests_without_an_oracle():
    # 8 long requests hold the 4 slots; short ones trickle in. FCFS makes them wait behind
    # the long ones; MLFQ demotes the long ones after 16 tokens and lets the short ones in.
    trace = [TraceRequest(f"long{i}", 0.0, 16, 400) for i in range(8)]
    trace += [TraceRequest(f"s{j}", 0.1 + 0.2 * j, 16, 20) for j in range(30)]
    short = [f"s{j}" for j in range(30)]
    m_f = _run(_engine("fcfs", max_num_seqs=4), trace)
    eng = _engine("mlfq", max_num_seqs=4)
    m_m = _run(eng, trace)
    assert _mean(m_m[r].e2e_latency for r in short) < 0.2 * _mean(m_f[r].e2e_latency for r in short)
    assert eng.stats()["preemptions_recompute"] > 0  # demoted long requests made room
    assert all(mm.finish_reason == "length" for mm in m_m.values())
    # MLFQ never read a length: the oracle is not consulted
    assert all("sjf_predicted" not in r.policy_state for r in eng.requests.values())
    # without preemption, MLFQ only reorders the queue: here the same as FCFS
    m_np = _run(_engine(MLFQ(preempt=False), max_num_seqs=4), trace)
    fcfs_short = _mean(m_f[r].e2e_latency for r in short)
    assert _mean(m_np[r].e2e_latency for r in short) == pytest.approx(fcfs_short)


def test_mlfq_demotes_per_quantum_and_boosts():
    levels = []

    class Watch(MLFQ):
        def on_step(self, scheduled, now):
            super().on_step(scheduled, now)
            levels.append(self.level(scheduled[0].request))

    eng = _engine(Watch(quanta=(4, 8), boost_interval=15, boost_unit="steps"))
    _run(eng, [TraceRequest("r", 0.0, 8, 40)])

    # tokens since the last boost j -> level 0 (j < 4), 1 (4 <= j < 12), 2 (j >= 12);
    # every 15 steps everyone is back at level 0.
    def expected(k):
        if k % 15 == 0:
            return 0
        j = k % 15
        return 0 if j < 4 else 1 if j < 12 else 2

    assert levels == [expected(k) for k in range(1, 41)]
    assert eng.policy.num_boosts == 2

    clock = MLFQ(quanta=(4,), boost_interval=0.1)  # seconds of the modeled clock
    eng = _engine(clock)
    _run(eng, [TraceRequest("r", 0.0, 8, 35)])
    assert clock.num_boosts == 3  # at 0.1, 0.2, 0.3 s (35 steps of 10 ms)


def test_mlfq_boost_bounds_the_wait_of_a_demoted_request():
    """One slot; a 100-token request L and a stream of 3-token requests, one every 2 steps.

    L is demoted after 4 tokens and every newcomer (level 0) pushes it out. The bound: after
    a boost (at most B after L's last token) L is level 0 and the oldest, so it runs once the
    3-token request in the slot ends, and its re-prefill step yields a token: no gap between
    two of L's tokens exceeds B + (3 + 1) steps. Without boosting L waits out the stream.
    """
    short_len, boost = 3, 0.5
    trace = [TraceRequest("L", 0.0, 8, 100)]
    trace += [TraceRequest(f"s{j}", 0.001 + 0.02 * j, 8, short_len) for j in range(500)]

    def worst_gap(policy):
        m = _run(_engine(policy, max_num_seqs=1), trace)
        t = [m["L"].first_scheduled_time] + m["L"].token_times
        assert m["L"].finish_reason == "length"
        return max(b - a for a, b in zip(t, t[1:]))

    assert worst_gap(MLFQ(quanta=(4,), boost_interval=boost)) <= boost + (short_len + 1) * STEP + 1e-9
    assert worst_gap(MLFQ(quanta=(4,), boost_interval=None)) > 10.0


# =====================================================================================
# Fair queuing (VTC)
# =====================================================================================


def _flood_trace():
    flood = [TraceRequest(f"flood-{i}", 0.0, 32, 32, tenant="flood") for i in range(60)]
    polite = [TraceRequest(f"b-{i}", 0.0, 32, 32, tenant="b") for i in range(15)]
    return flood + polite  # the flood is queued first: FCFS serves it first


def _service_while_backlogged(eng, weights, w_in=1.0, w_out=2.0):
    """Weighted service per tenant after each step, from the StepRecords (not the policy)."""
    tenant = {rid: r.tenant for rid, r in eng.requests.items()}
    service = {t: 0.0 for t in set(tenant.values())}
    admitted, diffs = set(), []
    for rec in eng.step_records:
        for e in rec.batch:
            t = tenant[e.request_id]
            service[t] += (
                (w_in * e.num_new_tokens if e.phase == "prefill" else 0.0) + w_out * e.num_output_tokens
            ) / weights.get(t, 1.0)
        admitted.update(rec.admitted)
        if all(any(rid not in admitted and tenant[rid] == t for rid in tenant) for t in service):
            diffs.append(abs(service["flood"] - service["b"]))
    return diffs


def test_fair_bounds_the_service_gap_when_one_tenant_floods():
    max_num_seqs = 4
    c_max = 1.0 * 32 + 2.0 * 32  # one request's weighted cost
    bound = (max_num_seqs + 1) * c_max  # Fair's docstring
    trace = _flood_trace()
    eng = _engine("fair", max_num_seqs=max_num_seqs)
    m = _run(eng, trace)
    diffs = _service_while_backlogged(eng, {})
    assert diffs and max(diffs) <= bound
    b_fair = _mean(m[f"b-{i}"].e2e_latency for i in range(15))
    # FCFS serves the whole flood first: the gap grows far past the bound
    eng_f = _engine("fcfs", max_num_seqs=max_num_seqs)
    m_f = _run(eng_f, trace)
    assert max(_service_while_backlogged(eng_f, {})) > 5 * bound
    assert b_fair < 0.5 * _mean(m_f[f"b-{i}"].e2e_latency for i in range(15))
    assert all(mm.finish_reason == "length" for mm in list(m.values()) + list(m_f.values()))


def test_fair_tenant_weights():
    # b has weight 2: its counter grows half as fast, so it is owed twice the raw service.
    c_max = 1.0 * 32 + 2.0 * 32  # the flood's (weight 1) is the largest
    share = {}
    for weights in ({}, {"b": 2.0}):
        eng = _engine(Fair(tenant_weights=weights), max_num_seqs=4)
        _run(eng, _flood_trace())
        diffs = _service_while_backlogged(eng, weights)
        assert diffs and max(diffs) <= 5 * c_max  # the bound, on weighted service
        raw = _service_while_backlogged_raw(eng)
        share[bool(weights)] = raw["b"] / raw["flood"]
    assert share[False] == pytest.approx(1.0, abs=0.1)
    assert share[True] > 1.3


def _service_while_backlogged_raw(eng):
    """Unweighted service per tenant at the last step where both still had requests waiting."""
    tenant = {rid: r.tenant for rid, r in eng.requests.items()}
    raw, admitted, last = {"flood": 0.0, "b": 0.0}, set(), None
    for rec in eng.step_records:
        for e in rec.batch:
            prefill = e.num_new_tokens if e.phase == "prefill" else 0.0
            raw[tenant[e.request_id]] += prefill + 2.0 * e.num_output_tokens
        admitted.update(rec.admitted)
        if all(any(rid not in admitted and tenant[rid] == t for rid in tenant) for t in raw):
            last = dict(raw)
    return last


# =====================================================================================
# Interference: prefill-priority, decode-priority, chunked
# =====================================================================================


def _interference(kind):
    cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    cfg = {
        "prefill-priority": dict(enable_chunked_prefill=False, max_num_batched_tokens=8192),
        "decode-priority": dict(enable_chunked_prefill=False, max_num_batched_tokens=8192),
        "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=512),
    }[kind]
    eng = _engine("fcfs", cost_model=cm, interference=kind, max_model_len=8192, max_num_seqs=8, **cfg)
    # four requests decoding; a 4000-token prompt arrives in the middle of it
    trace = [TraceRequest(f"d{i}", 0.0, 16, 300) for i in range(4)] + [TraceRequest("P", 0.5, 4000, 10)]
    m = _run(eng, trace)
    stall = max(max(m[f"d{i}"].inter_token_latencies) for i in range(4))
    return eng, m, stall, cm


def test_chunked_prefill_bounds_the_decode_stall():
    _, m_pp, stall_pp, cm = _interference("prefill-priority")
    _, m_ch, stall_ch, _ = _interference("chunked")
    # the worst gap between two tokens of a decoding request: a 4000-token prefill step vs
    # a step of at most 512 tokens (the budget), priced by the same roofline
    full_prefill = cm.step_time([4000, 1, 1, 1, 1], [4000, 320, 320, 320, 320])
    budget_step = cm.step_time([508, 1, 1, 1, 1], [4000, 320, 320, 320, 320])
    assert stall_pp >= full_prefill
    assert stall_ch <= budget_step + 1e-12
    assert stall_ch < stall_pp / 4
    # the cost: the long prompt's prefill is split into 8 steps that each re-read the weights,
    # so its first token comes a little later
    assert 1.0 < m_ch["P"].ttft / m_pp["P"].ttft < 1.2


def test_decode_priority_protects_decodes_and_delays_the_new_prompt():
    _, m_dp, stall_dp, cm = _interference("decode-priority")
    _, m_ch, stall_ch, _ = _interference("chunked")
    assert stall_dp < stall_ch  # decodes are never interrupted
    assert m_dp["P"].ttft > 10 * m_ch["P"].ttft  # the prompt waits for them to end
    assert m_dp["P"].first_scheduled_time >= max(m_dp[f"d{i}"].finish_time for i in range(4)) - 1e-12


# =====================================================================================
# Determinism and admission control
# =====================================================================================


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "priority", "mlfq", "fair"])
def test_modeled_runs_are_deterministic(policy):
    def once():
        cm = RooflineCostModel("H100-SXM", "llama-2-7b")
        trace = synthetic_trace(
            60,
            rate=40,
            prompt_len=Uniform(16, 400),
            output_len=Uniform(4, 120),
            priority_mix={0: 0.5, 1: 0.5},
            tenant_mix={"a": 0.7, "b": 0.3},
            seed=7,
        )
        eng = _engine(
            policy, cost_model=cm, max_num_seqs=8, num_kv_blocks=120, block_size=16, max_num_batched_tokens=512
        )
        m = _run(eng, trace)
        return summarize(m, eng.step_records, max_num_seqs=8), {r: mm.token_times for r, mm in m.items()}

    (s1, t1), (s2, t2) = once(), once()
    assert s1 == s2 and t1 == t2
    assert s1["num_finished"] == 60


def test_queue_cap_rejections_are_counted_and_nothing_is_lost():
    trace = synthetic_trace(50, rate=None, prompt_len=16, output_len=Uniform(5, 40), seed=4)
    eng = _engine("fcfs", max_num_seqs=4, max_queue_len=5)
    m = _run(eng, trace)
    rejected = [rid for rid, mm in m.items() if mm.finish_reason == "rejected"]
    finished = [rid for rid, mm in m.items() if mm.finish_reason == "length"]
    assert len(rejected) + len(finished) == 50  # every request accounted for
    assert len(finished) == 4 + 5  # 4 admitted at once, 5 queued
    assert eng.stats()["rejected"] == len(rejected) == 41
    assert summarize(m)["num_rejected"] == 41
    for rid in rejected:
        assert "max_queue_len=5" in eng.requests[rid].finish_detail
        assert eng.get_output(rid).finish_reason == "rejected"
    rec = eng.step_records[0]
    assert {w.request_id for w in rec.rejected} == set(rejected)
    assert not {w.request_id for w in rec.waiting} & set(rejected)  # not both waiting and rejected


@pytest.mark.parametrize("every", [1, 5])
def test_queue_cap_never_refuses_a_free_slot(every):
    # the cap counts requests still waiting after a pass, so a zero-length queue still serves
    # everyone when there is room, also when requests arrive between passes
    eng = _engine("fcfs", max_num_seqs=4, max_queue_len=0, schedule_every=every)
    m = _run(eng, [TraceRequest(f"r{i}", 0.013 * i, 16, 3) for i in range(3)])
    assert all(mm.finish_reason == "length" for mm in m.values())


def test_queue_delay_rejections_use_the_modeled_clock():
    # 1 slot, requests of 10 steps (0.1 s) every 0.02 s: the queue grows; nobody may wait > 0.25 s
    trace = [TraceRequest(f"r{i}", 0.02 * i, 16, 10) for i in range(40)]
    eng = _engine("fcfs", max_num_seqs=1, max_queue_delay=0.25)
    m = _run(eng, trace)
    rejected = [mm for mm in m.values() if mm.finish_reason == "rejected"]
    served = [mm for mm in m.values() if mm.finish_reason == "length"]
    assert rejected and served and len(rejected) + len(served) == 40
    assert eng.stats()["rejected"] == len(rejected)
    assert all(mm.queue_wait <= 0.25 + 1e-9 for mm in served)
    assert all(0.25 < mm.finish_time - mm.arrival_time <= 0.25 + STEP + 1e-9 for mm in rejected)
