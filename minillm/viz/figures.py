"""Plotly figures of what the engine did, drawn from ``StepRecord``s and request metrics.

Every figure here is a plain function that takes data and returns a ``plotly``
figure, so a notebook can use it without any widget. The step-through widgets
(``minillm.viz``) draw with the same functions and then keep the figure
alive, updating its traces in place after each step (``update_batch_figure``,
``update_kv_map``, inside ``fig.batch_update()``).

What each figure shows, in the notebooks' vocabulary:

* ``batch_figure``: one step's batch against the **execution-token budget**, a
  stacked bar of decode tokens, prefill-chunk tokens and unused budget (the
  upper bar of Figure 3 in notebook 01); with speculative decoding each request's draft
  guesses are their own segments, marked accepted or rejected.
* ``kv_map_figure``: the **KV memory map** after a step, one cell per block (or
  per token position when the capacity is small, as in Figure 4 of notebook 02),
  coloured by the request that owns it; **reserved but unused** positions are
  hatched, a prefix block shared by n requests is marked ``xn``, a free block
  that still holds a cached prefix is dotted slate grey, a free block is empty;
  the legend shows each state with its own fill.
* ``compare_kv_figure``: the KV maps of several engines at the same step, one
  above the other: reservation vs paging (Figure 4 of notebook 02).
* ``gantt_figure``: each request's life, queued -> prefill -> decode, with its
  preempted and swapped-out stretches.
* ``latency_cdf_figure``: TTFT and TPOT distributions of several configurations.
* ``kv_usage_figure``: KV positions used / reserved / cached over time.
* ``roofline_figure`` and ``throughput_latency_figure``: why batching decode is
  nearly free (memory bound) until it is not (compute bound).

Colours are stable per request: ``ColorMap`` hands out palette colours in the
order requests are first seen (the engine's add order), so request "B" keeps its
colour in every step, every figure and both halves of a lockstep view.
"""

from __future__ import annotations

import colorsys
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..step_record import BlockInfo, KVSnapshot, StepRecord

__all__ = [
    "PALETTE",
    "log_ticks",
    "ColorMap",
    "request_color",
    "KVCells",
    "kv_cells",
    "kv_labels",
    "empty_kv_snapshot",
    "kv_map_figure",
    "update_kv_map",
    "compare_kv_figure",
    "batch_segments",
    "batch_figure",
    "update_batch_figure",
    "gantt_segments",
    "gantt_figure",
    "latency_cdf_figure",
    "kv_usage_figure",
    "roofline_figure",
    "throughput_latency_figure",
]

# =====================================================================================
# Colours
# =====================================================================================

# Vega's category10, with its grey swapped for a purple: grey means "free" here.
PALETTE = [
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#EECA3B",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#7F3C8D",
    "#1F9E89",
    "#D4A017",
    "#3F51B5",
    "#C2185B",
    "#6D8B3A",
    "#8C6D31",
]


def log_ticks(marks: tuple = (1, 2, 5)) -> dict:
    """Tick labels for a log axis, written out, at ``marks`` of every power of ten (1, 2, 5: 0.01, 0.02,
    0.05, 0.1, ...): an axis spanning less than a decade still has labels, and none are plotly's small
    2-to-9 digits. ``fig.update_yaxes(type="log", **log_ticks())``; ``(1, 3)`` for an axis of many decades."""
    vals = [m * 10.0**e for e in range(-4, 7) for m in marks]
    return dict(tickvals=vals, ticktext=[f"{v:g}" for v in vals])


FREE_LINE = "#c4c4c4"  # outline of a free cell
CACHED_FILL = "#dde3ea"  # a free block that still holds a cached prefix (under a dotted pattern)
UNUSED_BUDGET = "#eeeeee"  # execution-token budget left unused
PHASE_COLORS = {
    "queued": "#c9c9c9",
    "prefill": "#F58518",
    "decode": "#4C78A8",
    "stalled": "#EECA3B",
    "preempted": "#E45756",
    "swapped": "#B279A2",
}


def _extra_color(i: int) -> str:
    """Colours past the palette: golden-ratio hues, fixed saturation and lightness."""
    h = (0.13 + i * 0.618033988749895) % 1.0
    r, g, b = colorsys.hls_to_rgb(h, 0.50, 0.55)
    return "#%02x%02x%02x" % (int(r * 255), int(g * 255), int(b * 255))


def request_color(request_id: Any, order: Optional[int] = None) -> str:
    """A deterministic colour: the ``order``-th palette colour, else one from a hash of the id."""
    i = order if order is not None else zlib.crc32(str(request_id).encode())
    return PALETTE[i] if i < len(PALETTE) else _extra_color(i)


def _tint(color: str, alpha: float) -> str:
    c = color.lstrip("#")
    r, g, b = int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)
    return f"rgba({r},{g},{b},{alpha})"


