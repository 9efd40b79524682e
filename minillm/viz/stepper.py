"""Stepper: drive the engine one scheduler iteration at a time and watch what it decides.

    from minillm import LLM, SamplingParams
    from minillm.viz import Stepper

    def build():
        llm = LLM(model="random", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
        for n in (6, 10, 3, 12):
            llm.engine.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=5, ignore_eos=True))
        return llm.engine

    Stepper(build)          # in a notebook cell: Step, Run N, Play/Pause, Reset, a history slider

Each **Step** is exactly one ``engine.step()``: the scheduler forms a batch under the
execution-token budget, the executor runs it, the engine applies the results and
emits a ``StepRecord``. The widget draws only that record (continuous batching, as in
Figures 2 to 4 of notebooks 01 and 02): the waiting queue and the running set, the batch against the
budget, the KV memory map, and the reasons in plain words.

**Reset** rebuilds the engine from the same configuration and the same requests: give a
factory ``() -> engine`` (or ``LLM``), or an engine, whose requests are recorded when the
Stepper is made and replayed into a fresh engine of the same config.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import ipywidgets as W
import plotly.graph_objects as go

from . import figures as F
from .figures import ColorMap
from ..step_record import StepRecord
from .live import LiveFigure
from .panels import Progress, RequestInfo, finished_html, metrics_html, queue_html, reasons_html

__all__ = ["Stepper", "as_engine", "engine_factory"]

# Widths in pixels. A cell's output in a 1,400 px browser window with JupyterLab's file browser open is
# about 970 px wide; every widget fits NOTEBOOK_PX: a Stepper's queue beside its figures, two compact
# Steppers (a LockstepStepper's columns) side by side.
NOTEBOOK_PX = 900
QUEUE_PX = 380
FIG_PX = NOTEBOOK_PX - QUEUE_PX - 20  # the queue's right margin, and room to spare
COMPACT_FIG_PX = 430


# =====================================================================================
# Engines and how to rebuild them
# =====================================================================================


def as_engine(obj: Any):
    """An ``LLMEngine`` from an engine or an ``LLM``."""
    eng = getattr(obj, "engine", None)
    if eng is not None and hasattr(eng, "step"):
        return eng
    if hasattr(obj, "step") and hasattr(obj, "add_request"):
        return obj
    raise TypeError(f"expected an LLMEngine, an LLM or a factory returning one, got {type(obj).__name__}")


def _request_kwargs(req) -> dict:
    """The add_request arguments that recreate an engine's request."""
    return dict(
        prompt=list(req.prompt_token_ids),
        sampling_params=req.sampling_params,
        request_id=req.request_id,
        arrival_time=req.arrival_time,
        priority=req.priority,
        tenant=req.tenant,
        expected_output_len=req.expected_output_len,
    )


def engine_factory(engine) -> Callable[[], Any]:
    """A factory that builds a fresh engine of ``engine``'s model and config and re-adds the
    requests ``engine`` holds now (its trace), so a reset replays the same run.

    On the wall clock the arrival times are shifted so the first request arrives at once in
    the new engine; on the modeled clock they are kept as they were.
    """
    from ..engine import LLMEngine

    engine = as_engine(engine)
    trace = [_request_kwargs(r) for r in engine.requests.values()]
    model = engine.model_path
    config = engine.config
    tokenizer = engine.tokenizer
    wall = engine.clock.name == "wall"

    def build():
        fresh = LLMEngine(model, config, tokenizer=tokenizer)
        shift = min((r["arrival_time"] for r in trace), default=0.0) if wall else 0.0
        for kw in trace:
            kw = dict(kw)
            kw["arrival_time"] = kw["arrival_time"] - shift
            fresh.add_request(**kw)
        return fresh

    return build


