"""The simulated executor: the same scheduler and memory manager, no model.

``executor="simulated"`` skips the forward pass and emits a placeholder token
for every request that would sample one; each request ends at its trace
output length (``expected_output_len``, finish reason "stop", as if the model
had emitted EOS there) or at ``max_tokens``, whichever comes first. A
``max_tokens`` above the true length is what a max-length reservation pays for. Paired with ``clock="modeled"`` it
replays thousands of requests of a 70B-shaped model on modeled H100s in
seconds, which is how the notebooks explore load curves at realistic scale.

Only the model's *shape* matters: ``model="llama-2-70b"`` (a preset of
``costmodel.MODELS``), the tiny ``"random"`` Llama, or a checkpoint directory
(its config.json). When the cost model carries its own ``ModelSpec``
(``RooflineCostModel(hardware, "llama-2-70b")``), that shape sizes the KV cache
(``kv_capacity_tokens``), prices every step, swap and preemption.

``simulate(trace, ...)`` wires it all up for a notebook: one call, a trace in,
``(engine, summary)`` out::

    from minillm.sim.simulated import simulate
    from minillm.analysis.workloads import synthetic_trace, LogNormal
    trace = synthetic_trace(10_000, rate=20, prompt_len=LogNormal(128, 1.0, 4, 2048),
                            output_len=LogNormal(128, 0.9, 4, 1024))
    engine, summary = simulate(trace, model="llama-2-70b", hardware="H100-SXM")   # 4 x H100
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

from .step_summary import StepSummary  # (what a long run keeps per step)

__all__ = ["simulate", "tensor_parallel", "tp_step_times", "gpus_needed", "StepSummary", "gc_paused"]

# =====================================================================================
# Hardware for a model that does not fit one GPU
# =====================================================================================


def tensor_parallel(hardware, num_gpus: int, link=None):
    """``num_gpus`` GPUs serving one model copy, as one bigger device.

    FLOP/s, HBM bandwidth, HBM capacity and PCIe links add up. Two variants:

    * ``link=None`` (ideal tensor parallelism): the all-reduce traffic between GPUs is not
      modeled, an optimistic bound;
    * ``link="NVLink" | "PCIe" | "InfiniBand"`` (a ``costmodel.LINKS`` preset or a
      ``LinkSpec``): ``RooflineCostModel`` adds two all-reduces per layer of the step's
      activations over that link (``RooflineCostModel.allreduce_time``), which is where TP
      stops paying: the all-reduce shrinks only as 2(N-1)/N while compute and weight reads
      shrink as 1/N.
    """
    from .costmodel import get_hardware, get_link

    hw = get_hardware(hardware)
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus!r}: must be an integer >= 1")
    link = get_link(link)
    if num_gpus == 1:
        return hw
    suffix = "" if link is None else f" over {link.name}"
    return replace(
        hw,
        name=f"{num_gpus}x{hw.name}{suffix}",
        peak_flops=hw.peak_flops * num_gpus,
        hbm_bandwidth=hw.hbm_bandwidth * num_gpus,
        hbm_bytes=hw.hbm_bytes * num_gpus,
        pcie_bandwidth=hw.pcie_bandwidth * num_gpus,
        tp_size=num_gpus,
        link=link,
    )


def tp_step_times(
    hardware, model, sizes=(1, 2, 4, 8), link=None, *, num_new_tokens=(1,), context_lens=(1024,), **roofline
) -> list[float]:
    """Modeled seconds of one step (``num_new_tokens`` / ``context_lens`` per request, as
    ``CostModel.step_time``) at each tensor-parallel size in ``sizes`` over ``link``
    (None: ideal). The TP curve of the notebook: speedup = times[0] / times[i]."""
    from .costmodel import RooflineCostModel

    out = []
    for n in sizes:
        cm = RooflineCostModel(tensor_parallel(hardware, int(n), link), model, **roofline)
        out.append(cm.step_time(list(num_new_tokens), list(context_lens)))
    return out


def gpus_needed(hardware, model, max_weight_fraction: float = 0.5) -> int:
    """The smallest of 1, 2, 4, 8 GPUs on which the weights take at most ``max_weight_fraction``
    of memory (the rest is KV cache): Llama-2-70B (138 GB of bf16) on 80 GB H100s -> 4."""
    from .costmodel import get_hardware, get_model_spec

    hw, m = get_hardware(hardware), get_model_spec(model)
    for n in (1, 2, 4, 8):
        if m.weight_bytes <= max_weight_fraction * n * hw.hbm_bytes:
            return n
    return 8


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block, restored after.

    A simulation allocates millions of small, short-lived, acyclic objects (requests and their
    token lists, batch entries, KV records, step summaries): the collector finds nothing to free
    in them yet costs ~40% of the stepping and of submitting a trace, and a full collection over
    a large heap right after one (while the metrics or the figures are built) takes a few tenths
    of a second. Reference counting still frees everything that is not in a cycle."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# =====================================================================================
# simulate(): a trace in, (engine, summary) out
# =====================================================================================


def simulate(
    trace: Sequence,
    *,
    model: str = "llama-2-70b",
    hardware: Any = "H100-SXM",
    num_gpus: Optional[int] = None,
    cost_model: Any = None,
    records: Union[str, bool] = "auto",
    progress: Optional[Callable] = None,
    on_finished: Optional[Callable[[int], None]] = None,
    slo_ttft: Optional[float] = None,
    slo_tpot: Optional[float] = None,
    max_waiting_entries: Optional[int] = 32,
    fast_forward: bool = True,
    **config,
) -> tuple:
    """Replay ``trace`` (a list of ``workloads.TraceRequest``) on the simulated executor with a
    modeled clock; returns ``(engine, summary)``, ``summary`` being ``metrics.summarize``'s dict
    plus ``wall_time`` (seconds this call took), ``cpu_time`` (its CPU seconds), ``step_cpu_time`` (the
    CPU seconds of stepping the engine, the rest being building it, submitting the trace and the
    metrics), ``num_gpus`` and ``cost_model`` (its name).

    * ``model``: whose shape to simulate: a preset of ``costmodel.MODELS`` (default
      "llama-2-70b"), "random", or a checkpoint directory.
    * ``hardware`` / ``num_gpus``: the roofline's accelerator; ``num_gpus=None`` takes
      ``gpus_needed`` (4 H100s for 70B) joined by ``tensor_parallel``. A ``cost_model``
      (any ``CostModel``, e.g. ``ConstantStepTime(0.010)``) replaces both.
    * ``records``: "full" keeps every ``StepRecord`` (``engine.step_records``, for the
      widgets), "summary" keeps a ``StepSummary`` per step (``engine.step_summaries``; the
      engine runs with ``record="totals"``: the KV counts, no entry per request),
      "auto" is "full" up to 2,000 requests; ``False`` keeps nothing per step (the engine
      runs with ``record="none"``: no KV snapshot, no batch entries; the metrics are the same).
    * ``progress``: called with each step's ``StepRecord``; ``on_finished``: called after each step that
      finished requests, with how many it finished (all a progress bar needs: with no ``progress``,
      fast-forward makes no record of a step where nothing but decoding happens).
    * ``max_waiting_entries``: at most this many waiting requests get a reason in each
      record (a queue of thousands would otherwise cost O(queue) objects per step).
    * ``fast_forward``: with ``records=False`` or ``"summary"``, step the engine with
      ``minillm/sim/fast_forward.py`` (per-request work only at events: a block boundary, a possible
      stop, a prompt chunk, an admission) where the configuration is the one it covers: the same
      decisions, clock, metrics, step summaries and records passed to ``progress``; ``False`` calls
      ``engine.step()`` for every step.
    * every other keyword is an ``EngineConfig`` field (``policy="sjf"``,
      ``max_num_seqs=...``); defaults here: ``max_num_seqs=256``,
      ``max_num_batched_tokens=8192``, ``max_model_len`` long enough for the trace.
    """
    from .costmodel import MODELS, RooflineCostModel
    from .fast_forward import FastForward
    from ..config import EngineConfig
    from ..engine import LLMEngine
    from ..analysis.metrics import summarize
    from ..analysis.workloads import submit_trace

    t0, c0 = time.perf_counter(), time.process_time()
    trace = list(trace)
    if cost_model is None:
        if model in MODELS:
            num_gpus = num_gpus or gpus_needed(hardware, model)
            cost_model = RooflineCostModel(tensor_parallel(hardware, num_gpus), MODELS[model])
        else:  # "random" or a checkpoint: the engine prices its own shape
            num_gpus = num_gpus or 1
            cost_model = tensor_parallel(hardware, num_gpus)
    longest = max((r.prompt_len + r.output_len for r in trace), default=0)
    config.setdefault("max_num_seqs", 256)
    config.setdefault("max_num_batched_tokens", 8192)
    config.setdefault("max_model_len", max(2048, longest + 1))
    config.update(executor="simulated", clock="modeled", cost_model=cost_model)
    mode = records
    if mode == "auto":
        mode = "full" if len(trace) <= 2000 else "summary"
    if mode not in ("full", "summary", True, False, None):
        raise ValueError(f"simulate(records={records!r}): 'auto', 'full', 'summary' or False")
    keep = mode in ("full", True)
    config.setdefault("record_history", None if keep else 0)  # keep every record, or none
    config.setdefault("record_max_waiting", max_waiting_entries)
    if not keep:  # KV counts only, no per-request entry nobody keeps; records off: no record
        config.setdefault("record", "totals" if mode == "summary" else "none")
    engine = LLMEngine(model, EngineConfig.from_fields("simulate", **config))
    summaries = engine.step_summaries
    keep_summary = mode == "summary"

    def on_step(rec):
        if keep_summary:
            summaries.append(StepSummary.from_record(rec, len(engine.scheduler.waiting)))
        if progress is not None:
            progress(rec)
        if on_finished is not None and rec.finished:
            on_finished(len(rec.finished))

    with gc_paused():  # submitting, stepping and the metrics make no cycles worth a collection
        submit_trace(engine, trace, vocab_size=engine.vocab_size)
        c_steps = time.process_time()
        # engine.run() without the list of every record; fast-forward where the configuration is the one it covers
        if fast_forward and FastForward.covers(engine):
            # (with no progress to show each record to, a quiet step's summary is made without one: it finishes nobody)
            FastForward(engine).run(on_step, summaries if keep_summary and progress is None else None)
        else:
            while engine.has_unfinished_requests():
                on_step(engine.step())
        step_cpu = time.process_time() - c_steps
        recs = engine.step_records if keep else summaries
        stats = engine.stats()
        prefix = stats["prefix_cache"] if engine.config.enable_prefix_caching else None
        summary = summarize(
            {rid: r.metrics for rid, r in engine.requests.items()},
            recs,
            slo_ttft=slo_ttft,
            slo_tpot=slo_tpot,
            max_num_seqs=engine.config.max_num_seqs,
            prefix_cache_stats=prefix,
        )
    summary["num_rejected_by_engine"] = stats["rejected"]
    summary["num_gpus"] = num_gpus
    summary["cost_model"] = getattr(engine.cost_model, "name", repr(engine.cost_model))
    summary["wall_time"] = time.perf_counter() - t0
    summary["cpu_time"] = time.process_time() - c0
    summary["step_cpu_time"] = step_cpu
    return engine, summary
