"""``python -m minillm.bench NAME [--size tiny|small|full] [--out DIR]`` (see ``minillm.bench``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from . import BENCHMARKS, get
from .common import SIZES


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minillm.bench", description=__doc__)
    p.add_argument("name", choices=sorted(BENCHMARKS) + ["all"], help="which benchmark ('all' runs each)")
    p.add_argument(
        "--size",
        choices=SIZES,
        default="full",
        help="tiny: seconds (the smoke test); small: a minute or so; full: the numbers we quote",
    )
    p.add_argument("--out", default="bench_results", help="directory for the JSON results")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (benchmarks with a real model)")
    p.add_argument("--seed", type=int, default=0, help="seeds the traces")
    p.add_argument(
        "--model",
        default="shipped",
        choices=("shipped", "qwen3-0.6b"),
        help="throughput: the shipped model, or a random Qwen3-0.6B-shaped checkpoint (for a GPU)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="throughput: measure every side this many times, in alternating rounds, and "
        "report medians (wall times on a shared machine drift between runs)",
    )
    # A benchmark with options of its own (serve: --url, --trace, --rate, ...) adds them.
    words = sys.argv[1:] if argv is None else list(argv)
    name = next((w for w in words if w in BENCHMARKS), None)
    own = getattr(get(name), "add_arguments", None) if name is not None else None
    if own is not None:
        own(p.add_argument_group(f"{name} options"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark(s); returns {name: result dict}. Exit status 1 if one failed."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse(argv)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    results, failed = {}, []
    t0 = time.perf_counter()
    for name in names:
        try:
            results[name] = get(name).main(args)
        except Exception:
            if len(names) == 1:
                raise
            traceback.print_exc()
            failed.append(name)
    if len(names) > 1:
        print(
            f"\nall: {len(names) - len(failed)}/{len(names)} benchmarks ran in "
            f"{time.perf_counter() - t0:.0f}s" + (f"; failed: {', '.join(failed)}" if failed else "")
        )
    if failed:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
