"""Serving metrics, computed from what the engine recorded.

| Metric          | Definition                                  | Here                              |
|-----------------|---------------------------------------------|-----------------------------------|
| Throughput      | tokens generated per second, system-wide    | ``output_throughput``             |
| TTFT            | time to first token                         | ``ttft_mean/p50/p90/p99``         |
| TPOT            | time per output token                       | ``tpot_*`` (and ``itl_*``)        |
| Batch occupancy | average active slots vs. maximum            | ``batch_occupancy``               |
| Queue wait time | admission delay                             | ``queue_wait_*``                  |
| Preemption rate | evictions per unit time                     | ``preemption_rate``               |
| Goodput         | throughput meeting latency SLOs             | ``goodput_*``                     |

Input: the requests' ``RequestMetrics`` (timestamps on the engine's clock, see
``minillm.core.request``) and, optionally, the engine's ``StepRecord`` list (batch, KV use).
Rejected and aborted requests are counted but kept out of the latency statistics:
"Watch the tail. P99 latency reveals problems that averages hide entirely."
Times are seconds everywhere except ``format_table``, which prints milliseconds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # only for annotations: this module reads plain attributes
    from ..step_record import StepRecord

__all__ = [
    "percentile",
    "summarize",
    "per_request_table",
    "format_table",
    "kv_utilisation_series",
    "batch_size_series",
    "request_category",
]

QUANTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue_wait")


def percentile(values: Iterable[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), interpolating linearly between order statistics
    (numpy's default "linear" method); None for no values (None entries are skipped)."""
    return _percentile_of_sorted(sorted(float(x) for x in values if x is not None), q)


def _percentile_of_sorted(v: Sequence[float], q: float) -> Optional[float]:
    if not len(v):
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q!r}: must be in [0, 100]")
    pos = (len(v) - 1) * q / 100.0  # fractional rank
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    """Mean, the ``QUANTILES`` and max of ``values`` (a list or a float array; None for none)."""
    a = np.asarray(values, dtype=float)
    d: dict[str, Optional[float]] = {"mean": float(np.mean(a)) if len(a) else None}
    # Each quantile reads two order statistics (and the max the last): np.partition puts exactly those in
    # their sorted places, in linear time (a long run has millions of inter-token gaps to sort otherwise).
    ranks = (
        {len(a) - 1} | {min(math.floor((len(a) - 1) * q / 100.0) + i, len(a) - 1) for q in QUANTILES for i in (0, 1)}
        if len(a)
        else set()
    )
    v = np.partition(a, sorted(ranks)) if ranks else a
    for q in QUANTILES:
        p = _percentile_of_sorted(v, q)
        d[f"p{q}"] = None if p is None else float(p)
    d["max"] = float(v[-1]) if len(v) else None
    return d


def _inter_token_latencies(ms: Sequence[Any]) -> np.ndarray:
    """Every gap between consecutive output tokens of the requests ``ms`` (``RequestMetrics``), in one
    array: each request's ``token_times`` differenced (a long run has millions of them)."""
    gaps = [np.diff(np.asarray(m.token_times, dtype=float)) for m in ms if len(m.token_times) > 1]
    return np.concatenate(gaps) if gaps else np.zeros(0)


def request_category(finish_reason: Optional[str]) -> str:
    """ "finished" | "rejected" | "aborted" | "unfinished" from a finish_reason string."""
    if finish_reason is None:
        return "unfinished"
    r = str(finish_reason).lower()
    if r.startswith("reject") or r in ("shed", "load_shed"):
        return "rejected"
    if r.startswith("abort") or r in ("cancelled", "canceled", "timeout"):
        return "aborted"
    return "finished"


def _normalise(requests: Any) -> list[tuple[str, Any]]:
    """(request id, RequestMetrics) pairs from a list of RequestMetrics, a dict id -> metrics,
    or objects with ``.metrics`` and ``.request_id`` (engine requests / outputs)."""
    if requests is None:
        return []
    if isinstance(requests, Mapping):
        items = list(requests.items())
    else:
        items = [(getattr(r, "request_id", None), r) for r in requests]
    out = []
    for i, (rid, r) in enumerate(items):
        m = getattr(r, "metrics", None)
        m = r if m is None or not hasattr(m, "arrival_time") else m
        out.append((str(rid) if rid is not None else str(i), m))
    return out


