"""Workload generators: deterministic, with the statistics they claim, and a faithful JSONL format."""

import math

import numpy as np
import pytest

from minillm.sampling_params import SamplingParams
from minillm.analysis.workloads import (
    Choice,
    Fixed,
    LogNormal,
    TraceRequest,
    Uniform,
    all_at_once,
    flood_trace,
    gamma_arrivals,
    load_jsonl,
    multi_turn_trace,
    poisson_arrivals,
    save_jsonl,
    shared_prefix_trace,
    submit_trace,
    synthetic_trace,
)


def test_same_seed_same_trace_other_seed_other_trace():
    kw = dict(
        rate=5.0,
        prompt_len=LogNormal(100, 1.0, hi=2000),
        output_len=Uniform(10, 50),
        vocab_size=1000,
        priority_mix={0: 0.3, 1: 0.7},
        tenant_mix={"a": 1, "b": 1},
    )
    assert synthetic_trace(50, seed=3, **kw) == synthetic_trace(50, seed=3, **kw)
    assert synthetic_trace(50, seed=3, **kw) != synthetic_trace(50, seed=4, **kw)
    assert np.array_equal(gamma_arrivals(20, 2.0, 3.0, seed=1), gamma_arrivals(20, 2.0, 3.0, seed=1))
    # the streams are independent: changing the lengths keeps the arrival times
    a = synthetic_trace(20, rate=5.0, prompt_len=10, seed=7)
    b = synthetic_trace(20, rate=5.0, prompt_len=Uniform(5, 500), seed=7)
    assert [r.arrival_time for r in a] == [r.arrival_time for r in b]


def test_poisson_rate_and_cv():
    # n = 5000 arrivals at 10/s: 4999 exponential gaps of mean 0.1 s and sd 0.1 s.
    # The sample mean's sd is 0.1 / sqrt(4999) = 0.0014 s; allow 5 sd.
    t = poisson_arrivals(5000, rate=10.0, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.1) < 5 * 0.1 / math.sqrt(4999)
    # cv of an exponential is 1; the sample cv's sd here is ~0.02
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1


def test_gamma_is_bursty_at_the_same_rate():
    # gaps ~ Gamma(shape 1/9, scale 0.1 * 9): mean 0.1 s, sd 0.3 s (cv = 3).
    gaps = np.diff(gamma_arrivals(5000, rate=10.0, cv=3.0, seed=0))
    assert abs(gaps.mean() - 0.1) < 5 * 0.3 / math.sqrt(4999)
    # the sample sd of so skewed a distribution is noisy (excess kurtosis 6 * 9 = 54):
    # relative sd of the sample cv ~ sqrt(56 / 5000) / 2 = 0.053; allow ~5 of those.
    assert 2.2 < gaps.std() / gaps.mean() < 3.8
    # bursts: far more near-zero gaps than a Poisson process at the same rate has
    pois = np.diff(poisson_arrivals(5000, rate=10.0, seed=0))
    assert (gaps < 0.01).mean() > 2 * (pois < 0.01).mean()


def test_all_at_once_and_no_rate():
    assert list(all_at_once(3)) == [0.0, 0.0, 0.0]
    tr = synthetic_trace(4, rate=None, prompt_len=6, output_len=3)
    assert [r.arrival_time for r in tr] == [0.0] * 4
    assert [(r.prompt_len, r.output_len) for r in tr] == [(6, 3)] * 4
    assert all(r.prompt_token_ids is None for r in tr)  # a length-only trace


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert list(Fixed(7).sample(3, rng)) == [7, 7, 7]
    u = Uniform(3, 5).sample(3000, rng)
    assert set(u.tolist()) == {3, 4, 5}  # both ends included
    # LogNormal(median 200, sigma 1): p99 / median = exp(2.326 * 1) = 10.2, mean = 200 * e^0.5 = 330
    x = LogNormal(200, 1.0, lo=1, hi=100_000).sample(20_000, rng)
    p50, p99 = np.percentile(x, [50, 99])
    assert abs(p50 / 200 - 1) < 0.05
    assert 8 < p99 / p50 < 13
    assert abs(x.mean() / (200 * math.exp(0.5)) - 1) < 0.06
    clipped = LogNormal(200, 2.0, lo=16, hi=512).sample(2000, rng)
    assert clipped.min() == 16 and clipped.max() == 512 and clipped.dtype.kind == "i"
    c = Choice((100, 1000), (8, 2)).sample(5000, rng)
    assert abs((c == 1000).mean() - 0.2) < 0.03
    assert Choice((100, 1000), (8, 2)).mean == pytest.approx(280)


def test_prompt_tokens_priority_and_tenant_mix():
    tr = synthetic_trace(
        2000,
        rate=100.0,
        prompt_len=Uniform(1, 20),
        output_len=5,
        vocab_size=50,
        priority_mix={0: 0.25, 2: 0.75},
        tenant_mix={"x": 0.9, "y": 0.1},
        seed=1,
    )
    ids = np.concatenate([r.prompt_token_ids for r in tr])
    assert ids.min() >= 10 and ids.max() < 50  # [token_low, vocab)
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in tr)
    prios = np.array([r.priority for r in tr])
    assert set(prios.tolist()) == {0, 2} and abs((prios == 0).mean() - 0.25) < 0.05
    assert abs(np.mean([r.tenant == "y" for r in tr]) - 0.1) < 0.03
    assert len({r.request_id for r in tr}) == 2000
    assert [r.arrival_time for r in tr] == sorted(r.arrival_time for r in tr)


