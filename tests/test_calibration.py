"""Calibrating the simulator's clock (``minillm/sim/calibration.py``, ``LinearStepCost``): the fit
recovers known step costs from noisy step times, a profile round-trips, a bad profile is refused with
the field named, and a calibrated model drives the simulator."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from minillm.sim.calibration import StepSample, fit_step_cost
from minillm.sim.costmodel import STEP_TERMS, CostModel, LinearStepCost, batch_terms

TRUE = {"fixed": 2e-3, "new_tokens": 2.5e-5, "sequences": 6e-5, "context_tokens": 4e-7, "attention_pairs": 3e-9}


def synthetic_steps(truth: dict, n: int = 400, noise: float = 0.02, seed: int = 0) -> list[StepSample]:
    """Batches like the calibration grid's (decodes, prefills, mixed), timed by ``truth`` with
    multiplicative noise of ``noise`` (standard deviation)."""
    rng = np.random.default_rng(seed)
    model = LinearStepCost(truth)
    out = []
    for _ in range(n):
        kind = rng.integers(3)
        decodes = int(rng.integers(0 if kind == 1 else 1, 64))
        q = [1] * decodes
        c = [int(x) for x in rng.integers(8, 900, decodes)]
        if kind != 0:                                        # a prefill (chunk) too
            chunk = int(rng.integers(16, 800))
            q.append(chunk)
            c.append(chunk + int(rng.integers(0, 200)))
        seconds = model.step_time(q, c) * float(np.exp(rng.normal(0.0, noise)))
        out.append(StepSample(tuple(q), tuple(c), seconds))
    return out


def test_batch_terms_by_hand():
    # decode at context 10 attends to 10 keys; a 5-token prefill at 5 positions: 1+2+3+4+5 pairs
    assert batch_terms([1, 5], [10, 5]) == (1, 6, 2, 15, 25)
    # a chunk of 3 after 4 computed positions: 5 + 6 + 7 pairs
    assert batch_terms([3], [7]) == (1, 3, 1, 7, 18)


def test_the_fit_recovers_known_step_costs_from_noisy_steps():
    fitted = fit_step_cost(synthetic_steps(TRUE))
    for term, value in TRUE.items():
        assert abs(fitted.seconds[term] - value) <= 3 * fitted.stderr[term], term    # within its uncertainty
        if term != "attention_pairs":           # pairs are a few % of a step here: known less tightly
            assert fitted.seconds[term] == pytest.approx(value, rel=0.15), term
    assert fitted.info["fit_median_rel_err"] < 0.03          # the noise, not a misfit
    batch = ([1] * 32 + [256], list(range(100, 132)) + [300])
    assert fitted.step_time(*batch) == pytest.approx(LinearStepCost(TRUE).step_time(*batch), rel=0.03)


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


def test_a_profile_round_trips(tmp_path):
    fitted = fit_step_cost(synthetic_steps(TRUE), info={"machine": "test-box", "threads": 2})
    path = tmp_path / "step-cost-test-box.json"
    fitted.save(path)
    loaded = CostModel.from_profile(path)
    assert isinstance(loaded, LinearStepCost)
    assert loaded.seconds == fitted.seconds and loaded.stderr == fitted.stderr
    assert loaded.info["machine"] == "test-box" and loaded.name == "calibrated(test-box)"
    assert loaded.step_time([1, 1, 40], [30, 70, 40]) == fitted.step_time([1, 1, 40], [30, 70, 40])


def _write(tmp_path, data) -> str:
    path = tmp_path / "profile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


GOOD = {"format": LinearStepCost.PROFILE_FORMAT, "terms": dict(TRUE)}


@pytest.mark.parametrize("data, field", [
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
])
def test_a_bad_profile_is_refused_naming_the_field(tmp_path, data, field):
    with pytest.raises(ValueError) as e:
        CostModel.from_profile(_write(tmp_path, data))
    assert field in str(e.value)


def test_the_good_profile_of_those_loads(tmp_path):
    assert CostModel.from_profile(_write(tmp_path, GOOD)).seconds == TRUE


def test_a_calibrated_profile_drives_the_simulator(tmp_path):
    """The simulator's clock is the profile's: a trace of decodes only advances by its step times."""
    from minillm.analysis.workloads import synthetic_trace
    from minillm.sim.simulated import simulate

    model = LinearStepCost(TRUE)
    trace = synthetic_trace(8, rate=None, prompt_len=16, output_len=5)
    engine, summary = simulate(trace, model="random", cost_model=model, max_num_batched_tokens=2048)
    expected = sum(model.step_time([e.num_new_tokens for e in rec.batch], [e.context_len for e in rec.batch])
                   for rec in engine.step_records)
    assert engine.clock.now() == pytest.approx(expected)
    assert summary["cost_model"] == model.name
    assert set(STEP_TERMS) == set(model.seconds)
