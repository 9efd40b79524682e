"""Fixed-seed simulations whose StepRecords and metrics pin the scheduler's decisions.

``python scripts/sim_fingerprint.py OUT.pkl`` runs a handful of configurations (FCFS, SJF,
priority with swap, MLFQ, fair queueing, chunked prefill on and off, a small KV cache that
forces preemption, prefix caching, load shedding) through ``simulate`` and pickles, per
configuration, every StepRecord as a plain dict and every request's metrics; with ``records=False``
(where ``simulate`` steps the engine with ``minillm/sim/fast_forward.py``) the records passed to
``progress``. Two such files compared key by key say whether a change to the simulated path changed any
decision.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys

import minillm

if os.path.isdir(os.path.join(os.path.dirname(minillm.__file__), "sim")):
    from minillm.sim.costmodel import ConstantStepTime
    from minillm.sim.simulated import simulate
    from minillm.analysis.workloads import LogNormal, shared_prefix_trace, synthetic_trace
else:  # a checkout from before the sub-packages (PYTHONPATH on an older commit)
    from minillm.costmodel import ConstantStepTime
    from minillm.simulated import simulate
    from minillm.workloads import LogNormal, shared_prefix_trace, synthetic_trace


TIMINGS = ("wall_time", "cpu_time", "step_cpu_time")  # the summary's own timings: left out


def _trace(n=400, rate=40.0, seed=3):
    return synthetic_trace(
        n,
        rate=rate,
        prompt_len=LogNormal(300, 1.0, 8, 1500),
        output_len=LogNormal(120, 1.0, 4, 600),
        priority_mix={0: 0.3, 1: 0.7},
        tenant_mix={"a": 0.6, "b": 0.4},
        seed=seed,
    )


CASES = {
    "fcfs": dict(policy="fcfs"),
    "fcfs-nochunk-small-kv": dict(policy="fcfs", enable_chunked_prefill=False, num_kv_blocks=600),
    "sjf-chunk-small-kv": dict(policy="sjf", num_kv_blocks=500, max_num_batched_tokens=1024),
    "priority-swap": dict(policy="priority", num_kv_blocks=500, preemption_mode="swap", num_swap_blocks=400),
    "mlfq": dict(policy="mlfq", num_kv_blocks=700),
    "fair": dict(policy="fair", max_num_seqs=32),
    "shed": dict(policy="fcfs", max_queue_len=20, max_queue_delay=3.0, num_kv_blocks=400),
    "prefill-priority": dict(interference="prefill-priority", num_kv_blocks=800),
    "decode-priority": dict(interference="decode-priority"),
}


OFF_CASES = {
    "fcfs": dict(policy="fcfs"),
    "fcfs-slow": dict(policy="fcfs"),
    "priority-swap-slow": dict(policy="priority", num_kv_blocks=500, preemption_mode="swap", num_swap_blocks=400),
    "small-kv-slow": dict(policy="fcfs", enable_chunked_prefill=False, num_kv_blocks=300),
    "sjf-slow": dict(policy="sjf", num_kv_blocks=700),
    "mlfq-slow": dict(policy="mlfq"),
    "decode-priority-slow": dict(interference="decode-priority"),
    "seats-slow": dict(max_num_seqs=8),
}


def _plain(x):
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x


def fingerprint() -> dict:
    out = {}
    trace = _trace()
    for name, cfg in CASES.items():
        eng, summ = simulate(trace, records="full", **cfg)
        out[name] = dict(
            records=[_plain(r) for r in eng.step_records],
            metrics={k: _plain(r.metrics) for k, r in eng.requests.items()},
            summary={k: v for k, v in summ.items() if k not in TIMINGS},
        )
    pre = shared_prefix_trace(
        300,
        256,
        LogNormal(64, 0.8, 4, 512),
        LogNormal(60, 0.8, 4, 300),
        vocab_size=32000,
        rate=30.0,
        num_prefixes=3,
        seed=5,
    )
    eng, summ = simulate(pre, records="full", enable_prefix_caching=True, num_kv_blocks=900)
    out["prefix"] = dict(
        records=[_plain(r) for r in eng.step_records],
        metrics={k: _plain(r.metrics) for k, r in eng.requests.items()},
        summary={k: v for k, v in summ.items() if k not in TIMINGS},
    )
    big = _trace(3000, rate=25.0, seed=7)
    for rec in ("summary", False):
        eng, summ = simulate(big, records=rec, num_kv_blocks=3000)
        out[f"big-{rec}"] = dict(
            records=[_plain(r) for r in eng.step_summaries],
            metrics={k: _plain(r.metrics) for k, r in eng.requests.items()},
            summary={k: v for k, v in summ.items() if k not in TIMINGS},
        )
    # records=False (where simulate steps with minillm/sim/fast_forward.py): the records passed to progress
    slow = _trace(400, rate=6.0, seed=9)
    for name, cfg in OFF_CASES.items():
        recs: list = []
        eng, summ = simulate(slow if name.endswith("-slow") else trace, records=False, progress=recs.append, **cfg)
        out[f"off-{name}"] = dict(
            records=[_plain(r) for r in recs],
            metrics={k: _plain(r.metrics) for k, r in eng.requests.items()},
            summary={k: v for k, v in summ.items() if k not in TIMINGS},
        )
    eng, summ = simulate(
        big[:1500], records="full", cost_model=ConstantStepTime(0.02), policy="sjf", num_kv_blocks=2000
    )
    out["const-sjf"] = dict(
        records=[_plain(r) for r in eng.step_records],
        metrics={k: _plain(r.metrics) for k, r in eng.requests.items()},
        summary={k: v for k, v in summ.items() if k not in TIMINGS},
    )
    return out


if __name__ == "__main__":
    with open(sys.argv[1], "wb") as f:
        pickle.dump(fingerprint(), f)
