"""sim-scale: the simulated executor on 10,000 requests of a 70B-shaped model.

No model runs: the same scheduler and paged KV manager as the real engine, a
placeholder token per sampled position, and a modeled clock that advances by what a
roofline says Llama-2-70B would take per step. What this measures is the engine's own
cost per step (scheduling, KV bookkeeping, applying results), in wall and CPU seconds
and steps per second. The run goes through ``simulate(..., records=False)``, the path
the notebooks use for long traces: no ``StepRecord`` is kept, so the engine records
nothing per step (``record="none"``), and the metrics come from the requests alone.
Llama-2-70B's bf16 weights (138 GB) do not fit one 80 GB H100, so the modeled device is
four H100-SXM seen as one (4x FLOP/s, bandwidth and memory, as tensor parallelism would
give, communication ignored).

Part 2, how a step's cost grows: CPU time per step while ``R`` requests decode, with
``W`` more waiting (held back by ``max_num_seqs``) or ``F`` already finished. The
log-log slope against ``R`` should be about 1 (linear in the batch) and against ``W``
and ``F`` about 0 (a step never walks the queue or the finished requests).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..sim.simulated import gc_paused
from .common import finish, fit_line, goal, loglog_exponent, median, pick, progress, table

NAME = "sim-scale"


def _sizes(size: str) -> dict:
    return pick(
        size,
        tiny=dict(n=200, running=[16, 32, 64], others=[100, 400], base=16, steps=5),
        small=dict(n=2000, running=[32, 64, 128, 256], others=[1000, 4000], base=64, steps=20),
        full=dict(n=10000, running=[32, 64, 128, 256, 512], others=[1000, 4000, 16000], base=64, steps=50),
    )


def four_h100():
    from ..sim.costmodel import HARDWARE, MODELS, RooflineCostModel

    hw = HARDWARE["H100-SXM"]
    hw4 = replace(
        hw,
        name="4xH100-SXM",
        peak_flops=4 * hw.peak_flops,
        hbm_bandwidth=4 * hw.hbm_bandwidth,
        hbm_bytes=4 * hw.hbm_bytes,
    )
    return RooflineCostModel(hw4, MODELS["llama-2-70b"])


class GrowthPoint:
    """One point of the growth curve: an engine in which ``running`` requests decode (none
    finishing for ``rounds * steps`` steps), ``waiting`` wait behind ``max_num_seqs`` and
    ``finished`` have come and gone. Built once; ``measure(steps)`` then times the next
    ``steps`` calls of ``engine.step()`` and may be called ``rounds`` times."""

    def __init__(self, running: int, waiting: int = 0, finished: int = 0, steps: int = 20, rounds: int = 1):
        from .. import LLM
        from ..sim.costmodel import ConstantStepTime
        from ..sampling_params import SamplingParams

        prompt = list(range(10, 26))  # 16 tokens: one block
        length = rounds * steps + 8  # output tokens: none finishes while measured
        blocks_per_req = -(-(len(prompt) + length) // 16)
        e = LLM(
            "random",
            executor="simulated",
            clock="modeled",
            cost_model=ConstantStepTime(0.01),
            max_num_seqs=running,
            num_kv_blocks=running * blocks_per_req + 1,
            max_model_len=2048,
            max_num_batched_tokens=max(2048, running * len(prompt)),
            record="none",
        ).engine
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        with gc_paused():  # (the set-up makes no cycles worth a collection)
            add_copies(e, prompt, one, finished)
            while e.has_unfinished_requests():
                e.step()
            add_copies(
                e, prompt, SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True), running + waiting
            )
            e.step()  # R prompts prefilled, W queued behind them
        assert len(e.scheduler.running) == running and len(e.scheduler.waiting) == waiting
        self.engine = e

    def measure(self, steps: int) -> float:
        """Median CPU seconds of one of the next ``steps`` calls of ``engine.step()``."""
        e, times = self.engine, []
        with gc_paused():
            for _ in range(steps):
                c0 = time.process_time()
                e.step()
                times.append(time.process_time() - c0)
        return median(times)


def add_copies(engine, prompt: list[int], params, count: int) -> None:
    """``count`` requests alike: checked once at the engine's door (``validate_request``), each then queued
    with an id of its own (``register_request``), as ``add_request`` would queue them."""
    checked = engine.validate_request(prompt, params, None, None, 0, None, None)
    for _ in range(count):
        engine.register_request(dict(checked))


def step_cpu_seconds(running: int, waiting: int = 0, finished: int = 0, steps: int = 20) -> float:
    """Median CPU seconds of one ``engine.step()`` while ``running`` requests decode (none
    finishing), ``waiting`` wait behind ``max_num_seqs`` and ``finished`` have come and gone."""
    return GrowthPoint(running, waiting, finished, steps).measure(steps)


def growth(P: dict, rounds: int = 3) -> dict:
    """Per-step CPU time against running, waiting and finished requests, and the log-log slopes.
    Each point's engine is built once; every point is then measured once per round, the rounds
    one after another, and keeps its smallest median: a busy spell of a shared machine then slows
    one round of every point rather than all rounds of a few."""
    base, steps = P["base"], P["steps"]
    points = [("running", r, dict(running=r)) for r in P["running"]]
    points += [("waiting", w, dict(running=base, waiting=w)) for w in P["others"]]
    points += [("finished", f, dict(running=base, finished=f)) for f in P["others"]]
    engines = {(kind, x): GrowthPoint(steps=steps, rounds=rounds, **kw) for kind, x, kw in points}
    best: dict = {}
    for _ in range(rounds):
        for key, point in engines.items():
            t = point.measure(steps)
            best[key] = min(best.get(key, t), t)
    by_running, by_waiting, by_finished = (
        {x: t for (k, x), t in best.items() if k == kind} for kind in ("running", "waiting", "finished")
    )
    # Linear in R means a + b R: a fixed part per step and b per running request. The log-log slope of
    # a + b R is below 1 where the fixed part still counts; the line itself is the test.
    fixed, per_request = fit_line(list(by_running), list(by_running.values()))
    off_line = max(abs(t - (fixed + per_request * r)) / t for r, t in by_running.items())
    return dict(
        by_running=by_running,
        by_waiting=by_waiting,
        by_finished=by_finished,
        base_running=base,
        fixed_s=fixed,
        per_running_s=per_request,
        off_line=off_line,
        slope_running=loglog_exponent(list(by_running), list(by_running.values())),
        slope_waiting=loglog_exponent(list(by_waiting), list(by_waiting.values())),
        slope_finished=loglog_exponent(list(by_finished), list(by_finished.values())),
    )


def run(args) -> dict:
    from ..sim.simulated import simulate
    from ..analysis.workloads import LogNormal, synthetic_trace

    P = _sizes(args.size)  # (no torch runs here: --threads has nothing to set)
    cm = four_h100()
    rate = 20.0
    engine_cfg = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    cfg = dict(
        n=P["n"],
        model="llama-2-70b (shape only)",
        hardware=cm.hardware.name,
        arrivals=f"Poisson {rate}/s",
        prompt_len=repr(LogNormal(400, 1.0, 8, 2048)),
        output_len=repr(LogNormal(200, 1.0, 4, 1024)),
        path="simulate(records=False)",
        **engine_cfg,
    )
    trace = synthetic_trace(
        P["n"],
        rate=rate,
        prompt_len=LogNormal(400, 1.0, 8, 2048),
        output_len=LogNormal(200, 1.0, 4, 1024),
        seed=args.seed,
    )
    bar = progress(P["n"], "simulated", "req")
    finished = 0

    def on_step(rec):
        nonlocal finished
        if rec.finished:
            finished += len(rec.finished)
            bar.update(len(rec.finished))

    t0 = time.perf_counter()
    c0 = time.process_time()
    engine, summary = simulate(trace, model="random", cost_model=cm, records=False, progress=on_step, **engine_cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    bar.close()
    steps = engine.step_count
    out_tokens = sum(r.output_len for r in trace)
    res = dict(
        requests=P["n"],
        finished=finished,
        steps=steps,
        wall_s=wall,
        cpu_s=cpu,
        step_cpu_s=summary["step_cpu_time"],
        steps_per_s=steps / wall,
        steps_per_cpu_s=steps / cpu,
        us_per_step=1e6 * wall / steps,
        modeled_s=engine.clock.now(),
        output_tokens=out_tokens,
        modeled_output_tok_per_s=out_tokens / engine.clock.now(),
        sim_speedup=engine.clock.now() / wall,
        kv_blocks=engine.num_kv_blocks,
        preemptions=summary["num_preemptions"],
        ttft_p50=summary["ttft_p50"],
        tpot_p50=summary["tpot_p50"],
    )
    t = table(
        [
            "requests",
            "steps",
            "wall (s)",
            "CPU (s)",
            "of which stepping",
            "steps/s",
            "us/step",
            "modeled time (s)",
            "modeled / wall",
        ],
        [
            [
                P["n"],
                steps,
                wall,
                cpu,
                res["step_cpu_s"],
                res["steps_per_s"],
                res["us_per_step"],
                res["modeled_s"],
                res["sim_speedup"],
            ]
        ],
        title=f"simulated executor, llama-2-70b on modeled {cm.hardware.name}, Poisson {rate:g} req/s, "
        f"max batch 256 (build, submit and metrics included)",
    )
    g = growth(P)
    res["step_growth"] = g
    rows = [[f"running R = {r}", 0, 0, 1e6 * s] for r, s in g["by_running"].items()]
    rows += [[f"R = {g['base_running']}", w, 0, 1e6 * s] for w, s in g["by_waiting"].items()]
    rows += [[f"R = {g['base_running']}", 0, f, 1e6 * s] for f, s in g["by_finished"].items()]
    t2 = table(
        ["running", "waiting", "finished", "CPU us / step (median)"],
        rows,
        title="a step's cost against running, waiting and finished requests",
    )
    t3 = table(
        ["log-log slope of CPU per step against", "slope", "expected"],
        [
            ["running requests", g["slope_running"], "1 (linear), less with a fixed part per step"],
            ["waiting requests", g["slope_waiting"], "0 (independent)"],
            ["finished requests", g["slope_finished"], "0 (independent)"],
        ],
        title="growth",
    )
    goals = [
        goal("every request finishes", f"{P['n']}", finished, finished == P["n"]),
        goal(
            "per-step cost linear in running requests: a + b R",
            "every point within 15% of the line, log-log slope <= 1.2",
            f"a {1e6 * g['fixed_s']:.1f} us + b {1e6 * g['per_running_s']:.3f} us x R, points within "
            f"{100 * g['off_line']:.0f}%, slope {g['slope_running']:.2f}",
            g["off_line"] <= 0.15 and g["per_running_s"] > 0 and g["slope_running"] <= 1.2,
        ),
        goal(
            "independent of waiting requests",
            "|slope| < 0.1",
            round(g["slope_waiting"], 2),
            abs(g["slope_waiting"]) < 0.1,
        ),
        goal(
            "independent of finished requests",
            "|slope| < 0.1",
            round(g["slope_finished"], 2),
            abs(g["slope_finished"]) < 0.1,
        ),
    ]
    return dict(config=cfg, results=res, goals=goals, _tables=[t, t2, t3])


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
