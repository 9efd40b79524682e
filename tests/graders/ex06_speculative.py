"""Graders of notebook 06's exercises (``exercises/ex06_speculative.py``): ``make grade EX=06``.

The acceptance rule is held against three things it did not compute: cases worked by hand; the
target distribution itself (the first token a verification emits must be distributed as p,
whatever the draft: a chi-square test); and minillm's own ``verify`` replaying the same random
draws. Then inside the engine: greedy speculation must reproduce plain decoding token for token,
and seeded sampling must reproduce the engine's own speculative run exactly. The speed-up formula
is held against sums worked by hand and the mean over a step's outcomes, with the engine's own
formula switched off.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile

import pytest
import torch

from minillm import LLM, SamplingParams, impl
from minillm.spec import speculative
from minillm.core.invariants import check_all_free
from minillm.model.loader import load_model
from minillm.spec.acceptance import verify as engine_verify

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ex():
    return impl.load("ex06_speculative")


@functools.lru_cache(maxsize=None)
def _draft_dir(vocab_size: int = 512) -> str:
    """The random target's first layer (same embeddings and LM head): a plausible draft, written
    once per process to a temporary directory (a plain function: graders are collected without
    their module's fixtures)."""
    from safetensors.torch import save_file

    path = tempfile.mkdtemp(prefix="minillm_ex06_draft_")
    m, cfg = load_model("random", "float32", "cpu", 0, {"vocab_size": vocab_size})
    state = {k: v.contiguous() for k, v in m.state_dict().items() if not k.startswith("model.layers.1.")}
    cfg.num_hidden_layers = 1
    cfg.save_pretrained(path)
    save_file(state, f"{path}/model.safetensors")
    return str(path)


# --- Exercise 1: accept_greedy ------------------------------------------------------------------------


def test_accept_greedy_by_hand():
    cases = [
        (([5, 7, 9], [5, 7, 2, 4]), [5, 7, 2]),
        (([5, 7], [5, 7, 8]), [5, 7, 8]),
        (([1, 2, 3], [4, 2, 3, 9]), [4]),
        (([], [6]), [6]),
        (([3, 3, 3, 3], [3, 3, 3, 3, 1]), [3, 3, 3, 3, 1]),
        (([3, 1], [3, 2, 1]), [3, 2]),
    ]
    for (draft, target), want in cases:
        got = ex().accept_greedy(draft, target)
        assert list(got) == want, f"accept_greedy(draft={draft}, target={target}): expected {want}, got {got}"


PROMPTS = [[11, 12, 13, 11, 12, 13, 11, 12], [20, 21, 22, 23, 20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def _tokens(llm, prompts, sp):
    outs = llm.generate(prompts, sp)
    check_all_free(llm.engine)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_speculation_reproduces_plain_decoding(proposer):
    cfg = dict(block_size=4, max_model_len=64, num_kv_blocks=40)
    sp = SamplingParams(max_tokens=16, **GREEDY)
    want = _tokens(LLM("random", **cfg), PROMPTS, sp)
    llm = ex().speculative_engine(
        "random", speculative_model="ngram" if proposer == "ngram" else _draft_dir(), num_speculative_tokens=3, **cfg
    )
    got = _tokens(llm, PROMPTS, sp)
    assert got == want, f"greedy with {proposer} speculation and your rule: {got}\nplain decoding: {want}"
    ms = llm.engine.request_metrics()
    proposed, accepted = sum(m.num_spec_proposed for m in ms), sum(m.num_spec_accepted for m in ms)
    assert proposed > 0 and 0 < accepted < proposed, (
        f"the run should accept some guesses and reject others: {accepted} of {proposed} accepted"
    )


# --- Exercise 2: accept_sampled ------------------------------------------------------------------------


class _FixedSampler:
    def __init__(self, g):
        self.g = g

    def generator(self, request_id, params):
        return self.g


def _random_dists(k, V, seed, peaked=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * (3.0 if peaked else 1.0), -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * (3.0 if peaked else 1.0), -1)
    return p, q


def test_accept_sampled_replays_the_engines_draws():
    """Same random stream, same rule: the same tokens, and the same number of draws taken."""
    params = SamplingParams(temperature=1.0)
    for seed in range(60):
        k, V = 1 + seed % 4, 6
        p, q = _random_dists(k, V, seed, peaked=seed % 2 == 0)
        gen = torch.Generator().manual_seed(seed)
        draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
        if seed % 3 == 0:
            draft[-1] = int(p[k - 1].argmax())  # a likely guess too
        for use_q in (True, False):
            g_ref, g_you = torch.Generator().manual_seed(1000 + seed), torch.Generator().manual_seed(1000 + seed)
            want = engine_verify(
                torch.zeros(k + 1, V), draft, q if use_q else None, params, _FixedSampler(g_ref), "r", target_probs=p
            )
            got = ex().accept_sampled(list(draft), p, q if use_q else None, g_you)
            assert list(got) == want, (
                f"seed {seed}, k={k}, draft={draft}, q {'given' if use_q else 'None (one-hot)'}:"
                f" minillm's verify emits {want} with the same random draws, yours {got}"
            )
            nxt_ref, nxt_you = torch.rand((), generator=g_ref), torch.rand((), generator=g_you)
            assert nxt_ref == nxt_you, "your rule took a different number of random draws than the docstring's order"


def _chi2(counts, p):
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_CRIT_3DF = 16.27  # 0.999 quantile of chi-square(3): a false alarm 1 time in 1000


@pytest.mark.parametrize("use_q", [True, False])
def test_accept_sampled_emits_the_target_distribution(use_q):
    """Whatever the draft proposes, the first token a verification emits is distributed as p[0]."""
    V, k, n = 4, 2, 4000
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.05, 0.15, 0.3, 0.5], [0.7, 0.1, 0.1, 0.1]])  # a poor draft: far from p
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        draft = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
        out = ex().accept_sampled(draft, p, q if use_q else None, g)
        assert 1 <= len(out) <= k + 1, f"a step emits between 1 and k + 1 = {k + 1} tokens, got {out}"
        counts[out[0]] += 1
    stat = _chi2(counts, p[0].double())
    assert stat < CHI2_CRIT_3DF, (
        f"the first emitted token should follow p[0] = {p[0].tolist()}; over {n} steps "
        f"it came out {counts.tolist()} (chi-square {stat:.1f} > {CHI2_CRIT_3DF})"
    )
    shown = _chi2(
        torch.bincount(
            torch.tensor([int(torch.multinomial(q[0], 1, generator=g)) for _ in range(n)]), minlength=V
        ).double(),
        p[0].double(),
    )
    assert shown > 10 * CHI2_CRIT_3DF, "(the test has power: the draft's own guesses are far from p)"


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_seeded_sampling_reproduces_the_engines_speculation(proposer):
    """A 16-token vocabulary, so sampled text repeats and the n-gram lookup finds guesses too."""
    V = 16
    cfg = dict(
        random_model=dict(vocab_size=V),
        block_size=4,
        max_model_len=64,
        num_kv_blocks=48,
        speculative_model="ngram" if proposer == "ngram" else _draft_dir(V),
        num_speculative_tokens=3,
    )
    prompts = [[p % V for p in prompt] for prompt in PROMPTS]
    sps = [
        SamplingParams(max_tokens=14, temperature=t, top_k=k, seed=s, ignore_eos=True)
        for t, k, s in ((0.7, 0, 1), (1.0, 8, 2), (0.3, 0, 3))
    ]
    ref = LLM("random", **cfg)
    want = [o.token_ids for o in ref.generate(prompts, sps)]
    assert sum(m.num_spec_proposed for m in ref.engine.request_metrics()) > 0, "(the run must speculate)"
    got = [o.token_ids for o in ex().speculative_engine("random", **cfg).generate(prompts, sps)]
    assert got == want, f"seeded sampling with {proposer} guesses: the engine's rule emits {want}, yours {got}"


