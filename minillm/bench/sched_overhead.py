"""sched-overhead: what one scheduling pass costs, and its share of a real step.

Part 1, the pass vs the queue lengths: a simulated engine (no model) holds ``R``
running requests (decoding, none finishing) and ``W`` waiting ones (blocked by
``max_num_seqs``). The engine steps with ``phase_clock=time.process_time``, so each
``StepRecord.phase_times`` holds the scheduling pass's CPU time; the median pass is reported
per (R, W) cell, with a fit of how it grows: the log-log exponent (1 = linear) and the cost
per running / waiting request.

Part 2, the share of a step: the shipped model at batch 64 (every request decoding).
The engine times its own phases (``EngineConfig.phase_clock``): the scheduling pass,
``runner.prepare`` (tensors for the batch), the model's forward, sampling, applying the
results and building the ``StepRecord`` (its KV snapshot); what is left is the rest of the step.
"""

from __future__ import annotations

import time

from .common import (
    finish,
    fit_line,
    goal,
    loglog_exponent,
    make_llm,
    median,
    pct,
    pick,
    progress,
    set_threads,
    step_clock,
    table,
)

NAME = "sched-overhead"


def _sizes(size: str) -> dict:
    return pick(
        size,
        tiny=dict(running=[8, 16, 32], waiting=[0, 100], passes=4, batch=8, steps=4),
        small=dict(running=[64, 128, 256, 512], waiting=[0, 1000], passes=10, batch=64, steps=10),
        full=dict(running=[64, 128, 256, 512, 1024], waiting=[0, 1000, 10000], passes=20, batch=64, steps=20),
    )


# --------------------------------------------------------------------------------------
# Part 1: one pass vs running and waiting requests (simulated executor)
# --------------------------------------------------------------------------------------


def time_pass(running: int, waiting: int, passes: int, prompt_len: int = 16, seed: int = 0) -> dict:
    """Median wall time of one ``Scheduler.schedule`` call with ``running`` decoding and
    ``waiting`` queued requests, stepping a simulated engine (modeled clock)."""
    from .. import LLM
    from ..sampling_params import SamplingParams

    max_tokens = passes + 8  # nobody finishes while we time
    blocks_per_req = -(-(prompt_len + max_tokens) // 16)
    llm = LLM(
        "random",
        executor="simulated",
        clock="modeled",
        max_num_seqs=running,
        num_kv_blocks=running * blocks_per_req + 1,
        max_num_batched_tokens=max(2048, running * prompt_len),
        max_model_len=2048,
        seed=seed,
        record="summary",
        record_history=0,
        phase_clock=time.process_time,
    )  # CPU time: a busy machine must not inflate the pass
    e = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(10, 10 + prompt_len))
    for _ in range(running):
        e.add_request(prompt, sp)
    e.step()  # every prompt prefilled: R requests running
    for _ in range(waiting):  # they wait: max_num_seqs is reached
        e.add_request(prompt, sp)
    e.step()
    assert len(e.scheduler.running) == running and len(e.scheduler.waiting) == waiting
    t_pass, t_step = [], []
    for _ in range(passes):
        t0 = time.process_time()
        rec = e.step()
        t_step.append(time.process_time() - t0)
        t_pass.append(rec.phase_times["schedule"])
    return dict(running=running, waiting=waiting, pass_s=median(t_pass), step_s=median(t_step), min_pass_s=min(t_pass))


def part1(P: dict) -> tuple[dict, list[str], list[dict]]:
    cells = [(r, w) for w in P["waiting"] for r in P["running"]]
    out = []
    bar = progress(len(cells), "scheduling pass", "cell")
    for r, w in cells:
        out.append(time_pass(r, w, P["passes"]))
        bar.update(1)
    bar.close()
    by = {(c["running"], c["waiting"]): c for c in out}
    R, W = P["running"], P["waiting"]

    # Growth in running requests (no queue), and in waiting requests (smallest batch).
    ys = [by[(r, 0)]["pass_s"] for r in R]
    exp_r = loglog_exponent(R, ys)
    _, slope_r = fit_line(R, ys)
    ratio_r = ys[-1] / ys[0]
    wy = [by[(R[0], w)]["pass_s"] for w in W]
    _, slope_w = fit_line(W, wy)
    fit = dict(
        running_exponent=exp_r,
        running_slope_us_per_request=slope_r * 1e6,
        running_ratio=ratio_r,
        running_ratio_if_linear=R[-1] / R[0],
        waiting_slope_us_per_request=slope_w * 1e6,
    )

    rows = []
    for r in R:
        rows.append([r] + [by[(r, w)]["pass_s"] * 1e3 for w in W] + [by[(r, 0)]["step_s"] * 1e3])
    t1 = table(
        ["running \\ waiting"] + [f"{w:,} waiting: pass (ms)" for w in W] + ["whole sim step, 0 waiting (ms)"],
        rows,
        title="one scheduling pass (median CPU ms), simulated executor",
    )
    t2 = table(
        ["fit", "value"],
        [
            [f"log-log exponent in running requests ({R[0]}..{R[-1]}, 0 waiting; 1 = linear)", exp_r],
            [f"pass({R[-1]}) / pass({R[0]}) (linear would be {R[-1] // R[0]})", ratio_r],
            ["slope: us per running request", slope_r * 1e6],
            [f"slope: us per waiting request (at {R[0]} running)", slope_w * 1e6],
        ],
        title="how the pass grows",
    )
    goals = [
        goal(
            "scheduling pass grows no worse than linearly in running requests",
            "log-log exponent <= 1.1",
            exp_r,
            exp_r <= 1.1,
        )
    ]
    return dict(cells=out, fit=fit), [t1, t2], goals


