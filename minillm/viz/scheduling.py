"""What notebooks 03 and 03b print and draw about a scheduling run, so their cells show the engine call.

Each function takes what a run returned (step records, the requests' metrics by id, ``metrics.summarize``'s
dict) and returns one line of text or one plotly figure; nothing here runs an engine.

* ``step_lines``: what each step ran and why the first waiting requests waited, one line per step;
* ``mean_of``: the mean of one metric over some requests (those without a value left out);
* ``run_line``: one run in one line: a name, latency statistics from the summary, group means, preemptions;
* ``every_n_line``: what scheduling every N steps saved and cost, measured on a run;
* ``load_line`` and ``shed_line``: one arrival rate of a load sweep, without and with a queue cap;
* ``aging_figure``, ``levels_figure``, ``service_figure``, ``token_gaps_figure``, ``load_figure``: the
  figures of the aging, MLFQ, fair-queuing, prefill-vs-decode and load sections.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..step_record import StepRecord
from .figures import PALETTE, log_ticks

__all__ = [
    "step_lines",
    "mean_of",
    "fmt_time",
    "run_line",
    "every_n_line",
    "load_line",
    "shed_line",
    "aging_figure",
    "levels_figure",
    "service_over_time",
    "service_figure",
    "token_gaps_figure",
    "load_figure",
]

# The summary's statistics (metrics.summarize: "e2e_mean", "ttft_p99", ...) as a line names them.
STAT_NAMES = {"mean": "mean", "p50": "median", "p90": "p90", "p99": "p99", "max": "worst"}


def step_lines(records: Iterable[StepRecord], max_waiting: int = 2) -> str:
    """One line per step: who ran (request, phase, new tokens) and, for the first ``max_waiting`` waiting
    requests, the scheduler's reason for leaving them waiting."""
    lines = []
    for rec in records:
        ran = ", ".join(f"{e.request_id} {e.phase} +{e.num_new_tokens}" for e in rec.batch)
        waits = "; ".join(f"{w.request_id}: {w.reason}" for w in rec.waiting[:max_waiting])
        lines.append(f"  step {rec.step}: ran {ran}" + (f"  | waiting {waits}" if waits else ""))
    return "\n".join(lines)


def mean_of(metrics: Mapping[str, Any], ids: Optional[Iterable[str]] = None, field: str = "e2e_latency") -> float:
    """The mean of ``field`` (a ``RequestMetrics`` attribute: ``e2e_latency``, ``queue_wait``, ``ttft``,
    ``tpot``) over the requests ``ids`` of ``metrics`` (request id -> metrics; all of them when ``ids`` is
    None). Requests without a value (not finished, one token for TPOT) are left out."""
    values = [getattr(metrics[rid], field) for rid in (metrics if ids is None else ids)]
    values = [v for v in values if v is not None]
    if not values:
        raise ValueError(f"mean_of(field={field!r}): none of the requests has a value")
    return sum(values) / len(values)


def fmt_time(seconds: Optional[float], unit: str = "s") -> str:
    """A time in seconds written in ``unit`` ("s": two decimals; "ms": whole milliseconds from 100 ms,
    one decimal below)."""
    if seconds is None:
        return "-"
    if unit == "s":
        return f"{seconds:.2f} s"
    if unit == "ms":
        ms = seconds * 1e3
        return f"{ms:.0f} ms" if abs(ms) >= 100 else f"{ms:.1f} ms"
    raise ValueError(f"fmt_time(unit={unit!r}): 's' or 'ms'")


def run_line(
    name: str,
    summary: Optional[Mapping[str, Any]] = None,
    *,
    stats: Sequence[str] = (),
    metric: str = "e2e",
    by: Optional[Mapping[str, float]] = None,
    by_label: str = "",
    note: str = "",
    preemptions: bool = False,
    unit: str = "s",
    width: int = 24,
) -> str:
    """One run in one line, e.g. ``FCFS  mean 4.97 s, median 3.80 s, worst 10.25 s | chat 0.41 s, doc 2.20 s``.

    ``stats``: which of the summary's statistics of ``metric`` to show ("mean", "p50", "p90", "p99",
    "max"); ``by``: label -> a time already computed (``mean_of``), shown after a bar, followed by
    ``by_label`` (e.g. "on average"); ``preemptions``: the summary's count; ``note``: text at the end."""
    parts = []
    if stats:
        if summary is None:
            raise ValueError("run_line(stats=...): needs the run's summary")
        parts.append(", ".join(f"{STAT_NAMES[k]} {fmt_time(summary[f'{metric}_{k}'], unit)}" for k in stats))
    if by:
        parts.append(
            ", ".join(f"{label} {fmt_time(v, unit)}" for label, v in by.items()) + (f" {by_label}" if by_label else "")
        )
    line = f"{name:<{width}} " + " | ".join(parts)
    if preemptions:
        if summary is None:
            raise ValueError("run_line(preemptions=True): needs the run's summary")
        line += f"; {summary['num_preemptions']} preemptions"
    return line + (f"  {note}" if note else "")


