"""WhatIf: move a serving knob, see the whole run again.

Every change of a control re-simulates one trace (2,000 chat-like requests by default, or
a notebook's own workload) with the engine's own scheduler, policies and paged KV manager
on the modeled clock (``minillm.sim.simulated.simulate``), and redraws:

* the TTFT and TPOT CDFs of this setting, beside the previous one (dashed), so a change
  reads as a shift of the curve;
* the KV cache in use over the run (fraction of capacity, per step), the previous run dashed;
* goodput under the SLOs (DistServe's measure: requests per second that meet both the
  TTFT and the TPOT target), throughput and the share of requests that meet the SLOs.

The knobs (``CONTROLS``): arrival rate, policy, execution-token budget, chunked prefill,
KV capacity, preemption mode, block size, prefix caching and admission headroom
(``watermark``). A notebook shows the ones its section is about (``controls=``), runs its
own workload (``trace=``: a function of the rate, or a fixed list) on its own model and
engine settings (``model=``, ``cost_model=``, ``config=``), and offers its own values
(``choices=``). ``WhatIf.settings`` holds what the controls show; ``simulate_kwargs()`` is
exactly what is handed to ``simulate``, so the same run can be made without the widget.
A progress bar follows the simulation (requests finished so far).
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Optional, Sequence, Union

import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import figures
from ..core.preemption import PREEMPTION_MODES
from ..sim.simulated import gc_paused, simulate
from ..analysis.workloads import LogNormal, synthetic_trace
from .stepper import FigureSlot

__all__ = ["WhatIf", "WhatIfSettings", "whatif_trace", "CONTROLS", "POLICY_CHOICES", "PREEMPTION_CHOICES"]

POLICY_CHOICES = ("fcfs", "sjf", "priority", "mlfq", "fair")
PREEMPTION_CHOICES = (*PREEMPTION_MODES, "auto")
# The values a slider offers unless a notebook gives its own (``WhatIf(choices=...)``); a
# starting value not among them is added.
DEFAULT_CHOICES = {
    "budget": (512, 1024, 2048, 4096, 8192, 16384),  # tokens per step
    "kv": (16_000, 32_000, 64_000, 128_000, 256_000, 457_906),  # positions; 457,906 = all of 4 x H100
    "block_size": (1, 4, 8, 16, 32, 64, 128, 256),  # positions per block
    "watermark": (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3),  # fraction of blocks kept free
}
# control name -> the WhatIfSettings field it sets
CONTROLS = {
    "rate": "rate",
    "policy": "policy",
    "budget": "max_num_batched_tokens",
    "chunked": "enable_chunked_prefill",
    "kv": "kv_capacity_tokens",
    "preemption": "preemption_mode",
    "block_size": "block_size",
    "prefix_caching": "enable_prefix_caching",
    "watermark": "watermark",
}
SCHEDULING_CONTROLS = ("rate", "policy", "budget", "chunked", "kv", "preemption")  # the default set


@dataclass(frozen=True)
class WhatIfSettings:
    """One point of the what-if space (what the controls show)."""

    rate: float = 8.0  # arrivals per second (Poisson)
    policy: str = "fcfs"  # a built-in policy name
    max_num_batched_tokens: int = 2048  # the execution-token budget of a step
    enable_chunked_prefill: bool = True
    kv_capacity_tokens: int = 64_000  # KV cache size in token positions
    preemption_mode: str = "recompute"  # "recompute" | "swap" | "auto"
    block_size: int = 16  # token positions per KV block
    enable_prefix_caching: bool = False
    watermark: float = 0.0  # fraction of blocks admission keeps free (headroom)

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"WhatIfSettings(rate={self.rate!r}): must be > 0 requests per second")
        if self.policy not in POLICY_CHOICES:
            raise ValueError(f"WhatIfSettings(policy={self.policy!r}): one of {POLICY_CHOICES}")
        if self.preemption_mode not in PREEMPTION_CHOICES:
            raise ValueError(f"WhatIfSettings(preemption_mode={self.preemption_mode!r}): one of {PREEMPTION_CHOICES}")
        if self.block_size < 1:
            raise ValueError(f"WhatIfSettings(block_size={self.block_size!r}): must be >= 1")
        if self.max_num_batched_tokens < 1 or self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"WhatIfSettings: max_num_batched_tokens={self.max_num_batched_tokens!r} must be "
                f">= 1 and kv_capacity_tokens={self.kv_capacity_tokens!r} >= block_size "
                f"({self.block_size})"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"WhatIfSettings(watermark={self.watermark!r}): must be in [0, 1)")


def whatif_trace(rate: float, n: int = 2000, seed: int = 0) -> list:
    """The what-if workload: ``n`` chat-like requests (log-normal prompts around 256 tokens,
    answers around 96, both with long tails) arriving as a Poisson process at ``rate`` per
    second; a fifth of them urgent (priority 0) and two tenants, 70 / 30, so the priority
    and fair policies have something to act on."""
    return synthetic_trace(
        n,
        rate=rate,
        prompt_len=LogNormal(256, 1.0, 4, 2048),
        output_len=LogNormal(96, 0.8, 4, 512),
        priority_mix={0: 0.2, 1: 0.8},
        tenant_mix={"a": 0.7, "b": 0.3},
        seed=seed,
    )


class WhatIf:
    """The what-if widget (``display(w)`` or ``w.widget``).

    ``controls``: which knobs are shown, names of ``CONTROLS`` (default: the scheduling six,
    without "rate" when the trace is fixed); the others stay at ``settings``. ``trace``: the
    workload, a function ``rate -> list of TraceRequest`` or a fixed list (default:
    ``whatif_trace(rate, n, seed)``). ``model`` / ``hardware`` / ``cost_model``: what is
    simulated (default Llama-2-70B on 4 x H100, ``simulate``'s); ``max_num_seqs``: the batch
    cap; ``config``: more ``EngineConfig`` fields, the same for every run (a field a control
    sets is refused). ``choices``: the values a slider offers, by control name ("budget",
    "kv", "block_size", "watermark"; "rate" as (min, max, step)). ``slo_ttft`` /
    ``slo_tpot``: goodput's targets (seconds). ``settings``: where the controls start.
    ``run=False`` builds the controls without simulating (call ``update()``).
    """

    def __init__(
        self,
        settings: Optional[WhatIfSettings] = None,
        *,
        controls: Optional[Sequence[str]] = None,
        trace: Union[None, Callable[[float], list], Sequence] = None,
        n: int = 2000,
        seed: int = 0,
        model: str = "llama-2-70b",
        hardware: Any = "H100-SXM",
        cost_model: Any = None,
        max_num_seqs: int = 128,
        config: Optional[dict] = None,
        choices: Optional[dict] = None,
        slo_ttft: float = 2.0,
        slo_tpot: float = 0.100,
        run: bool = True,
    ):
        fixed_trace = trace is not None and not callable(trace)
        controls = (
            tuple(controls)
            if controls is not None
            else tuple(c for c in SCHEDULING_CONTROLS if not (fixed_trace and c == "rate"))
        )
        unknown = [c for c in controls if c not in CONTROLS]
        if unknown or not controls:
            raise ValueError(f"WhatIf(controls={controls!r}): each one of {tuple(CONTROLS)}, at least one")
        if fixed_trace and "rate" in controls:
            raise ValueError(
                "WhatIf(controls=(..., 'rate')): a fixed trace has no arrival rate to change; "
                "pass trace as a function of the rate"
            )
        config = dict(config or {})
        own = {
            "num_kv_blocks",
            "num_swap_blocks",
            "model",
            "hardware",
            "cost_model",
            "records",
            "progress",
            "max_num_seqs",
            "slo_ttft",
            "slo_tpot",
        }
        taken = sorted(set(config) & (set(CONTROLS.values()) | own))
        if taken:
            raise ValueError(f"WhatIf(config=...): {taken} set by the settings or by WhatIf's own arguments")
        choices = {**DEFAULT_CHOICES, **(choices or {})}
        bad = sorted(set(choices) - set(DEFAULT_CHOICES) - {"rate"})
        if bad:
            raise ValueError(f"WhatIf(choices=...): {bad}; choices are for {sorted(DEFAULT_CHOICES) + ['rate']}")
        self.settings = settings or WhatIfSettings()
        self.trace_source = trace if trace is not None else (lambda rate: whatif_trace(rate, n, seed))
        self.fixed_trace = fixed_trace
        self.shown = controls  # the names of the controls on screen
        self.n, self.seed, self.model, self.hardware, self.cost_model = n, seed, model, hardware, cost_model
        self.max_num_seqs, self.config, self.slo_ttft, self.slo_tpot = max_num_seqs, config, slo_ttft, slo_tpot
        self.summary: Optional[dict] = None  # the last run's metrics.summarize dict
        self.engine = None  # the last run's engine
        self.previous: Optional[tuple] = None  # (settings, request metrics, KV series) of the run before
        self.num_runs = 0
        self.error: Optional[str] = None  # why the engine refused the last setting
        self.cpu_times: dict = {}  # CPU seconds of the last update: trace, simulate, figures
        # (simulate includes metrics.summarize)
        self._trace_cache: tuple = (None, None)  # (rate, trace): other knobs reuse the trace
        self._build_controls(choices)
        self.progress = W.FloatProgress(
            value=0.0, min=0.0, max=1.0, description="idle", style={"description_width": "initial"}
        )
        self.status = W.HTML()
        self.goodput_html = W.HTML()
        self.cdf_fig = FigureSlot(self._empty_cdf())
        self.kv_fig = FigureSlot(self._empty_kv())
        for c in self.controls:
            c.observe(self._on_change, names="value")
        wrap = W.Layout(flex_flow="row wrap")  # a narrow notebook puts a row's third control under the others
        rows = [W.HBox(self.controls[i : i + 3], layout=wrap) for i in range(0, len(self.controls), 3)]
        self.widget = W.VBox(
            rows + [W.HBox([self.progress, self.status]), self.goodput_html, self.cdf_fig.view, self.kv_fig.view]
        )
        if run:
            self.update()

    # --- the controls ------------------------------------------------------------------
    def _build_controls(self, choices: dict) -> None:
        s = self.settings
        style = dict(style={"description_width": "initial"})
        lo, hi, step = choices.get("rate", (1.0, 20.0, 0.5))
        self.rate = W.FloatSlider(
            value=s.rate,
            min=min(lo, s.rate),
            max=max(hi, s.rate),
            step=step,
            description="arrival rate (req/s)",
            continuous_update=False,
            **style,
        )
        self.policy = W.Dropdown(options=POLICY_CHOICES, value=s.policy, description="policy", **style)
        self.budget = W.SelectionSlider(
            options=_with(choices["budget"], s.max_num_batched_tokens),
            value=s.max_num_batched_tokens,
            description="token budget",
            continuous_update=False,
            **style,
        )
        self.chunked = W.Checkbox(value=s.enable_chunked_prefill, description="chunked prefill", **style)
        self.kv = W.SelectionSlider(
            options=_with(choices["kv"], s.kv_capacity_tokens),
            value=s.kv_capacity_tokens,
            description="KV capacity (positions)",
            continuous_update=False,
            **style,
        )
        self.preemption = W.Dropdown(
            options=PREEMPTION_CHOICES, value=s.preemption_mode, description="preemption", **style
        )
        self.block_size = W.SelectionSlider(
            options=_with(choices["block_size"], s.block_size),
            value=s.block_size,
            description="block size (positions)",
            continuous_update=False,
            **style,
        )
        self.prefix_caching = W.Checkbox(value=s.enable_prefix_caching, description="prefix caching", **style)
        self.watermark = W.SelectionSlider(
            options=[(f"{w:.0%}", w) for w in _with(choices["watermark"], s.watermark)],
            value=s.watermark,
            description="headroom (watermark)",
            continuous_update=False,
            **style,
        )

    @property
    def controls(self) -> list:
        """The controls on screen, in the order of ``CONTROLS``."""
        return [getattr(self, name) for name in CONTROLS if name in self.shown]

    def _read_controls(self) -> WhatIfSettings:
        return WhatIfSettings(**{field: _plain(getattr(self, name).value) for name, field in CONTROLS.items()})

    def _on_change(self, change) -> None:
        self.update()

    # --- one run -------------------------------------------------------------------------
    def simulate_kwargs(self, settings: Optional[WhatIfSettings] = None) -> dict:
        """The keywords ``simulate(self.trace_for(rate), **kwargs)`` gets for ``settings``
        (default: the current ones). Swap space, when a mode may swap, is as large as the cache."""
        s = settings or self.settings
        blocks = s.kv_capacity_tokens // s.block_size
        kw = dict(
            model=self.model,
            hardware=self.hardware,
            records="summary",
            slo_ttft=self.slo_ttft,
            slo_tpot=self.slo_tpot,
            max_num_seqs=self.max_num_seqs,
            policy=s.policy,
            max_num_batched_tokens=s.max_num_batched_tokens,
            enable_chunked_prefill=s.enable_chunked_prefill,
            block_size=s.block_size,
            num_kv_blocks=blocks,
            enable_prefix_caching=s.enable_prefix_caching,
            watermark=s.watermark,
            preemption_mode=s.preemption_mode,
            num_swap_blocks=0 if s.preemption_mode == "recompute" else blocks,
            **self.config,
        )
        if self.cost_model is not None:
            kw["cost_model"] = self.cost_model
        return kw

    def trace_for(self, rate: float) -> list:
        """The trace a run at ``rate`` replays (the fixed one, whatever the rate, if fixed)."""
        if self.fixed_trace:
            return self.trace_source
        if self._trace_cache[0] != rate:
            self._trace_cache = (rate, self.trace_source(rate))
        return self._trace_cache[1]

    def update(self) -> Optional[dict]:
        """Re-simulate with what the controls show and redraw; returns the run's summary, or
        None (figures kept, the reason in ``error`` and on screen) if the engine refuses the
        setting. The garbage collector is paused throughout (``simulated.gc_paused``)."""
        with gc_paused():
            return self._update()

    def _update(self) -> Optional[dict]:
        c0 = time.process_time()
        settings = self._read_controls()
        self.progress.value, self.progress.description = 0.0, "simulating"
        trace = self.trace_for(settings.rate)
        total = max(1, len(trace))
        self.status.value = f"<i>simulating {total:,} requests ...</i>"
        finished = shown = 0

        def on_finished(num_finished: int) -> None:  # the bar moves in steps of 2% (each move is a message)
            nonlocal finished, shown
            finished += num_finished
            if finished - shown >= total / 50:
                shown = finished
                self.progress.value = finished / total

        c1 = time.process_time()
        try:
            engine, summary = simulate(trace, on_finished=on_finished, **self.simulate_kwargs(settings))
        except ValueError as e:  # the engine refuses the setting (e.g. no chunking, budget < a prompt)
            self.progress.description = "refused"
            self.status.value = f"<b>the engine refuses this setting:</b> {html.escape(str(e))}"
            self.error = str(e)
            return None
        c2 = time.process_time()
        previous = (
            (self.settings, self._request_metrics(), kv_in_use(self.engine.step_summaries)) if self.engine else None
        )
        self.error = None
        self.engine, self.summary, self.settings, self.previous = engine, summary, settings, previous
        self.num_runs += 1
        self.progress.value, self.progress.description = 1.0, "done"
        self.status.value = f"simulated in {self.summary['wall_time']:.2f} s ({self.engine.step_count:,} steps)"
        self._draw()
        self.cpu_times = dict(trace=c1 - c0, simulate=c2 - c1, figures=time.process_time() - c2)
        return self.summary

    def _request_metrics(self) -> list:
        return [r.metrics for r in self.engine.requests.values()]

    # --- the figures ---------------------------------------------------------------------
    def _empty_cdf(self) -> go.Figure:
        fig = make_subplots(
            rows=1, cols=2, subplot_titles=("TTFT (time to first token)", "TPOT (time per output token)")
        )
        for name, dash in (("this setting", "solid"), ("previous", "dash")):
            for col in (1, 2):
                fig.add_trace(
                    go.Scatter(
                        x=[],
                        y=[],
                        mode="lines",
                        name=name,
                        legendgroup=name,
                        showlegend=col == 1,
                        line=dict(shape="hv", dash=dash, width=2, color=figures.PALETTE[0 if dash == "solid" else 7]),
                    ),
                    row=1,
                    col=col,
                )
        # labelled ticks written out: TTFTs span decades (1, 2, 5 of each), TPOTs mostly lie inside one (finer)
        fig.update_xaxes(title_text="seconds (log scale)", type="log", gridcolor="#eee", **figures.log_ticks())
        fig.update_xaxes(col=2, **figures.log_ticks((1, 1.5, 2, 3, 5, 7)))
        fig.update_yaxes(title_text="fraction of requests", range=[0, 1.02])
        fig.update_layout(
            height=360,
            plot_bgcolor="white",
            margin=dict(t=90, b=40),
            title=dict(text="latency CDFs: share of requests within each time", y=0.98, yanchor="top"),
            legend=dict(orientation="h", y=1.15, yanchor="bottom", x=0),
        )
        return fig

    def _empty_kv(self) -> go.Figure:
        fig = go.Figure(
            [
                go.Scatter(x=[], y=[], mode="lines", name=name, line=dict(color=figures.PALETTE[c], dash=dash))
                for name, c, dash in (
                    ("holds KV", 1, "solid"),
                    ("previous: holds KV", 7, "dash"),
                    ("blocks handed out", 1, "dot"),
                )
            ]
        )
        fig.update_layout(
            height=290,
            plot_bgcolor="white",
            margin=dict(t=70, b=40),  # the legend under the title
            title=dict(
                text="KV cache in use (the gap to the dotted line: unfilled tails of last blocks)",
                y=0.97,
                yanchor="top",
            ),
            xaxis_title="modeled time (s)",
            yaxis=dict(title="fraction of capacity", range=[0, 1.02]),
            legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0, xanchor="left"),
        )
        return fig

    def _draw(self) -> None:
        runs = [self._request_metrics(), self.previous[1] if self.previous else []]
        fig = self.cdf_fig.fig
        with fig.batch_update():
            for i, ms in enumerate(runs):
                for j, metric in enumerate(("ttft", "tpot")):
                    x, y = latency_ecdf(ms, metric)
                    fig.data[2 * i + j].x, fig.data[2 * i + j].y = x, y
            fig.data[2].name = "previous" if self.previous is None else f"previous ({self.describe(self.previous[0])})"
            fig.data[0].name = f"this setting ({self.describe(self.settings)})"
        self.cdf_fig.refresh()
        kv = self.kv_fig.fig
        with kv.batch_update():
            kv.data[0].x, kv.data[0].y = kv_in_use(self.engine.step_summaries)
            kv.data[1].x, kv.data[1].y = self.previous[2] if self.previous else ([], [])
            kv.data[2].x, kv.data[2].y = kv_in_use(self.engine.step_summaries, "held")
        self.kv_fig.refresh()
        self.goodput_html.value = goodput_html(
            self.summary, self.slo_ttft, self.slo_tpot, self.engine.stats()["recomputed_tokens"]
        )

    def describe(self, s: WhatIfSettings) -> str:
        """``s`` in a few words, the shown controls only ("12 req/s, sjf, budget 2048")."""
        words = dict(
            rate=f"{s.rate:g} req/s",
            policy=s.policy,
            budget=f"budget {s.max_num_batched_tokens}",
            chunked=f"chunked {'on' if s.enable_chunked_prefill else 'off'}",
            kv=f"KV {s.kv_capacity_tokens:,}",
            preemption=s.preemption_mode,
            block_size=f"blocks of {s.block_size}",
            prefix_caching=f"prefix cache {'on' if s.enable_prefix_caching else 'off'}",
            watermark=f"headroom {s.watermark:.0%}",
        )
        return ", ".join(words[name] for name in CONTROLS if name in self.shown)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


# =====================================================================================
# What the figures show, as plain functions (the test and the notebook call them too)
# =====================================================================================


def latency_ecdf(request_metrics: list, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(sorted values, fraction of requests at or below each) of ``metric`` ("ttft", "tpot")
    over the requests that have it. Arrays, which plotly takes without checking each number."""
    vals = np.sort(
        np.array([v for v in (getattr(m, metric, None) for m in request_metrics) if v is not None], dtype=float)
    )
    return vals, np.arange(1, len(vals) + 1) / max(1, len(vals))


def kv_in_use(step_summaries: list, what: str = "used") -> tuple[np.ndarray, np.ndarray]:
    """(modeled time, fraction of the KV capacity holding KV) after each step; ``what="held"``:
    the fraction in blocks handed out (``KVTotals.held``)."""
    n = len(step_summaries)
    t = np.fromiter(map(attrgetter("time"), step_summaries), dtype=float, count=n)
    kv = list(map(attrgetter("kv"), step_summaries))
    part = np.fromiter(map(attrgetter(what), kv), dtype=float, count=n)
    total = np.fromiter(map(attrgetter("total"), kv), dtype=float, count=n)
    return t, np.divide(part, total, out=np.zeros(n), where=total > 0)


def goodput_html(summary: dict, slo_ttft: float, slo_tpot: float, recomputed_tokens: int = 0) -> str:
    """The line under the controls: goodput, throughput, latency percentiles, preemptions
    (with the prompt tokens they made the engine prefill again) and mean KV use."""
    s = summary

    def f(key, fmt):
        v = s.get(key)
        return "n/a" if v is None else format(v, fmt)

    return (
        f"<b>goodput {f('goodput_requests_per_s', '.2f')} req/s</b> "
        f"(TTFT &le; {slo_ttft:g} s and TPOT &le; {1e3 * slo_tpot:g} ms; "
        f"{f('slo_attainment', '.0%')} of requests meet both) &middot; "
        f"throughput {f('request_throughput', '.2f')} req/s, {f('output_throughput', ',.0f')} tokens/s &middot; "
        f"TTFT p50 {f('ttft_p50', '.2f')} s, p99 {f('ttft_p99', '.2f')} s &middot; "
        f"TPOT p50 {1e3 * (s.get('tpot_p50') or 0):.0f} ms &middot; "
        f"preemptions {s.get('num_preemptions', 0)} ({recomputed_tokens:,} tokens prefilled again) &middot; "
        f"KV use mean {f('kv_util_mean', '.0%')}"
    )


def _with(options: tuple, value) -> tuple:
    return tuple(options) if value in options else tuple(sorted(set(options) | {value}))


def _plain(v):
    """A control's value as the plain Python number or string the settings hold."""
    return v.item() if isinstance(v, np.generic) else v
