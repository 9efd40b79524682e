"""CPU seconds of the course's widgets answering a reader: every what-if setting, every stepper's clicks.

    python scripts/widget_times.py                     # every widget of notebooks 02 to 05 and 03b
    python scripts/widget_times.py notebooks/05_*.py   # the widgets of some notebooks

Each notebook's cells run in this process (``MINILLM_IMPL=solutions``, one torch thread, as the tests run
them) up to its last cell that builds a widget; after each cell that builds one, driving the widget objects
as a click would:

* a what-if widget (``WhatIf``): each control set to each value it offers (a rate slider: its lowest,
  starting and highest value), one at a time from the starting setting and back; per change the redraw's
  CPU seconds (``WhatIf.cpu_times``: the trace, the simulation with its metrics, the figures);
* a stepper (``Stepper``, ``LockstepStepper``): the build cell, the first four clicks on Step, Reset, and
  the first Step after it.

CPU seconds (``time.process_time``) are what a quiet machine pays; the 1-minute load average, printed
before and after, says whether the machine was shared (wall times then overstate a click's).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = (
    "02_reservation_vs_paging.py",
    "03_scheduling_policies.py",
    "03b_scheduling_under_load.py",
    "04_prefix_caching.py",
    "05_preemption.py",
)


def _cells(path: Path):
    """The notebook's code cells as Python (IPython magics and shell lines left out)."""
    import jupytext

    for cell in jupytext.read(path).cells:
        if cell.cell_type == "code":
            yield "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _widgets(ns: dict, seen: set) -> list:
    from minillm.viz import LockstepStepper, Stepper
    from minillm.viz.whatif import WhatIf

    new = []
    for name, obj in list(ns.items()):
        if isinstance(obj, (WhatIf, Stepper, LockstepStepper)) and id(obj) not in seen:
            seen.add(id(obj))
            new.append((name, obj))
    return new


def _redraw(w) -> float:
    return sum(w.cpu_times.values()) if w.error is None else float("nan")


def whatif_rows(name: str, w) -> list[str]:
    """One row per control value: the setting, its steps and its redraw's CPU seconds."""
    from minillm.viz.whatif import CONTROLS

    rows = [f"| {name} | start ({w.describe(w.settings)}) | {w.engine.step_count:,} | {_redraw(w):.2f} |"]
    for control in CONTROLS:
        if control not in w.shown:
            continue
        widget = getattr(w, control)
        start = widget.value
        if hasattr(widget, "options"):
            values = [v[1] if isinstance(v, tuple) else v for v in widget.options]
        elif isinstance(widget.value, bool):
            values = [not start]
        else:  # a rate slider
            values = [widget.min, widget.max]
        for v in values:
            if v == start:
                continue
            widget.value = v
            what = f"{control} -> {v:g}" if isinstance(v, float) else f"{control} -> {v}"
            steps = f"{w.engine.step_count:,}" if w.error is None else "refused"
            rows.append(f"| {name} | {what} | {steps} | {_redraw(w):.2f} |")
        widget.value = start
    return rows


def stepper_rows(name: str, w, build_cpu: float, clicks: int = 4) -> list[str]:
    """The build cell, the first ``clicks`` clicks on Step, Reset, and a Step after it (CPU seconds)."""
    times = []
    for _ in range(clicks):
        c0 = time.process_time()
        w.step_button.click()
        times.append(time.process_time() - c0)
    c0 = time.process_time()
    w.reset_button.click()
    reset = time.process_time() - c0
    c0 = time.process_time()
    w.step_button.click()
    after = time.process_time() - c0
    kind = type(w).__name__
    return [
        f"| {name} ({kind}) | {build_cpu:.2f} | {' / '.join(f'{t:.2f}' for t in times)} | {reset:.2f} | {after:.2f} |"
    ]


def run_notebook(path: Path) -> tuple[list[str], list[str]]:
    os.chdir(path.parent)
    ns: dict = {"__name__": "__main__"}
    seen: set = set()
    whatifs, steppers = [], []
    from minillm.viz.whatif import WhatIf

    cells = list(_cells(path))
    last = max((i for i, src in enumerate(cells) if "WhatIf(" in src or "Stepper(" in src), default=-1)
    for src in cells[: last + 1]:  # (up to the last cell that builds a widget)
        c0 = time.process_time()
        exec(compile(src, str(path), "exec"), ns)
        cpu = time.process_time() - c0
        for name, w in _widgets(ns, seen):
            label = f"{path.stem[:3].rstrip('_')} `{name}`"
            if isinstance(w, WhatIf):
                whatifs += whatif_rows(label, w)
            else:
                steppers += stepper_rows(label, w, cpu)
    return whatifs, steppers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebooks/NN_*.py (default: 02 to 05 and 03b)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MINILLM_IMPL", "solutions")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    paths = [Path(p).resolve() for p in args.notebooks] or [ROOT / "notebooks" / n for n in NOTEBOOKS]
    load0 = os.getloadavg()[0]
    whatifs, steppers = [], []
    for p in paths:
        w, s = run_notebook(p)
        whatifs += w
        steppers += s
    out = [
        "=== widget times ===",
        "| what-if widget | setting | steps | redraw CPU s |",
        "|---|---|---:|---:|",
        *whatifs,
        "",
        "| stepper | build cell CPU s | Step clicks 1 / 2 / 3 / 4, CPU s | Reset | Step after Reset |",
        "|---|---:|---|---:|---:|",
        *steppers,
        "",
        f"1-minute load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)",
    ]
    print("\n".join(out))


if __name__ == "__main__":
    main()
