"""CPU seconds of the simulator's stepping loop alone: the ``sim-scale`` trace (10,000 requests,
Llama-2-70B's shape on four modeled H100s, max batch 256), ``engine.step()`` until every request is
done, timed with ``time.process_time`` (a shared machine cannot inflate it the way it does wall time).

    python scripts/sim_loop_cpu.py                        # record="none", garbage collector paused
    python scripts/sim_loop_cpu.py --record summary --gc  # how commit 330a5d0's sim-scale stepped

Run it with ``PYTHONPATH`` pointing at another checkout to time that one on the same trace; the
printed steps, modeled time and TTFT sum must agree (the same decisions). ``--profile OUT`` writes a
cProfile of the loop (``python -m pstats OUT``).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import minillm
from minillm import LLM
from minillm.bench.sim_scale import four_h100

# (by directory, not by trying the import: an editable install of this checkout would answer
# ``minillm.analysis`` from here while ``minillm`` comes from the older one)
if os.path.isdir(os.path.join(os.path.dirname(minillm.__file__), "analysis")):
    from minillm.analysis.workloads import LogNormal, submit_trace, synthetic_trace
else:  # a checkout from before the sub-packages (PYTHONPATH on an older commit)
    from minillm.workloads import LogNormal, submit_trace, synthetic_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--record", default="none", help="EngineConfig.record: none, summary or full")
    p.add_argument("--gc", action="store_true", help="leave the cyclic garbage collector on")
    p.add_argument("--profile", default=None, help="write a cProfile of the loop to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    engine = LLM(
        "random",
        executor="simulated",
        clock="modeled",
        cost_model=four_h100(),
        max_num_seqs=256,
        max_model_len=4096,
        max_num_batched_tokens=8192,
        record=args.record,
        record_history=0,
    ).engine
    trace = synthetic_trace(
        args.requests,
        rate=20.0,
        prompt_len=LogNormal(400, 1.0, 8, 2048),
        output_len=LogNormal(200, 1.0, 4, 1024),
        seed=0,
    )
    submit_trace(engine, trace, vocab_size=engine.vocab_size)
    if not args.gc:
        gc.disable()
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    c0 = time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    cpu = time.process_time() - c0
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    ttft = sum(r.metrics.ttft for r in engine.requests.values())
    print(
        f"{engine.step_count} steps, {sum(r.is_finished for r in engine.requests.values())} finished, "
        f"modeled {engine.clock.now():.3f} s, TTFT sum {ttft:.6f} s: loop {cpu:.2f} s CPU"
    )


if __name__ == "__main__":
    main()
