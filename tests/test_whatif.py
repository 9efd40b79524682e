"""The what-if widget, headless: move its controls, read its figures back.

Each change must re-simulate and redraw, and what is drawn must be what a direct
``simulate()`` call with the same settings, written out here by hand, gives: the TTFT and
TPOT CDFs (every request's value, sorted), the KV use per step and the goodput line.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from minillm.sim.simulated import simulate  # noqa: E402
from minillm.viz.whatif import WhatIf, WhatIfSettings, whatif_trace  # noqa: E402

N = 160                 # a short trace: the test checks what is drawn, not how fast


def direct(rate, policy="fcfs", budget=2048, chunked=True, kv_tokens=64_000, preemption="recompute"):
    """The run the widget should show, set up without the widget."""
    blocks = kv_tokens // 16
    return simulate(whatif_trace(rate, N, 0), model="llama-2-70b", hardware="H100-SXM", records="summary",
                    slo_ttft=2.0, slo_tpot=0.1, max_num_seqs=128, policy=policy, max_num_batched_tokens=budget,
                    enable_chunked_prefill=chunked, num_kv_blocks=blocks, preemption_mode=preemption,
                    num_swap_blocks=0 if preemption == "recompute" else blocks)


def drawn(w):
    cdf = w.cdf_fig.fig.data
    kv = w.kv_fig.fig.data[0]
    return dict(ttft=list(cdf[0].x), tpot=list(cdf[1].x), prev_ttft=list(cdf[2].x), kv_t=list(kv.x),
                kv=list(kv.y), goodput=w.goodput_html.value)


def expected(engine, summary):
    ms = [r.metrics for r in engine.requests.values()]
    return dict(ttft=sorted(m.ttft for m in ms if m.ttft is not None),
                tpot=sorted(m.tpot for m in ms if m.tpot is not None),
                kv_t=[s.time for s in engine.step_summaries],
                kv=[s.kv.used / s.kv.total for s in engine.step_summaries],
                goodput=f"goodput {summary['goodput_requests_per_s']:.2f} req/s")


def check_matches(w, engine, summary):
    got, want = drawn(w), expected(engine, summary)
    assert got["ttft"] == want["ttft"] and got["tpot"] == want["tpot"]
    assert got["kv_t"] == want["kv_t"] and got["kv"] == want["kv"]
    assert want["goodput"] in got["goodput"]
    assert {k: v for k, v in w.summary.items() if k != "wall_time"} == \
        {k: v for k, v in summary.items() if k != "wall_time"}
    assert w.progress.value == 1.0 and w.progress.description == "done"


def test_every_control_resimulates_and_draws_what_simulate_gives():
    w = WhatIf(n=N)
    check_matches(w, *direct(8.0))
    before = drawn(w)
    assert len(before["ttft"]) == N and before["prev_ttft"] == []

    w.rate.value = 16.0                                  # more load: a different run, previous kept
    check_matches(w, *direct(16.0))
    after = drawn(w)
    assert after["ttft"] != before["ttft"] and after["prev_ttft"] == before["ttft"]
    assert w.num_runs == 2

    w.policy.value = "priority"
    check_matches(w, *direct(16.0, policy="priority"))
    w.kv.value = 16_000                                  # a small cache: requests are preempted
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
    w.chunked.value = False                  # a 512-token budget cannot take a long prompt whole
    assert w.error is not None and "max_num_batched_tokens=512" in w.error
    assert "refuses" in w.status.value and w.progress.description == "refused"
    assert drawn(w) == shown and w.num_runs == 1
    assert w.settings.enable_chunked_prefill is True            # the settings of what is on screen


def test_settings_are_checked():
    with pytest.raises(ValueError, match="policy='lifo'"):
        WhatIfSettings(policy="lifo")
    with pytest.raises(ValueError, match="rate=0"):
        WhatIfSettings(rate=0)
