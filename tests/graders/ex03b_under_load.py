"""Graders of notebook 03b's exercises (``exercises/ex03b_under_load.py``): ``make grade EX=03b``.

The arithmetic of the scheduler under load (chunked prefill's chunks and worst stall, scheduling every
N steps, goodput, the largest queue cap) is held against numbers worked by hand and against what the
engine does on the same requests (simulated executor, modeled clock: exact and fast).
"""

from __future__ import annotations

import pytest

from minillm import LLM, impl
from minillm.sim.costmodel import ConstantStepTime
from minillm.analysis.workloads import TraceRequest, submit_trace, synthetic_trace


def ex():
    return impl.load("ex03b_under_load")


def _engine(policy, **cfg):
    cfg.setdefault("max_model_len", 2048)
    cfg.setdefault("max_num_batched_tokens", 4096)
    cfg.setdefault("record", "summary")  # per-block maps are not needed here
    cost_model = cfg.pop("cost_model")
    return LLM(
        model="random", executor="simulated", clock="modeled", cost_model=cost_model, policy=policy, **cfg
    ).engine


# --- Exercise 1: chunked prefill, the worst decode stall ---------------------------------------------


def test_chunk_sizes_by_hand():
    for (prompt, d, budget), want in (
        ((2000, 10, 512), [502, 502, 502, 494]),
        ((1004, 10, 512), [502, 502]),
        ((100, 0, 512), [100]),
        ((10, 2, 6), [4, 4, 2]),
        ((7, 3, 4), [1] * 7),
        ((503, 10, 512), [502, 1]),
    ):
        got = ex().chunk_sizes(prompt, d, budget)
        assert list(got) == want, (
            f"a {prompt}-token prompt beside {d} decoding requests, {budget} tokens a step: "
            f"expected chunks {want}, got {got}"
        )
    with pytest.raises(ValueError, match="token_budget"):
        ex().chunk_sizes(100, 8, 8)


def _toy(new, ctx):
    return sum(n * c for n, c in zip(new, ctx))


def _per_token(new, ctx):
    return 1e-4 * sum(new)


def test_worst_decode_stall_by_hand():
    # chunks 4, 4, 2; steps of (1 x 11 + 1 x 21 + 4 x 4), (12 + 22 + 4 x 8), (13 + 23 + 2 x 10)
    for args, want in (
        ((_toy, 10, [10, 20], 6), 66),
        ((_per_token, 2000, [300] * 10, 512), 0.0512),
        ((_toy, 3, [5], 100), 6 + 9),
        ((_toy, 8, [], 4), 4 * 8),
    ):
        got = ex().worst_decode_stall(*args)
        assert got == pytest.approx(want), (
            f"worst_decode_stall(step_time={args[0].__name__}, prompt_len={args[1]}, "
            f"decode_context_lens={args[2]}, token_budget={args[3]}): expected "
            f"{want}, got {got}"
        )


class _LinearStepTime(ConstantStepTime):
    """A cost model whose step grows with its tokens and with the attention they do: a fixed 5 ms,
    20 us per token, 10 ns per (token, position) pair. The scheduling pass is free."""

    def step_time(self, num_new_tokens, context_lens):
        return 0.005 + 2e-5 * sum(num_new_tokens) + 1e-8 * sum(n * c for n, c in zip(num_new_tokens, context_lens))


@pytest.mark.parametrize("budget", [128, 512, 1500])
def test_worst_decode_stall_matches_the_engine(budget):
    """Section 1's scenario on the engine: ten requests decoding when a 2000-token prompt arrives;
    the longest step while it is prefilled, from the step records."""
    cost = _LinearStepTime()
    eng = _engine(
        "fcfs",
        cost_model=cost,
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        num_kv_blocks=2048,
        interference="chunked",
        enable_chunked_prefill=True,
        max_model_len=4096,
    )
    trace = [TraceRequest(f"d{i}", 0.0, 100 + 37 * i, 1200) for i in range(10)] + [TraceRequest("P", 1.0, 2000, 4)]
    submit_trace(eng, trace, vocab_size=eng.vocab_size)
    eng.run()
    steps = [r for r in eng.step_records if any(e.request_id == "P" and e.phase == "prefill" for e in r.batch)]
    decoding = [e.num_computed_before for e in steps[0].batch if e.phase == "decode"]
    assert len(decoding) == 10 and all(len(r.batch) == 11 for r in steps), "(the ten decode through P's prefill)"
    want = max(r.duration for r in steps)
    got = ex().worst_decode_stall(cost.step_time, 2000, decoding, budget)
    assert got == pytest.approx(want, rel=1e-9), (
        f"budget {budget}: the engine's longest step while P's prompt was prefilled took {want * 1e3:.3f} ms "
        f"(chunks {[e.num_new_tokens for r in steps for e in r.batch if e.request_id == 'P']}); yours says "
        f"{got * 1e3:.3f} ms"
    )
    chunks = ex().chunk_sizes(2000, 10, budget)
    assert list(chunks) == [e.num_new_tokens for r in steps for e in r.batch if e.request_id == "P"], (
        f"budget {budget}: the engine prefilled P in chunks "
        f"{[e.num_new_tokens for r in steps for e in r.batch if e.request_id == 'P']}, yours {chunks}"
    )


