"""WhatIf: move a serving knob, see the whole run again.

Every change of a control re-simulates one fixed trace (2,000 chat-like requests by
default) with the engine's own scheduler, policies and paged KV manager on the modeled
clock (``minillm.sim.simulated.simulate``), and redraws:

* the TTFT and TPOT CDFs of this setting, beside the previous one (dashed), so a change
  reads as a shift of the curve;
* the KV cache in use over the run (fraction of capacity, per step);
* goodput under the SLOs (DistServe's measure: requests per second that meet both the
  TTFT and the TPOT target), throughput and the share of requests that meet the SLOs.

The knobs: arrival rate, policy, execution-token budget, chunked prefill, KV capacity and
preemption mode. ``WhatIf.settings`` holds what the controls show; ``simulate_kwargs()``
is exactly what is handed to ``simulate``, so the same run can be made without the widget.
A progress bar follows the simulation (requests finished so far).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Optional

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import figures
from ..sim.simulated import simulate
from ..analysis.workloads import LogNormal, synthetic_trace
from .stepper import _FigureSlot

__all__ = ["WhatIf", "WhatIfSettings", "whatif_trace", "POLICY_CHOICES", "PREEMPTION_CHOICES"]

POLICY_CHOICES = ("fcfs", "sjf", "priority", "mlfq", "fair")
PREEMPTION_CHOICES = ("recompute", "swap", "auto")
TOKEN_BUDGETS = (512, 1024, 2048, 4096, 8192, 16384)
KV_CAPACITIES = (16_000, 32_000, 64_000, 128_000, 256_000, 457_906)   # positions; 457,906 = all of 4 x H100


@dataclass(frozen=True)
class WhatIfSettings:
    """One point of the what-if space (what the controls show)."""
    rate: float = 8.0                         # arrivals per second (Poisson)
    policy: str = "fcfs"                      # a built-in policy name
    max_num_batched_tokens: int = 2048        # the execution-token budget of a step
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int = 64_000          # KV cache size in token positions
    preemption_mode: str = "recompute"        # "recompute" | "swap" | "auto"

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"WhatIfSettings(rate={self.rate!r}): must be > 0 requests per second")
        if self.policy not in POLICY_CHOICES:
            raise ValueError(f"WhatIfSettings(policy={self.policy!r}): one of {POLICY_CHOICES}")
        if self.preemption_mode not in PREEMPTION_CHOICES:
            raise ValueError(f"WhatIfSettings(preemption_mode={self.preemption_mode!r}): "
                             f"one of {PREEMPTION_CHOICES}")
        if self.max_num_batched_tokens < 1 or self.kv_capacity_tokens < 16:
            raise ValueError(f"WhatIfSettings: max_num_batched_tokens={self.max_num_batched_tokens!r} must be "
                             f">= 1 and kv_capacity_tokens={self.kv_capacity_tokens!r} >= 16")


def whatif_trace(rate: float, n: int = 2000, seed: int = 0) -> list:
    """The what-if workload: ``n`` chat-like requests (log-normal prompts around 256 tokens,
    answers around 96, both with long tails) arriving as a Poisson process at ``rate`` per
    second; a fifth of them urgent (priority 0) and two tenants, 70 / 30, so the priority
    and fair policies have something to act on."""
    return synthetic_trace(n, rate=rate, prompt_len=LogNormal(256, 1.0, 4, 2048),
                           output_len=LogNormal(96, 0.8, 4, 512), priority_mix={0: 0.2, 1: 0.8},
                           tenant_mix={"a": 0.7, "b": 0.3}, seed=seed)


class WhatIf:
    """The what-if widget (``display(w)`` or ``w.widget``).

    ``n`` / ``seed``: the trace (``whatif_trace``); ``model`` / ``hardware``: what is
    simulated (default Llama-2-70B on 4 x H100, ``simulate``'s); ``max_num_seqs``: the batch
    cap; ``slo_ttft`` / ``slo_tpot``: goodput's targets (seconds). ``settings``: where the
    controls start. ``run=False`` builds the controls without simulating (call ``update()``).
    """

    def __init__(self, settings: Optional[WhatIfSettings] = None, *, n: int = 2000, seed: int = 0,
                 model: str = "llama-2-70b", hardware: Any = "H100-SXM", max_num_seqs: int = 128,
                 slo_ttft: float = 2.0, slo_tpot: float = 0.100, run: bool = True):
        self.settings = settings or WhatIfSettings()
        self.n, self.seed, self.model, self.hardware = n, seed, model, hardware
        self.max_num_seqs, self.slo_ttft, self.slo_tpot = max_num_seqs, slo_ttft, slo_tpot
        self.summary: Optional[dict] = None          # the last run's metrics.summarize dict
        self.engine = None                           # the last run's engine
        self.previous: Optional[tuple] = None        # (settings, request metrics) of the run before
        self.num_runs = 0
        self.error: Optional[str] = None             # why the engine refused the last setting
        s = self.settings
        style = dict(style={"description_width": "initial"})
        self.rate = W.FloatSlider(value=s.rate, min=1.0, max=20.0, step=0.5, description="arrival rate (req/s)",
                                  continuous_update=False, **style)
        self.policy = W.Dropdown(options=POLICY_CHOICES, value=s.policy, description="policy", **style)
        self.budget = W.SelectionSlider(options=_with(TOKEN_BUDGETS, s.max_num_batched_tokens),
                                        value=s.max_num_batched_tokens, description="token budget",
                                        continuous_update=False, **style)
        self.chunked = W.Checkbox(value=s.enable_chunked_prefill, description="chunked prefill", **style)
        self.kv = W.SelectionSlider(options=_with(KV_CAPACITIES, s.kv_capacity_tokens), value=s.kv_capacity_tokens,
                                    description="KV capacity (positions)", continuous_update=False, **style)
        self.preemption = W.Dropdown(options=PREEMPTION_CHOICES, value=s.preemption_mode,
                                     description="preemption", **style)
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="idle", **style)
        self.status = W.HTML()
        self.goodput_html = W.HTML()
        self.cdf_fig = _FigureSlot(self._empty_cdf())
        self.kv_fig = _FigureSlot(self._empty_kv())
        for c in self.controls:
            c.observe(self._on_change, names="value")
        self.widget = W.VBox([W.HBox([self.rate, self.policy, self.budget]),
                              W.HBox([self.chunked, self.kv, self.preemption]),
                              W.HBox([self.progress, self.status]), self.goodput_html,
                              self.cdf_fig.view, self.kv_fig.view])
        if run:
            self.update()

    # --- the controls ------------------------------------------------------------------
    @property
    def controls(self) -> list:
        return [self.rate, self.policy, self.budget, self.chunked, self.kv, self.preemption]

    def _read_controls(self) -> WhatIfSettings:
        return WhatIfSettings(rate=float(self.rate.value), policy=self.policy.value,
                              max_num_batched_tokens=int(self.budget.value),
                              enable_chunked_prefill=bool(self.chunked.value),
                              kv_capacity_tokens=int(self.kv.value), preemption_mode=self.preemption.value)

    def _on_change(self, change) -> None:
        self.update()

    # --- one run -------------------------------------------------------------------------
    def simulate_kwargs(self, settings: Optional[WhatIfSettings] = None) -> dict:
        """The keywords ``simulate(whatif_trace(rate, n, seed), **kwargs)`` gets for ``settings``
        (default: the current ones). Swap space, when a mode may swap, is as large as the cache."""
        s = settings or self.settings
        blocks = s.kv_capacity_tokens // 16
        return dict(model=self.model, hardware=self.hardware, records="summary", slo_ttft=self.slo_ttft,
                    slo_tpot=self.slo_tpot, max_num_seqs=self.max_num_seqs, policy=s.policy,
                    max_num_batched_tokens=s.max_num_batched_tokens,
                    enable_chunked_prefill=s.enable_chunked_prefill, num_kv_blocks=blocks,
                    preemption_mode=s.preemption_mode,
                    num_swap_blocks=0 if s.preemption_mode == "recompute" else blocks)

    def update(self) -> Optional[dict]:
        """Re-simulate with what the controls show and redraw; returns the run's summary, or
        None (figures kept, the reason in ``error`` and on screen) if the engine refuses the
        setting."""
        settings = self._read_controls()
        previous = (self.settings, [r.metrics for r in self.engine.requests.values()]) if self.engine else None
        self.progress.value, self.progress.description = 0.0, "simulating"
        self.status.value = f"<i>simulating {self.n:,} requests ...</i>"
        finished = shown = 0

        def on_step(rec) -> None:              # the bar moves in steps of 2% (each move is a message)
            nonlocal finished, shown
            if rec.finished:
                finished += len(rec.finished)
                if finished - shown >= self.n / 50:
                    shown = finished
                    self.progress.value = finished / self.n

        trace = whatif_trace(settings.rate, self.n, self.seed)
        try:
            engine, summary = simulate(trace, progress=on_step, **self.simulate_kwargs(settings))
        except ValueError as e:    # the engine refuses the setting (e.g. no chunking, budget < a prompt)
            self.progress.description = "refused"
            self.status.value = f"<b>the engine refuses this setting:</b> {html.escape(str(e))}"
            self.error = str(e)
            return None
        self.error = None
        self.engine, self.summary, self.settings, self.previous = engine, summary, settings, previous
        self.num_runs += 1
        self.progress.value, self.progress.description = 1.0, "done"
        self.status.value = f"simulated in {self.summary['wall_time']:.2f} s ({self.engine.step_count:,} steps)"
        self._draw()
        return self.summary

    # --- the figures ---------------------------------------------------------------------
    def _empty_cdf(self) -> go.Figure:
        fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (time to first token)",
                                                            "TPOT (time per output token)"))
        for name, dash in (("this setting", "solid"), ("previous", "dash")):
            for col in (1, 2):
                fig.add_trace(go.Scatter(x=[], y=[], mode="lines", name=name, legendgroup=name,
                                         showlegend=col == 1, line=dict(shape="hv", dash=dash, width=2,
                                                                        color=figures.PALETTE[0 if dash == "solid"
                                                                                              else 7])),
                              row=1, col=col)
        fig.update_xaxes(title_text="s", type="log")
        fig.update_yaxes(title_text="fraction of requests", range=[0, 1.02], row=1, col=1)
        fig.update_yaxes(range=[0, 1.02])
        fig.update_layout(height=340, plot_bgcolor="white", margin=dict(t=60, b=40),
                          legend=dict(orientation="h", y=1.15, yanchor="bottom", x=0))
        return fig

    def _empty_kv(self) -> go.Figure:
        fig = go.Figure(go.Scatter(x=[], y=[], mode="lines", name="KV in use", line=dict(color=figures.PALETTE[1])))
        fig.update_layout(height=240, plot_bgcolor="white", margin=dict(t=40, b=40), title="KV cache in use",
                          xaxis_title="modeled time (s)", yaxis=dict(title="fraction of capacity", range=[0, 1.02]))
        return fig

    def _draw(self) -> None:
        current = [r.metrics for r in self.engine.requests.values()]
        runs = [current, self.previous[1] if self.previous else []]
        fig = self.cdf_fig.fig
        with fig.batch_update():
            for i, ms in enumerate(runs):
                for j, metric in enumerate(("ttft", "tpot")):
                    x, y = latency_ecdf(ms, metric)
                    fig.data[2 * i + j].x, fig.data[2 * i + j].y = x, y
            fig.data[2].name = "previous" if self.previous is None else f"previous ({_describe(self.previous[0])})"
            fig.data[0].name = f"this setting ({_describe(self.settings)})"
        self.cdf_fig.refresh()
        t, used = kv_in_use(self.engine.step_summaries)
        kv = self.kv_fig.fig
        with kv.batch_update():
            kv.data[0].x, kv.data[0].y = t, used
        self.kv_fig.refresh()
        self.goodput_html.value = goodput_html(self.summary, self.slo_ttft, self.slo_tpot)

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


# =====================================================================================
# What the figures show, as plain functions (the test and the notebook call them too)
# =====================================================================================

def latency_ecdf(request_metrics: list, metric: str) -> tuple[list, list]:
    """(sorted values, fraction of requests at or below each) of ``metric`` ("ttft", "tpot")
    over the requests that have it."""
    vals = sorted(v for v in (getattr(m, metric, None) for m in request_metrics) if v is not None)
    n = len(vals)
    return vals, [(i + 1) / n for i in range(n)]


def kv_in_use(step_summaries: list) -> tuple[list, list]:
    """(modeled time, fraction of the KV capacity holding KV) after each step."""
    return ([s.time for s in step_summaries],
            [s.kv.used / s.kv.total if s.kv.total else 0.0 for s in step_summaries])


def goodput_html(summary: dict, slo_ttft: float, slo_tpot: float) -> str:
    s = summary

    def f(key, fmt):
        v = s.get(key)
        return "n/a" if v is None else format(v, fmt)
    return (f"<b>goodput {f('goodput_requests_per_s', '.2f')} req/s</b> "
            f"(TTFT &le; {slo_ttft:g} s and TPOT &le; {1e3 * slo_tpot:g} ms; "
            f"{f('slo_attainment', '.0%')} of requests meet both) &middot; "
            f"throughput {f('request_throughput', '.2f')} req/s &middot; "
            f"TTFT p50 {f('ttft_p50', '.2f')} s, p99 {f('ttft_p99', '.2f')} s &middot; "
            f"TPOT p50 {1e3 * (s.get('tpot_p50') or 0):.0f} ms &middot; "
            f"preemptions {s.get('num_preemptions', 0)} &middot; KV use mean {f('kv_util_mean', '.0%')}")


def _describe(s: WhatIfSettings) -> str:
    return (f"{s.rate:g} req/s, {s.policy}, budget {s.max_num_batched_tokens}, "
            f"chunked {'on' if s.enable_chunked_prefill else 'off'}, KV {s.kv_capacity_tokens:,}, "
            f"{s.preemption_mode}")


def _with(options: tuple, value) -> tuple:
    return options if value in options else tuple(sorted(set(options) | {value}))
