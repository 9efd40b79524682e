"""calibrate: fit the simulator's step cost to this machine, then check it against the real engine.

``python -m minillm.bench calibrate [--out DIR]`` times the real engine's steps over a grid of batch
shapes (``minillm.sim.calibration.measure_steps``: at most 50 s of timing, under 60 s with loading the
model), fits ``LinearStepCost``'s terms with
their standard errors, and saves the profile as ``DIR/step-cost-MACHINE.json``
(``CostModel.from_profile`` loads it). Then the same traces run on the real engine and on the
simulator with that profile: a Poisson trace, and a second with longer requests on a small KV cache where
requests are preempted. Per request TTFT, TPOT and end-to-end latency, modeled against measured: the
median and p90 relative error of each (``median_rel_err``, ``p90_rel_err``, fractions) and both step
counts go into ``DIR/calibration-MACHINE.json`` and the benchmark's own JSON.

Each trace runs ``--rounds`` times on the real engine and a request's measured latency is the median
of its rounds (one run's scatter is the machine's, not the model's; the report gives it beside the error:
``noise``, how far two rounds differ, is the floor under any model's error). The traces run at a load
where a request's latency is its own steps (busy about two thirds of the time; ``sensitivity``: a 1%
longer step moves a request's latency about 1%), so an error per step does not compound.

Beside the errors: the same with the profile rescaled by the reference step timed before the rounds
(``rescaled``: a machine that got slower or faster since the timing), against each round alone
(``single_round``), and where the error is made (``step_times``: the real rounds' own steps priced by
the profile; ``step_times_own_fit``: priced by a fit to themselves, the least error a profile of this
form can leave).

Everything runs on one core with one torch thread (``--no-pin`` to let the system move it, with
``--threads`` or torch's default threads) and, with ``--clock cpu``, on the
process's own CPU time (``minillm.sim.clock.ProcessClock``) instead of the wall clock: on a machine shared
with other work the wall clock measures the other programs too. The goal is the wall clock's on a quiet
machine; the report names the clock and the load average at the start and the end.

Sizes: ``tiny`` (seconds, the smoke test: a short grid, 40-request traces, one round), ``small`` (30 s
of timing, 150- and 120-request traces, two rounds), ``full`` (at most 50 s of timing, 300- and
200-request traces, three rounds; about eight minutes in all on the wall clock, five on the CPU clock,
which skips the idle waits between arrivals).
"""

from __future__ import annotations

import argparse
import time

from .common import command_line, finish, goal, pct, pick, table

NAME = "calibrate"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="real-engine runs of each validation trace, medians compared (default: the size's)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="the real engine's clock: wall (the goal's, on a quiet machine) or cpu (this process's CPU time, "
        "for a machine shared with other work)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run on one core (default; --no-pin lets the system move the process)",
    )


def calibration_threads(args) -> int:
    """The torch threads the calibration runs with: as many as the cores it may use. Pinned (the default)
    that is one core, so one thread (two threads on one core would take turns on it, and every step would
    wait for the other); ``--no-pin``, ``--threads`` or torch's default. ``--threads`` above 1 with the pin
    is refused, naming both."""
    threads = getattr(args, "threads", None)
    if getattr(args, "pin", True):
        if threads not in (None, 1):
            raise ValueError(
                f"calibrate: --threads {threads} with --pin: the pin is one core, so one thread; "
                f"--no-pin --threads {threads} runs {threads} threads on the cores the system gives"
            )
        return 1
    return threads or 0  # 0: torch's default


