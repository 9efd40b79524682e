"""Is the simulator right? Calibrate its clock on this machine, then check it against the real engine.

The simulator runs the real scheduler and KV manager; only the *time* a step takes is predicted, by a
cost model. So a simulator calibrated on this machine should predict what the real engine does here.
Three parts, each usable alone:

1. ``measure_steps``: run the real engine (the shipped model unless told otherwise) over a grid of
   batch shapes (decodes at batch 1 to 64, short and long contexts, whole and chunked prefills, mixed
   batches), then over a few traces replayed in real time (the batches a server really forms), and
   keep, for every step, each request's new tokens and context, the step's time on the engine's clock,
   and whether the engine sat idle before it. Python's garbage collector stays out of the timing
   (``quiet_heap``).
2. ``fit_step_cost``: a least-squares fit of ``LinearStepCost``'s terms (``costmodel.batch_terms``: a
   fixed part, a step of more than one new token, per new token, per sequence, per context token, per
   attention pair; and ``after_idle``, the extra time of a step that follows a wait for an arrival) to
   those steps; a term the data make negative is dropped (its cost is then 0) and the rest fitted
   again. Each term keeps its standard error. ``held_out_errors`` predicts each calibration trace with
   a fit of the rest.
3. ``compare_on_trace``: the same trace (Poisson arrivals, log-normal lengths) run on the real engine
   (its clock, requests arriving in real time; a few rounds, each request's median taken) and on the
   simulator (modeled clock, the calibrated cost model): every request's TTFT, TPOT and end-to-end
   latency side by side, with the median and 90th-percentile relative error, both step counts, how
   far two real rounds differ (the floor under any model's error), how loaded the engine was, and how
   much an error in every step moves a request's latency at that load (``sensitivity``). Where the
   error is made: ``step_time_errors`` prices each real round's own steps with the profile (the error
   in the step times alone, the real schedule held), and ``scaled`` by the reference step timed before
   the rounds the profile follows a machine that got slower or faster since it was timed (``rescaled``).

``calibrate(out=DIR)`` does all three and writes the profile (``DIR/step-cost-MACHINE.json``, loaded by
``CostModel.from_profile``) and the report (``DIR/calibration-MACHINE.json``);
``python -m minillm.bench calibrate`` is the same from a shell. It runs on one core
(``pinned_to_one_core``), and on the clock you name: ``"wall"`` (what a user would see; the goal's), or
``"cpu"`` (``sim.clock.ProcessClock``: the process's own CPU time, for a machine shared with other work,
where the wall clock measures the other programs as much as the engine).

Published simulators, for scale: Vidur (Agrawal et al., MLSys 2024) profiles each operator and predicts
request latency within 9%; ours predicts only step times, with every decision the real one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .costmodel import STEP_TERMS, LinearStepCost, batch_terms
from .simulated import gc_paused

__all__ = [
    "StepSample",
    "measure_steps",
    "fit_step_cost",
    "held_out_errors",
    "validation_trace",
    "validation_traces",
    "compare_on_trace",
    "calibrate",
    "machine_name",
    "pinned_to_one_core",
]


@dataclass(frozen=True)
class StepSample:
    """One measured step: each request's new tokens and KV length after the step, the seconds it took,
    whether the engine sat idle before it (waiting for an arrival), and the workload it came from."""

    num_new_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    seconds: float
    after_idle: bool = False
    workload: str = ""


def machine_name() -> str:
    """A file-name-safe name for this machine (its host name)."""
    name = platform.node() or "this-machine"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


# ---------------------------------------------------------------------------------------------------------
# 1. Measuring the real engine's steps
# ---------------------------------------------------------------------------------------------------------

# (requests, prompt length range, output tokens, token budget): decodes at every batch size up to 64,
# long contexts, prefills whole and chunked, and decodes mixed with chunks of a new prompt.
GRID = (
    (1, (8, 32), 24, 2048),
    (2, (8, 32), 24, 2048),
    (4, (8, 64), 24, 2048),
    (8, (8, 64), 24, 2048),
    (16, (8, 64), 24, 2048),
    (32, (8, 64), 20, 2048),
    (64, (8, 48), 16, 2048),
    (4, (300, 700), 16, 2048),
    (16, (200, 500), 12, 4096),
    (1, (16, 900), 1, 2048),
    (1, (400, 900), 1, 2048),
    (1, (100, 300), 1, 2048),
    (12, (8, 32), 24, 96),
    (24, (64, 400), 12, 256),
    (6, (400, 800), 8, 128),
)


def _engine(model: Optional[str], **config):
    from ..config import EngineConfig
    from ..engine import LLMEngine

    config.setdefault("record", "summary")
    config.setdefault("record_history", None)
    return LLMEngine(model, EngineConfig.from_fields("calibrate", **config))


def _warm_up(engine) -> None:
    """Steps of many shapes first: torch's first forward at each new batch shape allocates, and is
    slower than every later one. Greedy requests of prompts from 3 to 600 tokens, at once."""
    from ..sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for n in (600, 300, 150, 80, 40, 20, 10, 3, 5, 7, 9, 12, 16, 24, 32, 48):
        engine.add_request(list(range(10, 10 + n)), sp)
    while engine.has_unfinished_requests():
        engine.step()


def _wait_if_idle(engine) -> float:
    """When the scheduler is idle (``is_idle``) and the next request arrives later, wait for it on the
    engine's clock; returns how late the wait ended (seconds past the arrival, >= 0), or -1 when there
    was nothing to wait for (work to do, or the next request already due)."""
    s = engine.scheduler
    t = s.next_arrival()
    if not s.is_idle() or t is None or engine.clock.now() >= t:
        return -1.0
    while engine.clock.now() < t:
        engine.clock.wait_until(t)
    return max(0.0, engine.clock.now() - t)


def _timed_steps(engine, workload: str = "", deadline: float = math.inf) -> list[StepSample]:
    """Step ``engine`` until it is done; every step with work, timed on the engine's own clock (wall or
    CPU time) from just before ``step()`` to just after it. A step after an idle wait counts from the
    moment its request arrived: the time a sleeping process takes to wake is part of what that request
    sees (``after_idle``). Past ``deadline`` (``time.perf_counter``) the requests left are aborted."""
    samples = []
    clock = engine.clock
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            for request_id in list(engine.active):
                engine.abort_request(request_id)
            break
        late = _wait_if_idle(engine)
        t0 = clock.now()
        rec = engine.step()
        seconds = clock.now() - t0
        if rec.batch:
            samples.append(
                StepSample(
                    tuple(e.num_new_tokens for e in rec.batch),
                    tuple(e.context_len for e in rec.batch),
                    seconds + max(late, 0.0),
                    after_idle=late >= 0,
                    workload=workload,
                )
            )
    return samples


def reference_steps(engine) -> list[StepSample]:
    """The machine's pulse: one request of 24 prompt tokens decoding 32 tokens alone, its decode steps
    (workload "reference"). Timed at the start of the calibration and before every real round, their
    median says whether the machine got slower or faster in between (``compare_on_trace``'s ``drift``):
    the profile cannot know that it did."""
    from ..sampling_params import SamplingParams

    engine.add_request(list(range(10, 34)), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    return _timed_steps(engine, "reference")[1:]  # not the prefill


@contextlib.contextmanager
def pinned_to_one_core(core: Optional[int] = None):
    """This thread on one core (the last this process may use, or ``core``) for the block, and back
    to its cores after; yields the core, or None where the system cannot pin (not Linux). The engine's
    steps then never move between cores mid-run (a move costs the caches); with one torch thread all
    of a step's work runs on this thread."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    core = max(before) if core is None else core
    if core not in before:
        raise ValueError(f"pinned_to_one_core: core={core!r}; this process may use {sorted(before)}")
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def quiet_heap():
    """Python's garbage collector out of the timings: the heap collected, what is alive frozen (a
    collection never walks it), the collector off for the block and restored after. The timing and
    the real runs both run inside, so the steps the fit sees are the steps the check measures."""
    gc.collect()
    gc.freeze()
    try:
        with gc_paused():
            yield
    finally:
        gc.unfreeze()


# Traces replayed in real time after the grid: the mixes a server sees (arrivals one by one,
# prefills beside decodes, batches growing and shrinking). (requests, rate, prompt median, output median)
# The first has short answers at a low rate: the engine sits idle between most arrivals, so the fit
# sees steps that start from an idle engine (the ``after_idle`` term).
TRACES = ((60, 10.0, 48, 4), (120, 8.0, 48, 40), (120, 16.0, 96, 64), (160, 24.0, 48, 40))


def measure_steps(
    model: Optional[str] = None,
    *,
    budget_s: float = 40.0,
    seed: int = 0,
    grid=GRID,
    traces=TRACES,
    progress: Optional[Callable[[int, int], None]] = None,
    **config,
) -> list[StepSample]:
    """Run the real engine over ``grid`` (every request arriving at once, greedy, exactly its output
    length), then replay ``traces`` (Poisson arrivals in real time, log-normal lengths; seeds 1000 and
    up, never those of ``validation_trace``'s defaults), and return every step as a ``StepSample``.
    The grid always runs whole (a few seconds on a quiet 2-core machine: every batch shape the fit
    needs to tell its terms apart); the traces fill the rest of ``budget_s`` seconds, the last one stopped in
    the middle when they run out (a busy machine is slower; the budget holds anyway)."""
    from dataclasses import replace as replace_field

    from ..analysis.workloads import submit_trace
    from ..sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    config.setdefault("max_model_len", 1024)
    samples: list[StepSample] = []
    engines: dict[int, Any] = {}

    def engine_with_budget(budget):
        if budget not in engines:
            engines[budget] = _engine(model, max_num_batched_tokens=budget, max_num_seqs=64, **config)
            _warm_up(engines[budget])
        return engines[budget]

    work = len(grid) + len(traces)
    engine_with_budget(2048)  # loading the model and warming up are not part of the budget
    t_start = time.perf_counter()
    with quiet_heap():
        samples += reference_steps(engines[2048])
        for i, (n, (lo, hi), out_len, budget) in enumerate(grid):
            engine = engine_with_budget(budget)
            sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
            for _ in range(n):
                length = int(rng.integers(lo, hi + 1))
                engine.add_request(rng.integers(10, engine.vocab_size, length).tolist(), sp)
            # Decodes: not their first step (the prompts' prefill, a new batch shape's allocations). A lone
            # prefill (one output token) is that step alone, of a shape the warm-up ran: kept.
            samples += _timed_steps(engine, f"grid {i}")[1 if out_len > 1 else 0 :]
            if progress is not None:
                progress(i + 1, work)
        for k, (n, rate, prompt_median, output_median) in enumerate(traces):
            if time.perf_counter() - t_start > budget_s:
                break
            engine = engine_with_budget(2048)
            trace = validation_trace(
                n,
                rate=rate,
                seed=1000 + seed * len(traces) + k,
                prompt_median=prompt_median,
                output_median=output_median,
            )
            start = engine.clock.now() + 0.02
            trace = [
                replace_field(r, arrival_time=r.arrival_time + start, request_id=f"cal{k}-{r.request_id}")
                for r in trace
            ]
            submit_trace(engine, trace, vocab_size=engine.vocab_size, seed=seed + k)
            samples += _timed_steps(engine, f"trace {k}", t_start + budget_s)
            if progress is not None:
                progress(len(grid) + k + 1, work)
    return samples


# ---------------------------------------------------------------------------------------------------------
# 2. Fitting the terms
# ---------------------------------------------------------------------------------------------------------


def step_terms(sample: StepSample) -> tuple:
    """A sample's row of the fit: its ``batch_terms`` and 1 if it followed an idle wait (``STEP_TERMS``)."""
    return batch_terms(sample.num_new_tokens, sample.context_lens) + (int(sample.after_idle),)


def fit_step_cost(samples: Sequence[StepSample], *, info: Optional[dict] = None) -> LinearStepCost:
    """Least squares of the step times on ``step_terms`` (the batch's terms, and ``after_idle`` for a
    step that followed a wait for an arrival), every term >= 0.

    Plain (unweighted) least squares: with the fixed term in the model its residuals sum to zero, so
    the fitted steps add up to the measured ones, which is what a request's latency adds up. (Weighting
    each step by 1/seconds would fit relative errors instead; step times are skewed, a few slow steps
    among many quick ones, and that fit comes out a few percent short in total.) A term whose fitted
    cost is negative, or that no step exercises (no step after an idle wait), is set to 0 and the
    others fitted again. Standard errors come from the residuals: ``s^2 (X^T X)^-1``."""
    if len(samples) < len(STEP_TERMS) + 2:
        raise ValueError(f"fit_step_cost: {len(samples)} steps; need at least {len(STEP_TERMS) + 2}")
    x = np.array([step_terms(s) for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("fit_step_cost: every step time must be a positive number of seconds")
    w = np.ones_like(y)  # one weight per step: see the docstring
    active = [a for a in range(len(STEP_TERMS)) if np.any(x[:, a])]
    if np.linalg.matrix_rank(x[:, active] / np.abs(x[:, active]).max(axis=0)) < len(active):
        shapes = len({(s.num_new_tokens, s.context_lens) for s in samples})
        raise ValueError(
            f"fit_step_cost: {len(samples)} steps of {shapes} batch shapes cannot tell the terms "
            f"{[STEP_TERMS[a] for a in active]} apart (every step alike in some of them): time more "
            "batch shapes (measure_steps with a larger budget_s, on a machine not busy with other work)"
        )
    while True:
        xa = x[:, active] * w[:, None]
        scale = np.abs(xa).max(axis=0)  # columns of very different sizes: rescale
        scale[scale == 0] = 1.0
        coef, *_ = np.linalg.lstsq(xa / scale, y * w, rcond=None)
        coef = coef / scale
        negative = [a for a, c in zip(active, coef) if c < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda a: coef[active.index(a)]))
    seconds = dict.fromkeys(STEP_TERMS, 0.0)
    stderr = dict.fromkeys(STEP_TERMS, 0.0)
    residual = (x[:, active] @ coef - y) * w
    dof = max(1, len(y) - len(active))
    xw = x[:, active] * w[:, None]
    cov = (residual @ residual / dof) * np.linalg.pinv(xw.T @ xw)
    for j, a in enumerate(active):
        seconds[STEP_TERMS[a]] = float(coef[j])
        stderr[STEP_TERMS[a]] = float(np.sqrt(max(cov[j, j], 0.0)))
    rel = np.abs(residual) / y
    info = dict(info or {})
    info.update(
        num_steps=len(samples), fit_median_rel_err=float(np.median(rel)), fit_p90_rel_err=float(np.percentile(rel, 90))
    )
    return LinearStepCost(seconds, stderr, info=info)


def held_out_errors(samples: Sequence[StepSample]) -> dict:
    """Each of the calibration's traces left out of the fit in turn and predicted by the fit of the rest
    (every sample here is calibration data; the validation traces are never seen): per trace its steps,
    ``total_rel_err`` (modeled total time / measured - 1, signed: a bias compounds into every latency),
    and the median and p90 relative error of a step."""
    out = {}
    for name in sorted({s.workload for s in samples if s.workload.startswith("trace")}):
        test = [s for s in samples if s.workload == name]
        cost = fit_step_cost([s for s in samples if s.workload != name])
        modeled = np.array([predicted_seconds(cost, s) for s in test])
        y = np.array([s.seconds for s in test])
        rel = np.abs(modeled - y) / y
        out[name] = {
            "num_steps": len(test),
            "total_rel_err": float(modeled.sum() / y.sum() - 1.0),
            "median_rel_err": float(np.median(rel)),
            "p90_rel_err": float(np.percentile(rel, 90)),
        }
    return out


def predicted_seconds(cost: LinearStepCost, sample: StepSample) -> float:
    """What ``cost`` says ``sample``'s step takes (its batch, and the idle term if it followed a wait)."""
    extra = cost.after_idle_time() if sample.after_idle else 0.0
    return cost.step_time(sample.num_new_tokens, sample.context_lens) + extra


# ---------------------------------------------------------------------------------------------------------
# 3. The same trace on the real engine and on the simulator
# ---------------------------------------------------------------------------------------------------------


def validation_trace(
    n: int = 300, rate: float = 5.0, seed: int = 1, *, prompt_median: int = 48, output_median: int = 40
) -> list:
    """``n`` requests, Poisson arrivals at ``rate`` per second, log-normal prompt and output lengths."""
    from ..analysis.workloads import LogNormal, synthetic_trace

    return synthetic_trace(
        n,
        rate=rate,
        prompt_len=LogNormal(prompt_median, 0.8, 4, 600),
        output_len=LogNormal(output_median, 0.8, 2, 300),
        seed=seed,
    )


def validation_traces(seed: int = 0, sizes: tuple[int, int] = (300, 200)) -> dict:
    """The two traces ``calibrate`` checks, {name: (trace, engine settings)}, seeds ``seed + 1`` and
    ``seed + 2`` (the calibration's own traces use 1000 and up):

    * "poisson": Poisson arrivals at 5 per second, prompts of median 48 tokens and answers of median
      40, on a KV cache that never runs out;
    * "preempting": longer requests (prompts of median 96, answers of median 64) at 3 per second on
      64 blocks of 16 positions: when a few long requests overlap the cache runs out and one is
      preempted (recompute); about 10 preemptions in 200 requests.

    Both at a load where a request's latency is made of its own steps, not of waiting behind others:
    the engine busy about two thirds of the time, about 1.6 requests in a batch, nobody left waiting.
    There a step that the model prices 1% too long makes a request about 1% too late
    (``compare_on_trace``'s ``sensitivity``, about 1.05). Nearer the machine's capacity the engine is
    busy all the time, an error in one step delays every request behind it and batches grow, and two
    real runs of the same trace differ from each other more than the goal allows any model (at 12
    per second: sensitivity 1.3 for end-to-end latency and 3 for TTFT, the real rounds 28% apart per
    request on a quiet machine). The rates were chosen with the simulator and a profile of this
    machine, for their load alone (busy, sensitivity, preemptions), never from how well the simulator
    matched the real engine on them."""
    n1, n2 = sizes
    return {
        "poisson": (validation_trace(n1, rate=5.0, seed=seed + 1), {}),
        "preempting": (
            validation_trace(n2, rate=3.0, seed=seed + 2, prompt_median=96, output_median=64),
            {"num_kv_blocks": 64},
        ),
    }


def _latencies(metrics) -> dict[str, Optional[float]]:
    tpot = None
    if metrics.num_output_tokens > 1 and metrics.first_token_time is not None:
        tpot = (metrics.finish_time - metrics.first_token_time) / (metrics.num_output_tokens - 1)
    return {"ttft": metrics.ttft, "tpot": tpot, "e2e": metrics.finish_time - metrics.arrival_time}


def _relative_errors(measured: dict, modeled: dict, metric: str) -> np.ndarray:
    pairs = [(measured[r][metric], modeled[r][metric]) for r in measured if r in modeled]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None and a > 0]
    return np.array([abs(b - a) / a for a, b in pairs])


def compare_on_trace(
    cost_model: LinearStepCost, trace: Sequence, model: Optional[str] = None, *, rounds: int = 1, **config
) -> dict:
    """Run ``trace`` on the real engine (wall clock) ``rounds`` times, each on a fresh engine, and once
    on the simulator (``cost_model``). A request's measured TTFT, TPOT and end-to-end latency are the
    median over the rounds (a single run's noise, a collection or another program taking the core,
    is the machine's, not the model's); per metric (``ttft``, ``tpot``, ``e2e``) the median and
    90th-percentile relative error of modeled against measured, both medians, ``noise`` and
    ``noise_p90``: the median and 90th percentile over requests and pairs of rounds of |one round -
    another| / the rounds' median (how far two runs of the same trace on the same engine differ: no
    model can be checked closer than that; 0 for one round), and ``sensitivity``: how far a request's
    modeled latency moves when every step is ``SENSITIVITY_STEP`` (2%) longer, over 2% (the median over
    requests; about 1 where latency is a request's own steps, above 1 where it waits behind others, so
    that an error per step grows into a larger error per request). Also every request's pair
    (``per_request``), the step counts (measured: the rounds' median), preemptions, and the load:
    ``utilisation``, the fraction of the trace's span (first arrival to last finish) the engine was
    busy, and ``mean_waiting``, the requests left waiting at a step (at most ``record_max_waiting``
    counted), measured (the rounds' median) and modeled. A batching engine is busy nearly all the
    time well below its capacity (every step serves whoever is running); a queue that keeps growing
    is what saturation looks like. ``reference_step_s``: each round's ``reference_steps`` (median), and
    ``drift``: their median against the one timed with the calibration (in ``cost_model.info``), less 1
    (+0.10: the machine's steps 10% slower in the real rounds than when the profile was timed; None for a
    cost model without it), and ``drift_priced``, the same against ``reference_baseline`` (the profile's
    own price of those steps); ``reference_step_after_s``: the same timed right after each round (the
    drift within a round). ``rescaled``: that drift divided out (``_rescaled``: the profile scaled by the
    reference step before the rounds over ``reference_baseline``, the trace simulated again, the same
    errors; None for a cost model without a reference step). ``single_round``: the errors against each round
    alone rather than the rounds' median (``_each_round``). ``step_times``: where the error is made
    (``step_time_errors`` on every round's own steps, the median over rounds): the real batches priced
    by the profile, and each request's latency had only its step times been modeled.
    ``step_times_own_fit``: the same with each round's steps priced by a fit to those very steps (not a
    prediction: the least error a profile of this form leaves on this run, the machine's own scatter
    and what the terms cannot express; None where no round's steps can be fitted)."""
    from ..model.loader import resolve_model_path
    from .simulated import simulate

    if rounds < 1:
        raise ValueError(f"compare_on_trace: rounds={rounds!r}; need at least 1")
    config.setdefault("max_num_seqs", 64)
    config.setdefault("max_num_batched_tokens", 2048)
    config.setdefault("max_model_len", 1024)
    config.setdefault("preemption_mode", "recompute")
    config.setdefault("record_max_waiting", 64)  # the same cap on both sides (``mean_waiting``)

    runs = [_real_run(trace, model, config) for _ in range(rounds)]
    ids = [r.request_id for r in trace]
    measured = {rid: {m: _median([run["latencies"][rid][m] for run in runs]) for m in METRICS} for rid in ids}

    sim, _ = simulate(trace, model=resolve_model_path(model), cost_model=cost_model, records="full", **config)
    modeled = {rid: _latencies(sim.requests[rid].metrics) for rid in ids}
    shifted = _simulated_latencies(scaled(cost_model, 1 + SENSITIVITY_STEP), trace, model, config)
    busy = [rec for rec in sim.step_records if rec.batch_size]
    span = max(r["e2e"] + t.arrival_time for r, t in zip(modeled.values(), trace)) - min(t.arrival_time for t in trace)

    report: dict[str, Any] = {}
    for metric in METRICS:
        noise = [
            _round_differences(a["latencies"], b["latencies"], measured, metric)
            for i, a in enumerate(runs)
            for b in runs[i + 1 :]
        ]
        noise = np.concatenate(noise) if noise else np.zeros(1)
        report[metric] = {
            **_errors(measured, modeled, metric),
            "median_measured_s": _median([measured[r][metric] for r in ids]),
            "num_requests": len(_relative_errors(measured, modeled, metric)),
            "noise": float(np.median(noise)),
            "noise_p90": float(np.percentile(noise, 90)),
            "sensitivity": float(np.median(_relative_errors(modeled, shifted, metric))) / SENSITIVITY_STEP,
        }
    report["single_round"] = _each_round(runs, [modeled] * len(runs))
    step_times = [step_time_errors(cost_model, run) for run in runs]
    report["step_times"] = _median_of(step_times) | {
        "total_rel_err_each_round": [e["total_rel_err"] for e in step_times]
    }
    own_fit = [e for e in map(_own_fit_errors, runs) if e is not None]
    report["step_times_own_fit"] = _median_of(own_fit) if own_fit else None
    report["steps"] = {
        "measured": int(np.median([run["steps"] for run in runs])),
        "modeled": len(busy),
        "measured_each_round": [run["steps"] for run in runs],
    }
    report["preemptions"] = int(np.median([run["preemptions"] for run in runs]))
    report["preemptions_modeled"] = sum(sim.requests[rid].metrics.num_preemptions for rid in ids)
    report["utilisation"] = {
        "measured": float(np.median([run["utilisation"] for run in runs])),
        "modeled": sum(rec.duration for rec in busy) / span if span > 0 else 0.0,
    }
    report["mean_waiting"] = {
        "measured": float(np.median([run["mean_waiting"] for run in runs])),
        "modeled": _mean_waiting(busy),
    }
    report["rounds"] = rounds
    report["reference_step_s"] = [run["reference_step_s"] for run in runs]
    report["reference_step_after_s"] = [run["reference_step_after_s"] for run in runs]
    timed, baseline = cost_model.info.get("reference_step_s"), reference_baseline(cost_model)
    report["drift"] = float(np.median(report["reference_step_s"]) / timed - 1.0) if timed else None
    report["drift_priced"] = float(np.median(report["reference_step_s"]) / baseline - 1.0) if baseline else None
    report["rescaled"] = _rescaled(cost_model, trace, model, config, runs, measured) if baseline else None
    report["num_requests"] = len(ids)
    report["per_request"] = {rid: {"measured": measured[rid], "modeled": modeled[rid]} for rid in ids}
    return report


METRICS = ("ttft", "tpot", "e2e")
SENSITIVITY_STEP = 0.02  # every step this much longer: how far does a request's latency move?


def _simulated_latencies(cost: LinearStepCost, trace: Sequence, model: Optional[str], config: dict) -> dict:
    """Every request's TTFT, TPOT and end-to-end latency, ``trace`` simulated with ``cost``."""
    from ..model.loader import resolve_model_path
    from .simulated import simulate

    sim, _ = simulate(trace, model=resolve_model_path(model), cost_model=cost, **config)
    return {r.request_id: _latencies(sim.requests[r.request_id].metrics) for r in trace}


def _errors(measured: dict, modeled: dict, metric: str) -> dict:
    """``metric``'s median and p90 relative error of ``modeled`` against ``measured``, and the modeled median."""
    err = _relative_errors(measured, modeled, metric)
    return {
        "median_rel_err": float(np.median(err)),
        "p90_rel_err": float(np.percentile(err, 90)),
        "median_modeled_s": _median([modeled[r][metric] for r in measured if r in modeled]),
    }


def _each_round(runs: list, modeled: list) -> dict:
    """Each real round on its own against its simulation (``modeled[i]`` for ``runs[i]``): per metric
    the median over the rounds of each round's median and p90 relative error (a single run as the
    reference, with all its scatter, where the headline figures take the median of the rounds)."""
    per = [{m: _errors(run["latencies"], sim, m) for m in METRICS} for run, sim in zip(runs, modeled)]
    return {m: _median_of([{k: p[m][k] for k in ("median_rel_err", "p90_rel_err")} for p in per]) for m in METRICS}


def _rescaled(cost: LinearStepCost, trace: Sequence, model: Optional[str], config: dict, runs: list, measured: dict):
    """The machine's drift divided out: the profile ``scaled`` by the rounds' reference step (timed
    just before each round; their median) over ``reference_baseline``, the trace simulated again, and the
    same errors as ``compare_on_trace``'s (``scale`` and, per metric, ``median_rel_err``,
    ``p90_rel_err``, ``median_modeled_s``); ``each_round``: every round against a simulation scaled by
    its own reference step (``_each_round``); ``step_times``: ``step_time_errors`` with those profiles."""
    baseline = reference_baseline(cost)
    factor = float(np.median([run["reference_step_s"] for run in runs])) / baseline
    modeled = _simulated_latencies(scaled(cost, factor), trace, model, config)
    own = [scaled(cost, run["reference_step_s"] / baseline) for run in runs]
    return {
        "scale": factor,
        **{m: _errors(measured, modeled, m) for m in METRICS},
        "each_round": _each_round(runs, [_simulated_latencies(c, trace, model, config) for c in own]),
        "step_times": _median_of([step_time_errors(c, run) for c, run in zip(own, runs)]),
    }


def _median_of(reports: list):
    """The median, field by field, of reports alike in shape (nested dicts and lists of numbers); a
    field some report lacks is left out, and so are lists of different lengths."""
    first = reports[0]
    if isinstance(first, dict):
        keys = [k for k in first if all(k in r for r in reports)]
        out = {k: _median_of([r[k] for r in reports]) for k in keys}
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(first, (list, tuple)):
        if any(len(r) != len(first) for r in reports):
            return None
        return [_median_of([r[i] for r in reports]) for i in range(len(first))]
    return float(np.median(reports))


def _median(values: list) -> Optional[float]:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def _round_differences(one: dict, other: dict, median: dict, metric: str) -> np.ndarray:
    triples = [(one[r][metric], other[r][metric], median[r][metric]) for r in median]
    return np.array([abs(a - b) / m for a, b, m in triples if a is not None and b is not None and m])


def _real_run(trace: Sequence, model: Optional[str], config: dict) -> dict:
    """``trace`` once on a fresh real engine, requests arriving in real time: every request's latencies
    and (``spans``) its arrival and finish on the engine's clock, every step with work timed as the
    calibration times it (``samples``, a ``StepSample`` each, and ``starts``, when each began, an idle
    wait's lateness counted from the arrival as ``_timed_steps`` does), the preemptions, the fraction
    of the span the engine was busy (the span less the idle waits for an arrival), and the reference
    step (``reference_steps``' median) timed just before the trace and just after it."""
    from ..analysis.workloads import submit_trace

    with quiet_heap():  # a clean heap, as a fresh server's; no collection inside
        engine = _engine(model, **config)
        _warm_up(engine)
        reference = float(np.median([s.seconds for s in reference_steps(engine)]))
        engine.step_records.clear()
        start = engine.clock.now() + 0.05
        ids = submit_trace(
            engine, [replace(r, arrival_time=r.arrival_time + start) for r in trace], vocab_size=engine.vocab_size
        )
        idle, first = 0.0, min(r.arrival_time for r in trace) + start
        samples, starts = [], []
        while engine.has_unfinished_requests():
            t = engine.clock.now()
            late = _wait_if_idle(engine)
            if late >= 0:
                idle += engine.clock.now() - max(t, first)
            t0 = engine.clock.now()
            rec = engine.step()
            if rec.batch:
                seconds = engine.clock.now() - t0 + max(late, 0.0)
                batch = (tuple(e.num_new_tokens for e in rec.batch), tuple(e.context_len for e in rec.batch))
                samples.append(StepSample(*batch, seconds, after_idle=late >= 0, workload="validation"))
                starts.append(t0 - max(late, 0.0))
        span = engine.clock.now() - first
        records = [rec for rec in engine.step_records if rec.batch_size]
        after = float(np.median([s.seconds for s in reference_steps(engine)]))
    metrics = {rid: engine.requests[rid].metrics for rid in ids}
    return {
        "latencies": {rid: _latencies(m) for rid, m in metrics.items()},
        "spans": {rid: (m.arrival_time, m.finish_time) for rid, m in metrics.items()},
        "samples": samples,
        "starts": starts,
        "steps": len(records),
        "preemptions": sum(m.num_preemptions for m in metrics.values()),
        "utilisation": 1.0 - idle / span if span > 0 else 0.0,
        "mean_waiting": _mean_waiting(records),
        "reference_step_s": reference,
        "reference_step_after_s": after,
    }


def step_time_errors(cost: LinearStepCost, run: dict) -> dict:
    """The real run's own steps priced by ``cost`` (``predicted_seconds``), against their measured
    times: is the error in the step times, or in what the simulator does with them? ``total_rel_err``:
    the priced steps' sum / the measured sum - 1 (signed: a bias every latency carries); the median
    and p90 relative error of a step; ``by_batch``: the signed total error of the steps of each kind
    (one request decoding alone, several decoding, a batch with a prefill, a step after an idle wait)
    and how many there were; ``e2e_same_schedule``: each request's end-to-end latency if only its
    steps' times were the model's (the real batches, in the real order: the measured latency plus the
    priced-minus-measured time of every step that started while the request was in the engine), its
    median and p90 relative error. What the simulator's error has beyond that comes from its schedule
    parting from the real one (other batches, a queue built or drained differently).
    ``slowdown_by_tenth``: the run cut into ten runs of consecutive steps, each one's measured time over
    its priced time (1.0 everywhere: a machine as fast as when it was timed, all along);
    ``e2e_speed_known``: ``e2e_same_schedule`` again with every step priced times its tenth's slowdown,
    as if the model knew the machine's speed at every moment (taken from the run itself: not a
    prediction, the error a profile of the right shape would have left if the speed held still)."""
    samples = run["samples"]
    if not samples:
        raise ValueError("step_time_errors: the run has no timed steps (run['samples'] is empty)")
    pred = np.array([predicted_seconds(cost, s) for s in samples])
    meas = np.array([s.seconds for s in samples])
    starts = np.asarray(run["starts"], dtype=float)
    rel = np.abs(pred - meas) / meas
    tenths = np.array_split(np.arange(len(samples)), min(10, len(samples)))
    slowdown = [float(meas[k].sum() / pred[k].sum()) for k in tenths]
    known = pred * np.concatenate([np.full(len(k), f) for k, f in zip(tenths, slowdown)])
    kinds = {
        "one decoding alone": [s.num_new_tokens == (1,) for s in samples],
        "several decoding": [len(s.num_new_tokens) > 1 and max(s.num_new_tokens) == 1 for s in samples],
        "with a prefill": [max(s.num_new_tokens) > 1 for s in samples],
        "after idle": [s.after_idle for s in samples],
    }
    by_batch = {
        kind: {"num_steps": int(np.sum(m)), "total_rel_err": float(pred[m].sum() / meas[m].sum() - 1.0)}
        for kind, m in ((k, np.array(v, dtype=bool)) for k, v in kinds.items())
        if np.any(m)
    }
    return {
        "num_steps": len(samples),
        "total_rel_err": float(pred.sum() / meas.sum() - 1.0),
        "median_rel_err": float(np.median(rel)),
        "p90_rel_err": float(np.percentile(rel, 90)),
        "by_batch": by_batch,
        "slowdown_by_tenth": slowdown,
        "e2e_same_schedule": _same_schedule_errors(pred, meas, starts, run["spans"]),
        "e2e_speed_known": _same_schedule_errors(known, meas, starts, run["spans"]),
    }


def _own_fit_errors(run: dict) -> Optional[dict]:
    """``step_time_errors`` of a run's steps priced by a fit to those same steps; None where they are
    too few or too alike to fit (``fit_step_cost`` refuses them)."""
    try:
        return step_time_errors(fit_step_cost(run["samples"]), run)
    except ValueError:
        return None


def _same_schedule_errors(pred: np.ndarray, meas: np.ndarray, starts: np.ndarray, spans: dict) -> dict:
    """Each request's end-to-end latency with the steps that started while it was in the engine
    (arrival to finish, ``spans``) priced at ``pred`` instead of ``meas``: its median and p90 relative
    error against the measured latency."""
    shifted = np.concatenate(([0.0], np.cumsum(pred - meas)))  # priced - measured, up to each step
    err = []
    for arrival, finish in spans.values():
        if finish is None or finish <= arrival:
            continue
        i, j = np.searchsorted(starts, arrival, "left"), np.searchsorted(starts, finish, "left")
        err.append(abs(shifted[j] - shifted[i]) / (finish - arrival))
    if not err:
        return {"median_rel_err": 0.0, "p90_rel_err": 0.0}
    return {"median_rel_err": float(np.median(err)), "p90_rel_err": float(np.percentile(err, 90))}


def reference_baseline(cost: LinearStepCost) -> Optional[float]:
    """What the reference step (``reference_steps``) takes on the machine ``cost`` describes: the
    profile's own price of the calibration's reference steps (``reference_step_priced_s``: the fit of
    every step timed, where one timing of 31 steps carries that moment's scatter), or, for a profile
    without it, their measured median (``reference_step_s``); None for a profile timed without them."""
    return cost.info.get("reference_step_priced_s") or cost.info.get("reference_step_s")


def scaled(cost: LinearStepCost, factor: float) -> LinearStepCost:
    """``cost`` with every term ``factor`` times as long (``info`` kept, with ``scale``: ``factor``):
    the profile of a machine whose every step runs that much slower (``factor`` > 1) or faster."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"scaled: factor={factor!r}; a step's time scales by a positive number")
    stderr = {t: v * factor for t, v in cost.stderr.items()}
    return LinearStepCost({t: v * factor for t, v in cost.seconds.items()}, stderr, info=dict(cost.info, scale=factor))


def _load_average() -> Optional[list]:
    """The machine's load average over 1, 5 and 15 minutes (None where the system does not say)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _mean_waiting(records) -> float:
    return float(np.mean([len(rec.waiting) for rec in records])) if records else 0.0


# ---------------------------------------------------------------------------------------------------------
# All three: the command
# ---------------------------------------------------------------------------------------------------------


def calibrate(
    out: Optional[str] = None,
    model: Optional[str] = None,
    *,
    budget_s: float = 40.0,
    validate: bool = True,
    traces: Optional[dict] = None,
    seed: int = 0,
    grid=GRID,
    calibration_traces=TRACES,
    rounds: int = 3,
    clock: str = "wall",
    pin: bool = True,
    progress: Optional[Callable[[str], None]] = print,
    **config,
) -> tuple[LinearStepCost, dict]:
    """Measure, fit, and (``validate``) compare on ``traces`` ({name: (trace, engine settings)}; default
    ``validation_traces(seed)``), each run ``rounds`` times on the real engine; ``grid`` and
    ``calibration_traces`` are what ``measure_steps`` times. ``clock``: the real engine's clock for the
    timing and the real runs alike, "wall" or "cpu" (``ProcessClock``, a CPU engine on a shared machine);
    ``pin``: all of it on one core (``pinned_to_one_core``). ``config``: ``EngineConfig`` fields for
    every engine (``device="cuda"`` calibrates a GPU, on the wall clock). The report holds
    ``calibration_s``, the profile, ``held_out`` (``held_out_errors``: each calibration trace predicted
    by a fit without it), the machine's load average when it started and ended (``load_average``), and,
    per trace, ``compare_on_trace``'s report.
    Returns ``(cost_model, report)``; with ``out``, writes the profile and the report there."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"calibrate: clock={clock!r}; the real engine runs on 'wall' or 'cpu'")
    with pinned_to_one_core() if pin else contextlib.nullcontext() as core:
        cost, report = _calibrate_here(model, budget_s, seed, grid, calibration_traces, progress, core, clock, config)
        if validate:
            report["traces"] = _validate(cost, model, traces, seed, rounds, progress, dict(config, clock=clock))
    report["load_average"]["end"] = _load_average()
    if out is not None:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        profile = path / f"step-cost-{cost.info['machine']}.json"
        cost.save(profile)
        (path / f"calibration-{cost.info['machine']}.json").write_text(json.dumps(report, indent=1) + "\n")
        if progress is not None:
            progress(f"calibrate: wrote {profile} (CostModel.from_profile loads it) and the report beside it")
    return cost, report


def _calibrate_here(model, budget_s, seed, grid, calibration_traces, progress, core, clock, config):
    """``calibrate``'s first two parts: the steps timed and the terms fitted; (cost model, report)."""
    import torch

    say = progress or (lambda _msg: None)
    info = {
        "machine": machine_name(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": clock,
        "core": core,
        "model": model or "shipped",
        "date": time.strftime("%Y-%m-%d"),
    }
    load_start = _load_average()
    t0 = time.perf_counter()
    say(
        f"calibrate: timing the real engine's steps on {info['machine']} (at most {budget_s:.0f} s; "
        f"{info['clock']} clock, core {core}, load average {load_start})"
    )
    samples = measure_steps(
        model, budget_s=budget_s, seed=seed, grid=grid, traces=calibration_traces, clock=clock, **config
    )
    info["calibration_s"] = time.perf_counter() - t0
    info["steps_after_idle"] = sum(s.after_idle for s in samples)
    info["reference_step_s"] = float(np.median([s.seconds for s in samples if s.workload == "reference"]))
    cost = fit_step_cost(samples, info=info)
    reference = [s for s in samples if s.workload == "reference"]
    cost.info["reference_step_priced_s"] = float(np.median([predicted_seconds(cost, s) for s in reference]))
    held_out = held_out_errors(samples)
    del samples  # thousands of objects the garbage collector would walk
    say(
        f"calibrate: {cost.info['num_steps']} steps in {info['calibration_s']:.1f} s; fit within "
        f"{cost.info['fit_median_rel_err']:.1%} (median), {cost.info['fit_p90_rel_err']:.1%} (p90) per step"
    )
    for term in STEP_TERMS:
        say(f"    {term:<16} {cost.seconds[term] * 1e6:12.4f} us  (+/- {cost.stderr.get(term, 0) * 1e6:.4f})")
    for name, h in held_out.items():
        say(
            f"    {name} left out of the fit: its {h['num_steps']} steps modeled {h['total_rel_err']:+.1%} in total, "
            f"{h['median_rel_err']:.1%} (median) / {h['p90_rel_err']:.1%} (p90) per step"
        )
    report: dict[str, Any] = {
        "calibration_s": info["calibration_s"],
        "profile": cost.to_profile(),
        "held_out": held_out,
        "clock": info["clock"],
        "core": core,
        "load_average": {"start": load_start},
        "traces": {},
    }
    return cost, report


def _validate(cost, model, traces, seed, rounds, progress, config) -> dict:
    """``calibrate``'s third part: every validation trace on the real engine and on the simulator."""
    say = progress or (lambda _msg: None)
    reports = {}
    for name, (trace, settings) in (validation_traces(seed) if traces is None else traces).items():
        say(
            f"calibrate: trace '{name}' ({len(trace)} requests) on the real engine ({rounds} rounds), "
            "then on the simulator"
        )
        r = reports[name] = compare_on_trace(cost, trace, model, rounds=rounds, **{**config, **settings})
        say(
            f"    {name}: e2e {r['e2e']['median_rel_err']:.1%} median / {r['e2e']['p90_rel_err']:.1%} p90, "
            f"TTFT {r['ttft']['median_rel_err']:.1%} / {r['ttft']['p90_rel_err']:.1%}, "
            f"TPOT {r['tpot']['median_rel_err']:.1%} / {r['tpot']['p90_rel_err']:.1%}; steps "
            f"{r['steps']['measured']} measured, {r['steps']['modeled']} modeled; {r['preemptions']} "
            f"preemptions measured, {r['preemptions_modeled']} modeled; busy "
            f"{r['utilisation']['measured']:.0%} measured, {r['utilisation']['modeled']:.0%} modeled, "
            f"{r['mean_waiting']['measured']:.1f} / {r['mean_waiting']['modeled']:.1f} requests waiting; "
            f"two rounds' e2e differ by {r['e2e']['noise']:.1%} (median) / {r['e2e']['noise_p90']:.1%} (p90); "
            f"every step 1% longer moves e2e {r['e2e']['sensitivity']:.2f}%; the machine's reference step "
            + (
                f"{r['drift']:+.1%} against the calibration's, {r['drift_priced']:+.1%} against the profile's price"
                if r["drift"] is not None
                else "not timed"
            )
        )
    return reports
