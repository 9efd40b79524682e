"""Calibrating the simulator's clock (``minillm/sim/calibration.py``, ``LinearStepCost``): the fit
recovers known step costs from noisy step times, a profile round-trips, a bad profile is refused with
the field named, and a calibrated model drives the simulator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from minillm.sim.calibration import StepSample, fit_step_cost, held_out_errors, predicted_seconds
from minillm.sim.costmodel import STEP_TERMS, CostModel, LinearStepCost, batch_terms

TRUE = {
    "fixed": 2e-3,
    "multi_token": 5e-4,
    "new_tokens": 2.5e-5,
    "sequences": 6e-5,
    "context_tokens": 4e-7,
    "attention_pairs": 3e-9,
}
IDLE = 1.5e-3  # the first step after an idle wait: this much slower


def synthetic_steps(
    truth: dict, n: int = 400, noise: float = 0.02, seed: int = 0, idle_every: int = 0, workload: str = ""
) -> list[StepSample]:
    """Batches like the calibration grid's (decodes, prefills, mixed, one request decoding alone),
    timed by ``truth`` with multiplicative noise of ``noise`` (standard deviation); with
    ``idle_every``, every such step is a lone prefill that follows an idle wait
    (``truth["after_idle"]`` more)."""
    rng = np.random.default_rng(seed)
    model = LinearStepCost(truth)
    out = []
    for i in range(n):
        if idle_every and i % idle_every == 0:
            prompt = int(rng.integers(4, 300))
            seconds = model.step_time([prompt], [prompt]) + model.after_idle_time()
            seconds *= float(np.exp(rng.normal(0.0, noise)))
            out.append(StepSample((prompt,), (prompt,), seconds, after_idle=True, workload=workload))
            continue
        kind = rng.integers(4)
        decodes = 1 if kind == 3 else int(rng.integers(0 if kind == 1 else 1, 64))
        q = [1] * decodes
        c = [int(x) for x in rng.integers(8, 900, decodes)]
        if kind in (1, 2):  # a prefill (chunk) too
            chunk = int(rng.integers(16, 800))
            q.append(chunk)
            c.append(chunk + int(rng.integers(0, 200)))
        seconds = model.step_time(q, c) * float(np.exp(rng.normal(0.0, noise)))
        out.append(StepSample(tuple(q), tuple(c), seconds, workload=workload))
    return out


def test_batch_terms_by_hand():
    # decode at context 10 attends to 10 keys; a 5-token prefill at 5 positions: 1+2+3+4+5 pairs
    assert batch_terms([1, 5], [10, 5]) == (1, 1, 6, 2, 15, 25)
    # a chunk of 3 after 4 computed positions: 5 + 6 + 7 pairs
    assert batch_terms([3], [7]) == (1, 1, 3, 1, 7, 18)
    # one request decoding alone: the only step of one new token (multi_token 0)
    assert batch_terms([1], [9]) == (1, 0, 1, 1, 9, 9)
    assert batch_terms([1, 1], [9, 4]) == (1, 1, 2, 2, 13, 13)


def test_the_fit_recovers_known_step_costs_from_noisy_steps():
    fitted = fit_step_cost(synthetic_steps(TRUE))
    for term, value in TRUE.items():
        assert abs(fitted.seconds[term] - value) <= 3 * fitted.stderr[term], term  # within its uncertainty
        if term != "attention_pairs":  # pairs are a few % of a step here: known less tightly
            assert fitted.seconds[term] == pytest.approx(value, rel=0.15), term
    assert fitted.info["fit_median_rel_err"] < 0.03  # the noise, not a misfit
    batch = ([1] * 32 + [256], list(range(100, 132)) + [300])
    assert fitted.step_time(*batch) == pytest.approx(LinearStepCost(TRUE).step_time(*batch), rel=0.03)


def test_the_fit_recovers_the_cost_of_a_step_after_an_idle_wait():
    truth = dict(TRUE, after_idle=IDLE)
    fitted = fit_step_cost(synthetic_steps(truth, n=600, idle_every=6))
    assert abs(fitted.seconds["after_idle"] - IDLE) <= 3 * fitted.stderr["after_idle"]
    assert fitted.seconds["after_idle"] == pytest.approx(IDLE, rel=0.2)
    assert fitted.seconds["fixed"] == pytest.approx(TRUE["fixed"], rel=0.15)
    # without steps after a wait the term is not exercised: 0, and the others as before
    plain = fit_step_cost(synthetic_steps(TRUE))
    assert plain.seconds["after_idle"] == 0.0 and plain.stderr["after_idle"] == 0.0
    # idle steps that cost nothing extra: the term is dropped (0), never negative
    free = fit_step_cost(synthetic_steps(dict(TRUE, after_idle=0.0), n=600, idle_every=6, seed=5))
    assert free.seconds["after_idle"] <= 3 * max(free.stderr["after_idle"], 1e-6)


def test_a_trace_left_out_of_the_fit_is_predicted_by_the_rest():
    truth = dict(TRUE, after_idle=IDLE)
    samples = (
        synthetic_steps(truth, n=300, idle_every=5, workload="grid 0")
        + synthetic_steps(truth, n=200, idle_every=4, seed=1, workload="trace 0")
        + synthetic_steps(truth, n=200, idle_every=9, seed=2, workload="trace 1")
    )
    held = held_out_errors(samples)
    assert set(held) == {"trace 0", "trace 1"}  # the grid is never left out
    for name, h in held.items():
        assert h["num_steps"] == 200
        assert abs(h["total_rel_err"]) < 0.01, name  # 2% noise per step averages out over 200 steps
        assert h["median_rel_err"] < 0.03, name
    # a trace whose steps are 10% slower than the rest's (a busier machine) shows as a bias
    slow = [
        StepSample(s.num_new_tokens, s.context_lens, s.seconds * 1.1, s.after_idle, s.workload)
        for s in samples
        if s.workload == "trace 1"
    ]
    held = held_out_errors([s for s in samples if s.workload != "trace 1"] + slow)
    assert held["trace 1"]["total_rel_err"] == pytest.approx(-1 / 11, abs=0.01)


def test_a_term_the_data_do_not_need_is_dropped_not_negative():
    truth = dict(TRUE, sequences=0.0, context_tokens=0.0)
    fitted = fit_step_cost(synthetic_steps(truth, noise=0.03, seed=3))
    assert all(v >= 0 for v in fitted.seconds.values())
    assert fitted.seconds["fixed"] == pytest.approx(truth["fixed"], rel=0.15)
    assert fitted.seconds["new_tokens"] == pytest.approx(truth["new_tokens"], rel=0.15)


def test_too_few_or_bad_steps_are_refused():
    steps = synthetic_steps(TRUE, n=50)
    with pytest.raises(ValueError, match="need at least"):
        fit_step_cost(steps[:4])
    with pytest.raises(ValueError, match="positive number of seconds"):
        fit_step_cost(steps[:20] + [StepSample((1,), (5,), 0.0)])


def test_steps_that_cannot_tell_the_terms_apart_are_refused():
    # One request decoding alone, step after step (what a busy machine leaves of the grid's first
    # workload): one new token and one sequence every step, so those two terms cannot be told apart.
    model = LinearStepCost(TRUE)
    lone = [StepSample((1,), (10 + i,), model.step_time([1], [10 + i])) for i in range(40)]
    with pytest.raises(ValueError, match="cannot tell the terms"):
        fit_step_cost(lone)
    fit_step_cost(lone + synthetic_steps(TRUE, n=60))  # with other batch shapes beside them: fits


def test_a_profile_round_trips(tmp_path):
    fitted = fit_step_cost(synthetic_steps(TRUE), info={"machine": "test-box", "threads": 2})
    path = tmp_path / "step-cost-test-box.json"
    fitted.save(path)
    loaded = CostModel.from_profile(path)
    assert isinstance(loaded, LinearStepCost)
    assert loaded.seconds == fitted.seconds and loaded.stderr == fitted.stderr
    assert loaded.info["machine"] == "test-box" and loaded.name == "calibrated(test-box)"
    assert loaded.step_time([1, 1, 40], [30, 70, 40]) == fitted.step_time([1, 1, 40], [30, 70, 40])
    idle = fit_step_cost(synthetic_steps(dict(TRUE, after_idle=IDLE), idle_every=5))
    idle.save(path)
    assert CostModel.from_profile(path).after_idle_time() == idle.seconds["after_idle"] > 0


def _write(tmp_path, data) -> str:
    path = tmp_path / "profile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


GOOD = {"format": LinearStepCost.PROFILE_FORMAT, "terms": dict(TRUE)}


@pytest.mark.parametrize(
    "data, field",
    [
        ("{not json", "not JSON"),
        ([1, 2], "expected a JSON object"),
        ({**GOOD, "format": "other/2"}, "format='other/2'"),
        ({"format": GOOD["format"]}, "terms=None"),
        ({**GOOD, "terms": {k: v for k, v in TRUE.items() if k != "sequences"}}, "terms.sequences is missing"),
        ({**GOOD, "terms": {**TRUE, "fixed": -1e-3}}, "terms.fixed=-0.001"),
        ({**GOOD, "terms": {**TRUE, "new_tokens": "fast"}}, "terms.new_tokens='fast'"),
        ({**GOOD, "terms": {**TRUE, "attention_pairs": math.inf}}, "terms.attention_pairs=inf"),
        ({**GOOD, "terms": {**TRUE, "per_layer": 1e-6}}, "unknown term(s) ['per_layer']"),
        ({**GOOD, "stderr": {**TRUE, "fixed": math.nan}}, "stderr.fixed=nan"),
        ({**GOOD, "stderr": 3}, "stderr=3"),
        ({**GOOD, "terms": {**TRUE, "after_idle": -2e-3}}, "terms.after_idle=-0.002"),
        ({**GOOD, "terms": {**TRUE, "after_idle": None}}, "terms.after_idle=None"),
        ({**GOOD, "terms": {**TRUE, "multi_token": -1e-4}}, "terms.multi_token=-0.0001"),
        ({**GOOD, "terms": {**TRUE, "multi_token": "yes"}}, "terms.multi_token='yes'"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_field(tmp_path, data, field):
    with pytest.raises(ValueError) as e:
        CostModel.from_profile(_write(tmp_path, data))
    assert field in str(e.value)


def test_the_good_profile_of_those_loads(tmp_path):
    # a profile without the after_idle term (saved before it existed) loads with the term at 0
    loaded = CostModel.from_profile(_write(tmp_path, GOOD))
    assert loaded.seconds == dict(TRUE, after_idle=0.0) and loaded.after_idle_time() == 0.0
    # one without multi_token either: a lone decode and a batch of two then differ by their units only
    older = {k: v for k, v in TRUE.items() if k != "multi_token"}
    loaded = CostModel.from_profile(_write(tmp_path, {**GOOD, "terms": older}))
    assert loaded.seconds["multi_token"] == 0.0
    two, one = loaded.step_time([1, 1], [10, 10]), loaded.step_time([1], [10])
    assert two - one == pytest.approx(TRUE["new_tokens"] + TRUE["sequences"] + 10 * TRUE["context_tokens"] + 10 * 3e-9)


def test_a_lone_decode_skips_the_multi_token_term():
    """By hand: one decode at 10 positions costs fixed + 1 token + 1 sequence + 10 context + 10 pairs;
    two decodes add the second's units and ``multi_token`` once."""
    model = LinearStepCost(TRUE)
    one = TRUE["fixed"] + TRUE["new_tokens"] + TRUE["sequences"] + 10 * TRUE["context_tokens"] + 10 * 3e-9
    assert model.step_time([1], [10]) == pytest.approx(one)
    two = one + TRUE["multi_token"] + TRUE["new_tokens"] + TRUE["sequences"] + 10 * TRUE["context_tokens"] + 10 * 3e-9
    assert model.step_time([1, 1], [10, 10]) == pytest.approx(two)