def every_n_line(n: int, overhead: float, held: float, admit: float, answer_s: float) -> str:
    """Scheduling every ``n`` steps, measured: the passes' share of the decode time, the longest a finished
    request was held (also as a share of an answer of ``answer_s`` seconds) and the longest a newcomer waited."""
    return (
        f"schedule every {n} step(s): overhead {overhead:6.2%} of decode time; a finished request is held up to "
        f"{held * 1e3:3.0f} ms ({held / answer_s:.2%} of a {answer_s:g} s answer); a new one waits up to "
        f"{admit * 1e3:3.0f} ms"
    )


def load_line(rate: float, s: Mapping[str, Any]) -> str:
    """One arrival rate of a load sweep: the TTFT median and tail, throughput, goodput and the share meeting
    the SLOs, the mean batch, and how long the simulation took."""
    return (
        f"{rate:>3} req/s: TTFT p50 {s['ttft_p50']:6.2f} s, p99 {s['ttft_p99']:6.2f} s | throughput "
        f"{s['request_throughput']:5.1f} req/s, goodput {s['goodput_requests_per_s']:5.1f} req/s "
        f"({s['slo_attainment']:.0%} meet the SLOs) | mean batch {s['batch_size_mean']:5.1f}  "
        f"[{s['wall_time']:.1f} s to simulate]"
    )


def shed_line(rate: float, cap: Optional[int], s: Mapping[str, Any]) -> str:
    """One arrival rate with (or without, ``cap=None``) a queue cap: the requests turned away, the TTFT of
    those served, goodput, and the share of *all* requests meeting the SLOs."""
    return (
        f"{rate:>3} req/s, queue cap {str(cap):>4}: rejected {s['num_rejected']:3d}, TTFT p50 "
        f"{s['ttft_p50']:5.2f} s, p99 {s['ttft_p99']:5.2f} s, goodput {s['goodput_requests_per_s']:5.1f} req/s, "
        f"SLOs met by {s['slo_attainment']:.0%} of all requests (rejected ones count as missed)"
    )


def _layout(fig: go.Figure, title: str, height: int = 360) -> go.Figure:
    fig.update_layout(title=title, height=height, plot_bgcolor="white")
    return fig


def aging_figure(agings: Sequence[float], long_wait: Sequence[float], short_mean: Sequence[float]) -> go.Figure:
    """The long request's wait and the short requests' mean latency against the aging rate (log axis, one
    labelled tick per rate run; the first entry, aging 0, is drawn as a dotted line: the starved wait)."""
    fig = go.Figure(
        [
            go.Scatter(x=agings[1:], y=long_wait[1:], name="L's wait (s)", mode="lines+markers"),
            go.Scatter(
                x=agings[1:],
                y=short_mean[1:],
                name="short requests' mean latency (s)",
                mode="lines+markers",
                yaxis="y2",
            ),
        ]
    )
    fig.add_hline(
        y=long_wait[0],
        line_dash="dot",
        annotation_text="L's wait without aging (starved)",
        annotation_position="top left",
    )
    fig.update_layout(
        xaxis=dict(
            title="aging (predicted tokens forgiven per second waited, log scale)",
            type="log",
            tickvals=list(agings[1:]),
            ticktext=[f"{a:g}" for a in agings[1:]],
        ),
        yaxis=dict(title="L's wait (s)", rangemode="tozero"),
        yaxis2=dict(
            title="short requests' mean latency (s)",
            overlaying="y",
            side="right",
            rangemode="tozero",
            tickmode="auto",
            showgrid=False,
        ),
        legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom"),
    )
    return _layout(fig, "aging bounds the longest wait; the short requests pay with their mean latency", 380)


