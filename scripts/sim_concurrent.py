"""An older checkout's ``sim-scale`` command and this checkout's stepping loop at the same time, one per
core, so that whatever slows the shared machine in those minutes slows both.

    python scripts/sim_concurrent.py OLD [--rounds 3]

OLD is a checkout (e.g. ``git worktree add /tmp/base 330a5d0``). Each round runs ``python -m minillm.bench
sim-scale --size full --threads 1`` in OLD pinned to core 0 and, until it ends, ``scripts/sim_loop_cpu.py``
(this checkout's loop, ``record="none"``) again and again on core 1; it prints the old command's CPU
seconds (its JSON's ``cpu_s``: the stepping loop), the new loop's runs meanwhile and old / median(new).
Needs two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pinned(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="the older checkout (a directory holding minillm/)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    old = os.path.abspath(args.old)
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("sim_concurrent: needs two cores")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for r in range(1, args.rounds + 1):
        cmd = subprocess.Popen(
            [sys.executable, "-m", "minillm.bench", "sim-scale", "--size", "full", "--threads", "1"],
            cwd=old,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=pinned(0),
        )
        new = []
        while cmd.poll() is None:
            out = subprocess.run(
                [sys.executable, os.path.join(HERE, "scripts", "sim_loop_cpu.py")],
                cwd=HERE,
                env=env,
                capture_output=True,
                text=True,
                preexec_fn=pinned(1),
                check=True,
            ).stdout
            new.append(float(re.search(r"loop ([0-9.]+) s CPU", out).group(1)))
        if cmd.returncode != 0:
            sys.exit(f"sim_concurrent: the old command exited with {cmd.returncode}")
        with open(os.path.join(old, "bench_results", "sim-scale-full.json")) as f:
            before = json.load(f)["results"]["cpu_s"]
        after = statistics.median(new)
        print(
            f"round {r}: old command {before:.2f} s CPU; new loop meanwhile {', '.join(f'{x:.2f}' for x in new)} s "
            f"(median {after:.2f}): {before / after:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
