"""Graders of notebook 01's exercises (``exercises/ex01_batching.py``): ``make grade EX=01``.

Each answer is held against something it did not compute: numbers worked by hand, the
engine's cost model, the KV tensors the engine really allocates, and what the real
scheduler decides on the same requests. Failure messages say what was expected.

The formulas are also graded on made-up models and hardware given as plain objects (only the
attributes the docstrings name), and with the engine's own versions of them switched off, so an
answer that hands the work to ``minillm.sim.costmodel`` does not pass.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from minillm import LLM, SamplingParams, impl
from minillm.sim import costmodel
from minillm.sim.costmodel import (
    HARDWARE,
    MODELS,
    ConstantStepTime,
    HardwareSpec,
    ModelSpec,
    RooflineCostModel,
    kv_cache_bytes,
    max_batch_size,
)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ex():
    return impl.load("ex01_batching")


# Made-up shapes and hardware: (engine spec for the expected value, plain object for your function).
_SHAPES = [
    dict(num_params=1_234_567_890, num_layers=7, num_heads=12, num_kv_heads=3, head_dim=80, dtype_bytes=2),
    dict(num_params=98_765_432, num_layers=3, num_heads=6, num_kv_heads=6, head_dim=48, dtype_bytes=4),
    dict(num_params=45_000_000_000, num_layers=50, num_heads=40, num_kv_heads=1, head_dim=96, dtype_bytes=1),
]
_HARDWARE = [
    dict(peak_flops=2.5e13, hbm_bandwidth=9e11, hbm_bytes=6e10, pcie_bandwidth=1e10, step_overhead=1e-3),
    dict(peak_flops=4e15, hbm_bandwidth=1e14, hbm_bytes=3e11, pcie_bandwidth=5e10, step_overhead=0.0),
    dict(peak_flops=1e12, hbm_bandwidth=2e12, hbm_bytes=1.2e10, pcie_bandwidth=1e10, step_overhead=2e-4),
]


def _made_up_model(i):
    d = _SHAPES[i]
    spec = ModelSpec(name=f"made-up-{i}", hidden_size=d["num_heads"] * d["head_dim"], **d)
    plain = SimpleNamespace(**d, weight_bytes=d["num_params"] * d["dtype_bytes"])
    return spec, plain


def _made_up_hardware(i):
    d = _HARDWARE[i]
    return HardwareSpec(name=f"made-up-hw-{i}", **d), SimpleNamespace(**d)


def _tripwire(*args, **kwargs):
    raise AssertionError(
        "your answer called the engine's own version of this computation (minillm.sim.costmodel: "
        "kv_cache_bytes, max_batch_size, RooflineCostModel or ModelSpec.kv_bytes_per_token); "
        "the exercise is to write it yourself"
    )


@contextlib.contextmanager
def _engine_formulas_switched_off():
    """Every engine function that computes what these exercises ask raises while the block runs."""
    with pytest.MonkeyPatch.context() as mp:
        for f in (
            costmodel.kv_cache_bytes,
            costmodel.max_kv_tokens,
            costmodel.max_batch_size,
            costmodel.bytes_per_generated_token,
            costmodel.RooflineCostModel.__init__,
            costmodel.RooflineCostModel.step_time,
            costmodel.RooflineCostModel.breakdown,
            costmodel.RooflineCostModel.step_flops,
            costmodel.RooflineCostModel.step_bytes,
            costmodel.ModelSpec.kv_bytes_per_token.fget,
        ):
            mp.setattr(f, "__code__", _tripwire.__code__)
        yield


# --- Exercise 1: kv_cache_bytes ------------------------------------------------------------


def test_kv_cache_bytes_matches_the_formula():
    for name, m in sorted(MODELS.items()):
        for n, b in ((1, 1), (4096, 1), (2048, 8), (17, 3)):
            want = kv_cache_bytes(m, n, b)
            got = ex().kv_cache_bytes(m, n, b)
            assert got == want, (
                f"kv_cache_bytes({name}, num_tokens={n}, batch={b}): expected {want} bytes "
                f"= 2 x {m.num_layers} layers x {m.head_dim} head_dim x {m.num_kv_heads} KV heads "
                f"x {n} x {b} x {m.dtype_bytes} bytes, got {got}"
            )


def test_kv_cache_bytes_on_made_up_models():
    """Any object with the four attributes the docstring names will do (not only the presets)."""
    for i in range(len(_SHAPES)):
        spec, plain = _made_up_model(i)
        for n, b in ((1, 1), (1000, 3)):
            want = kv_cache_bytes(spec, n, b)
            got = ex().kv_cache_bytes(plain, n, b)
            assert got == want, (
                f"kv_cache_bytes on a made-up model {_SHAPES[i]}, num_tokens={n}, batch={b}: expected {want}, got {got}"
            )


def test_kv_cache_bytes_is_your_own_formula():
    for name in ("llama-2-7b", "llama-2-70b", "qwen3-0.6b"):
        want = kv_cache_bytes(MODELS[name], 4096, 2)
        with _engine_formulas_switched_off():
            got = ex().kv_cache_bytes(MODELS[name], 4096, 2)
        assert got == want, f"kv_cache_bytes({name}, 4096, 2): expected {want}, got {got}"


def test_kv_cache_bytes_llama2_70b_example():
    """Llama-2-70B's KV per request is about 10 GB (10 GiB, counting all 64 heads
    at 4096 tokens); with grouped-query attention only 8 KV heads are stored."""
    mha = replace(MODELS["llama-2-70b"], num_kv_heads=64)
    got = ex().kv_cache_bytes(mha, 4096, 1)
    assert got == 2 * 80 * 128 * 64 * 4096 * 2, (
        f"Llama-2-70B with 64 KV heads, 4096 tokens: expected 10,737,418,240 bytes (10 GiB), got {got:,}"
    )
    gqa = ex().kv_cache_bytes(MODELS["llama-2-70b"], 4096, 1)
    assert gqa * 8 == got, f"with 8 KV heads instead of 64 the KV should be 8x smaller: got {gqa:,} vs {got:,}"


def test_kv_cache_bytes_predicts_the_engines_kv_tensors():
    """The engine allocates one K and one V tensor per layer; your formula must predict their size."""
    llm = LLM(model="random", block_size=4, num_kv_blocks=8, dtype="float32")
    eng = llm.engine
    actual = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in eng.executor.kv_caches)
    spec = replace(eng.model_spec, dtype_bytes=4)
    got = ex().kv_cache_bytes(spec, eng.num_kv_blocks * eng.config.block_size, 1)
    assert got == actual, (
        f"the engine's KV tensors take {actual} bytes for {eng.num_kv_blocks * 4} positions "
        f"(float32); kv_cache_bytes predicted {got}"
    )


# --- Exercise 2: max_batch_size -----------------------------------------------------------------


def test_max_batch_size_matches_the_cost_model():
    for hw_name, hw in sorted(HARDWARE.items()):
        for m_name, m in sorted(MODELS.items()):
            for max_len in (512, 2048, 4096):
                for frac in (0.9, 0.5):
                    want = max_batch_size(hw, m, max_len, frac)
                    got = ex().max_batch_size(hw, m, max_len, frac)
                    assert got == want, (
                        f"max_batch_size({hw_name}, {m_name}, max_len={max_len}, "
                        f"memory_fraction={frac}): expected {want}, got {got}"
                    )


def test_max_batch_size_on_made_up_hardware():
    for i in range(len(_SHAPES)):
        spec, plain = _made_up_model(i)
        for j in range(len(_HARDWARE)):
            hw_spec, hw_plain = _made_up_hardware(j)
            for max_len, frac in ((512, 0.9), (3000, 0.75), (1, 1.0)):
                want = max_batch_size(hw_spec, spec, max_len, frac)
                with _engine_formulas_switched_off():
                    got = ex().max_batch_size(hw_plain, plain, max_len, frac)
                assert got == want, (
                    f"max_batch_size on made-up hardware {_HARDWARE[j]} and model {_SHAPES[i]}, "
                    f"max_len={max_len}, memory_fraction={frac}: expected {want}, got {got}"
                )


def test_max_batch_size_is_zero_when_the_weights_do_not_fit():
    got = ex().max_batch_size(HARDWARE["A100-80GB"], MODELS["llama-2-70b"], 4096)
    assert got == 0, f"Llama-2-70B's bf16 weights (138 GB) do not fit one 80 GB GPU: expected 0, got {got}"


# --- Exercise 3: decode_step_time -----------------------------------------------------------------


def test_decode_step_time_matches_the_roofline_cost_model():
    for hw in ("H100-SXM", "A100-80GB", "L4"):
        for m in ("llama-2-7b", "llama-2-13b", "qwen3-0.6b"):
            cm = RooflineCostModel(hw, m)
            for b in (1, 8, 32, 128):
                for c in (128, 2048):
                    want = cm.step_time([1] * b, [c] * b)
                    got = ex().decode_step_time(MODELS[m], HARDWARE[hw], b, c)
                    assert got == pytest.approx(want, rel=1e-9), (
                        f"decode_step_time({m}, {hw}, batch={b}, context_len={c}): expected {want * 1e3:.6f} ms "
                        f"({cm.breakdown([1] * b, [c] * b)['bound']} bound), got {got * 1e3:.6f} ms"
                    )


def test_decode_step_time_on_made_up_hardware():
    """Made-up accelerators put some steps firmly on the compute side of the roofline."""
    for i in range(len(_SHAPES)):
        spec, plain = _made_up_model(i)
        for j in range(len(_HARDWARE)):
            hw_spec, hw_plain = _made_up_hardware(j)
            for b, c, fe, be in ((1, 64, 0.7, 0.8), (1024, 16, 0.5, 0.9), (64, 4096, 0.9, 0.6), (4096, 1, 1.0, 1.0)):
                cm = RooflineCostModel(hw_spec, spec, flops_efficiency=fe, bandwidth_efficiency=be)
                want, bound = cm.step_time([1] * b, [c] * b), cm.breakdown([1] * b, [c] * b)["bound"]
                with _engine_formulas_switched_off():
                    got = ex().decode_step_time(plain, hw_plain, b, c, flops_efficiency=fe, bandwidth_efficiency=be)
                assert got == pytest.approx(want, rel=1e-9), (
                    f"decode_step_time on made-up hardware {_HARDWARE[j]} and model {_SHAPES[i]}, batch={b}, "
                    f"context_len={c}, flops_efficiency={fe}, bandwidth_efficiency={be}: expected "
                    f"{want * 1e3:.6f} ms ({bound} bound), got {got * 1e3:.6f} ms"
                )


def test_decode_step_time_efficiency_knobs():
    cm = RooflineCostModel("H100-SXM", "llama-2-7b", flops_efficiency=0.5, bandwidth_efficiency=0.6)
    for b in (1, 512):
        want = cm.step_time([1] * b, [1024] * b)
        got = ex().decode_step_time(
            MODELS["llama-2-7b"], HARDWARE["H100-SXM"], b, 1024, flops_efficiency=0.5, bandwidth_efficiency=0.6
        )
        assert got == pytest.approx(want, rel=1e-9), (
            f"with flops_efficiency=0.5, bandwidth_efficiency=0.6, batch={b}: expected {want * 1e3:.6f} ms, "
            f"got {got * 1e3:.6f} ms"
        )


def test_decode_step_time_reproduces_the_batching_rule_of_thumb():
    """From batch 1 to 32, throughput ~20x for ~1.5x the step time (notebook 01, section 2)."""
    f = ex().decode_step_time
    m, hw = MODELS["llama-2-7b"], HARDWARE["H100-SXM"]
    t1, t32 = f(m, hw, 1, 512), f(m, hw, 32, 512)
    lat, thr = t32 / t1, (32 / t32) / (1 / t1)
    assert 1.3 < lat < 1.8 and 15 < thr < 25, (
        f"batch 1 -> 32 on an H100 (Llama-2-7B, 512 positions): expected latency x~1.5 and throughput x~20, "
        f"got latency x{lat:.2f} and throughput x{thr:.1f}"
    )


# --- Exercise 4: completion_times ----------------------------------------------------------------------


def test_completion_times_worked_example():
    """Notebook 01's worked example: 8 x 100 tokens and 2 x 1000, 10 ms per step."""
    lens = [100] * 8 + [1000] * 2
    static = ex().completion_times(lens, max_num_seqs=10, step_time=0.010, batching="static")
    cont = ex().completion_times(lens, max_num_seqs=10, step_time=0.010, batching="continuous")
    assert static == pytest.approx([10.0] * 10), (
        f"static batching: every request is returned with the longest, at 1000 x 10 ms = 10 s; got {static}"
    )
    assert cont == pytest.approx([1.0] * 8 + [10.0] * 2), (
        f"continuous batching: short requests at 100 x 10 ms = 1 s, long ones at 10 s; got {cont}"
    )


