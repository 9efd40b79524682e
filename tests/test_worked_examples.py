"""The two worked examples of the notebooks, exactly: static vs continuous batching (notebook 01,
section 4) and scheduling every 5 steps (notebook 03b, section 2).

Both run the real scheduler on the simulated executor under the examples' assumption,
``ConstantStepTime``: a step takes the same time whatever the batch. Expected numbers are
worked out by hand in the comments, never read from the engine.
"""

import pytest

from minillm import LLM
from minillm.sim.costmodel import ConstantStepTime
from minillm.analysis.workloads import TraceRequest, submit_trace


def _engine(cost_model, **cfg):
    cfg.setdefault("max_model_len", 2048)
    cfg.setdefault("max_num_batched_tokens", 4096)
    cfg.setdefault("record", "summary")  # per-block maps are for the widgets; not needed here
    engine = LLM(model="random", executor="simulated", clock="modeled", cost_model=cost_model, **cfg).engine
    return engine


def _run(engine, trace):
    submit_trace(engine, trace, vocab_size=engine.vocab_size)
    engine.run()
    return {rid: r.metrics for rid, r in engine.requests.items()}


# --- Static vs continuous batching -----------------------------------------------------------
# 10 requests arrive together: 8 generate 100 tokens and 2 generate 1000; every step takes 10 ms.
STEP = 0.010
STATIC_SHORT_MEAN = 1000 * STEP  # static: everyone is returned with the longest, 1000 x 10 ms
CONTINUOUS_SHORT_MEAN = 100 * STEP  # continuous: a short request leaves after its 100 x 10 ms
LONG_DONE = 1000 * STEP  # the long ones finish at 1000 x 10 ms either way


def _batching_trace():
    return [TraceRequest(f"short{i}", 0.0, 8, 100) for i in range(8)] + [
        TraceRequest(f"long{i}", 0.0, 8, 1000) for i in range(2)
    ]


@pytest.mark.parametrize(
    "batching, expected_short", [("static", STATIC_SHORT_MEAN), ("continuous", CONTINUOUS_SHORT_MEAN)]
)
def test_batching_short_request_completion(batching, expected_short):
    eng = _engine(ConstantStepTime(STEP), max_num_seqs=10, batching=batching)
    m = _run(eng, _batching_trace())
    short = [m[f"short{i}"].e2e_latency for i in range(8)]
    long_ = [m[f"long{i}"].e2e_latency for i in range(2)]
    mean_short = sum(short) / len(short)
    assert mean_short == pytest.approx(expected_short, abs=STEP)  # within one step
    assert all(x == pytest.approx(LONG_DONE, abs=STEP) for x in long_)
    assert all(mm.finish_reason == "length" for mm in m.values())
    assert all(mm.num_output_tokens == (100 if rid.startswith("short") else 1000) for rid, mm in m.items())


def test_batching_continuous_is_ten_times_faster_for_short_requests():
    res = {}
    for batching in ("static", "continuous"):
        m = _run(_engine(ConstantStepTime(STEP), max_num_seqs=10, batching=batching), _batching_trace())
        res[batching] = sum(m[f"short{i}"].e2e_latency for i in range(8)) / 8
    # continuous batching returns the short requests in 1/10 of the static time
    assert res["continuous"] / res["static"] == pytest.approx(1 / 10, rel=0.02)


# --- Scheduling every 5 steps ---------------------------------------------------------------------
# A decode step of 15 ms and a scheduling pass of 0.5 ms, scheduled every step or every 5 steps:
# overhead 0.5/15 = 3.3% -> 0.5/(15 x 5) = 0.67%; a completed request may wait up to 4 steps
# (60 ms) to be removed, a new request up to 5 steps (75 ms) to be added, and 60 ms is 0.8% of a
# 500-token request's 500 x 15 ms = 7500 ms.
DECODE, SCHED = 0.015, 0.0005
RATIO_EVERY_STEP = 0.5 / 15  # ~3.3%
RATIO_EVERY_5 = 0.5 / (15 * 5)  # ~0.67%
MAX_HOLD = 4 * DECODE  # 60 ms
MAX_ADMIT_WAIT = 5 * DECODE  # 75 ms (plus the pass's own 0.5 ms)
RELATIVE = 0.060 / 7.5  # 0.8%