class ColorMap:
    """Request id -> colour, handed out in the order ids are first seen (stable across steps)."""

    def __init__(self, request_ids: Iterable[str] = ()):
        self._colors: dict[str, str] = {}
        self.assign(request_ids)

    def assign(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self[str(rid)]

    def __getitem__(self, request_id: Any) -> str:
        rid = str(request_id)
        if rid not in self._colors:
            self._colors[rid] = request_color(rid, len(self._colors))
        return self._colors[rid]

    def __contains__(self, request_id: Any) -> bool:
        return str(request_id) in self._colors

    def __len__(self) -> int:
        return len(self._colors)


def _colors(colors: Optional[ColorMap]) -> ColorMap:
    return colors if colors is not None else ColorMap()


# =====================================================================================
# The KV memory map
# =====================================================================================


@dataclass
class KVCells:
    """The KV map as cells, ready to draw. One list entry per cell.

    ``unit`` is "position" (one cell per token position, grouped by block), "block",
    "blocks" (``blocks_per_cell`` blocks aggregated into one cell) or "aggregate" (no
    per-block map was recorded: cells are laid out from the per-request totals, not
    from real addresses).
    """

    unit: str
    positions_per_cell: int
    blocks_per_cell: int
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    block_ids: list[str] = field(default_factory=list)  # "7", or "12-15" for an aggregate cell
    owners: list[list[str]] = field(default_factory=list)  # request ids holding a reference
    owner: list[Optional[str]] = field(default_factory=list)  # the one the cell is coloured by
    filled: list[float] = field(default_factory=list)  # fraction of the cell holding KV
    reserved: list[float] = field(default_factory=list)  # fraction reserved for an owner, empty
    cached: list[float] = field(default_factory=list)  # fraction free but holding a cached prefix
    ref_count: list[int] = field(default_factory=list)
    label: list[str] = field(default_factory=list)
    hover: list[str] = field(default_factory=list)
    num_rows: int = 1
    x_max: float = 0.0

    def __len__(self) -> int:
        return len(self.x)


def empty_kv_snapshot(num_blocks: int, block_size: int, detail: bool = True) -> KVSnapshot:
    """The KV cache before the first step: every block free (what the map shows at step 0)."""
    total = num_blocks * block_size
    snap = KVSnapshot(
        total=total,
        used=0,
        free=total,
        blocks_total=num_blocks,
        blocks_used=0,
        blocks_free=num_blocks,
        block_size=block_size,
    )
    if detail:
        snap.blocks = [BlockInfo(block_id=i, owners=[], num_filled=0, ref_count=0) for i in range(num_blocks)]
    return snap


def _looks_reserved(kv: KVSnapshot) -> bool:
    return kv.reserved_unused > 0 or any(b.reserved for b in kv.blocks)


def kv_cells(
    kv: KVSnapshot, *, max_cells: int = 512, per_position_max: int = 64, mode: Optional[str] = None, columns: int = 32
) -> KVCells:
    """Turn a ``KVSnapshot`` into drawable cells.

    One cell per token position when the capacity is at most ``per_position_max``
    positions (and positions within a block are known: paged allocation, or
    block_size 1); else one cell per block; past ``max_cells`` blocks, consecutive
    blocks are aggregated into one cell so a map of thousands of blocks stays light.
    ``mode`` is the engine's ``kv_allocation`` ("paged" | "reserved"); None guesses it.
    """
    bs = max(1, kv.block_size)
    if mode is None:
        mode = "reserved" if _looks_reserved(kv) else "paged"
    blocks = kv.blocks
    if not blocks:
        return _aggregate_cells(kv, max_cells, columns)
    if kv.total <= per_position_max and (bs == 1 or mode == "paged"):
        return _position_cells(kv, columns)
    k = max(1, math.ceil(len(blocks) / max_cells))
    cells = KVCells(unit="block" if k == 1 else "blocks", positions_per_cell=bs * k, blocks_per_cell=k)
    for start in range(0, len(blocks), k):
        group = blocks[start : start + k]
        cap = bs * len(group)
        filled = sum(b.num_filled for b in group if b.ref_count > 0)
        reserved = sum(b.reserved for b in group if b.ref_count > 0)
        cached = sum(b.num_filled for b in group if b.ref_count == 0 and b.cached)
        weight: dict[str, int] = {}
        owners: list[str] = []
        for b in group:
            for rid in b.owners:
                if rid not in weight:
                    owners.append(rid)
                weight[rid] = weight.get(rid, 0) + max(1, b.num_filled + b.reserved)
        owner = max(owners, key=lambda r: weight[r]) if owners else None
        ref = max((b.ref_count for b in group), default=0)
        ids = str(group[0].block_id) if len(group) == 1 else f"{group[0].block_id}-{group[-1].block_id}"
        _add_cell(
            cells,
            ids,
            owners,
            owner,
            filled / cap,
            reserved / cap,
            cached / cap,
            ref,
            _block_hover(ids, group, owners, filled, reserved, cached, cap),
        )
    _grid(cells, columns)
    return cells


def _block_hover(ids, group, owners, filled, reserved, cached, cap) -> str:
    what = "block" if len(group) == 1 else "blocks"
    lines = [f"{what} {ids}"]
    if owners:
        lines.append("owner: " + ", ".join(owners[:6]) + (" ..." if len(owners) > 6 else ""))
    lines.append(f"holds KV: {filled}/{cap} positions")
    if reserved:
        lines.append(f"reserved, unused: {reserved}")
    if cached:
        lines.append(f"free, cached prefix: {cached}")
    ref = max((b.ref_count for b in group), default=0)
    if ref > 1:
        lines.append(f"shared: ref count {ref}")
    if not owners and not cached:
        lines.append("free")
    return "<br>".join(lines)


def _add_cell(
    cells: KVCells,
    ids: str,
    owners: list[str],
    owner: Optional[str],
    filled: float,
    reserved: float,
    cached: float,
    ref: int,
    hover: str,
) -> None:
    cells.block_ids.append(ids)
    cells.owners.append(list(owners))
    cells.owner.append(owner)
    cells.filled.append(float(filled))
    cells.reserved.append(float(reserved))
    cells.cached.append(float(cached))
    cells.ref_count.append(int(ref))
    cells.hover.append(hover)


def _grid(cells: KVCells, columns: int) -> None:
    n = len(cells.block_ids)
    cols = max(1, min(n, columns))
    cells.x = [float(i % cols) for i in range(n)]
    cells.y = [-float(i // cols) for i in range(n)]
    cells.num_rows = max(1, math.ceil(n / cols))
    cells.x_max = float(cols - 1)


def _position_cells(kv: KVSnapshot, columns: int) -> KVCells:
    """One cell per token position; positions of a block sit together, blocks apart."""
    bs = max(1, kv.block_size)
    cells = KVCells(unit="position", positions_per_cell=1, blocks_per_cell=1)
    blocks_per_row = max(1, columns // bs) if bs > 1 else max(1, min(len(kv.blocks), columns))
    gap = 0.45 if bs > 1 else 0.0
    xs, ys = [], []
    for idx, b in enumerate(kv.blocks):
        row, col = divmod(idx, blocks_per_row)
        owned = b.ref_count > 0
        for p in range(bs):
            filled = 1.0 if owned and p < b.num_filled else 0.0
            cached = 1.0 if (not owned and b.cached and p < max(b.num_filled, 0)) else 0.0
            # Reserved positions follow the filled ones (block_size 1: the block is one position).
            reserved = 1.0 if owned and not filled and p < b.num_filled + b.reserved else 0.0
            owner = b.owners[0] if b.owners else None
            pos = b.block_id * bs + p
            if filled:
                state = "holds KV"
            elif reserved:
                state = "reserved, unused"
            elif owned:
                state = "allocated, not yet filled"
            elif cached:
                state = "free, holds a cached prefix"
            else:
                state = "free"
            hover = f"position {pos} (block {b.block_id})<br>{state}"
            if b.owners:
                hover += "<br>owner: " + ", ".join(b.owners)
            if b.ref_count > 1:
                hover += f"<br>shared: ref count {b.ref_count}"
            _add_cell(cells, str(b.block_id), b.owners, owner, filled, reserved, cached, b.ref_count, hover)
            xs.append(col * (bs + gap) + p)
            ys.append(-float(row))
    cells.x, cells.y = [float(v) for v in xs], ys
    cells.num_rows = int(-min(ys)) + 1 if ys else 1
    cells.x_max = max(xs) if xs else 0.0
    return cells


def _aggregate_cells(kv: KVSnapshot, max_cells: int, columns: int) -> KVCells:
    """No block map recorded (very large caches): cells laid out from per-request totals."""
    n = max(1, min(kv.blocks_total, max_cells))
    per_cell = max(1, kv.total / n)
    cells = KVCells(
        unit="aggregate",
        positions_per_cell=int(math.ceil(per_cell)),
        blocks_per_cell=max(1, math.ceil(kv.blocks_total / n)),
    )
    segments: list[tuple[Optional[str], float, float, float]] = []  # owner, filled, reserved, cached
    for rid, rk in kv.per_request.items():
        segments.append((rid, float(rk.used), float(rk.reserved_unused), 0.0))
    if kv.cached:
        segments.append((None, 0.0, 0.0, float(kv.cached)))
    i = 0
    for owner, used, res, cached in segments:
        size = used + res + cached
        k = max(1, round(size / per_cell)) if size else 0
        for j in range(k):
            if i >= n:
                break
            f = used / size if size else 0.0
            r = res / size if size else 0.0
            c = cached / size if size else 0.0
            _add_cell(
                cells,
                f"~{i}",
                [owner] if owner else [],
                owner,
                f,
                r,
                c,
                1 if owner else 0,
                (f"{owner}: {int(used)} positions of KV" + (f", {int(res)} reserved unused" if res else ""))
                if owner
                else f"free, cached prefix: {int(cached)} positions",
            )
            i += 1
    while i < n:
        _add_cell(cells, f"~{i}", [], None, 0.0, 0.0, 0.0, 0, "free")
        i += 1
    _grid(cells, columns)
    return cells


KV_TRACE_NAMES = ("cell", "holds KV", "reserved, unused", "cached prefix, free", "labels")
_CELL_H = 0.86  # cell height in row units
_CELL_W = 0.86
_LABEL_PX = 6.4  # width of one label character at the labels' font size (10 px), with a margin
_DEFAULT_WIDTH = 600  # the width a map is assumed to get when none is set (label fitting)


def _cell_px(cells: KVCells, width: Optional[int]) -> float:
    """Width of one cell on screen, in pixels, for a map ``width`` pixels wide."""
    plot = max(100, (width or _DEFAULT_WIDTH) - 20)  # less the left and right margins
    return plot * _CELL_W / (cells.x_max + 1.2)


_LABEL_SIZES = ((10, _LABEL_PX), (8, 5.2))  # font size, px per character: normal, then small


def _fit(candidates: Sequence[str], px: float, small: Sequence[str] = ()) -> tuple[str, int]:
    """The first label that fits in ``px`` pixels at the normal font size, else the first of
    ``small`` that fits at the small size; ("", 10) when none does."""
    for (size, char_px), options in zip(_LABEL_SIZES, (candidates, small)):
        for t in options:
            if t and len(t) * char_px <= px:
                return t, size
    return "", _LABEL_SIZES[0][0]


def kv_labels(cells: KVCells, width: Optional[int] = None, labels: Optional[bool] = None) -> tuple:
    """Where the map writes text: (x, y, text, font size), one entry per label, never wider
    than its room.

    A cell holding KV is labelled with its owner; a block shared by n requests with ``×n``
    ("A×3" when that fits, else "×3"). One cell per token position: one label per block,
    centred over the block's positions, so the cells of a shared block do not each repeat it.
    """
    if labels is None:
        labels = len(cells) <= 160
    px = _cell_px(cells, width)
    xs, ys, texts, sizes = [], [], [], []
    i, n = 0, len(cells)
    while i < n:
        j = i + 1
        if cells.unit == "position":  # the positions of one block, on one row
            while j < n and cells.block_ids[j] == cells.block_ids[i] and cells.y[j] == cells.y[i]:
                j += 1
        o, ref = cells.owner[i], cells.ref_count[i]
        used = [k for k in range(i, j) if cells.filled[k] > 0 or cells.reserved[k] > 0]
        shared = f"\u00d7{ref}" if ref > 1 else ""
        if o is not None and used:
            if cells.unit == "position" and not shared:
                for k in used:  # an owner's id in every position cell that fits it
                    t, size = _fit([str(o)] if labels else [], px)
                    if t:
                        xs.append(cells.x[k]), ys.append(cells.y[k]), texts.append(t), sizes.append(size)
            else:  # the shared mark always shows, in a smaller font if need be
                room = px + (cells.x[used[-1]] - cells.x[used[0]]) * px / _CELL_W
                t, size = _fit(([f"{o}{shared}"] if labels else []) + [shared], room, [shared])
                if t:
                    xs.append((cells.x[used[0]] + cells.x[used[-1]]) / 2), ys.append(cells.y[i])
                    texts.append(t), sizes.append(size)
        i = j
    return xs, ys, texts, sizes


def _kv_trace_data(
    cells: KVCells, colors: ColorMap, labels: Optional[bool] = None, width: Optional[int] = None
) -> list[dict]:
    """The five traces of a KV map, as dicts (same order every step)."""
    h = _CELL_H
    bottoms = [y - h / 2 for y in cells.y]
    own_color = [colors[o] if o is not None else FREE_LINE for o in cells.owner]
    line_color = [CACHED_LINE if o is None and c > 0 else oc for oc, o, c in zip(own_color, cells.owner, cells.cached)]
    bg_fill = [_tint(c, 0.16) if o is not None else "white" for c, o in zip(own_color, cells.owner)]
    filled_h = [h * f for f in cells.filled]
    res_base = [b + fh for b, fh in zip(bottoms, filled_h)]
    res_h = [h * r for r in cells.reserved]
    cached_h = [h * c for c in cells.cached]
    customdata = [[ids, ",".join(ow), hv] for ids, ow, hv in zip(cells.block_ids, cells.owners, cells.hover)]
    lx, ly, text, sizes = kv_labels(cells, width, labels)
    return [
        dict(
            x=cells.x,
            y=[h] * len(cells),
            base=bottoms,
            customdata=customdata,
            marker=dict(color=bg_fill, line=dict(color=line_color, width=1)),
        ),
        dict(
            x=cells.x, y=filled_h, base=bottoms, customdata=customdata, marker=dict(color=own_color, line=dict(width=0))
        ),
        dict(
            x=cells.x,
            y=res_h,
            base=res_base,
            customdata=customdata,
            marker=dict(
                color="white",
                line=dict(width=0),
                pattern=dict(shape="/", fgcolor=own_color, bgcolor="white", size=6, solidity=0.4),
            ),
        ),
        dict(x=cells.x, y=cached_h, base=bottoms, customdata=customdata, marker=_CACHED_MARKER),
        dict(x=lx, y=ly, text=text, textfont=dict(size=sizes, color="#222")),
    ]


# A free block that still holds a cached prefix: dotted slate grey on a pale fill, so it reads
# apart from a free (white) cell and from a request's colour.
CACHED_LINE = "#7d8b99"
_CACHED_MARKER = dict(
    color=CACHED_FILL,
    line=dict(width=0),
    pattern=dict(shape=".", fgcolor="#5f6f80", bgcolor=CACHED_FILL, size=5, solidity=0.45),
)

# The map's legend: one entry per cell state, drawn with the cells' own fill and pattern.
KV_LEGEND_ENTRIES = (
    ("holds KV (owner's colour)", dict(color="#8a8a8a", line=dict(color="#8a8a8a", width=1))),
    (
        "reserved, unused",
        dict(
            color="white",
            line=dict(color="#8a8a8a", width=1),
            pattern=dict(shape="/", fgcolor="#8a8a8a", bgcolor="white", size=6, solidity=0.4),
        ),
    ),
    ("cached prefix, free (reusable)", dict(_CACHED_MARKER, line=dict(color=CACHED_LINE, width=1))),
    ("free", dict(color="white", line=dict(color=FREE_LINE, width=1))),
)


def _kv_traces(cells: KVCells, colors: ColorMap, width: Optional[int] = None) -> list:
    data = _kv_trace_data(cells, colors, width=width)
    hover = "%{customdata[2]}<extra></extra>"
    traces = []
    for name, d in zip(KV_TRACE_NAMES[:4], data[:4]):
        traces.append(go.Bar(name=name, width=_CELL_W, orientation="v", showlegend=False, hovertemplate=hover, **d))
    traces.append(go.Scatter(name="labels", mode="text", showlegend=False, hoverinfo="skip", **data[4]))
    return traces


def _kv_legend_traces() -> list:
    """Legend-only traces (no data): the cell states with their real fill and pattern."""
    return [
        go.Bar(name=name, x=[None], y=[None], marker=marker, hoverinfo="skip", showlegend=True)
        for name, marker in KV_LEGEND_ENTRIES
    ]


def _kv_title(kv: KVSnapshot, cells: KVCells, step: Optional[int] = None) -> str:
    parts = [f"KV {kv.used}/{kv.total} positions hold KV"]
    if kv.reserved_unused:
        parts.append(f"{kv.reserved_unused} reserved, unused")
    if kv.cached:
        parts.append(f"{kv.cached} cached (free)")
    parts.append(f"{kv.free} free")
    head = "" if step is None else f"after step {step}: "
    return head + ", ".join(parts)


def _kv_unit(kv: KVSnapshot, cells: KVCells) -> str:
    return {
        "position": f"one cell = one token position ({kv.block_size} per block)"
        if kv.block_size > 1
        else "one cell = one token position",
        "block": f"one cell = one block of {kv.block_size} positions",
        "blocks": f"one cell = {cells.blocks_per_cell} blocks of {kv.block_size} positions",
        "aggregate": "totals only: the engine recorded no block map for this many blocks",
    }[cells.unit]


KV_LEGEND = "\u00d7n: a block shared by n requests"


def _kv_legend(unit: str) -> str:
    return f"<span style='color:#555'>{unit} \u00b7 {KV_LEGEND}</span>"


_LEGEND_H = 62  # px under the map: the unit line and the legend's entries (two rows when narrow)


def _kv_layout(cells: KVCells, title: str, width: Optional[int], legend: Optional[str] = None) -> dict:
    rows = cells.num_rows
    height = int(min(640 + _LEGEND_H, 70 + 30 * rows + (_LEGEND_H if legend else 8)))
    lay = dict(
        title=dict(text=title, font=dict(size=13), x=0.01, xanchor="left", y=0.97, yanchor="top"),
        barmode="overlay",
        bargap=0,
        height=height,
        margin=dict(l=10, r=10, t=40, b=_LEGEND_H if legend else 8, autoexpand=False),
        plot_bgcolor="white",
        paper_bgcolor="white",
        hovermode="closest",
        showlegend=bool(legend),
        legend=dict(
            orientation="h",
            x=0,
            xanchor="left",
            y=0,
            yanchor="bottom",
            yref="container",
            font=dict(size=11),
            itemclick=False,
            itemdoubleclick=False,
            tracegroupgap=0,
        ),
        xaxis=dict(visible=False, range=[-0.6, cells.x_max + 0.6], fixedrange=True),
        yaxis=dict(visible=False, range=[-(rows - 1) - 0.6, 0.6], fixedrange=True),
        annotations=[
            dict(
                text=legend,
                xref="paper",
                yref="paper",
                x=0,
                y=0,
                yanchor="top",
                yshift=-2,
                align="left",
                xanchor="left",
                showarrow=False,
                font=dict(size=11),
            )
        ]
        if legend
        else [],
    )
    if width:
        lay["width"] = width
    return lay


def kv_map_figure(
    record: Union[StepRecord, KVSnapshot, None] = None,
    *,
    colors: Optional[ColorMap] = None,
    max_cells: int = 512,
    per_position_max: int = 64,
    mode: Optional[str] = None,
    width: Optional[int] = None,
    title: Optional[str] = None,
) -> go.Figure:
    """The KV memory map after a step (a ``StepRecord`` or its ``kv`` snapshot)."""
    kv, step = _kv_of(record)
    colors = _colors(colors)
    cells = kv_cells(kv, max_cells=max_cells, per_position_max=per_position_max, mode=mode)
    fig = go.Figure(
        data=_kv_traces(cells, colors, width) + _kv_legend_traces(),
        layout=_kv_layout(cells, title or _kv_title(kv, cells, step), width, legend=_kv_legend(_kv_unit(kv, cells))),
    )
    return fig


def _kv_of(record) -> tuple[KVSnapshot, Optional[int]]:
    if record is None:
        return empty_kv_snapshot(16, 1), None
    if isinstance(record, KVSnapshot):
        return record, None
    return record.kv, record.step


def update_kv_map(
    fig: go.Figure,
    record: Union[StepRecord, KVSnapshot],
    *,
    colors: Optional[ColorMap] = None,
    max_cells: int = 512,
    per_position_max: int = 64,
    mode: Optional[str] = None,
    title: Optional[str] = None,
) -> KVCells:
    """Redraw a ``kv_map_figure`` for another step, in place (same traces, new data)."""
    kv, step = _kv_of(record)
    colors = _colors(colors)
    cells = kv_cells(kv, max_cells=max_cells, per_position_max=per_position_max, mode=mode)
    data = _kv_trace_data(cells, colors, width=fig.layout.width)
    lay = _kv_layout(cells, title or _kv_title(kv, cells, step), None, legend=_kv_legend(_kv_unit(kv, cells)))
    with _batch(fig):
        for trace, d in zip(fig.data, data):
            trace.update(d)
        fig.layout.title.text = lay["title"]["text"]
        if fig.layout.annotations:
            fig.layout.annotations[0].text = lay["annotations"][0]["text"]
        if fig.layout.height != lay["height"]:
            fig.layout.height = lay["height"]
        fig.layout.xaxis.range = lay["xaxis"]["range"]
        fig.layout.yaxis.range = lay["yaxis"]["range"]
    return cells


def _batch(fig):
    """``fig.batch_update()``: a live figure (``minillm.viz.LiveFigure``) redraws once, at the end."""
    return fig.batch_update()


def compare_kv_figure(
    records: Mapping[str, Union[StepRecord, KVSnapshot]],
    *,
    colors: Optional[ColorMap] = None,
    max_cells: int = 512,
    per_position_max: int = 64,
    width: Optional[int] = None,
    title: Optional[str] = None,
) -> go.Figure:
    """KV maps of several engines at one step, one above the other (Figure 4 of notebook 02).

    ``records``: name -> the StepRecord (or KV snapshot) of that engine at the step to show,
    e.g. ``{"reserved": rec_a, "paged": rec_b}``. Each row's title says what waits and why; the figure's
    title (default: the engines compared) sits above them.
    """
    colors = _colors(colors)
    names = list(records)
    title = title or "KV caches side by side: " + ", ".join(names)
    cells_by = {}
    subtitles = []
    for name in names:
        kv, step = _kv_of(records[name])
        cells = kv_cells(kv, max_cells=max_cells, per_position_max=per_position_max)
        cells_by[name] = cells
        sub = f"<b>{name}</b>: " + _kv_title(kv, cells, step)
        rec = records[name]
        if isinstance(rec, StepRecord) and rec.waiting:
            w = rec.waiting[0]
            sub += f"<br><span style='font-size:11px'>{w.request_id} waits: {w.reason}</span>"
        subtitles.append(sub)
    heights = [c.num_rows for c in cells_by.values()]
    fig = make_subplots(
        rows=len(names),
        cols=1,
        subplot_titles=subtitles,
        vertical_spacing=0.25 / max(1, len(names)),
        row_heights=[h / sum(heights) for h in heights],
    )
    for i, name in enumerate(names, start=1):
        cells = cells_by[name]
        for tr in _kv_traces(cells, colors, width):
            fig.add_trace(tr, row=i, col=1)
        fig.update_xaxes(visible=False, range=[-0.6, cells.x_max + 0.6], row=i, col=1)
        fig.update_yaxes(visible=False, range=[-(cells.num_rows - 1) - 0.6, 0.6], row=i, col=1)
    for a in fig.layout.annotations:
        a.update(x=0, xanchor="left", font=dict(size=12), align="left")
    first = next(iter(cells_by.values()), None)
    unit = _kv_unit(_kv_of(records[names[0]])[0], first) if first is not None else ""
    for tr in _kv_legend_traces():
        fig.add_trace(tr, row=1, col=1)
    fig.add_annotation(
        text=_kv_legend(unit),
        xref="paper",
        yref="paper",
        x=0,
        y=0,
        yanchor="top",
        yshift=-4,
        xanchor="left",
        align="left",
        showarrow=False,
        font=dict(size=11),
    )
    fig.update_layout(
        barmode="overlay",
        bargap=0,
        plot_bgcolor="white",
        showlegend=True,
        legend=dict(
            orientation="h",
            x=0,
            xanchor="left",
            y=0,
            yanchor="bottom",
            yref="container",
            font=dict(size=11),
            itemclick=False,
            itemdoubleclick=False,
        ),
        height=int(min(900 + _LEGEND_H, 60 + _LEGEND_H + sum(110 + 30 * h for h in heights))),
        margin=dict(l=10, r=10, t=70 if title else 50, b=_LEGEND_H + 10, autoexpand=False),
        title=dict(text=title, x=0.01) if title else None,
    )
    if width:
        fig.update_layout(width=width)
    return fig


# =====================================================================================
# The batch against the execution-token budget
# =====================================================================================

SEGMENT_KINDS = ("decode", "prefill", "unused", "accepted", "rejected")


def batch_segments(record: Optional[StepRecord], token_budget: Optional[int] = None) -> dict[str, list[dict]]:
    """The stacked bar's segments: {"decode", "prefill", "unused", "accepted", "rejected"} -> a
    list of dict(request_id, start, tokens, label, context).

    A request's tokens are one segment of its phase; with speculative decoding its guesses
    follow it as their own segments, the accepted ones, then the rejected ones (their KV is
    rolled back). Sums: decode + prefill + accepted + rejected = record.num_batched_tokens,
    accepted = the guesses kept, rejected = the guesses dropped, unused = token_budget -
    num_batched_tokens.
    """
    out: dict[str, list[dict]] = {k: [] for k in SEGMENT_KINDS}
    if record is None:  # before the first step: the whole budget is unused
        if token_budget:
            out["unused"].append(
                dict(
                    request_id=None,
                    start=0,
                    tokens=token_budget,
                    label=f"budget {token_budget}, nothing ran yet",
                    context=0,
                )
            )
        return out
    pos = 0
    for e in record.batch:
        if e.num_new_tokens <= 0:
            continue
        kind = "decode" if e.phase == "decode" else "prefill"
        spec = max(0, min(e.num_spec_tokens, e.num_new_tokens))
        kept = max(0, min(e.num_spec_accepted, spec))
        own = e.num_new_tokens - spec
        label = f"{e.request_id} {'decode' if kind == 'decode' else 'prefill'} {e.num_new_tokens}"
        if spec:
            label += (
                f": {own} token{'s' if own != 1 else ''} of its own + {spec} draft guesses, "
                f"{kept} accepted, {spec - kept} rejected"
            )
        if own:
            out[kind].append(dict(request_id=e.request_id, start=pos, tokens=own, label=label, context=e.context_len))
            pos += own
        for part, n in (("accepted", kept), ("rejected", spec - kept)):
            if n:
                what = "accepted: their KV stays" if part == "accepted" else "rejected: their KV is rolled back"
                out[part].append(
                    dict(
                        request_id=e.request_id,
                        start=pos,
                        tokens=n,
                        context=e.context_len,
                        label=f"{e.request_id}: {n} draft guess{'es' if n != 1 else ''} {what}",
                    )
                )
                pos += n
    unused = max(0, record.token_budget - record.num_batched_tokens)
    if unused:
        out["unused"].append(
            dict(request_id=None, start=record.num_batched_tokens, tokens=unused, label=f"unused {unused}", context=0)
        )
    return out


# The bar's traces, in this order on every step (a live figure updates them in place);
# legend-only traces follow them.
BATCH_TRACE_NAMES = ("decode", "prefill chunk", "unused budget", "guess accepted", "guess rejected")
ACCEPTED_LINE = "#2e7d32"  # outline of accepted draft guesses (green)
REJECTED_COLOR = "#d62728"  # rejected draft guesses: red cross-hatch


def _segment_marker(kind: str, own: list[str]) -> tuple[dict, list[str]]:
    """Marker and label colours of one kind of segment, for segments of colours ``own``."""
    if kind == "decode":
        return dict(color=own, line=dict(color="white", width=1.5)), ["white"] * len(own)
    if kind == "prefill":
        return dict(color=[_tint(c, 0.35) for c in own], line=dict(color=own, width=2)), ["#222"] * len(own)
    if kind == "accepted":  # the request's colour, hatched, with a green outline
        return (
            dict(
                color=own,
                line=dict(color=ACCEPTED_LINE, width=2.5),
                pattern=dict(shape="/", fgcolor="white", size=7, solidity=0.25),
            ),
            ["white"] * len(own),
        )
    if kind == "rejected":  # pale, red cross-hatch, red outline: computed, then thrown away
        return (
            dict(
                color="#fdecea",
                line=dict(color=REJECTED_COLOR, width=2),
                pattern=dict(shape="x", fgcolor=REJECTED_COLOR, bgcolor="#fdecea", size=7, solidity=0.2),
            ),
            [REJECTED_COLOR] * len(own),
        )
    return dict(color=UNUSED_BUDGET, line=dict(color="#bbbbbb", width=1)), ["#666"] * len(own)


def _batch_trace_data(
    record: Optional[StepRecord], colors: ColorMap, token_budget: Optional[int] = None, width: Optional[int] = None
) -> list[dict]:
    """Decode segments solid in the request's colour, prefill chunks a light tint of it with
    an outline, draft guesses marked accepted (hatched, green outline) or rejected (red
    cross-hatch), the unused budget light grey."""
    seg = batch_segments(record, token_budget)
    budget = record.token_budget if record is not None else (token_budget or 1)
    data = []
    for kind in ("decode", "prefill", "unused", "accepted", "rejected"):
        s = seg[kind]
        own = [colors[d["request_id"]] if d["request_id"] is not None else UNUSED_BUDGET for d in s]
        marker, font = _segment_marker(kind, own)
        data.append(
            dict(
                x=[d["tokens"] for d in s],
                base=[d["start"] for d in s],
                y=["tokens"] * len(s),
                text=[_short_label(d, kind, budget, width) for d in s],
                hovertext=[d["label"] for d in s],
                customdata=[d["request_id"] or "" for d in s],
                marker=marker,
                textfont=dict(color=font, size=11),
            )
        )
    return data


_BAR_CHAR_PX = 7.0  # one character of a segment's label (11 px font)
_BAR_PAD_PX = 6  # room a label leaves at the segment's edges


def _short_label(d: dict, kind: str, budget: int = 0, width: Optional[int] = None) -> str:
    """The text inside a segment: the longest form that fits its width, else none (hover has it)."""
    n = d["tokens"]
    if kind == "unused":
        options = [f"unused {n}", f"{n}"]
    elif kind in ("accepted", "rejected"):
        mark = "\u2713" if kind == "accepted" else "\u2717"
        options = [f"{mark}{n} {kind}", f"{mark}{n}", mark]
    else:
        tag = "d" if kind == "decode" else "p"
        rid = str(d["request_id"])
        options = [f"{rid} {tag}{n}"] + ([rid, f"{tag}{n}"] if len(rid) <= 3 else [f"{tag}{n}", rid])
    room = ((width or _DEFAULT_WIDTH) - 20) * n / max(1, budget) if budget else float("inf")
    for t in options:
        if len(t) * _BAR_CHAR_PX + _BAR_PAD_PX <= room:
            return t
    return ""


def _batch_title(record: Optional[StepRecord], budget: int) -> str:
    if record is None:
        return f"batch: nothing ran yet (execution-token budget {budget})"
    head = (
        f"step {record.step}: {record.num_batched_tokens}/{record.token_budget} tokens "
        f"(decode {record.num_decode_tokens}, prefill {record.num_prefill_tokens}), "
        f"{len(record.batch)} request{'s' if len(record.batch) != 1 else ''}"
    )
    guessed = sum(e.num_spec_tokens for e in record.batch)
    if guessed:
        kept = sum(e.num_spec_accepted for e in record.batch)
        head += f"; draft guesses {kept}/{guessed} accepted"
    return head


def _batch_layout(budget: int, title: str, width: Optional[int]) -> dict:
    lay = dict(
        title=dict(text=title, font=dict(size=13), x=0.01, xanchor="left"),
        barmode="overlay",
        height=160,
        margin=dict(l=10, r=10, t=36, b=44),
        plot_bgcolor="white",
        paper_bgcolor="white",
        hovermode="closest",
        legend=dict(
            orientation="h",
            x=0,
            xanchor="left",
            y=0,
            yanchor="bottom",
            yref="container",
            font=dict(size=11),
            itemclick=False,
            itemdoubleclick=False,
        ),
        xaxis=dict(range=[0, max(1, budget)], title=None, fixedrange=True, showgrid=False, tickfont=dict(size=10)),
        yaxis=dict(visible=False, fixedrange=True),
    )
    if width:
        lay["width"] = width
    return lay


BATCH_LEGEND = (
    "decode (solid)",
    "prefill chunk (light, outlined)",
    "unused budget",
    "draft guess accepted",
    "draft guess rejected",
)


def batch_figure(
    record: Optional[StepRecord] = None,
    *,
    colors: Optional[ColorMap] = None,
    token_budget: Optional[int] = None,
    width: Optional[int] = None,
    speculative: Optional[bool] = None,
) -> go.Figure:
    """One step's batch against the execution-token budget: decode | prefill chunk | draft
    guesses accepted / rejected | unused. ``speculative``: list the guesses in the legend
    (default: when the record has any)."""
    colors = _colors(colors)
    budget = record.token_budget if record is not None else (token_budget or 1)
    data = _batch_trace_data(record, colors, budget, width)
    traces = []
    for name, d in zip(BATCH_TRACE_NAMES, data):
        traces.append(
            go.Bar(
                name=name,
                orientation="h",
                width=0.6,
                textposition="inside",
                insidetextanchor="middle",
                constraintext="none",
                textangle=0,
                showlegend=False,
                hovertemplate="%{hovertext}<extra></extra>",
                **d,
            )
        )
    if speculative is None:
        speculative = record is not None and any(e.num_spec_tokens for e in record.batch)
    # Legend swatches in neutral colours (the bars themselves carry each request's colour).
    kinds = ("decode", "prefill", "unused") + (("accepted", "rejected") if speculative else ())
    for kind in kinds:
        marker, _ = _segment_marker(kind, ["#777777"])
        marker = {k: (v[0] if isinstance(v, list) else v) for k, v in marker.items()}
        if isinstance(marker.get("line"), dict):
            marker["line"] = {k: (v[0] if isinstance(v, list) else v) for k, v in marker["line"].items()}
        name = BATCH_LEGEND[SEGMENT_KINDS.index(kind)]
        traces.append(go.Bar(name=name, x=[None], y=[None], orientation="h", marker=marker, hoverinfo="skip"))
    return go.Figure(data=traces, layout=_batch_layout(budget, _batch_title(record, budget), width))


def update_batch_figure(
    fig: go.Figure,
    record: Optional[StepRecord],
    *,
    colors: Optional[ColorMap] = None,
    token_budget: Optional[int] = None,
) -> None:
    """Redraw a ``batch_figure`` for another step, in place."""
    colors = _colors(colors)
    budget = record.token_budget if record is not None else (token_budget or 1)
    data = _batch_trace_data(record, colors, budget, fig.layout.width)
    with _batch(fig):
        for trace, d in zip(fig.data, data):
            trace.update(d)
        fig.layout.title.text = _batch_title(record, budget)
        fig.layout.xaxis.range = [0, max(1, budget)]


# =====================================================================================
# Requests over time: Gantt, latency CDFs, KV use
# =====================================================================================


def _metrics_by_id(requests: Any) -> dict[str, Any]:
    """id -> RequestMetrics from a dict, or a list of requests / outputs / metrics objects."""
    if requests is None:
        return {}
    if isinstance(requests, Mapping):
        items = list(requests.items())
    else:
        items = [(getattr(r, "request_id", i), r) for i, r in enumerate(requests)]
    out = {}
    for rid, r in items:
        m = getattr(r, "metrics", None)
        out[str(rid)] = m if m is not None and hasattr(m, "arrival_time") else r
    return out


GANTT_STATES = ("queued", "prefill", "decode", "stalled", "preempted", "swapped")
GANTT_LABELS = {
    "queued": "queued",
    "prefill": "prefill",
    "decode": "decode",
    "stalled": "running, not scheduled",
    "preempted": "preempted (waiting again)",
    "swapped": "swapped out",
}


def gantt_segments(records: Sequence[StepRecord], requests: Any = None) -> dict[str, list[tuple[str, float, float]]]:
    """Per request, the stretches of its life: {state: [(request_id, start, end), ...]}.

    States: "queued" (arrived, never run yet), "prefill" / "decode" (in the step's batch),
    "stalled" (running but given no tokens that step), "preempted" (KV dropped, waiting to be
    recomputed), "swapped" (KV in host memory). Step k spans [time - duration, time]; a state
    that lasts several steps is one stretch. A queued stretch starts at the request's arrival
    when its metrics are given.
    """
    metrics = _metrics_by_id(requests)
    out: dict[str, list[tuple[str, float, float]]] = {s: [] for s in GANTT_STATES}
    open_: dict[str, tuple[str, float, float]] = {}  # rid -> (state, start, end)
    started: set[str] = set()
    preempted: set[str] = set()
    done: set[str] = set()
    seen: set[str] = set()

    def close(rid):
        if rid in open_:
            st, a, b = open_.pop(rid)
            out[st].append((rid, a, b))

    def extend(rid, state, a, b):
        cur = open_.get(rid)
        if cur is not None and cur[0] == state:
            open_[rid] = (state, cur[1], b)
            return
        close(rid)
        open_[rid] = (state, a, b)

    for rec in records:
        a, b = rec.time - rec.duration, rec.time
        states: dict[str, str] = {}
        for p in rec.preempted:
            preempted.add(p.request_id)
        for w in rec.waiting:
            states[w.request_id] = (
                "preempted" if w.request_id in preempted else ("swapped" if w.request_id in rec.swapped else "queued")
            )
        for rid in rec.swapped:
            states[rid] = "swapped"
        for rid in rec.running:
            states[rid] = "stalled"
        for e in rec.batch:
            states[e.request_id] = "decode" if e.phase == "decode" else "prefill"
            started.add(e.request_id)
            if e.request_id in rec.admitted or e.request_id in rec.swapped_in:
                preempted.discard(e.request_id)
        for rid, st in states.items():
            if rid in done:
                continue
            arrival = getattr(metrics.get(rid), "arrival_time", None)
            first = rid not in seen
            seen.add(rid)
            if first and arrival is not None and arrival < a:
                if st == "queued":
                    extend(rid, st, arrival, b)
                    continue
                out["queued"].append((rid, arrival, a))  # arrived while the last step ran
            extend(rid, st, a, b)
        for rid in list(open_):
            if rid not in states:
                close(rid)
        for rid in list(rec.finished) + [w.request_id for w in rec.rejected] + list(rec.aborted):
            close(rid)
            done.add(rid)
    for rid in list(open_):
        close(rid)
    return out


def gantt_figure(
    records: Sequence[StepRecord],
    requests: Any = None,
    *,
    title: Optional[str] = None,
    max_requests: int = 60,
    width: Optional[int] = None,
) -> go.Figure:
    """A timeline per request: queued, prefill, decode, stalled, preempted and swapped stretches,
    with its first token (TTFT) and its finish marked. ``requests``: the engine's requests or
    their RequestMetrics (dict id -> metrics, or a list), for arrival, first-token and finish times.
    """
    seg = gantt_segments(records, requests)
    metrics = _metrics_by_id(requests)
    order: list[str] = list(metrics) if metrics else []
    for st in GANTT_STATES:
        for rid, _, _ in seg[st]:
            if rid not in order:
                order.append(rid)
    shown = order[:max_requests]
    keep = set(shown)
    fig = go.Figure()
    for st in GANTT_STATES:
        rows = [s for s in seg[st] if s[0] in keep]
        fig.add_trace(
            go.Bar(
                name=GANTT_LABELS[st],
                orientation="h",
                y=[r[0] for r in rows],
                x=[r[2] - r[1] for r in rows],
                base=[r[1] for r in rows],
                marker=dict(color=PHASE_COLORS[st], pattern=dict(shape="/" if st in ("preempted", "swapped") else "")),
                width=0.7,
                hovertemplate="%{y}: " + GANTT_LABELS[st] + " %{base:.4f} -> %{x:.4f}s long<extra></extra>",
            )
        )
    if metrics:
        ft = [
            (rid, metrics[rid].first_token_time)
            for rid in shown
            if getattr(metrics.get(rid), "first_token_time", None) is not None
        ]
        fin = [
            (rid, metrics[rid].finish_time)
            for rid in shown
            if getattr(metrics.get(rid), "finish_time", None) is not None
        ]
        fig.add_trace(
            go.Scatter(
                name="first token",
                mode="markers",
                y=[r for r, _ in ft],
                x=[t for _, t in ft],
                marker=dict(symbol="line-ns-open", size=14, color="black", line=dict(width=2)),
            )
        )
        fig.add_trace(
            go.Scatter(
                name="finished",
                mode="markers",
                y=[r for r, _ in fin],
                x=[t for _, t in fin],
                marker=dict(symbol="diamond", size=8, color="black"),
            )
        )
    clock = records[0].clock if records else "wall"
    fig.update_layout(
        barmode="overlay",
        title=title or f"request timeline ({len(order)} requests)",
        xaxis_title=f"time (s, {clock} clock)",
        plot_bgcolor="white",
        height=int(min(900, 140 + 22 * len(shown))),
        yaxis=dict(autorange="reversed", type="category", categoryorder="array", categoryarray=shown, title="request"),
        legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0),
        margin=dict(l=10, r=10, t=70, b=40),
    )
    fig.update_xaxes(showgrid=True, gridcolor="#eee")
    if width:
        fig.update_layout(width=width)
    return fig


def _ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Step-function points of the empirical CDF, starting at 0 (values rounded to 6 digits)."""
    v = np.sort(np.asarray([float(f"{x:.6g}") for x in values if x is not None], dtype=float))
    if not len(v):
        return v, np.array([])
    return np.concatenate([[v[0]], v]), np.concatenate([[0.0], np.arange(1, len(v) + 1) / len(v)])


def latency_cdf_figure(
    configs: Mapping[str, Sequence[Any]],
    metrics: Sequence[str] = ("ttft", "tpot"),
    *,
    unit: str = "ms",
    title: Optional[str] = None,
    width: Optional[int] = None,
) -> go.Figure:
    """TTFT and TPOT CDFs, one line per configuration.

    ``configs``: name -> list of RequestMetrics (anything with ``.ttft`` / ``.tpot``, or
    objects with ``.metrics``). Requests without a value (no first token; one output token
    for TPOT) are left out. The p50 and p99 of each line are in its hover text.
    """
    scale = {"ms": 1e3, "s": 1.0}[unit]
    names = {
        "ttft": "TTFT (time to first token)",
        "tpot": "TPOT (time per output token)",
        "e2e_latency": "end-to-end latency",
        "queue_wait": "queue wait",
    }
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[names.get(m, m) for m in metrics])
    for i, (cfg, reqs) in enumerate(configs.items()):
        color = PALETTE[i % len(PALETTE)]
        ms = [getattr(r, "metrics", r) for r in reqs]
        for j, metric in enumerate(metrics, start=1):
            vals = [getattr(m, metric, None) for m in ms]
            x, y = _ecdf([v * scale for v in vals if v is not None])
            raw = [v * scale for v in vals if v is not None]
            p50 = np.percentile(raw, 50) if raw else float("nan")
            p99 = np.percentile(raw, 99) if raw else float("nan")
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines",
                    line=dict(shape="hv", color=color, width=2),
                    name=cfg,
                    legendgroup=cfg,
                    showlegend=j == 1,
                    hovertemplate=f"{cfg}: %{{x:.2f}} {unit} (p%{{y:.0%}})"
                    f"<br>p50 {p50:.2f}, p99 {p99:.2f}<extra></extra>",
                ),
                row=1,
                col=j,
            )
            fig.update_xaxes(
                title_text=f"{metric.replace('_', ' ')} ({unit})",
                row=1,
                col=j,
                showgrid=True,
                gridcolor="#eee",
                rangemode="tozero",
            )
    fig.update_yaxes(title_text="fraction of requests", showgrid=True, gridcolor="#eee", range=[0, 1.02])
    fig.update_layout(
        title=title or "latency CDF: the share of requests served within each time",
        plot_bgcolor="white",
        height=380,
        margin=dict(t=80),
        legend=dict(orientation="h", y=1.12, yanchor="bottom", x=0),
    )
    if width:
        fig.update_layout(width=width)
    return fig


def kv_usage_figure(
    records: Union[Sequence[StepRecord], Mapping[str, Sequence[StepRecord]]],
    *,
    x: str = "time",
    title: Optional[str] = None,
    width: Optional[int] = None,
) -> go.Figure:
    """KV use over time.

    One run (a list of records): stacked areas of positions holding KV, reserved but unused,
    and free-but-cached, under the capacity line. Several runs (name -> records): one line per
    run of the fraction of capacity holding KV, dashed for held (KV + reserved).
    ``x``: "time" (the engine's clock) or "step".
    """

    def xs(recs):
        return [r.time for r in recs] if x == "time" else [r.step for r in recs]

    fig = go.Figure()
    if isinstance(records, Mapping):
        for i, (name, recs) in enumerate(records.items()):
            color = PALETTE[i % len(PALETTE)]
            used = [r.kv.used / r.kv.total if r.kv.total else 0 for r in recs]
            held = [(r.kv.used + r.kv.reserved_unused) / r.kv.total if r.kv.total else 0 for r in recs]
            fig.add_trace(
                go.Scatter(
                    x=xs(recs), y=used, name=f"{name}: holds KV", mode="lines", line=dict(color=color, shape="hv")
                )
            )
            if any(h != u for h, u in zip(held, used)):
                fig.add_trace(
                    go.Scatter(
                        x=xs(recs),
                        y=held,
                        name=f"{name}: + reserved, unused",
                        mode="lines",
                        line=dict(color=color, dash="dash", shape="hv"),
                    )
                )
        fig.update_yaxes(title_text="fraction of KV capacity", range=[0, 1.05], tickformat=".0%")
    else:
        recs = list(records)
        t = xs(recs)
        layers = (
            ("holds KV", [r.kv.used for r in recs], "#4C78A8"),
            ("reserved, unused", [r.kv.reserved_unused for r in recs], "#F58518"),
            ("cached prefix, free", [r.kv.cached for r in recs], "#9aa9b8"),
        )
        for name, ys, color in layers:
            if name != "holds KV" and not any(ys):
                continue
            fig.add_trace(
                go.Scatter(
                    x=t, y=ys, name=name, stackgroup="kv", mode="lines", line=dict(color=color, shape="hv", width=1)
                )
            )
        if recs:
            fig.add_trace(
                go.Scatter(
                    x=t,
                    y=[r.kv.total for r in recs],
                    name="capacity",
                    mode="lines",
                    line=dict(color="black", dash="dot", shape="hv"),
                )
            )
        fig.update_yaxes(title_text="KV token positions", rangemode="tozero")
    fig.update_xaxes(title_text="time (s)" if x == "time" else "step", showgrid=True, gridcolor="#eee")
    fig.update_layout(
        title=title or "KV cache use",
        plot_bgcolor="white",
        height=340,
        legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0),
    )
    if width:
        fig.update_layout(width=width)
    return fig


# =====================================================================================
# Cost: roofline, throughput and latency vs batch size
# =====================================================================================


def roofline_figure(
    cost_model: Any = None,
    *,
    peak_flops: Optional[float] = None,
    bandwidth: Optional[float] = None,
    points: Optional[Mapping[str, tuple]] = None,
    batch_sizes: Sequence[int] = (1, 4, 16, 64, 256),
    context_len: int = 512,
    prefill_lens: Sequence[int] = (512,),
    title: Optional[str] = None,
    width: Optional[int] = None,
) -> go.Figure:
    """The roofline: attainable FLOP/s = min(peak, bandwidth x arithmetic intensity).

    Either a ``RooflineCostModel`` (its achievable peak and bandwidth; decode steps of each
    batch size at ``context_len`` and one prefill per ``prefill_lens`` are placed on it from
    ``breakdown()``), or explicit ``peak_flops`` (FLOP/s), ``bandwidth`` (bytes/s) and
    ``points``: name -> (arithmetic intensities, achieved FLOP/s) arrays.
    """
    pts: dict[str, tuple] = {}
    if cost_model is not None:
        peak_flops = peak_flops or cost_model.flops_per_s
        bandwidth = bandwidth or cost_model.bytes_per_s
        dec_i, dec_f, dec_t = [], [], []
        for b in batch_sizes:
            br = cost_model.breakdown([1] * int(b), [int(context_len)] * int(b))
            dec_i.append(br["arithmetic_intensity"])
            dec_f.append(br["flops"] / br["time"])
            dec_t.append(f"decode, batch {b}: {br['bound']} bound, {br['time'] * 1e3:.2f} ms")
        pts["decode (batch size)"] = (dec_i, dec_f, dec_t)
        pre_i, pre_f, pre_t = [], [], []
        for n in prefill_lens:
            br = cost_model.breakdown([int(n)], [int(n)])
            pre_i.append(br["arithmetic_intensity"])
            pre_f.append(br["flops"] / br["time"])
            pre_t.append(f"prefill of {n} tokens: {br['bound']} bound, {br['time'] * 1e3:.2f} ms")
        pts["prefill"] = (pre_i, pre_f, pre_t)
    for name, v in (points or {}).items():
        pts[name] = (list(v[0]), list(v[1]), list(v[2]) if len(v) > 2 else [name] * len(v[0]))
    if peak_flops is None or bandwidth is None:
        raise ValueError(
            "roofline_figure: give a cost model with flops_per_s / bytes_per_s / breakdown, "
            "or peak_flops= and bandwidth="
        )
    ridge = peak_flops / bandwidth
    all_i = [i for v in pts.values() for i in v[0] if i > 0] + [ridge]
    lo, hi = min(all_i) / 4, max(all_i) * 4
    xi = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=xi,
            y=np.minimum(peak_flops, bandwidth * xi),
            mode="lines",
            name="roofline",
            line=dict(color="black", width=2),
        )
    )
    fig.add_trace(
        go.Scatter(
            x=[ridge, ridge],
            y=[bandwidth * lo, peak_flops],
            mode="lines",
            name=f"ridge point: {ridge:.0f} FLOP/byte",
            line=dict(color="#999", dash="dot"),
        )
    )
    symbols = ["circle", "diamond", "square", "triangle-up"]
    for k, (name, (i, f, t)) in enumerate(pts.items()):
        fig.add_trace(
            go.Scatter(
                x=i,
                y=f,
                mode="markers+lines" if len(i) > 1 else "markers",
                name=name,
                text=t,
                hovertemplate="%{text}<extra></extra>",
                marker=dict(size=10, symbol=symbols[k % 4], color=PALETTE[k % len(PALETTE)]),
                line=dict(dash="dot", width=1),
            )
        )
    name = getattr(cost_model, "name", "") if cost_model is not None else ""
    fig.update_layout(
        title=title or (name or "roofline"),
        plot_bgcolor="white",
        height=420,
        xaxis=dict(type="log", title="arithmetic intensity (FLOP / byte moved)", gridcolor="#eee"),
        yaxis=dict(type="log", title="FLOP/s", gridcolor="#eee"),
        legend=dict(orientation="h", y=-0.2, yanchor="top"),
    )
    if width:
        fig.update_layout(width=width)
    return fig


def throughput_latency_figure(
    batch_sizes: Sequence[int],
    latency: Optional[Sequence[float]] = None,
    throughput: Optional[Sequence[float]] = None,
    *,
    cost_model: Any = None,
    context_len: int = 512,
    title: Optional[str] = None,
    width: Optional[int] = None,
) -> go.Figure:
    """Decode step latency (ms) and throughput (tokens/s) vs batch size, on two y axes.

    Give measured arrays (``latency`` in seconds per step, ``throughput`` in tokens/s; a
    missing one is derived as batch / latency), or a cost model with ``step_time``: every
    request decodes one token with ``context_len`` positions of KV.
    """
    b = np.asarray(list(batch_sizes), dtype=float)
    if latency is None and cost_model is not None:
        latency = [cost_model.step_time([1] * int(n), [int(context_len)] * int(n)) for n in b]
    if latency is None and throughput is None:
        raise ValueError("throughput_latency_figure: give latency and/or throughput arrays, or cost_model=")
    lat = np.asarray(latency, dtype=float) if latency is not None else b / np.asarray(throughput, float)
    thr = np.asarray(throughput, dtype=float) if throughput is not None else b / lat
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Scatter(
            x=b, y=thr, name="throughput (tokens/s)", mode="lines+markers", line=dict(color=PALETTE[0], width=2)
        ),
        secondary_y=False,
    )
    fig.add_trace(
        go.Scatter(
            x=b,
            y=lat * 1e3,
            name="step latency (ms)",
            mode="lines+markers",
            line=dict(color=PALETTE[1], width=2, dash="dash"),
        ),
        secondary_y=True,
    )
    if len(b) > 1:
        gain_t, gain_l = thr[-1] / thr[0], lat[-1] / lat[0]
        sub = f"batch {int(b[0])} -> {int(b[-1])}: throughput x{gain_t:.1f}, latency x{gain_l:.2f}"
    else:
        sub = ""
    fig.update_xaxes(title_text="batch size (requests decoding together)", type="log", gridcolor="#eee")
    fig.update_yaxes(title_text="tokens / s", secondary_y=False, rangemode="tozero", gridcolor="#eee")
    fig.update_yaxes(title_text="ms per step", secondary_y=True, rangemode="tozero", showgrid=False)
    name = getattr(cost_model, "name", "") if cost_model is not None else ""
    fig.update_layout(
        title=title or (f"batching decode {name}<br><sup>{sub}</sup>" if sub else f"batching decode {name}"),
        plot_bgcolor="white",
        height=400,
        legend=dict(orientation="h", y=-0.2, yanchor="top"),
    )
    if width:
        fig.update_layout(width=width)
    return fig