def _num_output(m: Any) -> int:
    return int(m.num_output_tokens or len(m.token_times or []))


def _clock(metrics: list, records: Sequence) -> Optional[str]:
    clocks = {getattr(m, "clock", None) for m in metrics} | {getattr(r, "clock", None) for r in records}
    clocks.discard(None)
    if not clocks:
        return None
    return clocks.pop() if len(clocks) == 1 else "mixed"


def summarize(
    requests: Any,
    records: Optional[Sequence["StepRecord"]] = None,
    *,
    slo_ttft: Optional[float] = None,
    slo_tpot: Optional[float] = None,
    max_num_seqs: Optional[int] = None,
    prefix_cache_stats: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """One run's metrics as a flat dict (seconds, tokens, fractions; None where there is no data).

    * counts: ``num_requests`` and ``num_finished / num_rejected / num_aborted / num_unfinished``
      by ``finish_reason``;
    * ``duration``: first arrival -> last finish (falls back to the last record's time);
    * throughput: ``input_throughput`` / ``output_throughput`` (tokens/s),
      ``request_throughput`` (finished requests/s);
    * latency of finished requests: ``{ttft,tpot,itl,e2e,queue_wait}_{mean,p50,p90,p99,max}``;
    * from ``records``: ``batch_size_mean``, ``batch_occupancy`` (mean batch / ``max_num_seqs``),
      ``kv_util_mean/max`` (kv.used / kv.total), ``schedule_overhead_fraction``;
    * ``num_preemptions`` and ``preemption_rate`` (per second);
    * ``prefix_cache_hit_rate``: from ``prefix_cache_stats["hit_rate"]`` (or hit/queried blocks),
      else cached prompt tokens / prompt tokens;
    * goodput under ``slo_ttft`` / ``slo_tpot`` (finished requests meeting both; a request with
      a single output token has no TPOT and passes that SLO): ``goodput_requests_per_s``,
      ``goodput_tokens_per_s``, ``slo_attainment`` (over all requests, rejected ones failing);
    * ``clock``: "modeled" or "wall" (or "mixed"), the clock all these times are on.
    """
    records = list(records or [])
    pairs = _normalise(requests)
    ms = [m for _, m in pairs]
    cats = [request_category(getattr(m, "finish_reason", None)) for m in ms]
    done = [m for m, c in zip(ms, cats) if c == "finished"]
    served = [m for m, c in zip(ms, cats) if c != "rejected"]

    s: dict[str, Any] = {"clock": _clock(ms, records), "num_requests": len(ms)}
    for c in ("finished", "rejected", "aborted", "unfinished"):
        s[f"num_{c}"] = cats.count(c)

    # --- duration and throughput ---------------------------------------------------------
    arrivals = [m.arrival_time for m in ms]
    finishes = [m.finish_time for m in ms if m.finish_time is not None]
    start = min(arrivals) if arrivals else (records[0].time - records[0].duration if records else None)
    end = max(finishes) if finishes else None
    if records and (end is None or any(m.finish_time is None for m in ms)):
        end = max(end if end is not None else -math.inf, records[-1].time)
    duration = (end - start) if (start is not None and end is not None) else None
    s["duration"] = duration
    s["total_input_tokens"] = sum(int(m.num_prompt_tokens) for m in served if m.first_scheduled_time is not None)
    s["total_output_tokens"] = sum(_num_output(m) for m in served)
    ok = duration is not None and duration > 0

    def rate(x):
        return x / duration if ok else None

    s["input_throughput"] = rate(s["total_input_tokens"])
    s["output_throughput"] = rate(s["total_output_tokens"])
    s["total_token_throughput"] = rate(s["total_input_tokens"] + s["total_output_tokens"])
    s["request_throughput"] = rate(len(done))

    # --- latency (finished requests only) ---------------------------------------------------
    series = {
        "ttft": [m.ttft for m in done if m.ttft is not None],
        "tpot": [m.tpot for m in done if m.tpot is not None],
        "itl": _inter_token_latencies(done),
        "e2e": [m.e2e_latency for m in done if m.e2e_latency is not None],
        "queue_wait": [m.queue_wait for m in done if m.queue_wait is not None],
    }
    for name in LATENCIES:
        for k, v in _stats(series[name]).items():
            s[f"{name}_{k}"] = v

    # --- step records: occupancy, KV, scheduling overhead -----------------------------------
    if records:
        sizes = [r.batch_size for r in records]
        s["num_steps"] = len(records)
        s["batch_size_mean"] = float(np.mean(sizes))
        s["batch_size_max"] = int(max(sizes))
        s["batch_occupancy"] = s["batch_size_mean"] / max_num_seqs if max_num_seqs else None
        kv = [r.kv.used / r.kv.total for r in records if r.kv is not None and r.kv.total]
        s["kv_util_mean"] = float(np.mean(kv)) if kv else None
        s["kv_util_max"] = float(np.max(kv)) if kv else None
        busy = sum(r.duration for r in records)
        s["schedule_overhead_fraction"] = (
            sum(getattr(r, "schedule_time", 0.0) for r in records) / busy if busy > 0 else None
        )
        s["swap_time_total"] = sum(getattr(r, "swap_time", 0.0) for r in records)
    else:
        for k in (
            "num_steps",
            "batch_size_mean",
            "batch_size_max",
            "batch_occupancy",
            "kv_util_mean",
            "kv_util_max",
            "schedule_overhead_fraction",
            "swap_time_total",
        ):
            s[k] = None

    # --- preemption ---------------------------------------------------------------------------
    s["num_preemptions"] = sum(int(m.num_preemptions) for m in ms)
    s["preemption_rate"] = rate(s["num_preemptions"])

    # --- prefix cache ---------------------------------------------------------------------------
    prompt = sum(int(m.num_prompt_tokens) for m in served)
    cached = sum(int(m.num_cached_tokens) for m in served)
    if prefix_cache_stats:
        hr = prefix_cache_stats.get("hit_rate")
        if hr is None and prefix_cache_stats.get("queried_blocks"):
            hr = prefix_cache_stats.get("hit_blocks", 0) / prefix_cache_stats["queried_blocks"]
        s["prefix_cache_hit_rate"] = hr
        s["prefill_tokens_saved"] = prefix_cache_stats.get("prefill_tokens_saved", cached)
    else:
        s["prefix_cache_hit_rate"] = cached / prompt if prompt else None
        s["prefill_tokens_saved"] = cached

    # --- speculative decoding -------------------------------------------------------------------
    proposed = sum(int(getattr(m, "num_spec_proposed", 0) or 0) for m in ms)
    accepted = sum(int(getattr(m, "num_spec_accepted", 0) or 0) for m in ms)
    s["spec_acceptance_rate"] = accepted / proposed if proposed else None

    # --- goodput ----------------------------------------------------------------------------------
    s["slo_ttft"], s["slo_tpot"] = slo_ttft, slo_tpot
    if slo_ttft is None and slo_tpot is None:
        s["goodput_requests"] = s["goodput_requests_per_s"] = s["goodput_tokens_per_s"] = None
        s["slo_attainment"] = None
    else:
        good = [m for m in done if _meets(m, slo_ttft, slo_tpot)]
        s["goodput_requests"] = len(good)
        s["goodput_requests_per_s"] = rate(len(good))
        s["goodput_tokens_per_s"] = rate(sum(_num_output(m) for m in good))
        s["slo_attainment"] = len(good) / len(ms) if ms else None
    return s


def _meets(m: Any, slo_ttft: Optional[float], slo_tpot: Optional[float]) -> bool:
    if slo_ttft is not None and (m.ttft is None or m.ttft > slo_ttft):
        return False
    if slo_tpot is not None and m.tpot is not None and m.tpot > slo_tpot:
        return False
    return True


def per_request_table(requests: Any) -> list[dict[str, Any]]:
    """One row per request: ids, class, token counts, latencies (s), preemptions, finish reason."""
    rows = []
    for rid, m in _normalise(requests):
        rows.append(
            {
                "request_id": rid,
                "priority": getattr(m, "priority", 0),
                "tenant": getattr(m, "tenant", None),
                "arrival_time": m.arrival_time,
                "finish_time": m.finish_time,
                "prompt_tokens": int(m.num_prompt_tokens),
                "output_tokens": _num_output(m),
                "cached_tokens": int(m.num_cached_tokens),
                "queue_wait": m.queue_wait,
                "ttft": m.ttft,
                "tpot": m.tpot,
                "e2e": m.e2e_latency,
                "num_preemptions": int(m.num_preemptions),
                "finish_reason": m.finish_reason,
                "category": request_category(m.finish_reason),
            }
        )
    return rows


def kv_utilisation_series(records: Sequence["StepRecord"]) -> tuple[np.ndarray, np.ndarray]:
    """(step end times, kv.used / kv.total after each step)."""
    t = np.array([r.time for r in records], dtype=float)
    f = np.array([r.kv.used / r.kv.total if r.kv.total else 0.0 for r in records], dtype=float)
    return t, f


def batch_size_series(records: Sequence["StepRecord"]) -> tuple[np.ndarray, np.ndarray]:
    """(step end times, number of requests in each step's batch)."""
    return (np.array([r.time for r in records], dtype=float), np.array([r.batch_size for r in records], dtype=int))


# =====================================================================================
# Text table
# =====================================================================================


def _fmt(v: Any, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "ms":
        return f"{v * 1e3:.2f}"
    if kind == "pct":
        return f"{v * 100:.1f}%"
    if kind == "int":
        return f"{int(v)}"
    if kind == "s":
        return f"{v:.3f}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def format_table(summary: Mapping[str, Any]) -> str:
    """A readable, aligned text table of ``summarize``'s output (latencies in ms)."""
    s = summary
    lines = [f"clock: {s.get('clock') or '-'}"]
    rows: list[tuple[str, str]] = [
        (
            "requests (finished/rejected/aborted/unfinished)",
            f"{s.get('num_requests', 0)} ({s.get('num_finished', 0)}/{s.get('num_rejected', 0)}/"
            f"{s.get('num_aborted', 0)}/{s.get('num_unfinished', 0)})",
        ),
        ("duration (s)", _fmt(s.get("duration"), "s")),
        ("input tokens / output tokens", f"{s.get('total_input_tokens', 0)} / {s.get('total_output_tokens', 0)}"),
        ("output throughput (tok/s)", _fmt(s.get("output_throughput"), "f")),
        ("input throughput (tok/s)", _fmt(s.get("input_throughput"), "f")),
        ("request throughput (req/s)", _fmt(s.get("request_throughput"), "f")),
    ]
    if s.get("slo_attainment") is not None:
        slo = ", ".join(
            f"{k.split('_')[1].upper()} <= {_fmt(s[k], 'ms')} ms"
            for k in ("slo_ttft", "slo_tpot")
            if s.get(k) is not None
        )
        rows += [
            (f"goodput (req/s) [{slo}]", _fmt(s.get("goodput_requests_per_s"), "f")),
            ("goodput (tok/s)", _fmt(s.get("goodput_tokens_per_s"), "f")),
            ("SLO attainment", _fmt(s.get("slo_attainment"), "pct")),
        ]
    rows += [
        ("batch occupancy", _fmt(s.get("batch_occupancy"), "pct")),
        ("mean batch size", _fmt(s.get("batch_size_mean"), "f")),
        ("KV utilisation mean / max", f"{_fmt(s.get('kv_util_mean'), 'pct')} / {_fmt(s.get('kv_util_max'), 'pct')}"),
        ("preemptions (total, per s)", f"{s.get('num_preemptions', 0)}, {_fmt(s.get('preemption_rate'), 'f')}"),
        ("prefix cache hit rate", _fmt(s.get("prefix_cache_hit_rate"), "pct")),
    ]
    if s.get("schedule_overhead_fraction") is not None:
        rows.append(("scheduling overhead", _fmt(s["schedule_overhead_fraction"], "pct")))
    if s.get("spec_acceptance_rate") is not None:
        rows.append(("speculative acceptance", _fmt(s["spec_acceptance_rate"], "pct")))
    w = max(len(k) for k, _ in rows)
    lines += [f"{k:<{w}}  {v}" for k, v in rows]

    head = ["latency (ms)", "mean", "p50", "p90", "p99", "max"]
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E", "queue_wait": "queue wait"}
    table = [head] + [
        [names[n]] + [_fmt(s.get(f"{n}_{k}"), "ms") for k in ("mean", "p50", "p90", "p99", "max")] for n in LATENCIES
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines.append("")
    for r in table:
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    return "\n".join(lines)
