"""Smoke test of the benchmarks: each runs at ``--size tiny`` and writes its JSON.

No timing is asserted (timings belong in the benchmarks' own printed tables); this only
keeps ``python -m minillm.bench NAME`` from rotting as the engine changes.
"""

import json

import pytest

from minillm.bench import BENCHMARKS
from minillm.bench.__main__ import main
from minillm.bench.common import RESULT_KEYS

pytestmark = pytest.mark.slow  # runs every benchmark

# What each benchmark's "results" must hold, beyond the common keys.
EXPECTED = {
    "throughput": ("minillm", "hf_static", "hf_continuous", "ratio_vs_hf_static", "ratio_vs_hf_continuous"),
    "sched-overhead": ("scheduling_pass", "step_breakdown"),
    "paging": ("reserved_cap", "reserved_exact", "paged", "paged_vs_reserved_mean_concurrent"),
    "prefix": ("shared_prompt", "multi_turn"),
    "sim-scale": ("requests", "steps", "wall_s", "steps_per_s", "step_cpu_s"),
    "spec": ("acceptance", "modeled", "at_scale"),
    "router": ("shared-prefix", "multi-turn"),
    "vs-vllm": ("median_tok_per_s", "copy_bandwidth_Bps", "decode_bytes_per_step", "serving"),
    "calibrate": ("calibration_s", "profile", "held_out", "load_average", "traces"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_runs_tiny(name, tmp_path, capsys):
    main([name, "--size", "tiny", "--out", str(tmp_path), "--threads", "1"])
    path = tmp_path / f"{name}-tiny.json"
    assert path.exists(), f"{name} wrote no JSON"
    data = json.loads(path.read_text())
    for key in RESULT_KEYS:
        assert key in data, f"{name}: result JSON lacks {key!r}"
    assert data["benchmark"] == name and data["size"] == "tiny"
    assert data["command"].startswith(f"python -m minillm.bench {name}")
    for key in EXPECTED.get(name, ()):
        assert key in data["results"], f"{name}: results lack {key!r}"
    for g in data["goals"]:
        assert {"goal", "target", "measured", "met"} <= set(g)
    if name == "throughput":  # transformers' continuous batching ran, or the JSON says why not
        res = data["results"]
        assert res["hf_static"]["output_tokens"] == res["minillm"]["output_tokens"]
        assert "tok_per_s" in res["hf_continuous"] or "error" in res["hf_continuous"]
    if name == "calibrate":  # the figures the report names, per trace and metric
        for trace in data["results"]["traces"].values():
            for metric in ("ttft", "tpot", "e2e"):
                assert {"median_rel_err", "p90_rel_err", "noise", "noise_p90", "sensitivity"} <= set(trace[metric])
            assert {"utilisation", "steps", "preemptions", "drift", "reference_step_s"} <= set(trace)
            assert trace["drift"] > -1  # the reference step timed with the calibration and in the round
            x = trace["rescaled"]  # the drift divided out: the profile scaled by the reference step
            assert x["scale"] == pytest.approx(1 + trace["drift_priced"])  # against the profile's own price
            assert {"median_rel_err", "p90_rel_err"} <= set(x["e2e"]) | set(x["each_round"]["e2e"])
            assert {"total_rel_err", "by_batch", "e2e_same_schedule", "slowdown_by_tenth"} <= set(trace["step_times"])
        assert data["config"]["clock"] == "wall"
        assert data["config"]["threads"] == 1 and data["config"]["core"] is not None  # one thread, its one core
    captured = capsys.readouterr()
    if name == "vs-vllm":  # no vLLM at tiny: minillm's sides, offline and served, and the message
        res = data["results"]
        assert set(res["median_tok_per_s"]) == {"minillm", "minillm-torch"}
        assert set(res["serving"]) == {"minillm"} and res["serving"]["minillm"]["req_per_s"] > 0
        assert "vLLM skipped" in captured.err
    printed = captured.out
    assert "machine:" in printed and "command:" in printed


def test_throughput_repeat_reports_rounds_and_medians(tmp_path, capsys):
    data = main(["throughput", "--size", "tiny", "--out", str(tmp_path), "--threads", "1", "--repeat", "2"])
    res = data["throughput"]["results"]
    assert len(res["rounds"]) == 2
    assert "--repeat 2" in data["throughput"]["command"]
    for side, key in (("minillm", "minillm_tok_per_s"), ("hf_static", "hf_static_tok_per_s")):
        rates = sorted(r[key] for r in res["rounds"])
        assert res[side]["tok_per_s"] == pytest.approx(sum(rates) / 2)  # the median of two
    assert res["greedy_agreement_hf_static"] == 1.0
    with pytest.raises(ValueError, match="--repeat=0"):
        main(["throughput", "--size", "tiny", "--out", str(tmp_path), "--repeat", "0"])


def test_qwen3_shape_is_the_cost_models():
    # The GPU comparison's random checkpoint and the cost model's preset describe one model.
    from minillm.bench.throughput import QWEN3_06B
    from minillm.sim.costmodel import MODELS, ModelSpec
    from transformers import Qwen3Config

    spec = ModelSpec.from_hf_config(Qwen3Config(**QWEN3_06B), name="x", dtype_bytes=2)
    want = MODELS["qwen3-0.6b"]
    for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_params"):
        assert getattr(spec, f) == getattr(want, f), f
    assert 0.5e9 < want.num_params < 0.8e9
