"""The text panels of the step-through widgets, as HTML built from ``StepRecord``s.

Pure functions: (records, what is known about each request) -> an HTML string. The
``Stepper`` puts them in ``ipywidgets.HTML``; tests read them as text. Nothing here
touches an engine: what a reader sees is what the records say.

* ``metrics_html``: the running numbers (step, clock, batch occupancy, KV use, TTFT/TPOT so far);
* ``queue_html``: the waiting queue and the running set, each request with its phase and
  progress (prompt computed / output generated);
* ``reasons_html``: the step's decisions in plain words (admitted, who waits and why, who
  was preempted and how, who finished).
"""

from __future__ import annotations

import bisect
import html
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .figures import ColorMap
from ..step_record import StepRecord

__all__ = [
    "RequestInfo",
    "Progress",
    "progress_at",
    "metrics_html",
    "queue_html",
    "reasons_html",
    "latency_so_far",
    "arrived_during",
    "finished_html",
]

MAX_ROWS = 12  # requests listed per section; the rest are counted


@dataclass
class RequestInfo:
    """What is fixed about a request when it is added: its sizes and its arrival."""

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_time: float
    metrics: Any = None  # its RequestMetrics (timestamps), read for TTFT/TPOT so far


@dataclass
class Progress:
    """The cumulative state after some step, folded from the records up to it."""

    outputs: dict  # request id -> output tokens generated so far
    finished: dict  # request id -> finish reason ("rejected" for rejected ones)
    started: set  # request ids that have run at least once
    preempted: set  # request ids preempted and not yet back
    num_preemptions: int = 0

    @classmethod
    def empty(cls) -> "Progress":
        return cls({}, {}, set(), set(), 0)

    def copy(self) -> "Progress":
        return Progress(
            dict(self.outputs), dict(self.finished), set(self.started), set(self.preempted), self.num_preemptions
        )

    def apply(self, rec: StepRecord) -> "Progress":
        """Fold one more step in (in place; returns self)."""
        for p in rec.preempted:
            self.preempted.add(p.request_id)
            self.num_preemptions += 1
        for e in rec.batch:
            self.started.add(e.request_id)
            if e.num_output_tokens:
                self.outputs[e.request_id] = self.outputs.get(e.request_id, 0) + e.num_output_tokens
        for rid in list(rec.admitted) + list(rec.swapped_in):
            self.preempted.discard(rid)
        for rid in rec.finished:
            self.finished[rid] = rec.finish_reasons.get(rid, "finished")
            self.preempted.discard(rid)
        for w in rec.rejected:
            self.finished[w.request_id] = "rejected"
        for rid in rec.aborted:
            self.finished[rid] = "abort"
        return self


def arrived_during(rec: StepRecord, progress: Progress, infos: dict) -> list[str]:
    """Requests that arrived while ``rec``'s step ran: after its batch was formed, so the
    record lists them nowhere (not waiting, not running), and before its end, so they are
    no longer "not arrived". The scheduler considers them from the next step on."""
    known = (
        set(rec.running)
        | set(rec.swapped)
        | {w.request_id for w in rec.waiting}
        | {w.request_id for w in rec.rejected}
        | set(rec.finished)
        | set(progress.finished)
        | progress.started
    )
    start = rec.time - rec.duration
    return [rid for rid, info in infos.items() if rid not in known and start < info.arrival_time <= rec.time + 1e-12]


def progress_at(records: Sequence[StepRecord], index: int) -> Progress:
    """The cumulative ``Progress`` after ``records[index]`` (index -1: before any step)."""
    p = Progress.empty()
    for rec in records[: index + 1]:
        p.apply(rec)
    return p


# --- small HTML helpers ------------------------------------------------------------------


def _e(s: Any) -> str:
    return html.escape(str(s))


def _swatch(color: str) -> str:
    return (
        f"<span style='display:inline-block;width:11px;height:11px;background:{color};"
        f"border-radius:2px;margin-right:4px;vertical-align:-1px'></span>"
    )


def _bar(done: int, total: int, color: str, width: int = 70) -> str:
    frac = 0.0 if total <= 0 else max(0.0, min(1.0, done / total))
    return (
        f"<span style='display:inline-block;width:{width}px;height:8px;background:#eee;"
        f"border-radius:2px;vertical-align:0px;margin:0 3px'>"
        f"<span style='display:block;width:{frac * 100:.0f}%;height:8px;background:{color};"
        f"border-radius:2px'></span></span>"
    )