def test_a_calibrated_profile_drives_the_simulator(tmp_path):
    """The simulator's clock is the profile's: a trace of decodes only advances by its step times."""
    from minillm.analysis.workloads import synthetic_trace
    from minillm.sim.simulated import simulate

    model = LinearStepCost(TRUE)
    trace = synthetic_trace(8, rate=None, prompt_len=16, output_len=5)
    engine, summary = simulate(trace, model="random", cost_model=model, max_num_batched_tokens=2048)
    expected = sum(
        model.step_time([e.num_new_tokens for e in rec.batch], [e.context_len for e in rec.batch])
        for rec in engine.step_records
    )
    assert engine.clock.now() == pytest.approx(expected)
    assert summary["cost_model"] == model.name
    assert set(STEP_TERMS) == set(model.seconds)


def test_a_step_after_an_idle_wait_costs_the_idle_term_in_the_simulator():
    """Two one-token requests 10 s apart. The first arrives at 0, when the clock already is: no wait.
    The second finds the engine idle: the clock waits to 10 s, then that step costs its prefill plus
    ``after_idle``. By hand: finish times step(p1) and 10 + step(p2) + after_idle."""
    from minillm.analysis.workloads import TraceRequest
    from minillm.sim.simulated import simulate

    model = LinearStepCost(dict(TRUE, after_idle=IDLE))
    trace = [TraceRequest("a", 0.0, 16, 1), TraceRequest("b", 10.0, 24, 1)]
    engine, _ = simulate(trace, model="random", cost_model=model, max_num_batched_tokens=2048)
    assert engine.requests["a"].metrics.finish_time == pytest.approx(model.step_time([16], [16]))
    assert engine.requests["b"].metrics.finish_time == pytest.approx(10.0 + model.step_time([24], [24]) + IDLE)
    sample = StepSample((24,), (24,), 0.0, after_idle=True)
    assert predicted_seconds(model, sample) == pytest.approx(model.step_time([24], [24]) + IDLE)