def _engine_finish_times(lens, max_num_seqs, batching, step_time):
    llm = LLM(
        model="random",
        executor="simulated",
        clock="modeled",
        cost_model=ConstantStepTime(step_time),
        batching=batching,
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        max_num_batched_tokens=2048,
    )
    eng = llm.engine
    for i, n in enumerate(lens):
        eng.add_request([10 + i % 50] * 4, SamplingParams(max_tokens=n, **GREEDY), request_id=f"r{i}", arrival_time=0.0)
    eng.run()
    return [eng.requests[f"r{i}"].metrics.finish_time for i in range(len(lens))]


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_completion_times_match_the_engines_modeled_run(batching):
    rng = random.Random(1)
    for trial in range(6):
        lens = [rng.randint(1, 30) for _ in range(rng.randint(1, 12))]
        seqs = rng.choice([1, 2, 3, 4, 8])
        want = _engine_finish_times(lens, seqs, batching, 0.010)
        got = ex().completion_times(lens, max_num_seqs=seqs, step_time=0.010, batching=batching)
        assert list(got) == pytest.approx(want, abs=1e-9), (
            f"completion_times({lens}, max_num_seqs={seqs}, batching={batching!r}): the engine's modeled run "
            f"returned the requests at {[round(t, 3) for t in want]} s, you said {got}"
        )


