"""LiveFigure: a plotly figure that stays on screen and is redrawn in place.

Why not ``plotly.graph_objects.FigureWidget``? Since plotly 6 it is an anywidget whose
front-end keeps the figure model in one module-level variable, so with more than one
FigureWidget in a kernel every view draws from whichever model was created last; the
others come up as empty axes (plotly.py issues #4933, #4998). A Stepper has two
figures, a lockstep view four. ``LiveFigure`` is the small piece of that we need,
done per view:

* on the Python side it *is* a ``plotly.graph_objects.Figure`` (``.data``, ``.layout``,
  ``batch_update()``); leaving ``batch_update()`` sends the figure to the page once;
* on the page, ``Plotly.react`` redraws the existing plot in place (no new plot, no
  flicker). plotly.js comes from the ``plotly`` Python package, sent once per page the
  first time a view asks for it; nothing is fetched from the network.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Optional

import plotly.graph_objects as go

__all__ = ["LiveFigure", "anywidget_available"]

_ESM = r"""
function loadPlotly(model) {
  if (window.Plotly && window.Plotly.react) return Promise.resolve(window.Plotly);
  if (!window.__minillmPlotly) {
    window.__minillmPlotly = new Promise((resolve, reject) => {
      const onMsg = (msg, buffers) => {
        if (!msg || msg.type !== "plotly-js") return;
        model.off("msg:custom", onMsg);
        try {
          const url = URL.createObjectURL(new Blob([buffers[0]], { type: "text/javascript" }));
          const s = document.createElement("script");
          s.src = url;
          s.onload = () => {
            URL.revokeObjectURL(url);
            window.Plotly ? resolve(window.Plotly) : reject(new Error("plotly.js did not load"));
          };
          s.onerror = () => reject(new Error("plotly.js failed to load"));
          document.head.appendChild(s);
        } catch (e) { reject(e); }
      };
      model.on("msg:custom", onMsg);
      model.send({ type: "need-plotly" });
    });
    window.__minillmPlotly.catch(() => { window.__minillmPlotly = null; });
  }
  return window.__minillmPlotly;
}

export default {
  render({ model, el }) {
    let alive = true;
    let chain = Promise.resolve();
    el.classList.add("minillm-live-figure");
    const config = { displayModeBar: false, responsive: true };
    const draw = () => {
      chain = chain.then(() => loadPlotly(model)).then((Plotly) => {
        if (!alive) return;
        const f = model.get("figure") || {};
        return Plotly.react(el, f.data || [], f.layout || {}, config);
      }).catch((e) => {
        el.textContent = "minillm: could not draw this figure (" + e + ")";
      });
    };
    draw();
    model.on("change:figure", draw);
    return () => {
      alive = false;
      model.off("change:figure", draw);
      if (window.Plotly) window.Plotly.purge(el);
    };
  },
};
"""

_PLOTLY_JS: Optional[bytes] = None


def _plotly_js() -> bytes:
    global _PLOTLY_JS
    if _PLOTLY_JS is None:
        from plotly.offline import get_plotlyjs

        _PLOTLY_JS = get_plotlyjs().encode("utf-8")
    return _PLOTLY_JS


def anywidget_available() -> bool:
    try:
        import anywidget  # noqa: F401

        return True
    except ImportError:
        return False


def _view_class():
    import anywidget
    import traitlets

    class _PlotlyView(anywidget.AnyWidget):
        _esm = _ESM
        figure = traitlets.Dict().tag(sync=True)

        def __init__(self, **kw):
            super().__init__(**kw)
            self.on_msg(self._on_msg)

        def _on_msg(self, _widget, content, _buffers):
            if isinstance(content, dict) and content.get("type") == "need-plotly":
                self.send({"type": "plotly-js"}, buffers=[_plotly_js()])

    return _PlotlyView


_VIEW_CLASS = None


class LiveFigure(go.Figure):
    """A ``go.Figure`` with a notebook view (``.widget``) that follows it.

    Change it inside ``with fig.batch_update(): ...`` (or call ``fig.sync()`` after
    changing it otherwise): the view is redrawn once, in place. Without ``anywidget``
    installed, ``.widget`` is None and the figure is an ordinary plotly Figure.
    """

    def __init__(self, data: Any = None, layout: Any = None, **kw):
        super().__init__(data=data, layout=layout, **kw)
        for i, trace in enumerate(self.data):  # stable ids: Plotly.react updates these traces
            if trace.uid is None:
                trace.uid = f"trace{i}"
        self._live_view = None

    @property
    def widget(self):
        """The ipywidget showing this figure (made on first use)."""
        global _VIEW_CLASS
        if self._live_view is None and anywidget_available():
            if _VIEW_CLASS is None:
                _VIEW_CLASS = _view_class()
            self._live_view = _VIEW_CLASS(figure=self._payload())
            self._live_view.add_class("minillm-figure")
        return self._live_view

    def _payload(self) -> dict:
        d = json.loads(self.to_json(validate=False))
        for t, trace in zip(d.get("data", []), self.data):  # to_json leaves uids out
            if trace.uid is not None:
                t["uid"] = trace.uid
        return d

    def sync(self) -> None:
        """Send the figure as it is now to its view (one message)."""
        if self._live_view is not None:
            self._live_view.figure = self._payload()

    @contextmanager
    def batch_update(self):
        """Group changes; the view is redrawn once when the block ends."""
        if getattr(self, "_in_batch_mode", False):
            yield
            return
        with super().batch_update():
            yield
        self.sync()

    def _ipython_display_(self):
        from IPython.display import display

        w = self.widget
        if w is not None:
            display(w)
        else:
            display(go.Figure(self))
