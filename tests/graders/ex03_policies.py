"""Graders of notebook 03's exercises (``exercises/ex03_policies.py``): ``make grade EX=03``.

Every policy runs inside the engine (simulated executor, modeled clock: exact and fast) and is
held against two things it did not compute: the engine's own policy of the same rule
(``minillm.core.policies``) on the same trace, request by request, and the bounds worked out by hand
from the trace (the aging bound, the boost bound, the fair-share bound).
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest

from minillm import LLM, impl
from minillm.sim.costmodel import ConstantStepTime
from minillm.core.policies import MLFQ, SJF, Fair
from minillm.analysis.workloads import TraceRequest, Uniform, submit_trace, synthetic_trace

STEP = 0.010


def _tripwire(*args, **kwargs):
    raise AssertionError(
        "your policy called one of the engine's own policies "
        "(minillm.core.policies: SJF, MLFQ, Fair); the exercise is to write the rule yourself"
    )


@contextlib.contextmanager
def _engine_policies_switched_off():
    """Every method of the engine's SJF, MLFQ, Fair raises while the block runs (your classes are untouched)."""
    with pytest.MonkeyPatch.context() as mp:
        for cls in (SJF, MLFQ, Fair):
            for f in vars(cls).values():
                if inspect.isfunction(f) and not f.__code__.co_freevars:
                    mp.setattr(f, "__code__", _tripwire.__code__)
        yield


def ex():
    return impl.load("ex03_policies")


def _engine(policy, **cfg):
    cfg.setdefault("max_model_len", 2048)
    cfg.setdefault("max_num_batched_tokens", 4096)
    cfg.setdefault("record", "summary")  # per-block maps are for the widgets; not needed here
    cost_model = cfg.pop("cost_model", ConstantStepTime(STEP))
    eng = LLM(model="random", executor="simulated", clock="modeled", cost_model=cost_model, policy=policy, **cfg).engine
    return eng


def _run(eng, trace):
    submit_trace(eng, trace, vocab_size=eng.vocab_size)
    eng.run()
    return {rid: r.metrics for rid, r in eng.requests.items()}


def _schedule(m):
    """When each request started and when each of its tokens came out."""
    return {rid: (mm.first_scheduled_time, tuple(mm.token_times)) for rid, mm in m.items()}


def _secs(t):
    return "never" if t is None else f"{t:.3f} s"


def _first_difference(want, got):
    for rid in want:
        if want[rid] != got.get(rid):
            return (
                f"request {rid}: the engine's policy started it at {want[rid][0]:.3f} s with its last token "
                f"at {want[rid][1][-1]:.3f} s; yours at {_secs(got[rid][0])}, last token "
                f"{_secs(got[rid][1][-1]) if got[rid][1] else 'none'}"
            )
    return "the same"


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


# --- Exercise 1: SJFWithAging ----------------------------------------------------------------------


def test_sjf_key_by_hand():
    eng = _engine("fcfs")
    submit_trace(eng, [TraceRequest("a", 0.0, 8, 40), TraceRequest("b", 0.5, 8, 300)], vocab_size=eng.vocab_size)
    a, b = eng.requests["a"], eng.requests["b"]
    pol = ex().SJFWithAging(aging=10.0)
    for req, now, want in ((a, 0.0, 40.0), (a, 2.0, 40.0 - 20.0), (b, 0.0, 300.0), (b, 3.5, 300.0 - 30.0)):
        got = pol.key(req, now)
        assert got == pytest.approx(want), (
            f"key({req.request_id}, now={now}) with aging 10 tokens/s: predicted "
            f"{pol.predicted(req):g} tokens, waited {max(0, now - req.arrival_time)}"
            f" s: expected {want}, got {got}"
        )
    a.output_token_ids.extend([1] * 45)  # it outlived its prediction
    assert pol.remaining(a) == 0.0, f"remaining() never goes below 0: got {pol.remaining(a)}"
    order = pol.order_waiting([b, a], 0.5)
    assert [r.request_id for r in order] == ["a", "b"], f"a (0 left) goes before b: got {[r.request_id for r in order]}"