def _add_requests(engine, requests: Sequence[Any]) -> None:
    """Add a trace (``TraceRequest``s), or add_request keyword dicts, to ``engine``."""
    from ..analysis.workloads import TraceRequest, submit_trace

    trace = [r for r in requests if isinstance(r, TraceRequest)]
    if trace:
        submit_trace(engine, trace, vocab_size=engine.vocab_size)
    for r in requests:
        if isinstance(r, TraceRequest):
            continue
        if isinstance(r, dict):
            engine.add_request(**r)
        elif isinstance(r, (tuple, list)) and len(r) == 2 and not isinstance(r[0], int):
            engine.add_request(r[0], r[1])
        else:
            engine.add_request(r)


# =====================================================================================
# A figure slot: a LiveFigure redrawn in place, or a static figure redrawn into an Output
# =====================================================================================


class FigureSlot:
    """A figure on screen: a ``LiveFigure`` redrawn in place (``Plotly.react``), or, without
    anywidget, a static figure redrawn into an Output."""

    def __init__(self, fig):
        self.fig = LiveFigure(fig)
        view = self.fig.widget
        self.live = view is not None
        self.view = view if self.live else W.Output()
        self.refresh()

    def refresh(self) -> None:
        if self.live:
            return
        from IPython.display import display

        with self.view:
            self.view.clear_output(wait=True)
            display(go.Figure(self.fig))


# =====================================================================================
# The Stepper
# =====================================================================================


def add_step_controls(owner, run_n: int, speed: float, step_tooltip: str, reset_tooltip: str) -> None:
    """The controls a ``Stepper`` and a ``LockstepStepper`` share, set on ``owner``: ``step_button``,
    ``run_button`` with ``run_n``, ``play`` with its ``speed`` slider, ``reset_button`` and the
    ``history`` slider (disabled until there is a step to view)."""
    btn = dict(layout=W.Layout(width="auto"))
    owner.step_button = W.Button(
        description="Step",
        icon="step-forward",
        button_style="primary",
        tooltip=step_tooltip,
        **btn,
    )
    owner.run_button = W.Button(description="Run N", icon="forward", tooltip="run N steps", **btn)
    owner.run_n = W.BoundedIntText(
        value=run_n,
        min=1,
        max=100000,
        description="N",
        layout=W.Layout(width="110px"),
        style={"description_width": "16px"},
    )
    owner.play = W.Play(
        value=0,
        min=0,
        max=10**9,
        step=1,
        interval=int(1000 / max(0.1, speed)),
        show_repeat=False,
        description="Play",
        tooltip="play / pause",
    )
    owner.speed = W.FloatSlider(
        value=speed,
        min=0.5,
        max=20.0,
        step=0.5,
        description="steps/s",
        readout_format=".1f",
        layout=W.Layout(width="230px"),
        style={"description_width": "55px"},
    )
    owner.reset_button = W.Button(
        description="Reset",
        icon="undo",
        button_style="warning",
        tooltip=reset_tooltip,
        **btn,
    )
    owner.history = W.IntSlider(
        value=0,
        min=0,
        max=0,
        description="view step",
        disabled=True,
        continuous_update=False,
        layout=W.Layout(width="420px"),
        style={"description_width": "70px"},
    )