def service_over_time(
    records: Sequence[StepRecord], tenant_of: Mapping[str, Any], output_weight: float = 2.0
) -> list[tuple[float, dict]]:
    """(time, service received so far per tenant) after each step: prompt tokens prefilled plus
    ``output_weight`` x tokens generated, the virtual token counter of fair queuing, read off the records."""
    total = {t: 0.0 for t in set(tenant_of.values())}
    rows = []
    for rec in records:
        for e in rec.batch:
            total[tenant_of[e.request_id]] += (
                e.num_new_tokens if e.phase == "prefill" else 0
            ) + output_weight * e.num_output_tokens
        rows.append((rec.time, dict(total)))
    return rows


def service_figure(engines: Mapping[str, Any], tenants: Sequence[str]) -> go.Figure:
    """Each tenant's service over time (``service_over_time``), one panel per engine (name -> engine)."""
    fig = make_subplots(rows=1, cols=len(engines), subplot_titles=list(engines), shared_yaxes=True)
    for col, eng in enumerate(engines.values(), start=1):
        rows = service_over_time(eng.step_records, {rid: r.tenant for rid, r in eng.requests.items()})
        for i, tenant in enumerate(tenants):
            fig.add_trace(
                go.Scatter(
                    x=[r[0] for r in rows],
                    y=[r[1][tenant] for r in rows],
                    name=f"tenant {tenant}",
                    line=dict(color=PALETTE[i]),
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="time (s)")
    fig.update_yaxes(title_text="service received (weighted tokens)", col=1)
    return _layout(fig, "who gets served while one tenant floods")


def levels_figure(times: Sequence[float], levels: Mapping[str, Sequence[Optional[int]]], title: str) -> go.Figure:
    """Each watched request's MLFQ level after every step (``None`` once it has finished), as steps."""
    fig = go.Figure(
        [
            go.Scatter(x=times, y=lv, name=rid, mode="lines", line=dict(shape="hv", color=PALETTE[i]))
            for i, (rid, lv) in enumerate(levels.items())
        ]
    )
    fig.update_layout(xaxis_title="time (s)", yaxis=dict(title="level (0 = top)", autorange="reversed", dtick=1))
    return _layout(fig, title, 320)


def token_gaps_figure(runs: Mapping[str, Mapping[str, Any]], request_id: str, title: str) -> go.Figure:
    """The gap before each token of one request (ms, log axis), one line per run (name -> metrics by id)."""
    fig = go.Figure()
    for i, (name, metrics) in enumerate(runs.items()):
        m = metrics[request_id]
        fig.add_trace(
            go.Scatter(
                x=m.token_times[1:],
                y=[1e3 * g for g in m.inter_token_latencies],
                name=name,
                mode="lines",
                line=dict(color=PALETTE[i]),
            )
        )
    fig.update_layout(
        xaxis_title="time (s)", yaxis=dict(title="ms since its previous token (log scale)", type="log", **log_ticks())
    )
    return _layout(fig, title)


def load_figure(load: Mapping[float, Mapping[str, Any]], slo_ttft: float, title: str) -> go.Figure:
    """A load sweep (rate -> summary): the TTFT median and p99 against the SLO (log axis), and throughput
    beside goodput."""
    rates = list(load)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "served per second"))
    for q, dash in (("p50", "solid"), ("p99", "dash")):
        fig.add_trace(
            go.Scatter(
                x=rates,
                y=[load[r][f"ttft_{q}"] for r in rates],
                name=f"TTFT {q}",
                mode="lines+markers",
                line=dict(dash=dash, color=PALETTE[0]),
            ),
            row=1,
            col=1,
        )
    fig.add_hline(y=slo_ttft, line_dash="dot", annotation_text="TTFT SLO", row=1, col=1)
    for i, (key, name) in enumerate(
        (("request_throughput", "throughput"), ("goodput_requests_per_s", "goodput")), start=1
    ):
        fig.add_trace(
            go.Scatter(
                x=rates, y=[load[r][key] for r in rates], name=name, mode="lines+markers", line=dict(color=PALETTE[i])
            ),
            row=1,
            col=2,
        )
    fig.update_yaxes(title_text="time to first token (s, log scale)", type="log", row=1, col=1, **log_ticks((1, 3)))
    fig.update_yaxes(title_text="requests / s", row=1, col=2)
    fig.update_xaxes(title_text="arrival rate (requests / s)")
    return _layout(fig, title, 380)