@pytest.mark.parametrize("aging", [0.0, 30.0, 200.0])
def test_sjf_matches_the_engines_sjf(aging):
    trace = synthetic_trace(60, rate=25, prompt_len=Uniform(8, 64), output_len=Uniform(4, 150), seed=11)
    want = _schedule(_run(_engine(SJF(predictor="oracle", aging=aging), max_num_seqs=4), trace))
    got = _schedule(_run(_engine(ex().SJFWithAging(predictor="oracle", aging=aging), max_num_seqs=4), trace))
    assert got == want, f"SJF with aging {aging}: {_first_difference(want, got)}"


def test_sjf_with_a_history_predictor_matches_the_engines():
    trace = synthetic_trace(80, rate=30, prompt_len=16, output_len=1, tenant_mix={"chat": 0.7, "doc": 0.3}, seed=2)
    for r in trace:
        r.output_len = 10 if r.tenant == "chat" else 150
    want = _schedule(_run(_engine(SJF(predictor="history", aging=5.0), max_num_seqs=4), trace))
    got = _schedule(_run(_engine(ex().SJFWithAging(predictor="history", aging=5.0), max_num_seqs=4), trace))
    assert got == want, f"SJF with the history predictor: {_first_difference(want, got)}"


def test_sjf_aging_ends_starvation():
    """One 200-token request L at t=0 among a stream of 10-token requests, one slot. With aging a,
    L is passed only by requests that arrived by (200 - 10) / a seconds, so it waits at most
    their service time; without aging it waits for the whole stream."""
    gap, n_short, aging = 0.08, 150, 95.0
    trace = [TraceRequest("L", 0.0, 8, 200)] + [
        TraceRequest(f"s{j}", round(gap * j, 10), 8, 10) for j in range(n_short)
    ]
    horizon = (200 - 10) / aging
    bound = sum(r.output_len * STEP for r in trace[1:] if r.arrival_time <= horizon + 1e-12)
    m = _run(_engine(ex().SJFWithAging(aging=aging), max_num_seqs=1), trace)
    assert m["L"].queue_wait <= bound + 1e-9, (
        f"with aging {aging}, L should wait at most {bound:.2f} s (the "
        f"requests that arrived by {horizon:.2f} s); it waited "
        f"{m['L'].queue_wait:.2f} s"
    )
    m0 = _run(_engine(ex().SJFWithAging(aging=0.0), max_num_seqs=1), trace)
    assert m0["L"].queue_wait > 5 * bound, (
        f"without aging the stream of short requests should starve L; it waited only {m0['L'].queue_wait:.2f} s"
    )
    short = [f"s{j}" for j in range(n_short)]
    assert _mean(m0[r].e2e_latency for r in short) <= _mean(m[r].e2e_latency for r in short), (
        "aging costs the short requests a little: their mean latency should not improve with it"
    )


# --- Exercise 2: MLFQPolicy --------------------------------------------------------------------------


def test_mlfq_levels_by_hand():
    """One request of 40 tokens alone, quanta (4, 8), boost_interval 0.145 s: the timer starts
    after step 1 (t = 0.01 s), so boosts come after steps 16 and 31 (10 ms each). After j tokens
    since the last boost its level is 0 (j < 4), 1 (4 <= j < 12), then 2."""
    levels = []
    pol = ex().MLFQPolicy(quanta=(4, 8), boost_interval=0.145)
    eng = _engine(pol)
    submit_trace(eng, [TraceRequest("r", 0.0, 8, 40)], vocab_size=eng.vocab_size)
    while eng.has_unfinished_requests():
        eng.step()
        levels.append(pol.level(eng.requests["r"]))

    def expected(k):  # k tokens generated after step k (1-based); boosts after steps 16, 31
        j = k if k <= 15 else (k - 16 if k <= 30 else k - 31)
        return 0 if j < 4 else 1 if j < 12 else 2

    want = [expected(k) for k in range(1, 41)]
    assert levels == want, f"levels after each step: expected {want}, got {levels}"
    assert pol.num_boosts == 2, f"two boosts (after steps 16 and 31) in 40 steps, got {pol.num_boosts}"