# --------------------------------------------------------------------------------------
# Part 2: the shares of one real step at batch B
# --------------------------------------------------------------------------------------


def part2(P: dict, device: str, seed: int = 0) -> tuple[dict, list[str], list[dict]]:
    import random
    from ..sampling_params import SamplingParams

    B, steps = P["batch"], P["steps"]
    clock, clock_name = step_clock()
    llm, label = make_llm(max_num_seqs=B, device=device, record="summary", phase_clock=clock)
    e = llm.engine
    rng = random.Random(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for _ in range(B):
        e.add_request([rng.randrange(10, e.vocab_size) for _ in range(32)], sp)
    for _ in range(3):  # prefill everyone, warm up
        e.step()
    assert len(e.scheduler.running) == B and not e.scheduler.waiting
    t_step, phases = [], []
    bar = progress(steps, f"step breakdown, batch {B}", "step")
    for _ in range(steps):
        t0 = clock()
        rec = e.step()
        t_step.append(clock() - t0)
        phases.append(rec.phase_times)
        assert rec.batch_size == B
        bar.update(1)
    bar.close()
    # The per-block map StepRecord.kv carries by default when blocks <= 4096 (widgets draw it).
    t_map = []
    for _ in range(min(steps, 5)):
        t0 = clock()
        e.kv.snapshot(e.active, detail=True)
        t_map.append(clock() - t0)

    # Medians, not sums: on a shared machine a descheduled step would otherwise skew a share.
    step = median(t_step)
    parts = [
        ("scheduler.schedule", "schedule"),
        ("runner.prepare (batch tensors)", "prepare"),
        ("model forward", "forward"),
        ("sampling", "sample"),
        ("applying the results", "update"),
        ("StepRecord (KV snapshot)", "record"),
    ]
    med = {n: median([p.get(key, 0.0) for p in phases]) for n, key in parts}
    rest = step - sum(med.values())
    rows = [[n, m * 1e3, pct(m / step)] for n, m in med.items()]
    rows.append(["the rest (proposals, swaps, bookkeeping)", rest * 1e3, pct(rest / step)])
    rows.append(["whole step", step * 1e3, pct(1.0)])
    share = (med["scheduler.schedule"] + med["runner.prepare (batch tensors)"]) / step
    map_ms = median(t_map) * 1e3
    t = table(
        ["part of engine.step()", "median (ms)", "share of the median step"],
        rows,
        title=f"one decode step at batch {B} (median {clock_name}), {label} on {device} "
        f'({e.num_kv_blocks} KV blocks, record="summary")',
    )
    note = (
        f'with record="full" (the default up to 256 blocks) the per-block KV map alone takes '
        f"{map_ms:.1f} ms per step ({map_ms / (step * 1e3):.0%} of this step)"
    )
    res = dict(
        model=label,
        batch=B,
        steps=steps,
        clock=clock_name,
        step_ms=step * 1e3,
        parts_ms={n: m * 1e3 for n, m in med.items()},
        rest_ms=rest * 1e3,
        shares={n: m / step for n, m in med.items()},
        scheduler_plus_prepare_share=share,
        block_map_snapshot_ms=map_ms,
    )
    goals = [
        goal(f"scheduler + batch preparation share of a step (batch {B}, {device})", "<= 5%", pct(share), share <= 0.05)
    ]
    return res, [t, note], goals


def run(args) -> dict:
    P = _sizes(args.size)
    threads = set_threads(args)
    r1, t1, g1 = part1(P)
    r2, t2, g2 = part2(P, args.device, args.seed)
    cfg = dict(
        running=P["running"],
        waiting=P["waiting"],
        passes_per_cell=P["passes"],
        step_batch=P["batch"],
        steps=P["steps"],
        torch_threads=threads,
        prompt_len=16,
    )
    return dict(config=cfg, results=dict(scheduling_pass=r1, step_breakdown=r2), goals=g1 + g2, _tables=t1 + t2)


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
