"""Benchmarks: ``python -m minillm.bench NAME [--size tiny|small|full] [--out DIR]``.

Each benchmark measures the sides it compares in one run, prints a markdown table,
the machine and the command that reproduces it, and writes ``DIR/NAME-SIZE.json``:

* ``throughput``: continuous batching vs transformers' static ``generate`` (and
  transformers' own continuous batching), output tokens/s on a long-tail trace.
* ``sched-overhead``: time of one scheduling pass vs running / waiting requests, and the
  scheduler + batch-preparation share of a real step at batch 64.
* ``paging``: max-length reservation vs paged KV on one trace and one capacity.
* ``prefix``: prefill computed and TTFT with and without prefix caching.
* ``sim-scale``: the simulated executor on 10,000 requests of a 70B-shaped model.
* ``kv-quant``: the shipped model's held-out loss and greedy agreement with float32, float16,
  int8 and fp8 KV caches, and the KV blocks each buys in the same memory.
* ``serve``: a load generator for an OpenAI-compatible server (``--url``, ``--trace``, ``--rate``):
  TTFT/TPOT/ITL percentiles and goodput as the client sees them, beside the engine's own.
* ``router``: N simulated replicas behind round-robin, least-outstanding-tokens and prefix-aware
  routers on shared-prefix and multi-turn traces (100,000 requests each at ``--size full``).
* ``whatif``: CPU seconds of one redraw of the what-if widget per control change (engine,
  metrics, figures), and the engine's per-step KV record with and without per-request entries.
* ``calibrate``: the simulator's step cost fitted to this machine's real engine (a profile for
  ``CostModel.from_profile``), then checked: the same traces on both, modeled vs measured per request.
* ``vs-vllm``: minillm (both attention backends) and vLLM (``--vllm-python``, ``make vllm-env``)
  side by side, each in its own process on the same checkpoint and prompts: offline tokens/s,
  greedy exactness, the decode step's bytes over its time against the copy bandwidth, and the
  serving ratios (saturation throughput, TTFT, TPOT) of ``minillm serve`` and ``vllm serve``.
* ``all``: each of them at the chosen size.

Beside them, ``decode_timing`` (not a command): decode step time against batch size,
measured with repeats so that a noisy machine shows (notebook 01, section 2).
"""

from __future__ import annotations

import importlib
import importlib.util

# name on the command line -> module in this package (each has ``main(args)``)
BENCHMARKS = {
    "throughput": "throughput",
    "sched-overhead": "sched_overhead",
    "paging": "paging",
    "prefix": "prefix",
    "sim-scale": "sim_scale",
    "kv-quant": "kv_quant",
    "serve": "serve",
    "router": "router",
    "whatif": "whatif",
    "calibrate": "calibrate",
    "vs-vllm": "vs_vllm",
}
if importlib.util.find_spec(f"{__name__}.spec") is not None:  # added by the speculative-decoding work
    BENCHMARKS["spec"] = "spec"


def get(name: str):
    """The module of benchmark ``name``."""
    return importlib.import_module(f"{__name__}.{BENCHMARKS[name]}")