def test_the_scheduler_says_when_it_is_idle():
    """``is_idle``: nothing arrived is left to run, though a request from the future may be queued."""
    from minillm.analysis.workloads import TraceRequest, submit_trace
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    engine = LLMEngine(
        "random",
        EngineConfig.from_fields("test", executor="simulated", clock="modeled", cost_model=LinearStepCost(TRUE)),
    )
    assert engine.scheduler.is_idle()
    submit_trace(engine, [TraceRequest("late", 5.0, 8, 2)], vocab_size=engine.vocab_size)
    assert engine.scheduler.is_idle() and engine.scheduler.next_arrival() == 5.0
    engine.step()  # waits for it, then prefills it: running
    assert not engine.scheduler.is_idle() and engine.clock.now() > 5.0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.is_idle()


@pytest.mark.slow  # two runs of the real engine
def test_the_real_side_is_the_median_of_its_rounds():
    """Two rounds of a short trace on the real engine: a request's measured latency is the median of
    its two rounds (their mean), the step counts of both are kept, and ``noise`` is how far they differ."""
    from minillm.sim.calibration import compare_on_trace, validation_trace

    trace = validation_trace(6, rate=40.0, seed=3, prompt_median=16, output_median=4)
    report = compare_on_trace(LinearStepCost(TRUE), trace, rounds=2)
    assert report["rounds"] == 2 and report["num_requests"] == 6
    assert len(report["steps"]["measured_each_round"]) == 2
    for metric in ("ttft", "tpot", "e2e"):
        m = report[metric]
        assert 0 <= m["noise"] <= m["noise_p90"] and m["median_rel_err"] <= m["p90_rel_err"]
        assert m["sensitivity"] > 0  # every step 2% longer: every request later
    assert len(report["reference_step_s"]) == 2 and min(report["reference_step_s"]) > 0
    assert report["drift"] is None  # this cost model was not timed here: no reference step to compare
    assert report["rescaled"] is None and len(report["reference_step_after_s"]) == 2
    assert report["step_times"]["num_steps"] == pytest.approx(np.median(report["steps"]["measured_each_round"]))
    timed = LinearStepCost(TRUE, info={"reference_step_s": 1.0})  # a reference step of 1 s, when timed
    one = compare_on_trace(timed, trace, rounds=1)
    assert one["rescaled"]["scale"] == pytest.approx(one["reference_step_s"][0])  # ~ms over 1 s
    assert one["rescaled"]["e2e"]["median_modeled_s"] < one["e2e"]["median_modeled_s"]  # the steps priced shorter
    for load in ("utilisation", "mean_waiting"):
        assert set(report[load]) == {"measured", "modeled"}
    assert 0 < report["utilisation"]["measured"] <= 1 and 0 < report["utilisation"]["modeled"] <= 1
    with pytest.raises(ValueError, match="rounds=0"):
        compare_on_trace(LinearStepCost(TRUE), trace, rounds=0)


