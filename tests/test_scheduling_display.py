"""What notebooks 03 and 03b print about a run (``minillm.viz.scheduling``), held against runs worked by hand:
the step lines name who ran and why the others waited, the means leave out requests without a value, and a
run's line shows the summary's numbers in the unit asked for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minillm import LLM
from minillm.analysis.workloads import TraceRequest, submit_trace
from minillm.viz import scheduling as show


def _engine_after(steps: int):
    """One slot, 16 tokens a step: A (6-token prompt) runs, B waits behind it."""
    eng = LLM(
        model="random",
        executor="simulated",
        clock="modeled",
        cost_model=0.010,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        block_size=4,
        num_kv_blocks=32,
    ).engine
    submit_trace(eng, [TraceRequest("A", 0.0, 6, 3), TraceRequest("B", 0.0, 4, 2)], vocab_size=eng.vocab_size)
    for _ in range(steps):
        eng.step()
    return eng


def test_step_lines_name_who_ran_and_why_the_others_waited():
    eng = _engine_after(2)
    lines = show.step_lines(eng.step_records).split("\n")
    assert lines[0].startswith("  step 0: ran A prefill +6  | waiting B: ")
    assert "max_num_seqs=1" in lines[0], lines[0]
    assert lines[1].startswith("  step 1: ran A decode +1  | waiting B: ")
    assert show.step_lines(eng.step_records, max_waiting=0).split("\n")[0] == "  step 0: ran A prefill +6"


def test_mean_of_leaves_out_requests_without_a_value():
    m = {
        "a": SimpleNamespace(e2e_latency=1.0, tpot=None),
        "b": SimpleNamespace(e2e_latency=3.0, tpot=0.5),
        "c": SimpleNamespace(e2e_latency=None, tpot=0.25),
    }
    assert show.mean_of(m) == 2.0
    assert show.mean_of(m, ["a", "b"]) == 2.0
    assert show.mean_of(m, field="tpot") == 0.375
    with pytest.raises(ValueError, match="tpot"):
        show.mean_of(m, ["a"], field="tpot")


def test_fmt_time():
    assert show.fmt_time(10.254) == "10.25 s"
    assert show.fmt_time(0.1234, "ms") == "123 ms" and show.fmt_time(0.0456, "ms") == "45.6 ms"
    assert show.fmt_time(None) == "-"
    with pytest.raises(ValueError, match="unit"):
        show.fmt_time(1.0, "min")


def test_run_line_shows_the_summary_in_the_unit_asked_for():
    s = {"e2e_mean": 4.97, "e2e_p50": 3.8, "e2e_max": 10.254, "num_preemptions": 2}
    assert (
        show.run_line("FCFS", s, stats=("mean", "p50", "max"), width=6)
        == "FCFS   mean 4.97 s, median 3.80 s, worst 10.25 s"
    )
    line = show.run_line(
        "SJF",
        s,
        stats=("mean",),
        by={"s1..s3": 0.045, "L": 0.2},
        by_label="on average",
        preemptions=True,
        unit="ms",
        width=3,
        note="(x)",
    )
    assert line == "SJF mean 4970 ms | s1..s3 45.0 ms, L 200 ms on average; 2 preemptions  (x)"
    with pytest.raises(ValueError, match="summary"):
        show.run_line("x", stats=("mean",))


def test_load_and_shed_lines_carry_the_summary():
    s = {
        "ttft_p50": 0.31,
        "ttft_p99": 1.234,
        "request_throughput": 3.31,
        "goodput_requests_per_s": 3.3,
        "slo_attainment": 0.65,
        "batch_size_mean": 12.5,
        "wall_time": 1.0,
        "num_rejected": 7,
    }
    line = show.load_line(4, s)
    assert "TTFT p50   0.31 s, p99   1.23 s" in line and "throughput   3.3 req/s" in line
    assert "(65% meet the SLOs)" in line and "mean batch  12.5" in line
    assert "queue cap   16: rejected   7" in show.shed_line(20, 16, s)
    assert "queue cap None" in show.shed_line(20, None, s)


def test_every_n_line_shows_the_worked_example():
    line = show.every_n_line(5, 0.0005 / 0.075, 0.060, 0.0755, answer_s=7.5)
    assert line == (
        "schedule every 5 step(s): overhead  0.67% of decode time; a finished request is held up to  60 ms "
        "(0.80% of a 7.5 s answer); a new one waits up to  76 ms"
    )


def test_levels_figure_draws_each_request_as_steps():
    fig = show.levels_figure([0.01, 0.02, 0.03], {"a": [0, 1, None], "b": [0, 0, 2]}, title="levels")
    assert [t.name for t in fig.data] == ["a", "b"] and all(t.line.shape == "hv" for t in fig.data)
    assert fig.layout.title.text == "levels" and fig.layout.yaxis.autorange == "reversed"
