"""minillm.analysis.learned_predictor: features worked by hand, the ridge fit against closed forms, and
the lengths it is trained on read off the engine."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from minillm import LLM, SamplingParams
from minillm.analysis.learned_predictor import (
    RegressionPredictor,
    TokenFeatures,
    evenly_spaced_prompts,
    generated_lengths,
    prompt_length_features,
    rank_correlation,
)
from minillm.core.policies import SJF


def test_prompt_length_features():
    assert prompt_length_features([7] * 9).tolist() == [1.0, math.log(10)]


def test_token_features_count_from_the_last_marker():
    f = TokenFeatures(num_buckets=4, tail=2, marker=[199, 199])
    assert f.since_marker([5, 199, 199, 7, 199, 199, 8, 9]) == 2
    assert f.since_marker([5, 199, 7]) == 3  # no marker: the whole prompt
    x = f([5, 199, 199])  # ends with the marker: a new unit starts
    assert x[:4].tolist() == [1.0, math.log(4), 0.0, 1.0]
    assert x[4:].sum() == 2  # the last 2 tokens, hashed into 4 buckets
    assert x[4 + (199 * 2654435761) % 4] == 2


def test_fit_recovers_an_exact_log_linear_law():
    prompts = [[1] * n for n in (3, 10, 30, 100)]
    lengths = [math.expm1(0.5 + 0.8 * math.log1p(len(p))) for p in prompts]  # log1p(y) = 0.5 + 0.8 log1p(n)
    pred = RegressionPredictor(prompt_length_features, l2=0.0).fit(prompts, lengths)
    assert pred.weights.tolist() == pytest.approx([0.5, 0.8])
    assert pred.predict_ids([1] * 50) == pytest.approx(math.expm1(0.5 + 0.8 * math.log(51)))


def test_ridge_shrinks_the_slope_but_not_the_bias():
    prompts = [[1] * n for n in (3, 10, 30, 100)]
    pred = RegressionPredictor(prompt_length_features, l2=1e9).fit(prompts, [20, 20, 20, 20])
    assert pred.weights[1] == pytest.approx(0.0, abs=1e-6)
    assert pred.predict_ids([1] * 7) == pytest.approx(20.0, rel=1e-4)  # the bias alone: log1p(20)


def test_sjf_asks_the_predictor_with_the_prompt_ids():
    pred = RegressionPredictor(prompt_length_features, l2=0.0).fit([[1] * 3, [1] * 30], [2, 50])
    req = SimpleNamespace(prompt_token_ids=[1] * 30)
    assert pred.predict(req) == pytest.approx(50.0)
    assert SJF(predictor=pred).predictor is pred


def test_generated_lengths_are_the_engine_s_output_counts():
    llm = LLM(model="random", executor="simulated", max_num_seqs=4, max_model_len=64, record="summary")
    prompts = evenly_spaced_prompts(list(range(10, 40)), count=3, max_len=8)
    assert prompts == [list(range(10, 18)), list(range(21, 29)), list(range(32, 40))]  # ends at 8, 19, 30
    assert generated_lengths(llm.engine, prompts, SamplingParams(max_tokens=5, ignore_eos=True)) == [5, 5, 5]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="call fit"):
        RegressionPredictor().predict_ids([1, 2])
    with pytest.raises(ValueError, match="2 prompts and 1 lengths"):
        RegressionPredictor().fit([[1], [2]], [3])
    with pytest.raises(ValueError, match="l2 must be >= 0, got -1"):
        RegressionPredictor(l2=-1)
    with pytest.raises(ValueError, match="num_buckets and tail must be >= 1"):
        TokenFeatures(num_buckets=0)
    assert np.isfinite(prompt_length_features([])).all()


def test_rank_correlation_scores_the_order_only():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert rank_correlation([4, 3, 2, 1], [10, 20, 30, 400]) == pytest.approx(-1.0)
    assert rank_correlation([5, 5, 5, 5], [10, 20, 30, 400]) == 0.0  # one prediction for all: no order
    # ranks (0, 2, 1, 3) against (0, 1, 2, 3): 1 - 6 * (0 + 1 + 1 + 0) / (4 * 15) = 0.8
    assert rank_correlation([1, 3, 2, 4], [1, 2, 3, 4]) == pytest.approx(0.8)