def test_the_cpu_clock_counts_work_and_skips_waits():
    """``ProcessClock``: a sleep (another program's turn on the core) adds nothing, work adds its CPU
    time, and a wait for an arrival jumps there at once."""
    import time

    from minillm.sim.clock import ProcessClock, make_clock

    clock = make_clock("cpu")
    assert isinstance(clock, ProcessClock) and clock.name == "cpu"
    t = clock.now()
    time.sleep(0.2)
    assert clock.now() - t < 0.1  # asleep: (almost) no CPU time
    t = clock.now()
    x = 0
    while clock.now() - t < 0.01:  # work: the clock moves (the loop would never end otherwise)
        x += 1
    target = clock.now() + 30.0
    clock.wait_until(target)
    assert target <= clock.now() < target + 0.1
    clock.wait_until(target - 5.0)  # already past: nothing to wait for
    assert clock.now() >= target


def test_the_real_engine_runs_on_the_cpu_clock():
    """A request that arrives 5 s after the first is served without sleeping: the idle wait is skipped,
    its TTFT is the CPU time of its own step, and every step's duration is CPU time (> 0)."""
    import time

    from minillm.analysis.workloads import TraceRequest, submit_trace
    from minillm.config import EngineConfig
    from minillm.engine import LLMEngine

    engine = LLMEngine("random", EngineConfig.from_fields("test", clock="cpu", max_model_len=64))
    submit_trace(engine, [TraceRequest("a", 0.0, 8, 3), TraceRequest("b", 5.0, 8, 3)], vocab_size=engine.vocab_size)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    assert time.perf_counter() - t0 < 4.0  # did not sleep the 5 s
    b = engine.requests["b"].metrics
    assert b.arrival_time == 5.0 and b.first_token_time > 5.0 and b.clock == "cpu"
    assert all(rec.duration > 0 for rec in engine.step_records if rec.batch_size)