def run(args) -> dict:
    import torch

    from ..sim import calibration as cal

    if calibration_threads(args):
        torch.set_num_threads(calibration_threads(args))
    threads = torch.get_num_threads()
    pinned = "pinned to one core" if getattr(args, "pin", True) else "not pinned"
    print(f"calibrate: {threads} torch thread{'s' if threads != 1 else ''}, {pinned} (torch {torch.__version__})")
    size = args.size
    budget = pick(size, tiny=3.0, small=30.0, full=50.0)  # timing; loading the model adds a few s
    n1, n2 = pick(size, tiny=(40, 40), small=(150, 120), full=(300, 200))
    rounds = getattr(args, "rounds", None) or pick(size, tiny=1, small=2, full=3)
    grid = cal.GRID[:4] + cal.GRID[9:10] + cal.GRID[12:13] if size == "tiny" else cal.GRID
    calibration_traces = cal.TRACES[:1] if size == "tiny" else cal.TRACES
    seed = args.seed
    device = {} if args.device == "cpu" else {"device": args.device}  # on a GPU: the GPU's steps
    cost, report = cal.calibrate(
        args.out,
        budget_s=budget,
        traces=cal.validation_traces(seed, (n1, n2)),
        seed=seed,
        grid=grid,
        calibration_traces=calibration_traces,
        rounds=rounds,
        clock=getattr(args, "clock", "wall"),
        pin=getattr(args, "pin", True),
        **device,
    )

    terms = [[t, f"{cost.seconds[t] * 1e6:.4f}", f"{cost.stderr.get(t, 0.0) * 1e6:.4f}"] for t in cost.seconds]
    rows = []
    for name, r in report["traces"].items():
        for metric in ("ttft", "tpot", "e2e"):
            m = r[metric]
            rows.append(
                [
                    name,
                    metric,
                    f"{m['median_measured_s'] * 1e3:.1f}",
                    f"{m['median_modeled_s'] * 1e3:.1f}",
                    pct(m["median_rel_err"]),
                    pct(m["p90_rel_err"]),
                    f"{pct(m['noise'])} / {pct(m['noise_p90'])}",
                    f"{m['sensitivity']:.2f}",
                ]
            )
        rows.append(
            [
                name,
                "steps",
                r["steps"]["measured"],
                r["steps"]["modeled"],
                pct(abs(r["steps"]["modeled"] - r["steps"]["measured"]) / max(1, r["steps"]["measured"])),
                f"{r['preemptions']} / {r['preemptions_modeled']} preemptions",
                "",
                "",
            ]
        )
        if r["rescaled"] is not None:
            x = r["rescaled"]
            for metric in ("ttft", "tpot", "e2e"):
                rows.append(
                    [
                        name,
                        f"{metric}, rescaled x{x['scale']:.3f}",
                        f"{r[metric]['median_measured_s'] * 1e3:.1f}",
                        f"{x[metric]['median_modeled_s'] * 1e3:.1f}",
                        pct(x[metric]["median_rel_err"]),
                        pct(x[metric]["p90_rel_err"]),
                        f"each round alone: {pct(x['each_round'][metric]['median_rel_err'])} / "
                        f"{pct(x['each_round'][metric]['p90_rel_err'])}",
                        "",
                    ]
                )
        for label, st in (
            ("step times", r["step_times"]),
            ("step times, rescaled", (r["rescaled"] or {}).get("step_times")),
            ("step times, own fit", r["step_times_own_fit"]),
        ):
            if st is None:
                continue
            rows.append(
                [
                    name,
                    label,
                    f"total {st['total_rel_err']:+.1%}",
                    ", ".join(f"{k} {v['total_rel_err']:+.1%}" for k, v in st["by_batch"].items()),
                    pct(st["median_rel_err"]),
                    pct(st["p90_rel_err"]),
                    f"e2e, the real schedule: {pct(st['e2e_same_schedule']['median_rel_err'])} / "
                    f"{pct(st['e2e_same_schedule']['p90_rel_err'])}; the speed known: "
                    f"{pct(st['e2e_speed_known']['median_rel_err'])} / {pct(st['e2e_speed_known']['p90_rel_err'])}",
                    "slowdown by tenth " + " ".join(f"{x:.2f}" for x in st.get("slowdown_by_tenth", [])),
                ]
            )
        rows.append(
            [
                name,
                "busy",
                pct(r["utilisation"]["measured"]),
                pct(r["utilisation"]["modeled"]),
                "",
                f"waiting {r['mean_waiting']['measured']:.1f} / {r['mean_waiting']['modeled']:.1f}",
                ""
                if r["drift"] is None
                else f"reference step {r['drift']:+.1%} vs the calibration's, "
                f"{r['drift_priced']:+.1%} vs the profile's price",
                "",
            ]
        )
    goals = [goal("calibration time", "<= 60 s", f"{report['calibration_s']:.1f} s", report["calibration_s"] <= 60.0)]
    for name, r in report["traces"].items():
        goals.append(
            goal(
                f"{name}: e2e median rel. error",
                "<= 5%",
                pct(r["e2e"]["median_rel_err"]),
                r["e2e"]["median_rel_err"] <= 0.05,
            )
        )
        goals.append(
            goal(f"{name}: e2e p90 rel. error", "<= 12%", pct(r["e2e"]["p90_rel_err"]), r["e2e"]["p90_rel_err"] <= 0.12)
        )
    summary = {
        name: {
            m: {
                k: r[m][k]
                for k in (
                    "median_rel_err",
                    "p90_rel_err",
                    "median_measured_s",
                    "median_modeled_s",
                    "noise",
                    "noise_p90",
                    "sensitivity",
                )
            }
            for m in ("ttft", "tpot", "e2e")
        }
        | {
            k: r[k]
            for k in (
                "steps",
                "preemptions",
                "preemptions_modeled",
                "utilisation",
                "mean_waiting",
                "rounds",
                "reference_step_s",
                "reference_step_after_s",
                "drift",
                "drift_priced",
                "rescaled",
                "single_round",
                "step_times",
                "step_times_own_fit",
            )
        }
        for name, r in report["traces"].items()
    }
    command = command_line(NAME, args) + (f" --rounds {args.rounds}" if getattr(args, "rounds", None) else "")
    command += f" --clock {report['clock']}" + ("" if report["core"] is not None else " --no-pin")
    return {
        "command": command,
        "config": {
            "threads": threads,
            "budget_s": budget,
            "trace_sizes": [n1, n2],
            "seed": seed,
            "rounds": rounds,
            "validation_seeds": [seed + 1, seed + 2],
            "clock": report["clock"],
            "core": report["core"],
        },
        "results": {
            "calibration_s": report["calibration_s"],
            "profile": cost.to_profile(),
            "held_out": report["held_out"],
            "load_average": report["load_average"],
            "traces": summary,
        },
        "goals": goals,
        "_tables": [
            table(["term", "us per unit", "+/- us"], terms, title="fitted step cost"),
            table(
                [
                    "trace",
                    "metric",
                    "measured (median, ms)",
                    "modeled (median, ms)",
                    "median rel. error",
                    "p90 rel. error",
                    "two real rounds apart (median / p90)",
                    "sensitivity",
                ],
                rows,
                title=f"modeled vs measured, per request (measured: the median of {rounds} rounds, "
                f"{report['clock']} clock, load average {report['load_average']['start']} at the start, "
                f"{report['load_average']['end']} at the end)",
            ),
        ],
    }


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
