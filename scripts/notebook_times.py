"""Run the course's notebooks the way the tests do and print how long each took, and its slowest cells.

    python scripts/notebook_times.py                      # every notebook in notebooks/
    python scripts/notebook_times.py notebooks/03_*.ipynb  # some of them

Each notebook runs in a fresh kernel (nbclient), with ``MINILLM_IMPL=solutions``, the Hugging Face hub
offline and one torch thread, as ``tests/test_notebooks.py`` runs it. Per cell, the wall time and the CPU
time of the kernel are printed for the slowest three; the CPU time is what the notebook costs on a quiet
machine. The 1-minute load average before and after says whether the machine was quiet (load at most the
number of cores) or shared, in which case wall times overstate the notebook's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
import psutil
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


class TimedClient(NotebookClient):
    """A client that records each code cell's wall time and the kernel's CPU time spent in it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cell_times: list[tuple[int, float, float]] = []  # (cell index, wall s, kernel CPU s)

    def _kernel_cpu(self) -> float:
        """CPU seconds the kernel process has used so far (all its threads, and its children)."""
        t = psutil.Process(self.km.provisioner.pid).cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
        if cell.cell_type != "code":
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
        cpu0, t0 = self._kernel_cpu(), time.monotonic()
        out = await super().async_execute_cell(cell, cell_index, *args, **kwargs)
        wall, cpu = time.monotonic() - t0, self._kernel_cpu() - cpu0
        self.cell_times.append((cell_index, wall, cpu))
        return out


def run(path: Path, timeout: int) -> TimedClient:
    nb = nbformat.read(path, as_version=4)
    env = dict(
        os.environ,
        MINILLM_IMPL="solutions",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
    )
    client = TimedClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env, cwd=str(path.parent))
    return client


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path)
    ap.add_argument("--timeout", type=int, default=600, help="seconds one cell may take before the run stops")
    args = ap.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
    cores = os.cpu_count() or 1
    print(f"{len(paths)} notebooks, {cores} cores, load {os.getloadavg()[0]:.1f} (1-minute average)")
    for path in paths:
        t0 = time.monotonic()
        client = run(path, args.timeout)
        wall = time.monotonic() - t0
        cpu = sum(c for _, _, c in client.cell_times)
        slow = sorted(client.cell_times, key=lambda t: -t[2])[:3]
        cells = ", ".join(f"cell {i}: {w:.1f} s wall / {c:.1f} s CPU" for i, w, c in slow)
        print(
            f"{path.name}: {wall:.1f} s wall, {cpu:.1f} s kernel CPU; slowest {cells}; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