def _fmt_s(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v < 1.0:
        return f"{v * 1e3:.1f} ms"
    return f"{v:.3f} s"


# --- running numbers ---------------------------------------------------------------------


def latency_so_far(infos: dict, t: float) -> dict:
    """TTFT and TPOT of the requests as they stood at clock time ``t`` (means, counts)."""
    ttft, tpot = [], []
    for info in infos.values():
        m = info.metrics
        if m is None:
            continue
        if m.first_token_time is not None and m.first_token_time <= t + 1e-12:
            ttft.append(m.first_token_time - m.arrival_time)
        times = m.token_times
        n = bisect.bisect_right(times, t + 1e-12)
        if n >= 2:
            tpot.append((times[n - 1] - times[0]) / (n - 1))

    def mean(v):
        return sum(v) / len(v) if v else None

    return {
        "ttft_mean": mean(ttft),
        "ttft_n": len(ttft),
        "tpot_mean": mean(tpot),
        "tpot_n": len(tpot),
        "ttft_max": max(ttft) if ttft else None,
    }


def metrics_html(
    rec: Optional[StepRecord],
    progress: Progress,
    infos: dict,
    *,
    max_num_seqs: int,
    token_budget: int,
    num_taken: int,
    viewing_history: bool = False,
    kv_total: Optional[int] = None,
    note: str = "",
) -> str:
    """One line of numbers for the step on screen."""
    parts = []
    style = "font-family:var(--jp-ui-font-family, sans-serif);font-size:13px;line-height:1.6"
    if rec is None:
        queued = sum(1 for rid in infos if rid not in progress.finished)
        head = (
            f"<span class='mlw-step' style='font-weight:600'>step -</span> "
            f"(no step taken yet): {queued} request{'s' if queued != 1 else ''} added, "
            f"budget {token_budget} tokens, {max_num_seqs} sequences"
            + (f", KV {kv_total} positions" if kv_total else "")
        )
        return f"<div class='mlw-metrics' style='{style}'>{head}{_note(note)}</div>"
    hist = (
        f"<span style='background:#fff3cd;padding:0 4px;border-radius:3px'>history: "
        f"viewing step {rec.step}, latest is {num_taken - 1}</span> "
        if viewing_history
        else ""
    )
    parts.append(f"<span class='mlw-step' style='font-weight:600'>step {rec.step}</span>")
    clock = "wall clock: any pause between steps counts too" if rec.clock == "wall" else f"{_e(rec.clock)} clock"
    parts.append(f"t = {rec.time:.4f} s ({clock}; the step took {_fmt_s(rec.duration)})")
    parts.append(f"batch {len(rec.batch)}/{max_num_seqs} seqs ({len(rec.batch) / max(1, max_num_seqs):.0%})")
    parts.append(
        f"{rec.num_batched_tokens}/{rec.token_budget} tokens "
        f"({rec.num_batched_tokens / max(1, rec.token_budget):.0%} of the budget)"
    )
    kv = rec.kv
    if kv is not None:
        held = kv.used + kv.reserved_unused
        kv_s = f"KV {kv.used}/{kv.total} positions hold KV ({kv.used / max(1, kv.total):.0%})"
        if kv.reserved_unused:
            kv_s += f", {kv.reserved_unused} reserved unused (held {held / max(1, kv.total):.0%})"
        parts.append(kv_s)
    lat = latency_so_far(infos, rec.time)
    parts.append(f"TTFT mean {_fmt_s(lat['ttft_mean'])} (n={lat['ttft_n']})")
    parts.append(f"TPOT mean {_fmt_s(lat['tpot_mean'])} (n={lat['tpot_n']})")
    parts.append(f"finished {len(progress.finished)}/{len(infos)}")
    if progress.num_preemptions:
        parts.append(f"preemptions {progress.num_preemptions}")
    return f"<div class='mlw-metrics' style='{style}'>{hist}" + " &middot; ".join(parts) + f"{_note(note)}</div>"


def finished_html(num_requests: int, last_step: Optional[int]) -> str:
    """The banner of a run that has finished: why Step is off, and what to press."""
    when = f" (last step: {last_step})" if last_step is not None else ""
    return (
        "<div class='mlw-finished' style='margin:3px 0;padding:3px 8px;background:#fff3cd;"
        "border:1px solid #e0c060;border-radius:3px;font-family:var(--jp-ui-font-family, sans-serif);"
        f"font-size:13px'><b>Finished</b>: all {num_requests} request{'s' if num_requests != 1 else ''} "
        f"are done{_e(when)}, so Step and Run are off. Press <b>Reset</b> to step through again "
        "from the start, or drag <i>view step</i> to look back.</div>"
    )


def _note(note: str) -> str:
    return f"<br><span class='mlw-note' style='color:#a05a00'>{_e(note)}</span>" if note else ""


# --- the queue and the running set ------------------------------------------------------

ID_PX = 84  # widest request id shown in full in the queue (longer ids end in "...")


def _request_row(
    rid: str, colors: ColorMap, info: Optional[RequestInfo], computed: int, outputs: int, status: str, detail: str = ""
) -> str:
    """One request: colour, id, status, prompt computed and output generated (bars); an
    optional second line (why it waits) under it. A long id is cut with an ellipsis (the whole
    id on hover) and a long status wraps, so the counts stay inside the panel."""
    color = colors[rid]
    plen = info.prompt_len if info else 0
    mt = info.max_tokens if info else 0
    pc = min(computed, plen) if plen else computed
    row = (
        "<tr class='mlw-row'>"
        f"<td style='white-space:nowrap;padding-right:6px' title='{_e(rid)}'>{_swatch(color)}"
        f"<b class='mlw-rid' style='display:inline-block;max-width:{ID_PX}px;overflow:hidden;"
        f"text-overflow:ellipsis;white-space:nowrap;vertical-align:bottom'>{_e(rid)}</b></td>"
        f"<td style='white-space:normal;padding-right:6px;color:#333;min-width:60px'>{status}</td>"
        f"<td class='mlw-count' style='white-space:nowrap;font-size:11px;color:#555'>"
        f"{_bar(pc, plen, color, 36)}{pc}/{plen}</td>"
        f"<td class='mlw-count' style='white-space:nowrap;font-size:11px;color:#555;padding-left:4px'>"
        f"{_bar(outputs, mt, color, 36)}{outputs}/{mt}</td>"
        "</tr>"
    )
    if detail:
        row += (
            f"<tr><td></td><td colspan='3' style='font-size:11px;color:#666;padding:0 0 3px 0;"
            f"white-space:normal'>{detail}</td></tr>"
        )
    return row


_HEAD = (
    "<tr style='font-size:10.5px;color:#777'><td></td><td></td><td style='padding-left:3px'>prompt</td>"
    "<td style='padding-left:7px'>output</td></tr>"
)


def _section(title: str, rows: list[str], extra: int = 0) -> str:
    if not rows:
        return ""
    more = f"<div style='font-size:11px;color:#777'>... and {extra} more</div>" if extra > 0 else ""
    return (
        f"<div style='margin-top:6px;font-weight:600'>{title}</div>"
        f"<table style='border-collapse:collapse;font-size:12px'>{_HEAD}{''.join(rows)}</table>{more}"
    )


def idle_reason(rec: StepRecord, rid: str) -> str:
    """Why running request ``rid`` has no grant in step ``rec``: the scheduler's own reason, which the step
    recorded (``StepRecord.not_scheduled``). A record without one (made by hand) says only that."""
    return next((w.reason for w in rec.not_scheduled if w.request_id == rid), "not scheduled this step")


def queue_html(
    rec: Optional[StepRecord],
    progress: Progress,
    infos: dict,
    colors: ColorMap,
    *,
    max_num_seqs: int,
    max_rows: int = MAX_ROWS,
) -> str:
    """The running set and the waiting queue after the step, with each request's progress."""
    style = "font-family:var(--jp-ui-font-family, sans-serif);font-size:12px;line-height:1.35"
    out = [f"<div class='mlw-queue' style='{style}'>"]
    t = rec.time if rec is not None else 0.0
    per_req = rec.kv.per_request if rec is not None and rec.kv is not None else {}

    def computed(rid):
        rk = per_req.get(rid)
        return rk.used if rk is not None else 0

    if rec is None:
        waiting_ids = [rid for rid in infos if rid not in progress.finished]
        first = min((infos[r].arrival_time for r in waiting_ids), default=0.0)
        rows = [
            _request_row(
                rid,
                colors,
                infos.get(rid),
                0,
                0,
                "queued" if infos[rid].arrival_time <= first + 1e-9 else f"arrives at t={infos[rid].arrival_time:.3f}s",
            )
            for rid in waiting_ids[:max_rows]
        ]
        out.append(_section(f"Waiting queue ({len(waiting_ids)})", rows, len(waiting_ids) - max_rows))
        out.append("</div>")
        return "".join(out)

    # Running set.
    rows = []
    for rid in rec.running[:max_rows]:
        e = rec.entry(rid)
        if e is None:
            status = f"<span style='color:#a05a00'>{_e(idle_reason(rec, rid))}</span>"
        elif e.phase == "decode":
            status = f"decode +{e.num_new_tokens}"
            if e.num_spec_tokens:
                status += f" ({e.num_spec_accepted}/{e.num_spec_tokens} guesses kept)"
        else:  # a prefill that reached the end of what it knew sampled a token; else a chunk
            status = f"prefill +{e.num_new_tokens}" + ("" if e.num_output_tokens else " (chunk)")
        rows.append(_request_row(rid, colors, infos.get(rid), computed(rid), progress.outputs.get(rid, 0), status))
    out.append(
        _section(f"Running ({len(rec.running)}/{max_num_seqs} seqs)", rows, len(rec.running) - max_rows)
        or "<div style='margin-top:6px;font-weight:600'>Running (0)</div>"
    )
    # Swapped out (their KV sits in host memory), with why they have not come back yet.
    reasons = {w.request_id: w.reason for w in rec.waiting}
    swapped = set(rec.swapped)
    rows = [
        _request_row(
            rid,
            colors,
            infos.get(rid),
            0,
            progress.outputs.get(rid, 0),
            "swapped out (KV in host memory)",
            detail=_e(reasons.get(rid, "")),
        )
        for rid in rec.swapped[:max_rows]
    ]
    out.append(_section(f"Swapped out ({len(rec.swapped)})", rows, len(rec.swapped) - max_rows))
    # Waiting queue, with the reason each waits; then those that arrived during the step (after
    # its batch was formed: the scheduler sees them from the next step on).
    waiting = [w for w in rec.waiting if w.request_id not in swapped]
    arrived = arrived_during(rec, progress, infos)
    rows = []
    for w in waiting[:max_rows]:
        kind = "preempted, waits" if w.request_id in progress.preempted else "waits"
        rows.append(
            _request_row(
                w.request_id,
                colors,
                infos.get(w.request_id),
                computed(w.request_id),
                progress.outputs.get(w.request_id, 0),
                kind,
                detail=_e(w.reason),
            )
        )
    for rid in arrived[: max(0, max_rows - len(waiting))]:
        rows.append(
            _request_row(
                rid,
                colors,
                infos.get(rid),
                0,
                0,
                "<span class='mlw-arrived' style='color:#1f6f3f'>arrived during this step</span>",
                detail=f"arrived at t={infos[rid].arrival_time:.3f}s, after the batch was "
                "formed: it is considered from the next step",
            )
        )
    n_wait = len(waiting) + len(arrived)
    out.append(
        _section(f"Waiting queue ({n_wait})", rows, n_wait - max_rows)
        or "<div style='margin-top:6px;font-weight:600'>Waiting queue (0)</div>"
    )
    # Not arrived yet (a trace with arrival times).
    known = (
        set(rec.running)
        | set(rec.swapped)
        | {w.request_id for w in rec.waiting}
        | set(progress.finished)
        | set(arrived)
    )
    later = [rid for rid, info in infos.items() if rid not in known and info.arrival_time > t]
    if later:
        out.append(
            f"<div style='margin-top:6px;color:#777'>Not arrived yet ({len(later)}): "
            + ", ".join(f"{_e(r)} (t={infos[r].arrival_time:.3f}s)" for r in later[:max_rows])
            + (" ..." if len(later) > max_rows else "")
            + "</div>"
        )
    # Finished.
    if progress.finished:
        items = list(progress.finished.items())
        shown = items[-max_rows:]
        out.append(
            f"<div style='margin-top:6px'><b>Finished ({len(items)})</b>: "
            + ", ".join(f"{_swatch(colors[r])}{_e(r)} <span style='color:#777'>({_e(why)})</span>" for r, why in shown)
            + (" ..." if len(items) > max_rows else "")
            + "</div>"
        )
    out.append("</div>")
    return "".join(out)


# --- the step's decisions in plain words -------------------------------------------------


def reasons_html(
    rec: Optional[StepRecord], infos: dict, *, max_rows: int = MAX_ROWS, progress: Optional[Progress] = None
) -> str:
    """What the scheduler decided in this step, one plain sentence per decision (with
    ``progress``, the cumulative state after the step, also who arrived during it)."""
    style = (
        "font-family:var(--jp-ui-font-family, sans-serif);font-size:12.5px;line-height:1.5;"
        "background:#f7f7f9;border-left:3px solid #4C78A8;padding:4px 10px;margin-top:4px"
    )
    if rec is None:
        return (
            f"<div class='mlw-reasons' style='{style}'>Press <b>Step</b> to run one scheduler iteration: "
            "it decides who runs and how many tokens each gets under the execution-token budget, "
            "runs the batch, then shows what it did here.</div>"
        )
    items = []
    if not rec.reformed:
        items.append("The batch was <b>not re-formed</b> this step (schedule_every &gt; 1): the last one ran again.")
    if rec.batch:
        parts = []
        for e in rec.batch:
            info = infos.get(e.request_id)
            if e.phase == "decode" and e.num_spec_tokens:
                rejected = e.num_spec_tokens - e.num_spec_accepted
                own = e.num_new_tokens - e.num_spec_tokens
                parts.append(
                    f"<b>{_e(e.request_id)}</b> decode +{e.num_new_tokens} ({own} "
                    f"of its own + {e.num_spec_tokens} draft guesses: {e.num_spec_accepted} accepted, "
                    f"{rejected} rejected and rolled back)"
                )
            elif e.phase == "decode":
                parts.append(f"<b>{_e(e.request_id)}</b> decode +{e.num_new_tokens}")
            else:
                chunk = ""
                if not e.num_output_tokens:
                    total = f"/{info.prompt_len}" if info is not None and e.context_len < info.prompt_len else ""
                    chunk = f", a chunk: {e.context_len}{total} tokens computed so far"
                parts.append(f"<b>{_e(e.request_id)}</b> prefill +{e.num_new_tokens}{chunk}")
        items.append(f"Ran {rec.num_batched_tokens} of {rec.token_budget} budget tokens: " + "; ".join(parts) + ".")
    else:
        items.append("Nothing ran this step.")
    if rec.admitted:
        items.append(
            "Admitted: "
            + ", ".join(f"<b>{_e(r)}</b>" for r in rec.admitted)
            + " (the resources it needs were free, so its prefill joined the batch)."
        )
    for rid in rec.swapped_in:
        items.append(f"Swapped in: <b>{_e(rid)}</b> (its KV copied back from host memory).")
    for p in rec.preempted:
        how = (
            "its KV was dropped and will be recomputed"
            if p.mode == "recompute"
            else "its KV was copied to host memory (swap)"
        )
        items.append(f"Preempted: <b>{_e(p.request_id)}</b>, {how}, because {_e(p.reason)}.")
    for f in rec.forks:
        items.append(
            f"Forked: <b>{_e(f.request_id)}</b>'s prompt is computed; its {len(f.sequences)} samples "
            f"({', '.join(_e(s) for s in f.sequences)}) now share its {len(f.shared_blocks)} blocks "
            f"(each held {len(f.sequences)} times), nothing copied."
        )
    for c in rec.copies:
        items.append(
            f"Copy-on-write: <b>{_e(c.request_id)}</b> was about to write into block {c.src_block}, "
            f"which other samples share, so it got block {c.dst_block} with a copy of its contents."
        )
    for w in rec.waiting[:max_rows]:
        items.append(f"<b>{_e(w.request_id)}</b> waits: {_e(w.reason)}.")
    if len(rec.waiting) > max_rows:
        items.append(f"... and {len(rec.waiting) - max_rows} more wait.")
    for rid in (rid for rid in rec.running if rec.entry(rid) is None):
        items.append(f"Running but given no tokens this step: <b>{_e(rid)}</b>, {_e(idle_reason(rec, rid))}.")
    for rid in rec.finished:
        why = rec.finish_reasons.get(rid, "")
        why_s = {"length": "reached max_tokens", "stop": "produced a stop token"}.get(why, why)
        items.append(f"Finished: <b>{_e(rid)}</b> ({_e(why_s)}); its KV is freed.")
    for w in rec.rejected:
        items.append(f"Rejected: <b>{_e(w.request_id)}</b>: {_e(w.reason)}.")
    for rid in rec.aborted:
        items.append(f"Aborted: <b>{_e(rid)}</b>.")
    for rid in (arrived_during(rec, progress, infos) if progress is not None else [])[:max_rows]:
        items.append(
            f"Arrived during the step: <b>{_e(rid)}</b> (t={infos[rid].arrival_time:.3f}s), after "
            "the batch was formed; it joins the waiting queue at the next step."
        )
    body = "".join(f"<li>{it}</li>" for it in items)
    return (
        f"<div class='mlw-reasons' style='{style}'><b>What step {rec.step} did</b>"
        f"<ul style='margin:2px 0 2px 18px;padding:0'>{body}</ul></div>"
    )
