"""A learned output-length predictor for SJF: a small regression trained on a model's own outputs.

SJF needs each request's output length before it runs (``policies.SJF``). The predictors in
``policies`` guess it from history (the mean of the request's class) or from hints in the text.
The third source is a small learned model: record, for many prompts, how many tokens the served
model actually generated, and fit a function from the prompt to that length.

:class:`RegressionPredictor` is the smallest such model that still learns something: ridge
regression of ``log(1 + output length)`` on a feature vector of the prompt's token ids. Two
featurizers are provided:

* :func:`prompt_length_features`: the prompt's length only (``[1, log(1 + len)]``): the baseline
  that asks whether a longer question gets a longer answer;
* :class:`TokenFeatures`: the length, how far the prompt is past the last occurrence of a marker
  (in a play, the blank line that ends a speech: how much of the current speech is already
  written, and whether a new one starts), and a hashed bag of the prompt's last few tokens.

:func:`generated_lengths` collects the training data: it serves the prompts with the engine and
returns how many tokens each request generated before it stopped.

Learned length predictors for scheduling are studied in, e.g., Qiu et al., "Efficient Interactive
LLM Serving with Proxy Model-based Sequence Length Prediction" (2024), and Fu et al., "Efficient
LLM Scheduling by Learning to Rank" (NeurIPS 2024), with much larger predictors than this one.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from ..core.policies import LengthPredictor
from ..core.request import Request
from ..sampling_params import SamplingParams


def prompt_length_features(token_ids: Sequence[int]) -> np.ndarray:
    """``[1, log(1 + len(token_ids))]``: the prompt's length and nothing else."""
    return np.array([1.0, math.log1p(len(token_ids))])


class TokenFeatures:
    """Features of a prompt's token ids: ``[1, log(1 + len), log(1 + tokens since the last
    marker), 1 if the prompt ends with the marker]`` followed by ``num_buckets`` hashed counts of
    the last ``tail`` tokens.

    ``marker``: token ids whose last occurrence ends the previous unit (a speech, a paragraph),
    such as the ids of a blank line; empty leaves that feature at the prompt's length."""

    def __init__(self, num_buckets: int = 16, tail: int = 4, marker: Sequence[int] = ()):
        if num_buckets < 1 or tail < 1:
            raise ValueError(f"TokenFeatures: num_buckets and tail must be >= 1, got {num_buckets}, {tail}")
        self.num_buckets, self.tail, self.marker = num_buckets, tail, list(marker)

    def since_marker(self, ids: list[int]) -> int:
        """Tokens after the last occurrence of ``marker`` (all of them if it does not occur)."""
        k = len(self.marker)
        for end in range(len(ids), k - 1, -1):
            if k and ids[end - k : end] == self.marker:
                return len(ids) - end
        return len(ids)

    def __call__(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = list(token_ids)
        since = self.since_marker(ids)
        bag = np.zeros(self.num_buckets)
        for t in ids[-self.tail :]:
            bag[(t * 2654435761) % self.num_buckets] += 1.0  # Knuth's multiplicative hash
        return np.concatenate([[1.0, math.log1p(len(ids)), math.log1p(since), float(since == 0)], bag])

    def __repr__(self) -> str:
        return f"TokenFeatures(num_buckets={self.num_buckets}, tail={self.tail}, marker={self.marker})"


class RegressionPredictor(LengthPredictor):
    """Ridge regression of ``log(1 + output tokens)`` on ``featurize(prompt token ids)``.

    ``fit(prompts, lengths)`` solves ``(X^T X + l2 I) w = X^T y`` (the bias is not penalised);
    ``predict(request)`` returns ``exp(w . features) - 1``, at least 1 token. Fitting in log
    space keeps a few very long answers from dominating, and SJF only needs the order right.
    """

    name = "learned"

    def __init__(self, featurize: Callable[[Sequence[int]], np.ndarray] = prompt_length_features, l2: float = 1.0):
        if l2 < 0:
            raise ValueError(f"RegressionPredictor: l2 must be >= 0, got {l2}")
        self.featurize, self.l2 = featurize, float(l2)
        self.weights: Optional[np.ndarray] = None

    def fit(self, prompts: Sequence[Sequence[int]], lengths: Sequence[int]) -> "RegressionPredictor":
        if len(prompts) != len(lengths) or not prompts:
            raise ValueError(f"fit: {len(prompts)} prompts and {len(lengths)} lengths (need as many, at least one)")
        if min(lengths) < 0:
            raise ValueError(f"fit: lengths must be >= 0, got {min(lengths)}")
        x = np.stack([self.featurize(p) for p in prompts])
        y = np.log1p(np.asarray(lengths, dtype=float))
        penalty = self.l2 * np.eye(x.shape[1])
        penalty[0, 0] = 0.0  # the bias is free
        self.weights = np.linalg.solve(x.T @ x + penalty, x.T @ y)
        return self

    def predict_ids(self, token_ids: Sequence[int]) -> float:
        if self.weights is None:
            raise ValueError("RegressionPredictor: call fit(prompts, lengths) before predicting")
        return max(1.0, math.expm1(float(self.featurize(token_ids) @ self.weights)))

    def predict(self, request: Request) -> float:
        return self.predict_ids(request.prompt_token_ids)

    def __repr__(self) -> str:
        return f"RegressionPredictor({getattr(self.featurize, '__name__', self.featurize)!r}, l2={self.l2:g})"


def generated_lengths(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[int]:
    """Serve ``prompts`` on ``engine`` with ``params``; how many tokens each one generated
    (in the order of ``prompts``). The engine must be idle."""
    if engine.has_unfinished_requests():
        raise ValueError("generated_lengths needs an idle engine: it has unfinished requests")
    ids = [engine.add_request(list(p), params) for p in prompts]
    engine.run()
    return [engine.requests[i].num_output_tokens for i in ids]


def evenly_spaced_prompts(token_ids: Sequence[int], count: int, max_len: int) -> list[list[int]]:
    """``count`` prompts of ``max_len`` tokens cut from ``token_ids`` at evenly spaced ends (the
    first at ``max_len``, the last at the end): where a reader might stop and ask for the rest."""
    if count < 1 or max_len < 1:
        raise ValueError(f"count and max_len must be >= 1, got {count}, {max_len}")
    if len(token_ids) < max_len:
        raise ValueError(f"evenly_spaced_prompts: {len(token_ids)} token ids, fewer than max_len={max_len}")
    ends = np.linspace(max_len, len(token_ids), count).astype(int)
    return [list(token_ids[e - max_len : e]) for e in ends]


def _mean_ranks(values: Sequence[float]) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    ranks = np.empty(len(v))
    ranks[np.argsort(v, kind="stable")] = np.arange(len(v))
    for x in np.unique(v):
        ranks[v == x] = ranks[v == x].mean()
    return ranks


def rank_correlation(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Spearman's rank correlation (tied values share their mean rank): 1 when ``predicted``
    orders the requests exactly as ``actual`` does, about 0 when it says nothing about the order
    (one prediction for all gives 0). SJF uses only the order of its predictions, so this is the
    score that matters for it."""
    if len(predicted) != len(actual) or len(actual) < 2:
        raise ValueError(
            f"rank_correlation: {len(predicted)} predictions and {len(actual)} lengths (need as many, at least 2)"
        )
    ranks = [_mean_ranks(v) for v in (predicted, actual)]
    if ranks[0].std() == 0 or ranks[1].std() == 0:
        return 0.0
    return float(np.corrcoef(ranks[0], ranks[1])[0, 1])
