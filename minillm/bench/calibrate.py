"""calibrate: fit the simulator's step cost to this machine, then check it against the real engine.

``python -m minillm.bench calibrate [--out DIR]`` times the real engine's steps over a grid of batch
shapes (``minillm.sim.calibration.measure_steps``, at most 60 s), fits ``LinearStepCost``'s terms with
their standard errors, and saves the profile as ``DIR/step-cost-MACHINE.json``
(``CostModel.from_profile`` loads it). Then the same traces run on the real engine and on the
simulator with that profile: a Poisson trace, and a second with longer requests on a small KV cache where
requests are preempted. Per request TTFT, TPOT and end-to-end latency, modeled against measured: the
median and p90 relative error of each (``median_rel_err``, ``p90_rel_err``, fractions) and both step
counts go into ``DIR/calibration-MACHINE.json`` and the benchmark's own JSON.

Sizes: ``tiny`` (seconds, the smoke test: a short grid, 40-request traces), ``small`` (30 s of
timing, 150-request traces), ``full`` (60 s of timing, 300- and 240-request traces).
"""

from __future__ import annotations

import time

from .common import finish, goal, pct, pick, set_threads, table

NAME = "calibrate"


def run(args) -> dict:
    from ..sim import calibration as cal
    threads = set_threads(args)
    size = args.size
    budget = pick(size, tiny=3.0, small=30.0, full=60.0)
    n1, n2 = pick(size, tiny=(40, 40), small=(150, 120), full=(300, 240))
    grid = cal.GRID[:4] + cal.GRID[9:10] + cal.GRID[12:13] if size == "tiny" else cal.GRID
    seed = args.seed
    traces = {"poisson": (cal.validation_trace(n1, rate=12.0, seed=seed + 1), {}),
              "preempting": (cal.validation_trace(n2, rate=6.0, seed=seed + 2, prompt_median=96, output_median=64),
                             {"num_kv_blocks": 64})}
    device = {} if args.device == "cpu" else {"device": args.device}     # on a GPU: the GPU's steps
    cost, report = cal.calibrate(args.out, budget_s=budget, traces=traces, seed=seed, grid=grid, **device)

    terms = [[t, f"{cost.seconds[t] * 1e6:.4f}", f"{cost.stderr.get(t, 0.0) * 1e6:.4f}"] for t in cost.seconds]
    rows = []
    for name, r in report["traces"].items():
        for metric in ("ttft", "tpot", "e2e"):
            m = r[metric]
            rows.append([name, metric, f"{m['median_measured_s'] * 1e3:.1f}", f"{m['median_modeled_s'] * 1e3:.1f}",
                         pct(m["median_rel_err"]), pct(m["p90_rel_err"])])
        rows.append([name, "steps", r["steps"]["measured"], r["steps"]["modeled"],
                     pct(abs(r["steps"]["modeled"] - r["steps"]["measured"]) / max(1, r["steps"]["measured"])),
                     f"{r['preemptions']} preemptions"])
    goals = [goal("calibration time", "<= 60 s", f"{report['calibration_s']:.1f} s", report["calibration_s"] <= 60.0)]
    for name, r in report["traces"].items():
        goals.append(goal(f"{name}: e2e median rel. error", "<= 5%", pct(r["e2e"]["median_rel_err"]),
                          r["e2e"]["median_rel_err"] <= 0.05))
        goals.append(goal(f"{name}: e2e p90 rel. error", "<= 12%", pct(r["e2e"]["p90_rel_err"]),
                          r["e2e"]["p90_rel_err"] <= 0.12))
    summary = {name: {m: {k: r[m][k] for k in ("median_rel_err", "p90_rel_err", "median_measured_s",
                                                  "median_modeled_s")} for m in ("ttft", "tpot", "e2e")}
               | {"steps": r["steps"], "preemptions": r["preemptions"]} for name, r in report["traces"].items()}
    return {
        "config": {"threads": threads, "budget_s": budget, "trace_sizes": [n1, n2], "seed": seed},
        "results": {"calibration_s": report["calibration_s"], "profile": cost.to_profile(), "traces": summary},
        "goals": goals,
        "_tables": [table(["term", "us per unit", "+/- us"], terms, title="fitted step cost"),
                    table(["trace", "metric", "measured (median, ms)", "modeled (median, ms)",
                           "median rel. error", "p90 rel. error"], rows, title="modeled vs measured, per request")],
    }


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
