"""The what-if widget, headless: move its controls, read its figures back.

Each change must re-simulate and redraw, and what is drawn must be what a direct
``simulate()`` call with the same settings, written out here by hand, gives: the TTFT and
TPOT CDFs (every request's value, sorted), the KV use per step and the goodput line.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from minillm.sim.costmodel import RooflineCostModel
from minillm.sim.simulated import simulate
from minillm.viz.whatif import WhatIf, WhatIfSettings, whatif_trace
from minillm.analysis.workloads import Uniform, shared_prefix_trace, synthetic_trace

N = 160  # a short trace: the test checks what is drawn, not how fast


def direct(rate, policy="fcfs", budget=2048, chunked=True, kv_tokens=64_000, preemption="recompute"):
    """The run the widget should show, set up without the widget."""
    blocks = kv_tokens // 16
    return simulate(
        whatif_trace(rate, N, 0),
        model="llama-2-70b",
        hardware="H100-SXM",
        records="summary",
        slo_ttft=2.0,
        slo_tpot=0.1,
        max_num_seqs=128,
        policy=policy,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        num_kv_blocks=blocks,
        preemption_mode=preemption,
        num_swap_blocks=0 if preemption == "recompute" else blocks,
    )


def drawn(w):
    cdf = w.cdf_fig.fig.data
    kv = w.kv_fig.fig.data[0]
    return dict(
        ttft=list(cdf[0].x),
        tpot=list(cdf[1].x),
        prev_ttft=list(cdf[2].x),
        kv_t=list(kv.x),
        kv=list(kv.y),
        goodput=w.goodput_html.value,
    )


def expected(engine, summary):
    ms = [r.metrics for r in engine.requests.values()]
    return dict(
        ttft=sorted(m.ttft for m in ms if m.ttft is not None),
        tpot=sorted(m.tpot for m in ms if m.tpot is not None),
        kv_t=[s.time for s in engine.step_summaries],
        kv=[s.kv.used / s.kv.total for s in engine.step_summaries],
        goodput=f"goodput {summary['goodput_requests_per_s']:.2f} req/s",
    )


def check_matches(w, engine, summary):
    got, want = drawn(w), expected(engine, summary)
    assert got["ttft"] == want["ttft"] and got["tpot"] == want["tpot"]
    assert got["kv_t"] == want["kv_t"] and got["kv"] == want["kv"]
    assert want["goodput"] in got["goodput"]
    timings = ("wall_time", "cpu_time", "step_cpu_time")
    assert {k: v for k, v in w.summary.items() if k not in timings} == {
        k: v for k, v in summary.items() if k not in timings
    }
    assert w.progress.value == 1.0 and w.progress.description == "done"


def test_every_control_resimulates_and_draws_what_simulate_gives():
    w = WhatIf(n=N)
    check_matches(w, *direct(8.0))
    before = drawn(w)
    assert len(before["ttft"]) == N and before["prev_ttft"] == []

    w.rate.value = 16.0  # more load: a different run, previous kept
    check_matches(w, *direct(16.0))
    after = drawn(w)
    assert after["ttft"] != before["ttft"] and after["prev_ttft"] == before["ttft"]
    assert w.num_runs == 2

    w.policy.value = "priority"
    check_matches(w, *direct(16.0, policy="priority"))
    w.kv.value = 16_000  # a small cache: requests are preempted
    eng, summ = direct(16.0, policy="priority", kv_tokens=16_000)
    check_matches(w, eng, summ)
    assert summ["num_preemptions"] > 0 and max(drawn(w)["kv"]) > 0.9
    w.preemption.value = "swap"
    check_matches(w, *direct(16.0, policy="priority", kv_tokens=16_000, preemption="swap"))
    w.budget.value = 512
    check_matches(w, *direct(16.0, policy="priority", budget=512, kv_tokens=16_000, preemption="swap"))
    assert w.num_runs == 6


def test_a_setting_the_engine_refuses_is_explained_and_the_figures_stay():
    w = WhatIf(WhatIfSettings(max_num_batched_tokens=512), n=N)
    shown = drawn(w)
    w.chunked.value = False  # a 512-token budget cannot take a long prompt whole
    assert w.error is not None and "max_num_batched_tokens=512" in w.error
    assert "refuses" in w.status.value and w.progress.description == "refused"
    assert drawn(w) == shown and w.num_runs == 1
    assert w.settings.enable_chunked_prefill is True  # the settings of what is on screen


def test_settings_are_checked():
    with pytest.raises(ValueError, match="policy='lifo'"):
        WhatIfSettings(policy="lifo")
    with pytest.raises(ValueError, match="rate=0"):
        WhatIfSettings(rate=0)


# --- the widget configured by a notebook: its controls, its workload, its model ---------------

SMALL = synthetic_trace(60, rate=30, prompt_len=Uniform(300, 900), output_len=Uniform(50, 200), seed=1)
H100_7B = RooflineCostModel("H100-SXM", "llama-2-7b")


def direct_7b(trace, watermark=0.0, preemption="recompute", kv_tokens=4096, block_size=16, caching=False):
    """A run of section 4 of notebook 05 (or 3 of 02), set up without the widget; records="full",
    so the KV lines are read from the full snapshot, not from the summaries the widget draws."""
    blocks = kv_tokens // block_size
    return simulate(
        trace,
        model="llama-2-7b",
        cost_model=H100_7B,
        records="full",
        slo_ttft=2.0,
        slo_tpot=0.1,
        max_num_seqs=256,
        max_model_len=8192,
        max_num_batched_tokens=8192,
        block_size=block_size,
        num_kv_blocks=blocks,
        watermark=watermark,
        preemption_mode=preemption,
        num_swap_blocks=0 if preemption == "recompute" else blocks,
        enable_prefix_caching=caching,
    )


def check_matches_full(w, engine, summary):
    got = drawn(w)
    ms = [r.metrics for r in engine.requests.values()]
    assert got["ttft"] == sorted(m.ttft for m in ms) and got["tpot"] == sorted(m.tpot for m in ms if m.tpot)
    assert got["kv_t"] == [r.time for r in engine.step_records]
    assert got["kv"] == [r.kv.used / r.kv.total for r in engine.step_records]
    held = w.kv_fig.fig.data[2]
    assert list(held.y) == [r.kv.blocks_used * r.kv.block_size / r.kv.total for r in engine.step_records]
    for k in ("num_finished", "num_preemptions", "output_throughput", "ttft_p99", "kv_util_mean"):
        assert w.summary[k] == summary[k], k
    assert f"{engine.stats()['recomputed_tokens']:,} tokens prefilled again" in got["goodput"]


def test_a_notebooks_own_fixed_trace_and_controls():
    w = WhatIf(
        WhatIfSettings(max_num_batched_tokens=8192, kv_capacity_tokens=4096),
        controls=("watermark", "preemption", "kv"),
        trace=SMALL,
        model="llama-2-7b",
        cost_model=H100_7B,
        max_num_seqs=256,
        config=dict(max_model_len=8192),
        choices=dict(kv=(2048, 4096, 8192)),
    )
    assert w.controls == [w.kv, w.preemption, w.watermark]  # only these on screen
    on_screen = [c for row in w.widget.children[:1] for c in row.children]
    assert on_screen == w.controls and w.rate not in on_screen
    first = direct_7b(SMALL)
    check_matches_full(w, *first)
    assert first[1]["num_preemptions"] > 0  # a small cache: the burst preempts
    w.watermark.value = 0.1  # headroom: fewer preemptions
    eng, summ = direct_7b(SMALL, watermark=0.1)
    check_matches_full(w, eng, summ)
    assert summ["num_preemptions"] < first[1]["num_preemptions"]
    assert w.kv_fig.fig.data[1].y is not None and list(w.kv_fig.fig.data[1].y) == [
        r.kv.used / r.kv.total for r in first[0].step_records
    ]  # the previous run, dashed
    w.preemption.value = "swap"
    check_matches_full(w, *direct_7b(SMALL, watermark=0.1, preemption="swap"))
    w.kv.value = 8192
    check_matches_full(w, *direct_7b(SMALL, watermark=0.1, preemption="swap", kv_tokens=8192))
    assert "headroom 10%" in w.cdf_fig.fig.data[0].name and "req/s" not in w.cdf_fig.fig.data[0].name


def test_block_size_and_prefix_caching_controls_with_a_trace_of_the_rate():
    def shared_prompts(rate):
        return shared_prefix_trace(
            50,
            prefix_len=256,
            suffix_len=Uniform(20, 200),
            output_len=Uniform(20, 100),
            vocab_size=32000,
            rate=rate,
            seed=2,
        )

    w = WhatIf(
        WhatIfSettings(rate=10, max_num_batched_tokens=8192, kv_capacity_tokens=4096),
        controls=("rate", "block_size", "prefix_caching"),
        trace=shared_prompts,
        model="llama-2-7b",
        cost_model=H100_7B,
        max_num_seqs=256,
        config=dict(max_model_len=8192),
    )
    check_matches_full(w, *direct_7b(shared_prompts(10)))
    w.prefix_caching.value = True
    eng, summ = direct_7b(shared_prompts(10), caching=True)
    check_matches_full(w, eng, summ)
    assert summ["prefix_cache_hit_rate"] > 0.5 and w.summary["prefix_cache_hit_rate"] == summ["prefix_cache_hit_rate"]
    w.block_size.value = 64  # longer tails: the dotted line leaves the solid
    eng, summ = direct_7b(shared_prompts(10), caching=True, block_size=64)
    check_matches_full(w, eng, summ)
    assert max(r.kv.partial_waste for r in eng.step_records) > 0
    w.rate.value = 20.0  # a new trace, from the notebook's function
    check_matches_full(w, *direct_7b(shared_prompts(20), caching=True, block_size=64))
    assert w.num_runs == 4


def test_a_configuration_that_cannot_work_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="controls=.*'budgets'"):
        WhatIf(controls=("rate", "budgets"), run=False)
    with pytest.raises(ValueError, match="fixed trace has no arrival rate"):
        WhatIf(controls=("rate", "kv"), trace=SMALL, run=False)
    with pytest.raises(ValueError, match=r"\['num_kv_blocks'\]"):
        WhatIf(config=dict(num_kv_blocks=10), run=False)
    with pytest.raises(ValueError, match="watermark=1.0"):
        WhatIfSettings(watermark=1.0)
    with pytest.raises(ValueError, match="kv_capacity_tokens=8"):
        WhatIfSettings(kv_capacity_tokens=8)


def test_notebook_03s_suggestion_shows_fcfs_and_sjf_apart():
    """Notebook 03 suggests FCFS against SJF at 16,000 KV positions and 12 req/s (the widget's 2,000-request trace):
    a queue forms and SJF's median TTFT is several times FCFS's while its p99 is not better; at the default
    64,000 positions and 12 req/s hardly a queue forms and the two policies give nearly the same TTFTs (why it
    suggests 16,000)."""
    w = WhatIf(slo_ttft=2.0, slo_tpot=0.1)
    run = {
        (kv, pol): simulate(
            w.trace_for(12.0), **w.simulate_kwargs(WhatIfSettings(rate=12.0, policy=pol, kv_capacity_tokens=kv))
        )[1]
        for kv in (16_000, 64_000)
        for pol in ("fcfs", "sjf")
    }
    fcfs, sjf = run[16_000, "fcfs"], run[16_000, "sjf"]
    assert fcfs["ttft_p50"] > 3 * sjf["ttft_p50"] and sjf["ttft_p99"] >= fcfs["ttft_p99"]
    assert run[64_000, "fcfs"]["ttft_p50"] == pytest.approx(run[64_000, "sjf"]["ttft_p50"], rel=0.05)