def _requests(n):
    eng = _engine("fcfs")
    submit_trace(eng, [TraceRequest(f"r{i}", 0.01 * i, 8, 400) for i in range(n)], vocab_size=eng.vocab_size)
    return [eng.requests[f"r{i}"] for i in range(n)]


def test_mlfq_on_step_demotes_through_several_levels_in_one_step():
    """A speculative step can emit several tokens, enough to use up more than one quantum: the
    request falls through every level whose quantum it used up, keeping the tokens left over."""
    pol = ex().MLFQPolicy(quanta=(2, 3, 4), boost_interval=None)
    a, b = _requests(2)

    def step(req, tokens):
        req.output_token_ids.extend([1] * tokens)
        pol.on_step([SimpleNamespace(request=req, num_new_tokens=tokens, phase="decode")], 0.0)
        return list(pol.state(req)[:2])

    got = [step(a, 1), step(a, 10), step(a, 5)]
    assert got == [[0, 1], [3, 2], [3, 7]], (
        f"quanta (2, 3, 4), steps of 1, 10, then 5 tokens: 1 token stays at level 0; 1 + 10 = 11 tokens use up "
        f"2 + 3 + 4 and leave 2 at level 3 (the last, no quantum); 5 more counted there: expected [level, count] "
        f"after each step [[0, 1], [3, 2], [3, 7]], got {got}"
    )
    got = [step(b, 3), step(b, 4)]
    assert got == [[1, 1], [2, 2]], (
        f"steps of 3 then 4 tokens: 3 = 2 (level 0's quantum) + 1 counted at level 1; then 1 + 4 = 5 = 3 (level 1's "
        f"quantum) + 2 at level 2: expected [[1, 1], [2, 2]], got {got}"
    )


def test_mlfq_victims_come_from_the_deepest_level():
    pol = ex().MLFQPolicy(quanta=(4, 8))
    r = _requests(5)
    for req, level, seq in zip(r, (0, 2, 1, 2, 1), (5, 1, 2, 3, 4)):
        st = pol.state(req)
        st[0] = level
        req.admit_seq = seq
    got = pol.pick_victim(r, 0.0)
    assert got is r[3], (
        f"levels {[pol.level(q) for q in r]}, admit_seq {[q.admit_seq for q in r]}: the victim is "
        f"the deepest level (2), most recently admitted there: r3; got {got.request_id}"
    )
    got = pol.pick_victim([r[0], r[2], r[4]], 0.0)
    assert got is r[4], f"levels 0, 1, 1: the deepest is 1, r4 admitted after r2; got {got.request_id}"
    got = pol.preempt_for(r[2], [r[0], r[1], r[3], r[4]], 0.0)
    assert got is r[3], (
        f"a waiting request at level 1 may push out only a deeper one (r1, r3 at level 2), the most "
        f"recently admitted: r3; got {got and got.request_id}"
    )
    got = pol.preempt_for(r[1], [r[0], r[2], r[3]], 0.0)
    assert got is None, f"a level-2 request may not push out requests at level 2 or above; got {got and got.request_id}"


def test_mlfq_matches_the_engines_mlfq():
    trace = [TraceRequest(f"long{i}", 0.0, 16, 300) for i in range(6)]
    trace += [TraceRequest(f"s{j}", 0.1 + 0.15 * j, 16, 20) for j in range(25)]
    for kw in (
        dict(quanta=(16, 64), boost_interval=1.0),
        dict(quanta=(8,), boost_interval=None),
        dict(quanta=(16, 64), boost_interval=1.0, preempt=False),
    ):
        want = _schedule(_run(_engine(MLFQ(boost_unit="seconds", **kw), max_num_seqs=4), trace))
        got = _schedule(_run(_engine(ex().MLFQPolicy(**kw), max_num_seqs=4), trace))
        assert got == want, f"MLFQ {kw}: {_first_difference(want, got)}"


