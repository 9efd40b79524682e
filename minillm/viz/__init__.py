"""Seeing what the engine did: plotly figures, and widgets that step the scheduler one iteration at a time.

* ``Stepper``: Step / Run N / Play-Pause / Reset and a history slider over one engine;
  shows the waiting queue and running set, the batch against the execution-token
  budget, the KV memory map and the step's reasons in plain words.
* ``LockstepStepper``: two engines (e.g. reservation vs paging) stepped together;
  ``reservation_vs_paging_lockstep()`` builds Figure 4 of notebook 02.
* ``EngineMonitor``: the same view of an engine something else steps (a server's loop):
  ``poll()`` / ``follow()`` draw what it has done since.
* ``WhatIf`` (``minillm.viz.whatif``): controls over a simulated trace; each change re-simulates
  and redraws.

The figures they draw are in ``minillm.viz.figures`` and work without any widget.
"""

from .live import LiveFigure
from .lockstep import LockstepStepper, unused_reservation_engine, reservation_vs_paging_lockstep
from .monitor import EngineMonitor
from .panels import metrics_html, queue_html, reasons_html
from .stepper import Stepper, as_engine, engine_factory

__all__ = [
    "Stepper",
    "LockstepStepper",
    "EngineMonitor",
    "unused_reservation_engine",
    "reservation_vs_paging_lockstep",
    "engine_factory",
    "as_engine",
    "LiveFigure",
    "metrics_html",
    "queue_html",
    "reasons_html",
]