# --- Exercise 3: tokens_per_step and speculative_speedup ----------------------------------------------


def _tripwire(*args, **kwargs):
    raise AssertionError(
        "your answer called the engine's own formula "
        "(minillm.spec.speculative.expected_tokens_per_step, expected_speedup or modeled_speedup); "
        "the exercise is to write it yourself"
    )


@contextlib.contextmanager
def _engine_formula_switched_off():
    with pytest.MonkeyPatch.context() as mp:
        for f in (speculative.expected_tokens_per_step, speculative.expected_speedup, speculative.modeled_speedup):
            mp.setattr(f, "__code__", _tripwire.__code__)
        yield


# (alpha, k): the expected tokens per verification, summed by hand: 1 + alpha + ... + alpha^k
TOKENS_BY_HAND = [
    ((0.8, 4), 1 + 0.8 + 0.64 + 0.512 + 0.4096),
    ((0.6, 3), 1 + 0.6 + 0.36 + 0.216),
    ((0.5, 1), 1.5),
    ((0.5, 0), 1.0),
    ((0.0, 4), 1.0),
    ((1.0, 4), 5.0),
    ((1.0, 1), 2.0),
    ((0.9, 8), 6.12579511),
]


def test_tokens_per_step_by_hand():
    with _engine_formula_switched_off():
        for (alpha, k), want in TOKENS_BY_HAND:
            got = ex().tokens_per_step(alpha, k)
            assert got == pytest.approx(want, abs=1e-6), (
                f"alpha={alpha}, k={k}: 1 + alpha + ... + alpha^k = {want:.6g} tokens per step, got {got}"
            )