# --- Exercise 5: plan_step ---------------------------------------------------------------------------


def test_plan_step_figures_2_and_3():
    """Budget 8: B decodes (1 token) and C prefills (6) = 7 tokens; D waits (at most 2 requests)."""
    got = ex().plan_step([("B", 7, 6)], [("C", 6), ("D", 3)], token_budget=8, free_kv_positions=18, max_num_seqs=2)
    assert got == {"B": 1, "C": 6}, f"Figure 3: expected {{'B': 1, 'C': 6}} (1 + 6 = 7 tokens of 8), got {got}"


def test_plan_step_small_cases():
    f = ex().plan_step
    cases = [
        # (running, waiting, budget, free, seqs) -> expected, why
        (([], [("A", 5), ("B", 5)], 8, 100, 4), {"A": 5, "B": 3}, "B's prefill is chunked to the 3 tokens left"),
        (([], [("A", 5), ("B", 2)], 8, 6, 4), {"A": 5}, "B needs 2 KV positions, 1 is free: it waits"),
        (([], [("A", 9), ("B", 1)], 8, 100, 4), {"A": 8}, "A takes the whole budget; B waits behind it"),
        (([("A", 12, 8)], [("B", 3)], 4, 100, 4), {"A": 4}, "A's next prompt chunk takes the budget"),
        (([("A", 6, 5), ("B", 4, 3)], [("C", 2)], 8, 100, 2), {"A": 1, "B": 1}, "no slot left for C"),
        (([("A", 6, 5)], [("C", 7), ("D", 1)], 8, 5, 4), {"A": 1}, "C needs 7 positions, 4 left; D waits behind C"),
        (([("A", 6, 5), ("B", 4, 3)], [], 1, 100, 4), {"A": 1}, "the budget is spent before B"),
        (
            ([("A", 6, 5)], [("C", 5)], 8, 5, 4),
            {"A": 1},
            "A's decode takes 1 of the 5 free KV positions, so only 4 are left for C's 5",
        ),
        (
            ([("A", 20, 12), ("B", 9, 8)], [("C", 3), ("D", 1)], 16, 12, 4),
            {"A": 8, "B": 1, "C": 3},
            "A's chunk (8) and B's decode (1) take 9 of the 12 free positions: C's 3 fit, D's 1 no longer does",
        ),
    ]
    for args, want, why in cases:
        got = f(*args)
        assert got == want, (
            f"plan_step(running={args[0]}, waiting={args[1]}, token_budget={args[2]}, "
            f"free_kv_positions={args[3]}, max_num_seqs={args[4]}): expected {want} ({why}), "
            f"got {got}"
        )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_plan_step_matches_the_engines_scheduler(seed):
    """Replay random workloads through the real scheduler; before every step, ask plan_step."""
    rng = random.Random(seed)
    budget, seqs, blocks = rng.choice([4, 8, 16]), rng.choice([2, 3, 4, 6]), rng.choice([32, 40, 64])
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=1,
        num_kv_blocks=blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=64,
    )
    eng = llm.engine
    for i in range(rng.randint(4, 10)):
        eng.add_request(
            [10 + i] * rng.randint(1, 20),
            SamplingParams(max_tokens=rng.randint(1, 10), **GREEDY),
            request_id=f"r{i}",
            arrival_time=0.0,
        )
    compared = 0
    while eng.has_unfinished_requests():
        s = eng.scheduler
        running = [(r.request_id, r.num_tokens, r.num_computed_tokens) for r in s.running]
        waiting = [(r.request_id, r.num_tokens) for r in s.waiting]
        free = eng.kv.num_free_blocks
        rec = eng.step()
        if rec.preempted:  # a running request could not grow: outside plan_step's rule
            continue
        want = {e.request_id: e.num_new_tokens for e in rec.batch}
        got = ex().plan_step(running, waiting, token_budget=budget, free_kv_positions=free, max_num_seqs=seqs)
        assert got == want, (
            f"step {rec.step}: plan_step(running={running}, waiting={waiting}, "
            f"token_budget={budget}, free_kv_positions={free}, max_num_seqs={seqs}) returned "
            f"{got}; the engine's scheduler ran {want}"
        )
        compared += 1
    assert compared > 0
