"""Metrics on hand-built requests and records whose every number is computed by hand below."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minillm.analysis.metrics import (
    batch_size_series,
    format_table,
    kv_utilisation_series,
    per_request_table,
    percentile,
    request_category,
    summarize,
)
from minillm.core.request import RequestMetrics
from minillm.step_record import BatchEntry, KVSnapshot, StepRecord


def four_requests(clock="modeled"):
    """A: finished, 4 tokens. B: finished, 2 tokens, preempted once. C: rejected. D: aborted.

    A: arrives 0.0, scheduled 0.1, tokens at 0.5 0.7 0.9 1.1 -> TTFT 0.5, TPOT 0.2, E2E 1.1, wait 0.1
    B: arrives 0.2, scheduled 0.2, tokens at 0.4 1.0         -> TTFT 0.2, TPOT 0.6, E2E 0.8, wait 0.0
    """
    a = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=0.1,
        first_token_time=0.5,
        finish_time=1.1,
        token_times=[0.5, 0.7, 0.9, 1.1],
        num_prompt_tokens=10,
        num_output_tokens=4,
        num_cached_tokens=4,
        finish_reason="length",
        clock=clock,
    )
    b = RequestMetrics(
        arrival_time=0.2,
        first_scheduled_time=0.2,
        first_token_time=0.4,
        finish_time=1.0,
        token_times=[0.4, 1.0],
        num_prompt_tokens=20,
        num_output_tokens=2,
        num_preemptions=1,
        finish_reason="stop",
        clock=clock,
    )
    c = RequestMetrics(arrival_time=0.3, finish_time=0.3, num_prompt_tokens=30, finish_reason="rejected", clock=clock)
    d = RequestMetrics(
        arrival_time=0.5,
        first_scheduled_time=0.6,
        first_token_time=0.9,
        finish_time=1.5,
        token_times=[0.9],
        num_prompt_tokens=8,
        num_output_tokens=1,
        finish_reason="abort",
        clock=clock,
    )
    return [a, b, c, d]


def kv(used, total=10):
    return KVSnapshot(
        total=total,
        used=used,
        free=total - used,
        blocks_total=total,
        blocks_used=used,
        blocks_free=total - used,
        block_size=1,
    )


def record(step, time, duration, n_batch, used, sched):
    batch = [BatchEntry(f"x{i}", "decode", 1, 5, 6) for i in range(n_batch)]
    return StepRecord(
        step=step,
        time=time,
        duration=duration,
        batch=batch,
        num_batched_tokens=n_batch,
        token_budget=8,
        admitted=[],
        finished=[],
        preempted=[],
        waiting=[],
        kv=kv(used),
        clock="modeled",
        schedule_time=sched,
    )


RECORDS = [record(0, 0.1, 0.1, 2, 4, 0.01), record(1, 0.2, 0.1, 1, 8, 0.01), record(2, 0.4, 0.2, 0, 2, 0.02)]


def test_counts_duration_throughput():
    s = summarize(four_requests())
    assert s["clock"] == "modeled"
    assert (s["num_requests"], s["num_finished"], s["num_rejected"], s["num_aborted"]) == (4, 2, 1, 1)
    assert s["duration"] == pytest.approx(1.5)  # first arrival 0.0 -> last finish 1.5
    assert s["total_input_tokens"] == 10 + 20 + 8  # the rejected prompt never ran
    assert s["total_output_tokens"] == 4 + 2 + 1
    assert s["output_throughput"] == pytest.approx(7 / 1.5)
    assert s["input_throughput"] == pytest.approx(38 / 1.5)
    assert s["request_throughput"] == pytest.approx(2 / 1.5)
    assert s["num_preemptions"] == 1 and s["preemption_rate"] == pytest.approx(1 / 1.5)
    assert s["prefix_cache_hit_rate"] == pytest.approx(4 / 38)  # cached / prompt tokens served
    assert s["prefill_tokens_saved"] == 4


def test_latency_statistics_of_finished_requests_only():
    s = summarize(four_requests())
    # TTFT [0.5, 0.2]: mean 0.35; p90 = 0.2 + 0.9 * 0.3 = 0.47; p99 = 0.2 + 0.99 * 0.3 = 0.497
    assert (s["ttft_mean"], s["ttft_p50"], s["ttft_p90"], s["ttft_p99"], s["ttft_max"]) == pytest.approx(
        (0.35, 0.35, 0.47, 0.497, 0.5)
    )
    # TPOT [(1.1 - 0.5) / 3, (1.0 - 0.4) / 1] = [0.2, 0.6]
    assert (s["tpot_mean"], s["tpot_p50"]) == pytest.approx((0.4, 0.4))
    # ITL pooled [0.2, 0.2, 0.2, 0.6]: mean 0.3, p50 0.2, p90 at rank 2.7 -> 0.2 + 0.7 * 0.4 = 0.48
    assert (s["itl_mean"], s["itl_p50"], s["itl_p90"]) == pytest.approx((0.3, 0.2, 0.48))
    assert (s["e2e_mean"], s["e2e_max"]) == pytest.approx((0.95, 1.1))
    assert (s["queue_wait_mean"], s["queue_wait_p50"]) == pytest.approx((0.05, 0.05))


def test_goodput_under_slos():
    # TTFT <= 0.3 s: only B (0.2) -> 1 request, 2 tokens in 1.5 s; attainment 1 of 4.
    s = summarize(four_requests(), slo_ttft=0.3)
    assert s["goodput_requests"] == 1
    assert s["goodput_requests_per_s"] == pytest.approx(1 / 1.5)
    assert s["goodput_tokens_per_s"] == pytest.approx(2 / 1.5)
    assert s["slo_attainment"] == pytest.approx(0.25)
    # TTFT <= 0.6 and TPOT <= 0.3: A passes both, B fails TPOT (0.6) -> 4 tokens
    s = summarize(four_requests(), slo_ttft=0.6, slo_tpot=0.3)
    assert s["goodput_requests"] == 1 and s["goodput_tokens_per_s"] == pytest.approx(4 / 1.5)
    # loose SLOs: both finished requests count; the rejected and aborted never do
    s = summarize(four_requests(), slo_ttft=10, slo_tpot=10)
    assert s["goodput_requests"] == 2 and s["slo_attainment"] == pytest.approx(0.5)
    assert summarize(four_requests())["goodput_requests_per_s"] is None  # no SLO, no goodput


def test_records_give_occupancy_kv_and_overhead():
    s = summarize(four_requests(), RECORDS, max_num_seqs=4)
    assert s["num_steps"] == 3
    assert s["batch_size_mean"] == pytest.approx(1.0)  # (2 + 1 + 0) / 3
    assert s["batch_occupancy"] == pytest.approx(0.25)  # 1 of 4 slots
    assert s["kv_util_mean"] == pytest.approx((0.4 + 0.8 + 0.2) / 3)
    assert s["kv_util_max"] == pytest.approx(0.8)
    assert s["schedule_overhead_fraction"] == pytest.approx(0.04 / 0.4)
    t, f = kv_utilisation_series(RECORDS)
    assert t.tolist() == [0.1, 0.2, 0.4] and f.tolist() == pytest.approx([0.4, 0.8, 0.2])
    assert batch_size_series(RECORDS)[1].tolist() == [2, 1, 0]


def test_prefix_cache_stats_take_precedence():
    s = summarize(
        four_requests(),
        prefix_cache_stats={
            "lookups": 4,
            "hit_blocks": 3,
            "queried_blocks": 12,
            "hit_rate": 0.25,
            "prefill_tokens_saved": 48,
        },
    )
    assert s["prefix_cache_hit_rate"] == 0.25 and s["prefill_tokens_saved"] == 48
    s = summarize(four_requests(), prefix_cache_stats={"hit_blocks": 3, "queried_blocks": 4})
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.75)


def test_clock_mixed_and_input_shapes():
    reqs = four_requests()
    reqs[0].clock = "wall"
    assert summarize(reqs)["clock"] == "mixed"
    # a dict id -> metrics, and objects with .request_id / .metrics (engine outputs) work alike
    byid = dict(zip("ABCD", four_requests()))
    wrapped = [SimpleNamespace(request_id=k, metrics=m) for k, m in byid.items()]
    assert summarize(byid)["ttft_mean"] == summarize(wrapped)["ttft_mean"] == pytest.approx(0.35)
    rows = per_request_table(wrapped)
    assert [r["request_id"] for r in rows] == list("ABCD")
    assert rows[0]["ttft"] == pytest.approx(0.5) and rows[0]["tpot"] == pytest.approx(0.2)
    assert [r["category"] for r in rows] == ["finished", "finished", "rejected", "aborted"]
    assert rows[1]["num_preemptions"] == 1 and rows[2]["queue_wait"] is None


def test_unfinished_requests_extend_duration_to_the_last_record():
    reqs = four_requests()
    reqs.append(RequestMetrics(arrival_time=0.1, first_scheduled_time=0.2, num_prompt_tokens=5, clock="modeled"))
    recs = RECORDS + [record(3, 2.0, 0.1, 1, 3, 0.0)]
    s = summarize(reqs, recs)
    assert s["num_unfinished"] == 1 and s["duration"] == pytest.approx(2.0)


def test_empty_input():
    s = summarize([])
    assert s["num_requests"] == 0 and s["duration"] is None and s["output_throughput"] is None
    assert s["ttft_mean"] is None and s["ttft_p99"] is None and s["clock"] is None
    assert "TTFT" in format_table(s)
    assert percentile([], 50) is None
    assert per_request_table([]) == []
    t, f = kv_utilisation_series([])
    assert t.size == f.size == 0


def test_format_table_is_aligned_and_in_ms():
    text = format_table(summarize(four_requests(), RECORDS, slo_ttft=0.3, max_num_seqs=4))
    assert "clock: modeled" in text
    lat = [line for line in text.splitlines() if line.startswith(("latency", "TTFT", "TPOT", "ITL", "E2E", "queue"))]
    assert len(lat) == 6 and len({len(line) for line in lat}) == 1  # one width: aligned
    ttft = next(line for line in lat if line.startswith("TTFT")).split()
    assert ttft[1:] == ["350.00", "350.00", "470.00", "497.00", "500.00"]
    assert "goodput" in text and "25.0%" in text


def test_request_category():
    assert [request_category(r) for r in ("stop", "length", "rejected", "abort", None)] == [
        "finished",
        "finished",
        "rejected",
        "aborted",
        "unfinished",
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.sampled_from([0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100]),
)
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_percentile_by_hand():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([3, 1, 2], 100) == 3 and percentile([3, 1, 2], 0) == 1
    assert math.isclose(percentile([0, 10], 90), 9.0)
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(0, 1e4, allow_nan=False), max_size=12), min_size=1, max_size=8))
def test_inter_token_latency_stats_are_every_gap_of_every_request(times_per_request):
    """``itl_*`` are the statistics of every gap between a finished request's consecutive output
    tokens (the gaps of all requests in one list), whatever the token counts (none, one, many)."""
    ms = [
        RequestMetrics(
            arrival_time=0.0,
            first_scheduled_time=0.0,
            first_token_time=t[0] if t else None,
            finish_time=max(t, default=0.0),
            token_times=list(t),
            num_output_tokens=len(t),
            finish_reason="stop",
        )
        for t in times_per_request
    ]
    gaps = [b - a for t in times_per_request for a, b in zip(t, t[1:])]
    s = summarize(ms)
    if not gaps:
        assert s["itl_mean"] is None and s["itl_p50"] is None and s["itl_max"] is None
        return
    assert s["itl_mean"] == float(np.mean(gaps)) and s["itl_max"] == max(gaps)
    assert (s["itl_p50"], s["itl_p90"], s["itl_p99"]) == tuple(percentile(gaps, q) for q in (50, 90, 99))
    assert all(type(s[k]) is float for k in ("itl_mean", "itl_p50", "itl_p99", "itl_max"))
