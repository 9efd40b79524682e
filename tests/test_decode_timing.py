"""minillm.bench.decode_timing: the estimate is the fastest repeat's median, the spread flags noise,
and every timed step is one in which the whole batch decodes."""

import pytest

from minillm import LLM
from minillm.bench import decode_timing
from minillm.bench.decode_timing import DecodeTimings


def simulated_engine(max_num_seqs=8):
    return LLM(
        model="random", executor="simulated", max_num_seqs=max_num_seqs, max_model_len=128, record="summary"
    ).engine


def test_estimate_is_the_fastest_repeat_and_spread_is_slowest_over_fastest():
    t = DecodeTimings([1, 32], {1: [0.012, 0.010, 0.011], 32: [0.020, 0.030, 0.016]})
    assert t.step_time == [0.010, 0.016]
    assert t.spread == pytest.approx([1.2, 1.875])
    assert t.noisy  # 1.875 > 1.5
    gain, growth = t.ratio(1, 32)
    assert gain == pytest.approx((32 / 0.016) / (1 / 0.010)) and growth == pytest.approx(1.6)  # x20, x1.6


def test_quiet_repeats_are_not_noisy():
    t = DecodeTimings([1, 2], {1: [0.010, 0.0104], 2: [0.011, 0.011]})
    assert not t.noisy and max(t.spread) == pytest.approx(1.04)


def test_decode_steps_times_only_steps_where_the_whole_batch_decodes():
    engine = simulated_engine()
    times = decode_timing.decode_steps(engine, batch=4, steps=6, prompt_len=8)
    # 7 output tokens each: the prefill step makes the first, then 6 decode steps of all 4
    assert len(times) == 6
    decode_steps = [r for r in engine.step_records if r.num_prefill_tokens == 0]
    assert len(decode_steps) == 6 and all(len(r.batch) == 4 for r in decode_steps)
    assert not engine.has_unfinished_requests()


def test_measure_runs_every_batch_size_every_repeat():
    t = decode_timing.measure(simulated_engine(), [1, 2, 4], steps=3, repeats=2, prompt_len=8)
    assert t.batches == [1, 2, 4] and all(len(t.repeat_medians[b]) == 2 for b in t.batches)


def test_measure_rejects_bad_input_naming_the_value():
    with pytest.raises(ValueError, match="max_num_seqs is 8"):
        decode_timing.measure(simulated_engine(), [1, 16])
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        decode_timing.measure(simulated_engine(), [1], repeats=0)
    with pytest.raises(ValueError, match="steps=0"):
        decode_timing.decode_steps(simulated_engine(), 1, 0)
    busy = simulated_engine()
    busy.add_request([1, 2, 3])
    with pytest.raises(ValueError, match="unfinished requests"):
        decode_timing.measure(busy, [1])


def test_measure_on_the_cpu_uses_one_torch_thread_and_cpu_time_then_restores_the_count():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []

        class CountingEngine:
            """The simulated engine, noting torch's thread count at every step."""

            def __init__(self, engine):
                self.engine, self.config = engine, engine.config

            def __getattr__(self, name):
                return getattr(self.engine, name)

            def step(self):
                seen.append(torch.get_num_threads())
                return self.engine.step()

        engine = CountingEngine(simulated_engine())
        t = decode_timing.measure(engine, [1, 2], steps=2, repeats=1, prompt_len=8, device="cpu")
        assert set(seen) == {1} and t.clock == "CPU time"
        assert torch.get_num_threads() == 2, "the caller's thread count is restored"
    finally:
        torch.set_num_threads(before)