def test_tokens_per_step_is_the_mean_over_outcomes():
    """An independent reference: the step emits i + 1 tokens when guesses 1..i are kept and guess
    i + 1 is rejected (probability alpha^i (1 - alpha)), k + 1 when all k are kept (alpha^k)."""
    with _engine_formula_switched_off():
        for alpha in (0.05, 0.3, 0.47, 0.55, 0.75, 0.99):
            for k in (1, 2, 4, 6, 10):
                want = sum((i + 1) * alpha**i * (1 - alpha) for i in range(k)) + (k + 1) * alpha**k
                got = ex().tokens_per_step(alpha, k)
                assert got == pytest.approx(want, rel=1e-9), (
                    f"alpha={alpha}, k={k}: the mean over outcomes is {want:.6f} tokens per step, got {got}"
                )


# (alpha, k, c): the speed-up, worked by hand: tokens per step / (k c + 1)
SPEEDUP_BY_HAND = [
    ((0.8, 4, 0.05), 3.3616 / 1.2),
    ((0.5, 4, 0.36), 1.9375 / 2.44),
    ((1.0, 4, 0.0), 5.0),
    ((0.0, 4, 0.1), 1 / 1.4),
    ((0.6, 3, 0.2), 2.176 / 1.6),
    ((0.5, 1, 1.0), 0.75),
    ((0.7, 0, 0.3), 1.0),
]


def test_speculative_speedup_by_hand():
    with _engine_formula_switched_off():
        for (alpha, k, c), want in SPEEDUP_BY_HAND:
            got = ex().speculative_speedup(alpha, k, c)
            assert got == pytest.approx(want, rel=1e-9), (
                f"alpha={alpha}, k={k}, draft cost c={c}: {ex().tokens_per_step(alpha, k):.4g} tokens for "
                f"k c + 1 = {k * c + 1:.4g} target forwards: expected {want:.4f}x, got {got}"
            )
    got = [ex().speculative_speedup(a, 4, 0.36) for a in (0.3, 0.5, 0.8)]
    assert got[0] < 1 < got[2], (
        f"the shipped pair's draft costs c = 0.36: at alpha 0.3 speculation must be slower "
        f"(< 1x), at 0.8 faster; got {[round(x, 3) for x in got]}"
    )


# --- Exercise 4 (judgement): the draft length at which the pair stops paying --------------------------------


class _Measured:
    """A stand-in for runs of the engine: the speed-up at each k (a table or a formula), and the k asked for."""

    def __init__(self, speedup, max_k):
        self.speedup, self.max_k, self.asked = speedup, max_k, []

    def __call__(self, k):
        assert isinstance(k, int) and 1 <= k <= self.max_k, f"asked for a run with k = {k!r}: k is 1 to max_k"
        self.asked.append(k)
        return self.speedup(k)


def _check_first_losing_k(speedup, max_k, want, what):
    runs = _Measured(speedup, max_k)
    got = ex().first_losing_k(runs, max_k)
    shown = [round(speedup(k), 4) for k in range(1, max_k + 1)]
    assert got == want, f"{what}: speed-ups {shown} for k = 1..{max_k}: expected {want}, got {got}"
    last = max_k if want is None else want
    assert runs.asked == list(range(1, last + 1)), (
        f"{what}: each k is a run of the engine: ask for 1 to {last} once "
        f"each, in order, then stop; you asked for {runs.asked}"
    )


@pytest.mark.parametrize(
    "table, want",
    [
        ([1.11, 1.10, 0.93, 0.81], 3),  # the docstring's table
        ([1.4, 1.6, 1.5, 1.2, 1.0, 0.9], 5),  # a speed-up of exactly 1 gains nothing
        ([0.8, 0.7, 0.6], 1),  # a draft that never pays
        ([1.3, 1.2, 1.1, 1.05], None),  # every k tried pays
        ([1.2, 0.99, 1.3, 0.5], 2),  # the first k that loses, not the last
    ],
)
def test_first_losing_k_by_hand(table, want):
    _check_first_losing_k(lambda k: table[k - 1], len(table), want, "by hand")


@pytest.mark.parametrize("alpha, c", [(0.5, 0.365), (0.8, 0.05), (0.6, 0.2), (0.3, 0.365), (0.9, 0.1)])
def test_first_losing_k_on_the_formula(alpha, c):
    """Leviathan et al.'s speed-up (the engine's expected_speedup) at the acceptance rate and draft cost of a
    pair: the shipped one (alpha about 0.5, c about 0.365) first."""
    want = next((k for k in range(1, 17) if speculative.expected_speedup(alpha, k, c) <= 1.0), None)
    _check_first_losing_k(lambda k: speculative.expected_speedup(alpha, k, c), 16, want, f"alpha = {alpha}, c = {c}")
