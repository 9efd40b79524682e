"""replay: a trace served by the simulated executor, as the notebooks read it.

The notebooks replay a trace under one configuration after another and compare the results. Each
replay is :func:`~minillm.sim.simulated.simulate` (the real scheduler and KV manager, no forward
pass, on the modeled clock) with the engine's own defaults for what the notebook does not set, a
``StepRecord`` kept for every step (without the per-block KV map: the views of a run read its totals),
and the requests' metrics by id beside the summary, so a cell can write ``eng, m, s = replay(...)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from ..config import EngineConfig
from .simulated import simulate

# The fields simulate() would default to its large-scale values; a replay keeps EngineConfig's.
# (max_model_len is simulate's: at least 2048, and long enough for the trace.)
ENGINE_DEFAULTS = ("max_num_seqs", "max_num_batched_tokens")


class Replay(NamedTuple):
    engine: Any  # the LLMEngine after the run: engine.step_records, engine.requests
    metrics: dict  # request id -> RequestMetrics
    summary: dict  # metrics.summarize's dict (and simulate's additions)


def replay(trace: Sequence, *, model: str = "llama-2-7b", cost_model: Any = "H100-SXM", **config) -> Replay:
    """Serve ``trace`` (``workloads.TraceRequest``s) on the simulated executor with the modeled clock of
    ``cost_model`` (a hardware name priced for ``model``, a ``CostModel``, or seconds per step).
    ``model``: whose shape ("llama-2-7b", "random", ...); every other keyword is an ``EngineConfig``
    field (``policy="sjf"``, ``num_kv_blocks=1024``), unset ones at ``EngineConfig``'s defaults but
    ``max_model_len`` (at least 2048, and long enough for the trace's longest request)."""
    for name in ENGINE_DEFAULTS:
        config.setdefault(name, EngineConfig.__dataclass_fields__[name].default)
    config.setdefault("record", "summary")  # a StepRecord per step, without the per-block KV map
    engine, summary = simulate(
        trace,
        model=model,
        cost_model=cost_model,
        records="full",
        max_waiting_entries=EngineConfig.__dataclass_fields__["record_max_waiting"].default,
        **config,
    )
    return Replay(engine, {rid: r.metrics for rid, r in engine.requests.items()}, summary)
