"""Two checkouts' simulators side by side in one process, so a busy machine slows both alike.

    python scripts/sim_ab.py A B [--chunk 100] [--requests 10000]

A and B are checkouts (directories holding ``minillm/``). Each engine is copied under its own
package name (``minillm_a``, ``minillm_b``) into a temporary directory, both are built on the
``sim-scale`` trace (10,000 requests, Llama-2-70B's shape on four modeled H100s, max batch 256,
``record="none"``, the collector paused), and they step in alternating chunks of ``--chunk``
steps; each chunk's ``time.process_time`` is charged to its engine. Prints both totals and B/A.
Both must take the same steps to the same modeled time (the same decisions), or it says so.
An engine against itself gives 0.99-1.00.

``--a-record summary`` records A's steps as commit 330a5d0's ``sim-scale`` did (a ``StepSummary`` per
step), so that checkout can be A; the collector stays paused for both (that command left it on):

    python scripts/sim_ab.py <checkout of 330a5d0> . --a-record summary
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import shutil
import sys
import tempfile
import time


def build(package: str, num_requests: int, record: str = "none"):
    llm = importlib.import_module(package)
    sim_scale = importlib.import_module(f"{package}.bench.sim_scale")
    try:
        workloads = importlib.import_module(f"{package}.analysis.workloads")
    except ImportError:  # a checkout from before the sub-packages
        workloads = importlib.import_module(f"{package}.workloads")
    engine = llm.LLM(
        "random",
        executor="simulated",
        clock="modeled",
        cost_model=sim_scale.four_h100(),
        max_num_seqs=256,
        max_model_len=4096,
        max_num_batched_tokens=8192,
        record=record,
        record_history=0,
    ).engine
    trace = workloads.synthetic_trace(
        num_requests,
        rate=20.0,
        prompt_len=workloads.LogNormal(400, 1.0, 8, 2048),
        output_len=workloads.LogNormal(200, 1.0, 4, 1024),
        seed=0,
    )
    workloads.submit_trace(engine, trace, vocab_size=engine.vocab_size)
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="checkout A (the reference)")
    p.add_argument("b", help="checkout B")
    p.add_argument("--chunk", type=int, default=100, help="steps each engine takes before the other's turn")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--a-record", default="none", help="A's EngineConfig.record (B's is none)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for checkout, name in ((args.a, "minillm_a"), (args.b, "minillm_b")):
            shutil.copytree(
                os.path.join(checkout, "minillm"), os.path.join(tmp, name), ignore=shutil.ignore_patterns("__pycache__")
            )
        sys.path.insert(0, tmp)
        engines = [build("minillm_a", args.requests, args.a_record), build("minillm_b", args.requests)]
        cpu = [0.0, 0.0]
        gc.disable()
        while any(e.has_unfinished_requests() for e in engines):
            for i, e in enumerate(engines):
                c0 = time.process_time()
                for _ in range(args.chunk):
                    if not e.has_unfinished_requests():
                        break
                    e.step()
                cpu[i] += time.process_time() - c0
        gc.enable()
    a, b = engines
    same = a.step_count == b.step_count and a.clock.now() == b.clock.now()
    print(
        f"A {cpu[0]:.2f} s CPU, B {cpu[1]:.2f} s CPU: B/A {cpu[1] / cpu[0]:.3f}, A/B {cpu[0] / cpu[1]:.2f} "
        f"({a.step_count} steps"
        + (")" if same else f"; B took {b.step_count} steps to {b.clock.now():.3f} s: not the same decisions)")
    )


if __name__ == "__main__":
    main()
