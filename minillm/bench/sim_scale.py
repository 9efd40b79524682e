"""sim-scale: the simulated executor on 10,000 requests of a 70B-shaped model.

No model runs: the same scheduler and paged KV manager as the real engine, a
placeholder token per sampled position, and a modeled clock that advances by what a
roofline says Llama-2-70B would take per step. What this measures is the engine's own
cost per step (scheduling, KV bookkeeping, applying results, the ``StepRecord``), in
wall seconds and steps per second. Llama-2-70B's bf16 weights (138 GB) do not fit one
80 GB H100, so the modeled device is four H100-SXM seen as one (4x FLOP/s, bandwidth and
memory, as tensor parallelism would give, communication ignored).
"""

from __future__ import annotations

import time
from dataclasses import replace

from .common import finish, goal, pick, progress, set_threads, table

NAME = "sim-scale"


def _sizes(size: str) -> dict:
    return pick(size, tiny=dict(n=200), small=dict(n=2000), full=dict(n=10000))


def four_h100():
    from ..costmodel import HARDWARE, MODELS, RooflineCostModel
    hw = HARDWARE["H100-SXM"]
    hw4 = replace(hw, name="4xH100-SXM", peak_flops=4 * hw.peak_flops, hbm_bandwidth=4 * hw.hbm_bandwidth,
                  hbm_bytes=4 * hw.hbm_bytes)
    return RooflineCostModel(hw4, MODELS["llama-2-70b"])


def run(args) -> dict:
    from .. import LLM
    from ..workloads import LogNormal, submit_trace, synthetic_trace
    P = _sizes(args.size)
    set_threads(args)
    cm = four_h100()
    rate = 20.0
    cfg = dict(n=P["n"], model="llama-2-70b (shape only)", hardware=cm.hardware.name, arrivals=f"Poisson {rate}/s",
               prompt_len=repr(LogNormal(400, 1.0, 8, 2048)), output_len=repr(LogNormal(200, 1.0, 4, 1024)),
               max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096,
               record="summary", record_history=0)
    t_build = time.perf_counter()
    llm = LLM("random", executor="simulated", clock="modeled", cost_model=cm, max_num_seqs=256,
              max_model_len=4096, max_num_batched_tokens=8192, record="summary", record_history=0)
    e = llm.engine
    trace = synthetic_trace(P["n"], rate=rate, prompt_len=LogNormal(400, 1.0, 8, 2048),
                            output_len=LogNormal(200, 1.0, 4, 1024), seed=args.seed)
    submit_trace(e, trace, vocab_size=e.vocab_size, seed=args.seed)
    t_submit = time.perf_counter() - t_build
    bar = progress(P["n"], "simulated", "req")
    finished = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while e.has_unfinished_requests():
        rec = e.step()
        if rec.finished:
            finished += len(rec.finished)
            bar.update(len(rec.finished))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    bar.close()
    steps = e.step_count
    out_tokens = sum(r.output_len for r in trace)
    res = dict(requests=P["n"], finished=finished, steps=steps, wall_s=wall, cpu_s=cpu,
               steps_per_s=steps / wall, steps_per_cpu_s=steps / cpu, us_per_step=1e6 * wall / steps,
               submit_s=t_submit, modeled_s=e.clock.now(), output_tokens=out_tokens,
               modeled_output_tok_per_s=out_tokens / e.clock.now(),
               sim_speedup=e.clock.now() / wall, kv_blocks=e.num_kv_blocks,
               preemptions=e.stats()["preemptions_recompute"] + e.stats()["preemptions_swap"])
    t = table(["requests", "steps", "wall (s)", "CPU (s)", "steps/s", "us/step", "modeled time (s)",
               "modeled / wall", "build + submit (s)"],
              [[P["n"], steps, wall, cpu, res["steps_per_s"], res["us_per_step"], res["modeled_s"],
                res["sim_speedup"], t_submit]],
              title=f"simulated executor, llama-2-70b on modeled {cm.hardware.name}, Poisson {rate:g} req/s, "
                    f"max batch 256")
    goals = [goal("every request finishes", f"{P['n']}", finished, finished == P["n"])]
    return dict(config=cfg, results=res, goals=goals, _tables=[t])


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
