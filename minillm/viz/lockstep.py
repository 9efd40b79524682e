"""LockstepStepper: two (or more) engines stepped together, side by side.

The same trace on two configurations, one Step advancing each by one scheduler
iteration, shows a difference as it happens. Figure 4 of notebook 02 is the case in
point: with ``kv_allocation="reserved"`` request B holds 20 positions (6 of KV, 14
reserved but unused) so C's 6-token prefill cannot be allocated although only 13
positions would hold KV; with ``"paged"`` C joins at once::

    from minillm.viz import reservation_vs_paging_lockstep
    reservation_vs_paging_lockstep()            # reserved (left) vs paged (right)
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import ipywidgets as W

from . import figures as F
from .figures import ColorMap
from ..step_record import StepRecord
from .panels import finished_html
from .stepper import COMPACT_FIG_PX, Stepper, add_step_controls

__all__ = ["LockstepStepper", "unused_reservation_engine", "reservation_vs_paging_lockstep"]


class LockstepStepper:
    """Several engines under one set of controls: Step advances every unfinished engine by
    exactly one iteration; the history slider shows the same step index in each.

    ``engines``: engines, ``LLM``s or factories (as for ``Stepper``). ``names``: a title per
    engine (default: their ``kv_allocation`` when those differ, else A, B, ...). ``fig_width``: each
    engine's figures in pixels; the engines sit in columns, at most two to a row, so that the widget
    fits a notebook with JupyterLab's file browser open (``stepper.NOTEBOOK_PX``).
    Handles: ``step_button``, ``run_button``, ``reset_button``, ``history``, ``step()``,
    ``run(n)``, ``reset()``, ``show(i)``, ``steppers`` (one ``Stepper`` each, also ``left`` and
    ``right``), ``records`` (one list per engine), ``kv_figs`` / ``batch_figs``, ``widget``.
    """

    def __init__(
        self,
        engine_a: Any,
        engine_b: Any,
        *more: Any,
        names: Optional[Sequence[str]] = None,
        run_n: int = 10,
        speed: float = 2.0,
        max_cells: int = 512,
        per_position_max: int = 64,
        title: Optional[str] = None,
        fig_width: int = COMPACT_FIG_PX,
    ):
        sources = [engine_a, engine_b, *more]
        self.colors = ColorMap()
        self.steppers = [
            Stepper(
                src,
                controls=False,
                compact=True,
                colors=self.colors,
                max_cells=max_cells,
                per_position_max=per_position_max,
                fig_width=fig_width,
            )
            for src in sources
        ]
        if names is None:
            modes = [s.engine.config.kv_allocation for s in self.steppers]
            names = modes if len(set(modes)) == len(modes) else [chr(ord("A") + i) for i in range(len(modes))]
        self.names = list(names)
        for s, name in zip(self.steppers, self.names):
            s.widget.layout = W.Layout(width=f"{fig_width + 12}px", margin="0 12px 8px 0")
            s.title = name
            s.title_html.value = f"<div style='font-size:14px;font-weight:600'>{name}</div>"
            s.widget.children = s.layout_children()
        self.title = title
        add_step_controls(
            self,
            run_n,
            speed,
            "one scheduler iteration in every engine",
            "rebuild every engine from its config and requests",
        )
        self.step_button.on_click(lambda _: self.step())
        self.run_button.on_click(lambda _: self.run(self.run_n.value))
        self.reset_button.on_click(lambda _: self.reset())
        self.play.observe(self._on_play, names="value")
        self.speed.observe(lambda ch: setattr(self.play, "interval", int(1000 / max(0.1, ch["new"]))), names="value")
        self.history.observe(self._on_history, names="value")
        self._syncing = False
        self._last_tick = 0.0
        controls = W.HBox(
            [self.step_button, self.run_button, self.run_n, self.play, self.speed, self.reset_button],
            layout=W.Layout(flex_flow="row wrap", align_items="center"),
        )
        head = [W.HTML(f"<div style='font-size:15px;font-weight:600'>{title}</div>")] if title else []
        self.finished_html = W.HTML()  # once every engine is done: why Step is off, and Reset
        self.widget = W.VBox(
            head
            + [
                controls,
                self.history,
                self.finished_html,
                # Columns of one engine each, at most two to a row (four engines: two rows of two),
                # one under the other where the notebook is narrower than two.
                W.HBox(
                    [s.widget for s in self.steppers],
                    layout=W.Layout(
                        align_items="flex-start", flex_flow="row wrap", max_width=f"{2 * (fig_width + 24)}px"
                    ),
                ),
            ]
        )
        self.widget.add_class("minillm-lockstep")
        for b, cls in (
            (self.step_button, "mlw-step-button"),
            (self.run_button, "mlw-run-button"),
            (self.reset_button, "mlw-reset-button"),
        ):
            b.add_class(cls)  # stable hooks for the browser test
        self._sync()

    # --- handles ----------------------------------------------------------------------------
    @property
    def left(self) -> Stepper:
        return self.steppers[0]

    @property
    def right(self) -> Stepper:
        return self.steppers[-1]

    @property
    def engines(self) -> list:
        return [s.engine for s in self.steppers]

    @property
    def records(self) -> list[list[StepRecord]]:
        return [s.records for s in self.steppers]

    @property
    def kv_figs(self) -> list:
        return [s.kv_fig for s in self.steppers]

    @property
    def batch_figs(self) -> list:
        return [s.batch_fig for s in self.steppers]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.steppers)

    def step(self) -> list[Optional[StepRecord]]:
        """One iteration in every engine that still has work (None for an engine that is done)."""
        out = [None if s.done else s.step() for s in self.steppers]
        self._sync()
        return out

    def run(self, n: Optional[int] = None) -> list[list[StepRecord]]:
        n = self.run_n.value if n is None else int(n)
        out = [s.run(n) for s in self.steppers]
        self._sync()
        return out

    def reset(self) -> None:
        self.play.playing = False
        for s in self.steppers:
            s.reset()
        self._sync()

    def show(self, index: int) -> None:
        """Show step ``index`` in every engine (an engine that finished earlier shows its last step)."""
        for s in self.steppers:
            if s.records:
                s.show(min(index, len(s.records) - 1))
        self._sync(index)

    def compare_figure(self, index: Optional[int] = None, **kw):
        """A static figure of the engines' KV maps at step ``index`` (default: the last)."""
        recs = {}
        for name, s in zip(self.names, self.steppers):
            if s.records:
                i = len(s.records) - 1 if index is None else min(index, len(s.records) - 1)
                recs[name] = s.records[i]
            else:
                recs[name] = s.empty_kv
        return F.compare_kv_figure(recs, colors=self.colors, **kw)

    def display(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _ipython_display_(self) -> None:
        self.display()

    # --- internals -----------------------------------------------------------------------------
    def _sync(self, index: Optional[int] = None) -> None:
        n = max((len(s.records) for s in self.steppers), default=0)
        self._syncing = True
        try:
            self.history.max = max(0, n - 1)
            self.history.value = max(0, n - 1 if index is None else index)
            self.history.disabled = n < 2
        finally:
            self._syncing = False
        done = self.done
        self.step_button.disabled = done
        self.run_button.disabled = done
        if done:
            reqs = {rid for s in self.steppers for rid in s.engine.requests}
            self.finished_html.value = finished_html(len(reqs), n - 1 if n else None)
        else:
            self.finished_html.value = ""

    def _on_history(self, change) -> None:
        if self._syncing:
            return
        self.show(int(change["new"]))

    def _on_play(self, change) -> None:
        if change["new"] <= change["old"]:
            return
        now = time.monotonic()
        # Ticks that piled up while a slow step ran are dropped, not replayed in a burst.
        if now - self._last_tick < 0.5 * self.play.interval / 1000.0:
            return
        self._last_tick = now
        if self.done:
            self.play.playing = False
            return
        self.step()
        if self.done:
            self.play.playing = False


# =====================================================================================
# Figure 4 of notebook 02: reservation vs paging
# =====================================================================================


def unused_reservation_engine(kv_allocation: str = "reserved", *, executor: str = "simulated", model: str = "random"):
    """Figure 4's set-up (notebook 02): KV capacity 24 positions (block_size 1), budget 8 tokens,
    at most 2 requests. B (prompt 6, max_tokens 14: a 20-position reservation) arrives first;
    C (prompt 6, max_tokens 4) arrives just after B's prefill. On the modeled clock (10 ms a
    step) so the arrival order is the same on every machine.
    """
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(
        model=model,
        executor=executor,
        block_size=1,
        num_kv_blocks=24,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        kv_allocation=kv_allocation,
        clock="modeled",
        cost_model=0.010,
        max_model_len=64,
    )
    eng = llm.engine
    eng.add_request(
        list(range(10, 16)),
        SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.0),
        request_id="B",
        arrival_time=0.0,
    )
    eng.add_request(
        list(range(20, 26)),
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
        request_id="C",
        arrival_time=0.005,
    )
    return eng


def reservation_vs_paging_lockstep(executor: str = "simulated", model: str = "random", **kw) -> LockstepStepper:
    """Reservation (left) vs paging (right) on the Figure 4 trace, stepped in lockstep."""
    kw.setdefault("title", "Figure 4: unused reservations make new requests wait")
    return LockstepStepper(
        lambda: unused_reservation_engine("reserved", executor=executor, model=model),
        lambda: unused_reservation_engine("paged", executor=executor, model=model),
        names=["reserved (max-length reservation)", "paged (blocks on demand)"],
        **kw,
    )