class Stepper:
    """An ipywidgets control that advances the engine one scheduler iteration per Step.

    ``engine_or_factory``: a factory ``() -> LLMEngine | LLM`` (called now and on every
    Reset), or an engine / ``LLM`` (its requests are recorded now and replayed on Reset).
    ``requests``: optional trace (``TraceRequest``s or ``add_request`` keyword dicts) added
    to the engine now and after every Reset.

    Handles a test (or a notebook) can drive: ``step_button``, ``run_button``,
    ``reset_button`` (Buttons), ``run_n`` (how many steps Run takes), ``play`` and
    ``speed`` (Play/Pause and steps per second), ``history`` (the slider that looks back),
    ``step()``, ``run(n)``, ``reset()``, ``show(i)``; ``records`` (the StepRecords taken so
    far), ``shown`` (the one on screen); ``batch_fig`` and ``kv_fig`` (``LiveFigure``s: plotly
    Figures whose traces are updated in place in ``batch_update()`` and redrawn on the page
    with ``Plotly.react``); ``widget`` (the root to display).
    """

    def __init__(
        self,
        engine_or_factory: Any,
        requests: Optional[Sequence[Any]] = None,
        *,
        run_n: int = 10,
        speed: float = 2.0,
        max_cells: int = 512,
        per_position_max: int = 64,
        title: Optional[str] = None,
        colors: Optional[ColorMap] = None,
        compact: bool = False,
        controls: bool = True,
        fig_width: Optional[int] = None,
    ):
        if (
            callable(engine_or_factory)
            and not hasattr(engine_or_factory, "step")
            and not hasattr(engine_or_factory, "engine")
        ):
            self._factory = engine_or_factory
            engine = as_engine(self._factory())
            self._requests = list(requests or [])
            _add_requests(engine, self._requests)
        else:
            engine = as_engine(engine_or_factory)
            _add_requests(engine, list(requests or []))
            self._requests = []  # already inside the recorded trace
            self._factory = engine_factory(engine)
        self.colors = colors if colors is not None else ColorMap()
        self.max_cells = max_cells
        self.per_position_max = per_position_max
        self.title = title
        self.compact = compact
        self._fig_width = fig_width or (COMPACT_FIG_PX if compact else FIG_PX)
        self._busy = False
        self._syncing = False
        self._last_tick = 0.0
        self._note = ""
        self._build(run_n, speed, controls)
        self._attach(engine)

    # --- wiring ---------------------------------------------------------------------------
    def _build(self, run_n: int, speed: float, controls: bool) -> None:
        add_step_controls(
            self,
            run_n,
            speed,
            "run exactly one scheduler iteration",
            "rebuild the engine from the same config and requests",
        )
        for b, cls in (
            (self.step_button, "mlw-step-button"),
            (self.run_button, "mlw-run-button"),
            (self.reset_button, "mlw-reset-button"),
        ):
            b.add_class(cls)  # stable hooks for the browser test
        self.step_button.on_click(lambda _: self.step())
        self.run_button.on_click(lambda _: self.run(self.run_n.value))
        self.reset_button.on_click(lambda _: self.reset())
        self.play.observe(self._on_play, names="value")
        self.speed.observe(lambda ch: setattr(self.play, "interval", int(1000 / max(0.1, ch["new"]))), names="value")
        self.history.observe(self._on_history, names="value")

        self.title_html = W.HTML(
            f"<div style='font-size:14px;font-weight:600'>{self.title}</div>" if self.title else ""
        )
        self.metrics_html = W.HTML()
        self.finished_html = W.HTML()  # once every request is done: why Step is off, and Reset
        # Beside the figures: a column QUEUE_PX wide. Under them (compact): the full width, as tall as its rows
        # (a flex basis there would be a height, and leave a short queue's panel mostly blank).
        queue_layout = (
            W.Layout(overflow="auto")
            if self.compact
            else W.Layout(
                flex=f"0 1 {QUEUE_PX}px",
                min_width="280px",
                max_width=f"{QUEUE_PX}px",
                overflow="auto",
                margin="0 12px 0 0",
            )
        )
        self.queue_html = W.HTML(layout=queue_layout)
        self.reasons_html = W.HTML()
        self._batch_slot = None  # made in _attach (its budget comes from the engine)
        self._kv_slot = None  # made in _attach (its cell count depends on the engine)
        self.controls = W.HBox(
            [self.step_button, self.run_button, self.run_n, self.play, self.speed, self.reset_button],
            layout=W.Layout(flex_flow="row wrap", align_items="center"),
        )
        self._show_controls = controls
        self.widget = W.VBox(layout=W.Layout(width="100%"))
        self.widget.add_class("minillm-stepper")

    def layout_children(self) -> list:
        figs = W.VBox([self._batch_slot.view, self._kv_slot.view])
        head = [self.title_html] if self.title else []
        if self._show_controls:
            head += [self.controls, self.history, self.finished_html]
        if self.compact:
            return head + [self.metrics_html, figs, self.reasons_html, self.queue_html]
        # The queue beside the figures where the notebook is wide enough, above them where it is not.
        body = W.HBox([self.queue_html, figs], layout=W.Layout(align_items="flex-start", flex_flow="row wrap"))
        return head + [self.metrics_html, body, self.reasons_html]

    def _attach(self, engine) -> None:
        """Show ``engine`` (new, or rebuilt by Reset) from its current state."""
        self.engine = engine
        self.records: list[StepRecord] = list(getattr(engine, "step_records", []) or [])
        self._infos: dict[str, RequestInfo] = {}
        self._refresh_infos()
        self._latest = Progress.empty()
        for rec in self.records:
            self._latest.apply(rec)
        cfg = engine.config
        self._mode = cfg.kv_allocation
        # The per-block map is drawn when the engine records it (EngineConfig.record="full",
        # the default up to 256 blocks).
        detail = engine.record_mode == "full"
        self.empty_kv = F.empty_kv_snapshot(engine.num_kv_blocks, cfg.block_size, detail=detail)
        first = self.records[-1] if self.records else None
        kv_fig = F.kv_map_figure(
            first if first is not None else self.empty_kv,
            colors=self.colors,
            max_cells=self.max_cells,
            per_position_max=self.per_position_max,
            mode=self._mode,
            width=self._fig_width,
        )
        if self._kv_slot is None:
            self._batch_slot = FigureSlot(
                F.batch_figure(
                    first,
                    colors=self.colors,
                    width=self._fig_width,
                    token_budget=cfg.max_num_batched_tokens,
                    speculative=getattr(cfg, "speculative_model", None) is not None,
                )
            )
            self._kv_slot = FigureSlot(kv_fig)
            self.widget.children = self.layout_children()
        self._sync_history(len(self.records) - 1)
        self._render(len(self.records) - 1)

    def _refresh_infos(self) -> None:
        for rid, req in self.engine.requests.items():
            if rid not in self._infos:
                self._infos[rid] = RequestInfo(
                    rid, req.num_prompt_tokens, req.sampling_params.max_tokens, req.arrival_time, req.metrics
                )
                self.colors[rid]

    # --- public handles --------------------------------------------------------------------
    @property
    def batch_fig(self):
        """The batch bar (a ``LiveFigure``: its traces are updated in place each step)."""
        return self._batch_slot.fig

    @property
    def kv_fig(self):
        """The KV memory map (a ``LiveFigure``, updated in place each step)."""
        return self._kv_slot.fig

    @property
    def view_index(self) -> int:
        """Index in ``records`` of the step on screen (-1: before the first step)."""
        return self._view

    @property
    def shown(self) -> Optional[StepRecord]:
        """The StepRecord on screen (None before the first step)."""
        return self.records[self._view] if self._view >= 0 else None

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def add_request(self, *args, **kwargs) -> str:
        """Add a request to the engine now; it is replayed after every Reset too."""
        rid = self.engine.add_request(*args, **kwargs)
        req = self.engine.requests[rid]
        self._requests.append(_request_kwargs(req))
        self._refresh_infos()
        self._render(self._view)
        return rid

    def step(self) -> Optional[StepRecord]:
        """Run exactly one scheduler iteration (same as clicking Step); None when all are done."""
        if self._busy:
            return None
        if self.done:
            self._set_note("every request has finished: nothing to step (Reset to start again)")
            return None
        self._busy = True
        try:
            rec = self._advance()
        finally:
            self._busy = False
        self._sync_history(len(self.records) - 1)
        self._render(len(self.records) - 1)
        return rec

    def run(self, n: Optional[int] = None) -> list[StepRecord]:
        """Run up to ``n`` steps (default: the N box), drawing once at the end."""
        n = self.run_n.value if n is None else int(n)
        if self._busy:
            return []
        out = []
        self._busy = True
        try:
            for _ in range(max(0, n)):
                if self.done:
                    break
                out.append(self._advance())
        finally:
            self._busy = False
        if not out and self.done:
            self._set_note("every request has finished: nothing to run (Reset to start again)")
        self._sync_history(len(self.records) - 1)
        self._render(len(self.records) - 1)
        return out

    def reset(self) -> None:
        """Rebuild the engine from the same config and requests; back to before step 0."""
        self.play.playing = False
        engine = as_engine(self._factory())
        extra = self._requests
        if engine.clock.name == "wall":  # a request added by hand arrives at once on replay
            extra = [dict(r, arrival_time=None) if isinstance(r, dict) else r for r in extra]
        _add_requests(engine, extra)
        self._note = ""
        self._attach(engine)

    def show(self, index: int) -> None:
        """Put ``records[index]`` on screen (history) without stepping."""
        if not self.records:
            return
        index = max(0, min(int(index), len(self.records) - 1))
        self._sync_history(index)
        self._render(index)

    def display(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _ipython_display_(self) -> None:
        self.display()

    # --- internals -------------------------------------------------------------------------
    def _advance(self) -> StepRecord:
        rec = self.engine.step()
        self.records.append(rec)
        self._latest.apply(rec)
        self._note = ""
        return rec

    def _set_note(self, note: str) -> None:
        self._note = note
        self._render(self._view)

    def _on_play(self, change) -> None:
        if change["new"] <= change["old"] or self._busy:
            return
        now = time.monotonic()
        # Ticks that piled up while a slow step ran are dropped, not replayed in a burst.
        if now - self._last_tick < 0.5 * self.play.interval / 1000.0:
            return
        if self.done:
            self.play.playing = False
            self._set_note("every request has finished")
            return
        self.step()
        self._last_tick = time.monotonic()
        if self.done:
            self.play.playing = False

    def _on_history(self, change) -> None:
        if self._syncing or not self.records:
            return
        self._render(int(change["new"]))

    def _sync_history(self, index: int) -> None:
        self._syncing = True
        try:
            n = len(self.records)
            self.history.max = max(0, n - 1)
            self.history.value = max(0, index)
            self.history.disabled = n < 2
        finally:
            self._syncing = False

    def _progress(self, index: int) -> Progress:
        if index == len(self.records) - 1:
            return self._latest
        p = Progress.empty()
        for rec in self.records[: index + 1]:
            p.apply(rec)
        return p

    def _render(self, index: int) -> None:
        """Draw records[index] (or the state before step 0 when index is -1)."""
        self._view = index
        self._refresh_infos()
        rec = self.records[index] if index >= 0 else None
        progress = self._progress(index)
        cfg = self.engine.config
        self.metrics_html.value = metrics_html(
            rec,
            progress,
            self._infos,
            max_num_seqs=cfg.max_num_seqs,
            token_budget=cfg.max_num_batched_tokens,
            num_taken=len(self.records),
            viewing_history=0 <= index < len(self.records) - 1,
            kv_total=self.empty_kv.total,
            note=self._note,
        )
        self.queue_html.value = queue_html(rec, progress, self._infos, self.colors, max_num_seqs=cfg.max_num_seqs)
        self.reasons_html.value = reasons_html(rec, self._infos, progress=progress)
        F.update_batch_figure(self.batch_fig, rec, colors=self.colors, token_budget=cfg.max_num_batched_tokens)
        F.update_kv_map(
            self.kv_fig,
            rec if rec is not None else self.empty_kv,
            colors=self.colors,
            max_cells=self.max_cells,
            per_position_max=self.per_position_max,
            mode=self._mode,
        )
        self._batch_slot.refresh()
        self._kv_slot.refresh()
        done = self.done
        self.step_button.disabled = done
        self.run_button.disabled = done
        self.finished_html.value = (
            finished_html(len(self._infos), self.records[-1].step if self.records else None)
            if done and self._show_controls
            else ""
        )