def test_pinned_to_one_core_and_back():
    import os

    from minillm.sim.calibration import pinned_to_one_core

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this system")
    before = os.sched_getaffinity(0)
    with pinned_to_one_core() as core:
        assert os.sched_getaffinity(0) == {core} and core == max(before)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="core=100000"):
        with pinned_to_one_core(100000):
            pass
    assert os.sched_getaffinity(0) == before


def test_timing_stops_at_its_deadline():
    """Past the deadline the requests left are aborted and the timing returns what it has, so the
    calibration's budget holds on a machine slower than expected."""
    import time

    from minillm.sampling_params import SamplingParams
    from minillm.sim.calibration import _engine, _timed_steps

    engine = _engine("random", max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    ids = [engine.add_request(list(range(10, 30)), sp) for _ in range(3)]
    assert len(_timed_steps(engine, "late", deadline=time.perf_counter() - 1.0)) == 0
    assert not engine.has_unfinished_requests()
    assert all(engine.requests[str(r)].is_finished for r in ids)
    engine.add_request(list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    steps = _timed_steps(engine, "on time")  # no deadline: to the end, every step timed
    assert [s.num_new_tokens for s in steps] == [(20,), (1,), (1,)] and all(s.seconds > 0 for s in steps)


def test_the_reference_steps_are_one_request_decoding_alone():
    from minillm.sim.calibration import _engine, reference_steps

    steps = reference_steps(_engine("random", max_model_len=128))
    assert [s.num_new_tokens for s in steps] == [(1,)] * 31  # 32 tokens: the prefill's, then 31 decodes
    assert [s.context_lens for s in steps] == [(25 + i,) for i in range(31)]
    assert {s.workload for s in steps} == {"reference"}


def test_a_scaled_profile_prices_every_step_that_much_longer():
    from minillm.sim.calibration import scaled

    cost = LinearStepCost(dict(TRUE, after_idle=IDLE), {t: 1e-6 for t in TRUE}, info={"machine": "m"})
    slower = scaled(cost, 1.25)
    assert slower.step_time([1, 40], [30, 40]) == pytest.approx(1.25 * cost.step_time([1, 40], [30, 40]))
    assert slower.after_idle_time() == pytest.approx(1.25 * IDLE)
    assert slower.stderr["fixed"] == pytest.approx(1.25e-6)
    assert slower.info == {"machine": "m", "scale": 1.25} and cost.info == {"machine": "m"}
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="factor="):
            scaled(cost, bad)


def hand_run() -> dict:
    """A real run of four steps, by hand: 1, 2, 1 and 1 ms, starting at 0, 1, 3 and 4 ms; "a" in the
    engine from 0 to 5 ms (all four steps), "b" from 3 to 5 ms (the last two)."""
    samples = [
        StepSample((1,), (20,), 1e-3),  # one request decoding alone
        StepSample((1, 1), (21, 9), 2e-3),  # two decoding
        StepSample((5,), (5,), 1e-3),  # a prefill
        StepSample((1,), (22,), 1e-3, after_idle=True),  # alone, after an idle wait
    ]
    return {"samples": samples, "starts": [0.0, 1e-3, 3e-3, 4e-3], "spans": {"a": (0.0, 5e-3), "b": (3e-3, 5e-3)}}


def test_the_real_runs_steps_priced_by_the_profile():
    """Every step priced 1 ms (a fixed term alone): 4 ms priced against 5 measured (-20%); the two-request
    step is the one short (-50%); "a"'s latency loses that 1 ms of its 5 (20% off), "b"'s steps are
    priced right (0%); each tenth (here each step) measured over priced: 1, 2, 1, 1; priced with those,
    every latency is right."""
    from minillm.sim.calibration import step_time_errors

    one_ms = LinearStepCost(dict.fromkeys(STEP_TERMS, 0.0) | {"fixed": 1e-3})
    e = step_time_errors(one_ms, hand_run())
    assert e["num_steps"] == 4
    assert e["total_rel_err"] == pytest.approx(-0.2)
    assert e["median_rel_err"] == pytest.approx(0.0) and e["p90_rel_err"] == pytest.approx(0.35)  # 0, 0, 0, 0.5
    assert {k: v["num_steps"] for k, v in e["by_batch"].items()} == {
        "one decoding alone": 2,
        "several decoding": 1,
        "with a prefill": 1,
        "after idle": 1,
    }
    assert e["by_batch"]["several decoding"]["total_rel_err"] == pytest.approx(-0.5)
    assert e["by_batch"]["one decoding alone"]["total_rel_err"] == pytest.approx(0.0)
    assert e["slowdown_by_tenth"] == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert e["e2e_same_schedule"]["median_rel_err"] == pytest.approx(0.1)  # a 20%, b 0%
    assert e["e2e_same_schedule"]["p90_rel_err"] == pytest.approx(0.18)
    assert e["e2e_speed_known"] == pytest.approx({"median_rel_err": 0.0, "p90_rel_err": 0.0})
    with pytest.raises(ValueError, match="samples"):
        step_time_errors(one_ms, dict(hand_run(), samples=[]))


def test_each_round_alone_and_the_median_of_reports():
    """Round 1 is matched exactly, round 2 is 10% and 30% off: per metric the median over the rounds of
    each round's median (0 and 20%: 10%); a field one report lacks is left out of the median."""
    from minillm.sim.calibration import METRICS, _each_round, _median_of

    def lat(x, y):
        return {"a": dict.fromkeys(METRICS, x), "b": dict.fromkeys(METRICS, y)}

    runs = [{"latencies": lat(1.0, 2.0)}, {"latencies": lat(1.0, 1.0)}]
    out = _each_round(runs, [lat(1.0, 2.0), lat(1.1, 1.3)])
    assert out["e2e"]["median_rel_err"] == pytest.approx(0.1)
    assert out["ttft"]["p90_rel_err"] == pytest.approx((0.0 + (0.1 + 0.9 * 0.2)) / 2)
    assert _median_of([{"x": 1, "y": {"z": 3}}, {"x": 3, "y": {"z": 5}, "w": 0}]) == {"x": 2.0, "y": {"z": 4.0}}
    assert _median_of([{"t": [1, 4]}, {"t": [3, 2]}, {"t": [2, 9]}]) == {"t": [2.0, 4.0]}  # position by position
    assert _median_of([{"t": [1, 4], "x": 1}, {"t": [3], "x": 2}]) == {"x": 1.5}  # lengths differ: left out


def test_a_run_priced_by_a_fit_to_its_own_steps():
    """Steps timed exactly by a linear cost: a fit to them prices every one right (no error left, any
    request); four steps are too few to fit (None)."""
    from minillm.sim.calibration import _own_fit_errors

    samples = synthetic_steps(TRUE, n=60, noise=0.0)
    starts = np.concatenate(([0.0], np.cumsum([s.seconds for s in samples])[:-1]))
    run = {"samples": samples, "starts": starts, "spans": {"a": (starts[3], starts[40]), "b": (0.0, starts[-1])}}
    e = _own_fit_errors(run)
    assert abs(e["total_rel_err"]) < 1e-9 and e["p90_rel_err"] < 1e-9
    assert e["e2e_same_schedule"]["p90_rel_err"] < 1e-9 and e["slowdown_by_tenth"] == pytest.approx([1.0] * 10)
    assert _own_fit_errors(hand_run()) is None


def test_the_reference_baseline_is_the_profiles_price_where_it_has_one():
    from minillm.sim.calibration import reference_baseline

    priced = {"reference_step_s": 2.4e-3, "reference_step_priced_s": 2.0e-3}
    assert reference_baseline(LinearStepCost(TRUE, info=priced)) == 2.0e-3
    assert reference_baseline(LinearStepCost(TRUE, info={"reference_step_s": 2.4e-3})) == 2.4e-3  # an older profile
    assert reference_baseline(LinearStepCost(TRUE)) is None


def test_the_default_calibrate_command_runs_one_thread_on_its_one_core():
    """`python -m minillm.bench calibrate --out DIR` pins the process to one core: its engines then run one
    torch thread (as many threads as cores it may use), and a thread count the pin cannot hold is refused."""
    from minillm.bench.__main__ import parse
    from minillm.bench.calibrate import calibration_threads

    assert calibration_threads(parse(["calibrate", "--out", "x"])) == 1
    assert calibration_threads(parse(["calibrate", "--out", "x", "--threads", "1"])) == 1
    assert calibration_threads(parse(["calibrate", "--out", "x", "--no-pin", "--threads", "2"])) == 2
    assert calibration_threads(parse(["calibrate", "--out", "x", "--no-pin"])) == 0  # torch's default
    with pytest.raises(ValueError, match="--threads 2 with --pin"):
        calibration_threads(parse(["calibrate", "--out", "x", "--threads", "2"]))
