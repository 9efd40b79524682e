"""whatif: CPU time of one redraw of the what-if widget, per control change.

The widget (``minillm.viz.whatif.WhatIf``, notebook 03b section 3) re-simulates its
2,000-request trace (Llama-2-70B on 4 modeled H100s, max batch 128) whenever a control
moves, and redraws its figures. Each row here is one control change as a reader makes it,
in order, measured in CPU seconds of this process (``time.process_time``), split into:

* trace: building the trace (only when the rate moves; other knobs reuse it);
* engine: ``simulate``'s loop over the engine's steps (scheduler, KV manager, modeled
  clock, one ``StepSummary`` per step; the simulator's fast path, ``sim/fast_forward.py``,
  where ``FastForward.covers`` the setting: FCFS or SJF without prefix caching);
* metrics: ``metrics.summarize`` over the requests and the step summaries (timed again on
  the same run, and taken out of ``simulate``'s share);
* figures: the CDFs, the KV series and the goodput line handed to plotly.

Then the KV record side by side, on the default setting in alternating rounds: the engine's
``record="totals"`` (the KV counts a ``StepSummary`` keeps, which ``simulate(records=
"summary")`` runs with) against ``record="summary"`` (a KV snapshot with an entry per
request every step, which nobody reads there), both stepped by ``engine.step()``.
"""

from __future__ import annotations

import gc
import time

from .common import finish, goal, median, pick, set_threads, table

NAME = "whatif"

# (label, control, value): the reader's session, in order; None = the widget's first run
CHANGES = [
    ("first run (8 req/s, fcfs, budget 2048, KV 64,000)", None, None),
    ("policy -> sjf", "policy", "sjf"),
    ("rate -> 12 req/s", "rate", 12.0),
    ("KV capacity -> 16,000", "kv", 16_000),
    ("preemption -> swap", "preemption", "swap"),
    ("token budget -> 512", "budget", 512),
    ("chunked prefill -> off (refused: budget < a prompt)", "chunked", False),
    ("chunked prefill -> on", "chunked", True),
    ("policy -> fcfs", "policy", "fcfs"),
]


def _sizes(size: str) -> dict:
    return pick(size, tiny=dict(n=100, rounds=1), small=dict(n=1000, rounds=3), full=dict(n=2000, rounds=5))


def run(args) -> dict:
    from ..analysis.metrics import summarize
    from ..sim.simulated import gc_paused, simulate
    from ..viz.whatif import WhatIf

    P = _sizes(args.size)
    set_threads(args)
    w = WhatIf(n=P["n"], run=False)
    rows, per_change = [], []
    for label, control, value in CHANGES:
        c0 = time.process_time()
        if control is None:
            w.update()
        else:
            getattr(w, control).value = value
        total = time.process_time() - c0
        if w.error is not None:
            rows.append([label, "refused", "", "", "", "", round(total, 3)])
            continue
        e = w.engine
        with gc_paused():  # as inside the widget's update
            c1 = time.process_time()
            summarize(
                {rid: r.metrics for rid, r in e.requests.items()},
                e.step_summaries,
                slo_ttft=w.slo_ttft,
                slo_tpot=w.slo_tpot,
                max_num_seqs=e.config.max_num_seqs,
            )
            metrics_s = time.process_time() - c1
        t = w.cpu_times
        part = dict(
            change=label,
            steps=e.step_count,
            trace_s=t["trace"],
            engine_s=t["simulate"] - metrics_s,
            metrics_s=metrics_s,
            figures_s=t["figures"],
            total_s=total,
        )
        per_change.append(part)
        rows.append([label, e.step_count, part["trace_s"], part["engine_s"], metrics_s, t["figures"], total])
    t1 = table(
        ["control change", "steps", "trace", "engine", "metrics", "figures", "redraw total"],
        rows,
        title=f"CPU seconds per redraw, {P['n']:,} requests (time.process_time)",
    )

    # the KV record per step, side by side in alternating rounds, on the default setting
    trace = w.trace_for(8.0)
    kw = w.simulate_kwargs(type(w.settings)())
    cpu = {"totals": [], "summary": []}
    w = None  # the widget's runs are not held during these
    for _ in range(P["rounds"]):
        for record in ("totals", "summary"):
            gc.collect()
            c0 = time.process_time()
            eng, _ = simulate(trace, record=record, fast_forward=False, **kw)
            cpu[record].append(time.process_time() - c0)
            assert eng.record_mode == record
            del eng  # freed outside the timed part
    kv_side = {k: median(v) for k, v in cpu.items()}
    t2 = table(
        ["engine record mode", "CPU s (median of rounds)", "rounds"],
        [
            ['"totals" (KV counts only; what simulate(records="summary") runs)', kv_side["totals"], P["rounds"]],
            ['"summary" (KV snapshot with an entry per request)', kv_side["summary"], P["rounds"]],
        ],
        title="one simulate() of the default setting through engine.step(), by what each step records of the KV cache",
    )
    worst = max(p["total_s"] for p in per_change)
    res = dict(
        per_change=per_change,
        kv_record_cpu_s=cpu,
        kv_record_median_s=kv_side,
        redraw_median_s=median(p["total_s"] for p in per_change),
        redraw_max_s=worst,
    )
    goals = [
        goal("redraw per control change (CPU)", "<= 2 s", round(worst, 2), worst <= 2.0 if P["n"] == 2000 else None)
    ]
    cfg = dict(
        n=P["n"], model=kw["model"], hardware=kw["hardware"], max_num_seqs=kw["max_num_seqs"], rounds=P["rounds"]
    )
    return dict(config=cfg, results=res, goals=goals, _tables=[t1, t2])


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
