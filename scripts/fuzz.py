"""A long randomized differential campaign against the engine (``make fuzz``).

Runs ``tests/fuzz_engine.py``'s ``fuzz_run`` on successive seeds until ``--steps`` engine steps
have run (``--tp-share`` of the runs on 2 tensor-parallel ranks, ``--async-share`` through
``async_fuzz_run``), then prints what was covered (each feature's requests, quantized and
tensor-parallel runs, async streams), aborts, faults, mismatches, lost requests and leaks, and
the first problems found (each names its seed and configuration, so it can be replayed).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fuzz_engine import FuzzStats, async_fuzz_run, fuzz_run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000, help="stop after this many engine steps")
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--seed", type=int, default=1, help="first seed")
    ap.add_argument("--fault-rate", type=float, default=0.05)
    ap.add_argument("--abort-rate", type=float, default=0.03)
    ap.add_argument(
        "--tp-share",
        type=float,
        default=0.005,
        help="fraction of runs on 2 tensor-parallel ranks (each starts 2 processes: slow)",
    )
    ap.add_argument("--async-share", type=float, default=0.05, help="fraction of runs through AsyncLLM")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and leaves the other core free
    total = FuzzStats()
    t0 = time.perf_counter()
    seed = args.seed
    with tqdm(total=args.steps, unit="step") as bar:
        while total.steps < args.steps:
            kind = random.Random(f"kind {seed}").random()
            if kind < args.async_share:
                s = async_fuzz_run(seed)
            else:
                s = fuzz_run(
                    seed,
                    num_requests=args.requests,
                    fault_rate=args.fault_rate,
                    abort_rate=args.abort_rate,
                    tensor_parallel=kind > 1 - args.tp_share,
                )
            total.add(s)
            bar.update(s.steps)
            bar.set_postfix(runs=total.runs, mismatches=total.mismatches, lost=total.lost, leaks=total.leaks)
            seed += 1
    print(f"seeds {args.seed}..{seed - 1}: {total.line()} ({time.perf_counter() - t0:.0f} s)")
    for p in total.problems[:10]:
        print("  " + p[:1000])
    return 1 if total.problems else 0


if __name__ == "__main__":
    sys.exit(main())