def _schedule_every(every, trace):
    eng = _engine(ConstantStepTime(DECODE, schedule_overhead=SCHED), max_num_seqs=64, schedule_every=every)
    m = _run(eng, trace)
    return eng, m


def _overhead_ratio(records):
    """The overhead ratio: scheduling time over decode (forward) time."""
    sched = sum(r.schedule_time for r in records)
    forward = sum(r.duration - r.schedule_time for r in records)
    return sched / forward


def _every_trace():
    # 20 requests of 500..519 tokens, all at t=0: every residue mod 5 occurs, so some request
    # finishes right after a pass and waits the full 4 steps.
    return [TraceRequest(f"r{i}", 0.0, 8, 500 + i) for i in range(20)]


def test_schedule_every_overhead_ratio():
    eng1, _ = _schedule_every(1, _every_trace())
    eng5, _ = _schedule_every(5, _every_trace())
    r1, r5 = _overhead_ratio(eng1.step_records), _overhead_ratio(eng5.step_records)
    assert r1 == pytest.approx(RATIO_EVERY_STEP, rel=1e-9)
    assert round(r1 * 100, 1) == 3.3
    assert r5 == pytest.approx(RATIO_EVERY_5, abs=1e-4)  # the last pass may be short
    assert round(r5 * 100, 2) in (0.67, 0.68)
    assert r1 / r5 == pytest.approx(5, rel=0.02)  # a fifth of the original
    # passes happen only every 5 steps, and only passes pay the 0.5 ms
    assert [r.reformed for r in eng5.step_records[:11]] == [True, False, False, False, False] * 2 + [True]
    assert all((r.schedule_time > 0) == r.reformed for r in eng5.step_records)


def test_schedule_every_completed_requests_wait_at_most_4_steps():
    _, m1 = _schedule_every(1, _every_trace())
    _, m5 = _schedule_every(5, _every_trace())
    held1 = [mm.finish_time - mm.token_times[-1] for mm in m1.values()]
    held5 = [mm.finish_time - mm.token_times[-1] for mm in m5.values()]
    assert max(held1) == pytest.approx(0.0, abs=1e-12)  # every step: returned at once
    assert max(held5) <= MAX_HOLD + 1e-9
    assert max(held5) == pytest.approx(MAX_HOLD, abs=1e-9)  # and the bound is reached
    for mm in m5.values():
        # the added completion delay, relative to the request's own decode time (>= 500 x 15 ms)
        held = mm.finish_time - mm.token_times[-1]
        assert held / (mm.num_output_tokens * DECODE) <= RELATIVE + 1e-12
    # the tokens themselves are not late: generation is the same, only the return waits
    for rid in m1:
        assert len(m1[rid].token_times) == len(m5[rid].token_times)


def test_schedule_every_new_requests_wait_at_most_5_steps():
    # long-running requests keep the engine busy; newcomers arrive at awkward moments
    trace = [TraceRequest(f"bg{i}", 0.0, 8, 300) for i in range(4)]
    trace += [TraceRequest(f"new{i}", 0.0101 + 0.0377 * i, 8, 20) for i in range(40)]
    _, m5 = _schedule_every(5, trace)
    waits = [m5[f"new{i}"].queue_wait for i in range(40)]
    assert max(waits) <= MAX_ADMIT_WAIT + SCHED + 1e-9
    assert max(waits) > 3 * DECODE  # some do wait several steps
    _, m1 = _schedule_every(1, trace)
    assert max(m1[f"new{i}"].queue_wait for i in range(40)) <= DECODE + SCHED + 1e-9