def test_mlfq_lets_short_requests_past_long_ones():
    trace = [TraceRequest(f"long{i}", 0.0, 16, 400) for i in range(8)]
    trace += [TraceRequest(f"s{j}", 0.1 + 0.2 * j, 16, 20) for j in range(30)]
    short = [f"s{j}" for j in range(30)]
    m_f = _run(_engine("fcfs", max_num_seqs=4), trace)
    eng = _engine(ex().MLFQPolicy(), max_num_seqs=4)
    m_m = _run(eng, trace)
    f, mm = _mean(m_f[r].e2e_latency for r in short), _mean(m_m[r].e2e_latency for r in short)
    assert mm < 0.2 * f, f"short requests: mean latency {mm:.2f} s under your MLFQ vs {f:.2f} s under FCFS"
    assert all(x.finish_reason == "length" for x in m_m.values()), "every request must finish"


def test_mlfq_boost_bounds_the_gap_of_a_demoted_request():
    """One slot; a 100-token request L and a 3-token request every 2 steps. After a boost L is at
    level 0 and the oldest, so no gap between two of its tokens exceeds boost + 4 steps."""
    boost = 0.5
    trace = [TraceRequest("L", 0.0, 8, 100)] + [TraceRequest(f"s{j}", 0.001 + 0.02 * j, 8, 3) for j in range(500)]

    def worst_gap(policy):
        m = _run(_engine(policy, max_num_seqs=1), trace)
        t = [m["L"].first_scheduled_time] + m["L"].token_times
        return max(b - a for a, b in zip(t, t[1:]))

    got = worst_gap(ex().MLFQPolicy(quanta=(4,), boost_interval=boost))
    assert got <= boost + 4 * STEP + 1e-9, f"with a boost every {boost} s L waited {got:.2f} s between two tokens"
    got = worst_gap(ex().MLFQPolicy(quanta=(4,), boost_interval=None))
    assert got > 10.0, f"without boosting the stream should keep L waiting for seconds; its worst gap was {got:.2f} s"


def _pressure_trace():
    return synthetic_trace(
        40, rate=60, prompt_len=Uniform(16, 200), output_len=Uniform(8, 120), tenant_mix={"a": 0.5, "b": 0.5}, seed=4
    )


@pytest.mark.parametrize("policy", ["SJFWithAging", "MLFQPolicy", "FairPolicy"])
def test_your_policy_is_your_own(policy):
    """Your policy runs a trace under memory pressure (every hook is asked) with the engine's own
    policies switched off: an answer that hands the rule to minillm.core.policies fails here."""
    pol = {
        "SJFWithAging": lambda: ex().SJFWithAging(aging=50.0),
        "MLFQPolicy": lambda: ex().MLFQPolicy(quanta=(8, 32), boost_interval=0.3),
        "FairPolicy": lambda: ex().FairPolicy(),
    }[policy]()
    eng = _engine(pol, max_num_seqs=6, num_kv_blocks=40, block_size=16, max_num_batched_tokens=256)
    with _engine_policies_switched_off():
        m = _run(eng, _pressure_trace())
    assert all(x.finish_reason == "length" for x in m.values()), f"{policy}: every request must finish"
    assert eng.stats()["preemptions_recompute"] > 0, "(the trace must make the engine ask for victims)"


# --- Exercise 3: FairPolicy ---------------------------------------------------------------------------


def _flood():
    flood = [TraceRequest(f"flood-{i}", 0.0, 32, 32, tenant="flood") for i in range(60)]
    return flood + [TraceRequest(f"b-{i}", 0.0, 32, 32, tenant="b") for i in range(15)]