# --- Exercise 2: scheduling every N steps --------------------------------------------------------------


def test_schedule_every_tradeoff_by_hand():
    """Section 2's worked example: 15 ms steps, a 0.5 ms pass."""
    for n, overhead, hold, wait in (
        (5, 0.0005 / 0.075, 0.060, 0.0755),
        (1, 0.0005 / 0.015, 0.0, 0.0155),
        (2, 0.0005 / 0.030, 0.015, 0.0305),
    ):
        got = ex().schedule_every_tradeoff(n, 0.015, 0.0005)
        want = dict(overhead=overhead, longest_hold=hold, longest_admission_wait=wait)
        assert set(got) == set(want), f"the dict's keys: expected {sorted(want)}, got {sorted(got)}"
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-12), (
                f"every {n} step(s), 15 ms steps, 0.5 ms per pass: {key} should be {want[key]:.6g}, got {got[key]}"
            )
    with pytest.raises(ValueError, match="n"):
        ex().schedule_every_tradeoff(0, 0.015, 0.0005)


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_schedule_every_tradeoff_matches_the_engine(n):
    """The engine with schedule_every=n: newcomers that arrive just after a pass started, and
    requests finishing at every phase of the cycle, on a modeled clock of 20 ms steps and 1 ms passes."""
    step, pass_time, eps = 0.020, 0.001, 1e-6
    got = ex().schedule_every_tradeoff(n, step, pass_time)
    period = n * step + pass_time  # a pass starts every `period` seconds while busy
    trace = [TraceRequest("bg", 0.0, 8, 40 * n + 40)]
    trace += [TraceRequest(f"new{k}", k * period + eps, 8, 3) for k in range(1, 6)]
    trace += [TraceRequest(f"r{i}", 0.0, 8, 10 + i) for i in range(n)]
    eng = _engine(
        "fcfs", cost_model=ConstantStepTime(step, schedule_overhead=pass_time), schedule_every=n, max_num_seqs=64
    )
    submit_trace(eng, trace, vocab_size=eng.vocab_size)
    eng.run()
    m = {rid: r.metrics for rid, r in eng.requests.items()}
    wait = max(m[f"new{k}"].queue_wait for k in range(1, 6))
    hold = max(x.finish_time - x.token_times[-1] for x in m.values())
    assert got["longest_admission_wait"] == pytest.approx(wait + eps, abs=1e-9), (
        f"every {n} step(s): newcomers arriving {eps} s after a pass started waited {wait:.6f} s in the engine; "
        f"your longest admission wait is {got['longest_admission_wait']:.6f} s"
    )
    assert got["longest_hold"] == pytest.approx(hold, abs=1e-9), (
        f"every {n} step(s): the engine held a finished request up to {hold:.6f} s; yours says "
        f"{got['longest_hold']:.6f} s"
    )
    passes = sum(1 for r in eng.step_records if r.reformed)
    assert passes == -(-len(eng.step_records) // n), "(a pass every n steps)"


# --- Exercise 3: goodput under SLOs, with load shedding ------------------------------------------------


def test_goodput_by_hand():
    reqs = [
        (0.0, [0.5, 0.6, 0.7]),  # TTFT 0.5 s, TPOT 0.1 s: meets both (ties pass)
        (0.2, [2.8, 2.9]),  # TTFT 2.6 s: misses
        (0.4, []),  # turned away: fails, and counts among all requests
        (1.0, [1.5, 1.9, 2.0]),  # TPOT 0.25 s: misses, though one gap is short
        (1.5, [3.5]),  # one token, TTFT 2.0 s: meets (no TPOT)
        (3.0, [3.2, 3.3, 3.4, 4.0]),
    ]  # TPOT 0.8 / 3 = 0.267 s: misses
    got = ex().goodput(reqs, slo_ttft=2.0, slo_tpot=0.1)
    want = dict(goodput=2 / 4.0, attainment=2 / 6)
    assert set(got) == set(want), f"the dict's keys: expected {sorted(want)}, got {sorted(got)}"
    for key in want:
        assert got[key] == pytest.approx(want[key]), (
            f"{key}: 2 of 6 requests meet TTFT <= 2 s and TPOT <= 0.1 s "
            f"over 4.0 s (first arrival to last token): expected "
            f"{want[key]:.4f}, got {got[key]}"
        )
    got = ex().goodput([(0.5, [0.6, 0.7, 0.8]), (0.5, []), (1.0, [1.3, 2.5])], slo_ttft=0.5, slo_tpot=1.5)
    assert got == pytest.approx(dict(goodput=2 / 2.0, attainment=2 / 3)), (
        f"the run starts at the first arrival (0.5 s), ends at the last token (2.5 s): expected goodput 1.0 req/s, "
        f"attainment 2/3, got {got}"
    )


@pytest.mark.parametrize("rate, queue_cap", [(6, None), (30, None), (16, 8), (30, 4)])
def test_goodput_matches_the_engines_metrics(rate, queue_cap):
    """Chat-like traffic on a modeled Llama-2-70B, with and without load shedding (max_queue_len):
    your goodput from the requests' token times against minillm.analysis.metrics.summarize."""
    from minillm.sim.simulated import simulate
    from minillm.analysis.workloads import LogNormal

    slo = dict(slo_ttft=2.0, slo_tpot=0.100)
    trace = synthetic_trace(
        200, rate=rate, prompt_len=LogNormal(512, 1.0, 4, 4096), output_len=LogNormal(128, 0.9, 1, 1024), seed=1
    )
    eng, s = simulate(trace, model="llama-2-70b", records=False, max_num_seqs=64, max_queue_len=queue_cap, **slo)
    reqs = [(r.metrics.arrival_time, list(r.metrics.token_times)) for r in eng.requests.values()]
    got = ex().goodput(reqs, **slo)
    assert (s["num_rejected"] > 0) == (queue_cap is not None), "(the cap must shed load, no cap must not)"
    for key, theirs in (("goodput", "goodput_requests_per_s"), ("attainment", "slo_attainment")):
        assert got[key] == pytest.approx(s[theirs], rel=1e-9), (
            f"{rate} req/s, queue cap {queue_cap} ({s['num_rejected']} turned away): minillm.analysis.metrics gives "
            f"{theirs} = {s[theirs]:.4f}, your {key} = {got[key]:.4f}"
        )


# --- Exercise 4 (judgement): the largest queue cap for a 2 s TTFT -------------------------------------------


class _Runs:
    """A stand-in for the simulator: the TTFT p99 each cap gives (a table), and the caps asked for."""

    def __init__(self, p99):
        self.p99, self.asked = p99, []

    def __call__(self, cap):
        assert isinstance(cap, int) and cap in self.p99, (
            f"asked for a run with queue cap {cap!r}: caps are 1 to max_cap"
        )
        self.asked.append(cap)
        return {
            "ttft_p99": self.p99[cap],
            "ttft_p50": self.p99[cap] / 3,
            "ttft_p90": self.p99[cap] / 2,
            "ttft_mean": self.p99[cap] / 3,
        }


def _runs_allowed(max_cap):
    return max_cap.bit_length()  # ceil(log2(max_cap + 1))


@pytest.mark.parametrize(
    "p99, slo, want",
    [
        ([0.4, 0.9, 1.6, 2.3, 3.1], 2.0, 3),  # the docstring's table
        ([0.5 + 0.1 * c for c in range(40)], 2.0, 16),  # 16 -> 2.0 s exactly: a tie meets the target
        ([2.5 + c for c in range(20)], 2.0, 0),  # even one waiting request is one too many
        ([0.1 * c for c in range(1, 33)], 5.0, 32),  # every cap meets it: the largest tried
        ([0.3, 0.6, 1.9, 2.1, 2.2, 2.4, 2.6, 2.9, 3.5], 2.0, 3),
        ([1.0] * 7 + [2.0001] * 50, 2.0, 7),
    ],
    ids=[
        "docstring_table",
        "a_tie_meets_the_target",
        "no_cap_meets_it",
        "every_cap_meets_it",
        "uneven_steps",
        "just_above_the_target",
    ],
)
def test_largest_queue_cap_by_hand(p99, slo, want):
    runs = _Runs({c: t for c, t in enumerate(p99, start=1)})
    got = ex().largest_queue_cap(runs, slo, len(p99))
    assert got == want, (
        f"TTFT p99 by cap {dict(runs.p99)}, target {slo} s: the largest cap that meets it is {want}, got {got}"
    )
    allowed = _runs_allowed(len(p99))
    assert len(runs.asked) <= allowed, (
        f"caps 1 to {len(p99)}: bisection needs at most {allowed} runs (each is a "
        f"whole simulation); yours asked for {len(runs.asked)}: {runs.asked}"
    )


def test_largest_queue_cap_in_the_simulator():
    """Overloaded chat traffic on a modeled Llama-2-70B: at your cap the accepted requests meet the 2 s TTFT
    target at the p99, and one more waiting request breaks it."""
    from minillm.sim.simulated import simulate
    from minillm.analysis.workloads import LogNormal

    trace = synthetic_trace(
        150, rate=40, prompt_len=LogNormal(512, 1.0, 4, 4096), output_len=LogNormal(128, 0.9, 4, 1024), seed=0
    )

    def run(cap):
        return simulate(
            trace, model="llama-2-70b", records=False, max_num_seqs=32, max_queue_len=cap, slo_ttft=2.0, slo_tpot=0.100
        )[1]

    got = ex().largest_queue_cap(run, 2.0, 32)
    assert isinstance(got, int) and 1 <= got < 32, f"on this trace the answer lies between 1 and 31, got {got!r}"
    at, above = run(got)["ttft_p99"], run(got + 1)["ttft_p99"]
    assert at <= 2.0 < above, (
        f"your cap {got}: TTFT p99 {at:.3f} s there and {above:.3f} s at {got + 1}; the largest "
        f"cap meets 2 s and the next one does not"
    )