def test_shared_prefix_is_identical():
    tr = shared_prefix_trace(6, prefix_len=32, suffix_len=8, output_len=4, vocab_size=1000, seed=0)
    pre = tr[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == pre for r in tr)
    assert len({tuple(r.prompt_token_ids[32:]) for r in tr}) == 6  # unique suffixes
    assert all(r.prompt_len == 40 and r.output_len == 4 for r in tr)
    two = shared_prefix_trace(6, prefix_len=16, suffix_len=4, output_len=2, vocab_size=1000, num_prefixes=2)
    p = [tuple(r.prompt_token_ids[:16]) for r in two]
    assert p[0] == p[2] == p[4] and p[1] == p[3] == p[5] and p[0] != p[1]


def test_multi_turn_prompt_extends_previous_turn():
    tr = multi_turn_trace(
        3,
        turns=4,
        system_len=20,
        user_len=Uniform(3, 9),
        answer_len=Uniform(5, 12),
        vocab_size=500,
        think_time=2.0,
        seed=0,
    )
    assert len(tr) == 12
    assert [r.arrival_time for r in tr] == sorted(r.arrival_time for r in tr)
    system = tr[0].prompt_token_ids[:20]
    for c in ("c0", "c1", "c2"):
        turns = sorted((r for r in tr if r.conversation_id == c), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2, 3]
        assert turns[0].prompt_token_ids[:20] == system  # one system prompt for all
        assert 20 + 3 <= turns[0].prompt_len <= 20 + 9
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prompt_token_ids[: prev.prompt_len] == prev.prompt_token_ids
            grown = cur.prompt_len - prev.prompt_len  # answer + new user message
            assert prev.output_len + 3 <= grown <= prev.output_len + 9
            assert cur.arrival_time == pytest.approx(prev.arrival_time + 2.0)


def test_flood_trace():
    tr = flood_trace(
        "hog",
        num_flood=30,
        polite_tenants=("a", "b"),
        num_polite=5,
        polite_rate=1.0,
        prompt_len=8,
        output_len=4,
        vocab_size=100,
        seed=0,
    )
    by = {t: [r for r in tr if r.tenant == t] for t in ("hog", "a", "b")}
    assert [len(by[t]) for t in ("hog", "a", "b")] == [30, 5, 5]
    assert all(r.arrival_time == 0.0 for r in by["hog"])
    assert by["a"][-1].arrival_time > 0 and len({r.request_id for r in tr}) == 40
    assert [r.arrival_time for r in tr] == sorted(r.arrival_time for r in tr)


def test_jsonl_round_trip(tmp_path):
    tr = synthetic_trace(
        5,
        rate=3.0,
        prompt_len=Uniform(2, 9),
        output_len=7,
        vocab_size=100,
        tenant_mix={"t1": 1},
        priority_mix={1: 1, 2: 1},
        seed=2,
    )
    tr += multi_turn_trace(1, turns=2, system_len=4, user_len=2, answer_len=3, vocab_size=100)
    tr.append(TraceRequest("text", 1 / 3, prompt_len=4, output_len=9, prompt='héllo world, "quoted"'))
    path = tmp_path / "trace.jsonl"
    save_jsonl(tr, path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(tr)
    import json

    first, last = json.loads(lines[0]), json.loads(lines[-1])
    assert "prompt_token_ids" in first and "prompt" not in first
    assert last["prompt"] == 'héllo world, "quoted"' and "prompt_token_ids" not in last
    assert {"prompt_len", "output_len", "arrival_time", "priority", "tenant", "request_id"} <= set(first)
    assert load_jsonl(path) == tr  # exact, floats included


def test_submit_trace_calls_the_engine_contract():
    class FakeEngine:
        def __init__(self):
            self.calls = []

        def add_request(self, prompt, sampling_params, **kw):
            self.calls.append((prompt, sampling_params, kw))
            return kw["request_id"]

    tr = synthetic_trace(3, rate=1.0, prompt_len=4, output_len=6, vocab_size=100, tenant_mix={"a": 1})
    tr.append(TraceRequest("txt", 9.0, prompt_len=2, output_len=2, prompt="hi there", priority=3))
    eng = FakeEngine()
    assert submit_trace(eng, tr) == ["r0", "r1", "r2", "txt"]
    prompt, sp, kw = eng.calls[0]
    assert prompt == tr[0].prompt_token_ids
    assert isinstance(sp, SamplingParams) and (sp.temperature, sp.max_tokens, sp.ignore_eos) == (0.0, 6, True)
    assert kw == dict(request_id="r0", arrival_time=tr[0].arrival_time, priority=0, tenant="a", expected_output_len=6)
    assert eng.calls[3][0] == "hi there" and eng.calls[3][2]["priority"] == 3
    # a length-only trace needs a vocabulary to draw prompts from
    bare = synthetic_trace(2, prompt_len=5, output_len=1)
    with pytest.raises(ValueError, match="vocab_size"):
        submit_trace(FakeEngine(), bare)
    eng2 = FakeEngine()
    submit_trace(eng2, bare, vocab_size=64)
    assert [len(c[0]) for c in eng2.calls] == [5, 5]


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        TraceRequest("x", 0.0, prompt_len=3, output_len=1, prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="arrival"):
        synthetic_trace(3, rate=1.0, arrival="uniform")
    with pytest.raises(ValueError):
        Uniform(5, 3)
    with pytest.raises(TypeError):
        synthetic_trace(3, prompt_len="long")