def test_fair_order_by_hand():
    eng = _engine("fcfs")
    submit_trace(
        eng,
        [
            TraceRequest("x1", 0.0, 10, 4, tenant="x"),
            TraceRequest("x2", 0.1, 10, 4, tenant="x"),
            TraceRequest("y1", 0.2, 30, 4, tenant="y"),
            TraceRequest("y2", 0.3, 5, 4, tenant="y"),
        ],
        vocab_size=eng.vocab_size,
    )
    r = eng.requests
    pol = ex().FairPolicy()
    got = [q.request_id for q in pol.order_waiting([r["y2"], r["x2"], r["y1"], r["x1"]], 1.0)]
    # x and y at 0: x first (oldest); x is charged 10 -> y1 (0); y charged 30 -> x2 (10); x at 20 -> y2 (30)
    assert got == ["x1", "y1", "x2", "y2"], f"expected ['x1', 'y1', 'x2', 'y2'], got {got}"
    assert dict(pol.counters) in ({}, {"x": 0.0, "y": 0.0}), (
        f"order_waiting must not change the counters (its charges are provisional): {dict(pol.counters)}"
    )
    pol.counters["x"] = 100.0
    got = [q.request_id for q in pol.order_waiting([r["x1"], r["x2"], r["y1"], r["y2"]], 1.0)]
    assert got == ["y1", "y2", "x1", "x2"], f"x has been served 100, y 0: expected y's requests first, got {got}"


def test_fair_charges_what_ran():
    pol = ex().FairPolicy(input_weight=1.0, output_weight=2.0)
    eng = _engine(pol, max_num_seqs=4)
    _run(eng, [TraceRequest("a", 0.0, 12, 5, tenant="a"), TraceRequest("b", 0.0, 20, 3, tenant="b")])
    assert pol.counters["a"] == pytest.approx(12 + 2 * 5) and pol.counters["b"] == pytest.approx(20 + 2 * 3), (
        f"a prefilled 12 tokens and generated 5, b 20 and 3: expected counters a=22, b=26, got {dict(pol.counters)}"
    )


def test_fair_matches_the_engines_vtc_on_a_flood():
    for cfg in (dict(max_num_seqs=4), dict(max_num_seqs=6, max_num_batched_tokens=48)):
        want = _schedule(_run(_engine(Fair(), **cfg), _flood()))
        got = _schedule(_run(_engine(ex().FairPolicy(), **cfg), _flood()))
        assert got == want, f"flood, {cfg}: {_first_difference(want, got)}"


def test_fair_bounds_the_service_gap():
    """While both tenants have requests waiting, their service differs by at most
    (max_num_seqs + 1) x the cost of one request (1 x 32 prompt + 2 x 32 output)."""
    max_num_seqs, c_max = 4, 1.0 * 32 + 2.0 * 32
    eng = _engine(ex().FairPolicy(), max_num_seqs=max_num_seqs)
    m = _run(eng, _flood())
    tenant = {rid: r.tenant for rid, r in eng.requests.items()}
    service, admitted, worst = {"flood": 0.0, "b": 0.0}, set(), 0.0
    for rec in eng.step_records:
        for e in rec.batch:
            service[tenant[e.request_id]] += (e.num_new_tokens if e.phase == "prefill" else 0) + 2 * e.num_output_tokens
        admitted.update(rec.admitted)
        if all(any(rid not in admitted and tenant[rid] == t for rid in tenant) for t in service):
            worst = max(worst, abs(service["flood"] - service["b"]))
    bound = (max_num_seqs + 1) * c_max
    assert worst <= bound, f"the service gap reached {worst:g} tokens, above the bound {bound:g}"
    m_f = _run(_engine("fcfs", max_num_seqs=max_num_seqs), _flood())
    b_fair = _mean(m[f"b-{i}"].e2e_latency for i in range(15))
    b_fcfs = _mean(m_f[f"b-{i}"].e2e_latency for i in range(15))
    assert b_fair < 0.5 * b_fcfs, f"tenant b waits {b_fair:.2f} s on average with yours, {b_fcfs:.2f} s under FCFS"
