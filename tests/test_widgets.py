"""The step-through widgets and figures, headless: click the buttons, read the figures back.

What is checked is that the widget draws what the engine recorded: after each Step the
batch bar's segments add up to the StepRecord's decode / prefill tokens and unused budget,
the KV map's cells carry the owners and fill of ``record.kv.blocks``, the history slider
puts an old record back on screen, and Reset rebuilds the engine at step 0. Figure 4's
numbers (reservation: C waits with 4 of 24 positions free; paging: B and C hold 7 + 6 = 13
positions) are worked out by hand, not read from the engine.
"""

from __future__ import annotations

import html
import math
import re

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import plotly.graph_objects as go

from minillm import LLM, SamplingParams
from minillm.viz import figures as F
from minillm.viz import LiveFigure, LockstepStepper, Stepper, reservation_vs_paging_lockstep, unused_reservation_engine
from minillm.viz import live

needs_anywidget = pytest.mark.skipif(
    not live.anywidget_available(), reason="the live figures' page side is an anywidget"
)

# (prompt length, max_tokens) of the small trace: more demand than 4 sequences / 16 tokens.
TRACE = [(6, 5), (10, 3), (3, 8), (12, 4), (5, 6)]
SMALL = dict(model="random", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)


def small_engine(**over):
    llm = LLM(**{**SMALL, **over})
    for i, (p, o) in enumerate(TRACE):
        llm.engine.add_request(
            list(range(10 + i, 10 + i + p)),
            SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0),
            request_id=chr(ord("A") + i),
        )
    return llm.engine


def text(h: str) -> str:
    """The visible text of an HTML panel, whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", h))).replace(" ,", ",").replace(" .", ".")


# --- what the figures must say -------------------------------------------------------------


def assert_batch_matches(fig, rec):
    dec, pre, unused, acc, rej = fig.data[:5]
    assert [t.name for t in fig.data[:5]] == list(F.BATCH_TRACE_NAMES)
    spec = sum(e.num_spec_tokens for e in rec.batch)
    kept = sum(e.num_spec_accepted for e in rec.batch)
    assert sum(acc.x or ()) == kept and sum(rej.x or ()) == spec - kept
    assert sum(dec.x or ()) + sum(acc.x or ()) + sum(rej.x or ()) == rec.num_decode_tokens
    assert sum(pre.x or ()) == rec.num_prefill_tokens
    assert sum(dec.x or ()) + sum(pre.x or ()) + spec == rec.num_batched_tokens
    assert sum(unused.x or ()) == rec.token_budget - rec.num_batched_tokens
    assert list(fig.layout.xaxis.range) == [0, rec.token_budget]
    per_request: dict[str, int] = {}
    for tr in (dec, pre, acc, rej):
        for rid, n in zip(tr.customdata or (), tr.x or ()):
            per_request[rid] = per_request.get(rid, 0) + n
    assert per_request == {e.request_id: e.num_new_tokens for e in rec.batch if e.num_new_tokens}
    # Segments tile the bar from 0 without overlap.
    segs = sorted(
        zip(
            [b for tr in (dec, pre, unused, acc, rej) for b in (tr.base or ())],
            [x for tr in (dec, pre, unused, acc, rej) for x in (tr.x or ())],
        )
    )
    pos = 0
    for base, width in segs:
        assert base == pos
        pos += width
    assert pos == rec.token_budget


def assert_kv_matches(fig, rec, stepper=None):
    bg, filled, reserved, cached = fig.data[0], fig.data[1], fig.data[2], fig.data[3]
    kv = rec.kv
    blocks = {b.block_id: b for b in kv.blocks}
    n = len(bg.x)
    assert len(filled.y) == len(reserved.y) == len(cached.y) == n
    per_block_filled: dict[int, float] = {}
    per_block_res: dict[int, float] = {}
    cells_per_block: dict[int, int] = {}
    for i in range(n):
        bid, owners, _ = bg.customdata[i]
        b = blocks[int(bid)]
        assert owners == ",".join(b.owners), f"cell {i}: block {bid}"
        per_block_filled[b.block_id] = per_block_filled.get(b.block_id, 0.0) + filled.y[i] / F._CELL_H
        per_block_res[b.block_id] = per_block_res.get(b.block_id, 0.0) + reserved.y[i] / F._CELL_H
        cells_per_block[b.block_id] = cells_per_block.get(b.block_id, 0) + 1
    assert set(cells_per_block) == set(blocks)
    for bid, b in blocks.items():
        scale = kv.block_size / cells_per_block[bid]  # positions per cell
        want = b.num_filled if b.ref_count > 0 else 0
        assert math.isclose(per_block_filled[bid] * scale, want, abs_tol=1e-9), bid
        assert math.isclose(per_block_res[bid] * scale, b.reserved if b.ref_count else 0, abs_tol=1e-9)
    # Owners colour the cells, with one stable colour per request.
    if stepper is not None:
        for i in range(n):
            owners = bg.customdata[i][1]
            if owners:
                assert filled.marker.color[i] == stepper.colors[owners.split(",")[0]]


def assert_shows(stepper, rec):
    assert stepper.shown is rec
    assert_batch_matches(stepper.batch_fig, rec)
    assert_kv_matches(stepper.kv_fig, rec, stepper)
    assert f"step {rec.step}" in text(stepper.metrics_html.value)
    reasons = text(stepper.reasons_html.value)
    for w in rec.waiting:
        assert f"{w.request_id} waits: {w.reason}" in reasons
    for rid in rec.admitted:
        assert rid in reasons
    for rid in rec.finished:
        assert f"Finished: {rid}" in reasons
    for p in rec.preempted:
        assert f"Preempted: {p.request_id}" in reasons


# --- the Stepper on the real (random-weight) model --------------------------------------------


@pytest.fixture(scope="module")
def real_stepper():
    return Stepper(small_engine)


def test_step_and_run_advance_exactly(real_stepper):
    s = real_stepper
    s.reset()
    assert s.engine.step_count == 0 and s.records == []
    assert isinstance(s.batch_fig, LiveFigure) and isinstance(s.kv_fig, LiveFigure)
    assert isinstance(s.batch_fig, go.Figure)
    assert (s.kv_fig.widget is not None) == live.anywidget_available()
    assert "step -" in text(s.metrics_html.value)

    s.step_button.click()
    assert s.engine.step_count == 1 and len(s.records) == 1
    assert_shows(s, s.records[-1])

    rec = s.step()  # same as a click
    assert rec is s.records[-1] and s.engine.step_count == 2
    assert_shows(s, rec)

    s.run_n.value = 3
    s.run_button.click()
    assert s.engine.step_count == 5 and len(s.records) == 5
    assert [r.step for r in s.records] == [0, 1, 2, 3, 4]
    assert s.records == s.engine.step_records
    assert_shows(s, s.records[-1])
    # The KV map of 64 positions is drawn one cell per position.
    assert len(s.kv_fig.data[0].x) == 64


def test_queue_panel_lists_running_and_waiting(real_stepper):
    s = real_stepper
    s.reset()
    s.step()
    rec = s.records[-1]
    q = text(s.queue_html.value)
    assert f"Running ({len(rec.running)}/4 seqs)" in q
    assert f"Waiting queue ({len(rec.waiting)})" in q
    for rid in rec.running:
        e = rec.entry(rid)
        assert f"{e.phase} +{e.num_new_tokens}" in q
    for w in rec.waiting:
        assert w.reason in q
    # Progress: prompt computed / output generated of the first request after its prefill.
    assert "prompt output A prefill +6 6/6 1/5" in q
    s.step()
    rec = s.records[-1]
    q = text(s.queue_html.value)
    chunks = [e for e in rec.batch if e.phase == "prefill" and e.num_output_tokens == 0]
    assert chunks, "the trace was built so a prompt is split by the budget"
    for e in chunks:
        assert f"{e.request_id} prefill +{e.num_new_tokens} (chunk)" in q
        assert f"{e.request_id} prefill +{e.num_new_tokens}, a chunk" in text(s.reasons_html.value)


def test_history_slider_shows_an_old_step(real_stepper):
    s = real_stepper
    s.reset()
    s.run(4)
    assert s.history.max == 3 and s.history.value == 3
    s.history.value = 1  # as if the reader dragged it
    assert s.engine.step_count == 4  # looking back does not step
    assert_shows(s, s.records[1])
    assert "history: viewing step 1, latest is 3" in text(s.metrics_html.value)
    s.history.value = 0
    assert_shows(s, s.records[0])
    s.step()  # a new step jumps back to the latest
    assert s.history.value == 4
    assert_shows(s, s.records[-1])


def test_reset_restores_step_zero(real_stepper):
    s = real_stepper
    s.reset()
    first = s.step()
    s.run(3)
    old_engine = s.engine
    s.reset_button.click()
    assert s.engine is not old_engine
    assert s.engine.step_count == 0 and s.records == [] and s.shown is None
    assert s.history.value == 0 and s.history.max == 0
    assert sum(s.batch_fig.data[0].x or ()) == 0 and sum(s.batch_fig.data[1].x or ()) == 0
    assert sum(s.batch_fig.data[2].x or ()) == SMALL["max_num_batched_tokens"]
    assert sum(s.kv_fig.data[1].y) == 0  # every cell free
    assert all(c[1] == "" for c in s.kv_fig.data[0].customdata)
    assert sorted(s.engine.requests) == list("ABCDE")
    again = s.step()  # the same trace replays
    assert [(e.request_id, e.phase, e.num_new_tokens) for e in again.batch] == [
        (e.request_id, e.phase, e.num_new_tokens) for e in first.batch
    ]


def _walk(w):
    yield w
    for c in getattr(w, "children", ()):
        yield from _walk(c)


@needs_anywidget
def test_figures_are_updated_in_place(real_stepper):
    s = real_stepper
    s.reset()
    batch_fig, kv_fig = s.batch_fig, s.kv_fig
    views = (batch_fig.widget, kv_fig.widget)
    uids = [t.uid for t in batch_fig.data] + [t.uid for t in kv_fig.data]
    assert None not in uids
    s.step()
    s.run(2)
    s.history.value = 0
    s.reset()
    rec = s.step()
    assert s.batch_fig is batch_fig and s.kv_fig is kv_fig
    assert (batch_fig.widget, kv_fig.widget) == views
    assert [t.uid for t in batch_fig.data] + [t.uid for t in kv_fig.data] == uids
    tree = list(_walk(s.widget))
    assert views[0] in tree and views[1] in tree
    # What the page is sent is the figure as it stands after the step.
    sent = kv_fig.widget.figure
    assert [t["uid"] for t in sent["data"]] == [t.uid for t in kv_fig.data]
    assert sent["data"][1]["y"] == list(kv_fig.data[1].y)
    assert sum(batch_fig.widget.figure["data"][1]["x"]) == rec.num_prefill_tokens
    assert kv_fig.widget.figure["layout"]["title"]["text"] == kv_fig.layout.title.text


@needs_anywidget
def test_live_figure_sends_plotly_js_on_request():
    fig = LiveFigure(F.batch_figure(None, token_budget=8))
    view = fig.widget
    sent = []
    view.send = lambda content, buffers=None: sent.append((content, buffers))
    view._on_msg(view, {"type": "need-plotly"}, [])
    assert sent[0][0] == {"type": "plotly-js"}
    assert b"Plotly" in sent[0][1][0][:2000] and len(sent[0][1][0]) > 1_000_000


def test_runs_to_the_end_then_refuses_to_step(real_stepper):
    s = real_stepper
    s.reset()
    s.run(1000)
    assert s.done
    n = s.engine.step_count
    assert s.step() is None and s.run(5) == []
    s.step_button.click()
    assert s.engine.step_count == n
    assert s.step_button.disabled and s.run_button.disabled
    assert "every request has finished" in text(s.metrics_html.value)
    # Why Step is off, and what to do, stays on screen (not only after a click).
    s.show(0)
    banner = text(s.finished_html.value)
    assert f"all 5 requests are done (last step: {n - 1})" in banner and "Press Reset" in banner
    s.show(n - 1)
    fin = set()
    for r in s.records:
        fin.update(r.finished)
    assert fin == set("ABCDE")
    assert "Finished (5)" in text(s.queue_html.value)
    s.reset()
    assert not s.step_button.disabled
    assert s.finished_html.value == ""


def test_request_colours_are_stable(real_stepper):
    s = real_stepper
    s.reset()
    before = {rid: s.colors[rid] for rid in "ABCDE"}
    assert len(set(before.values())) == 5
    s.run(3)
    s.reset()
    assert {rid: s.colors[rid] for rid in "ABCDE"} == before
    assert F.ColorMap(list("ABCDE"))["C"] == before["C"]


# --- the simulated executor, an engine (not a factory), the Play control ---------------------------


def sim_engine(**over):
    cfg = dict(SMALL, executor="simulated", clock="modeled", cost_model=0.01)
    cfg.update(over)
    llm = LLM(**cfg)
    for i, (p, o) in enumerate(TRACE):
        llm.engine.add_request(
            list(range(10, 10 + p)),
            SamplingParams(max_tokens=o, ignore_eos=True),
            request_id=f"r{i}",
            arrival_time=0.004 * i,
        )
    return llm


def test_engine_is_replayed_on_reset():
    s = Stepper(sim_engine())  # an LLM: its requests are recorded now
    first = [r.summary() for r in s.run(6)]
    for rec in s.records:
        s.show(rec.step)
        assert_shows(s, rec)
    s.reset()
    assert s.engine.step_count == 0
    assert [r.summary() for r in s.run(6)] == first  # modeled clock: the same run, exactly


def test_play_steps_once_per_tick_and_stops_at_the_end():
    s = Stepper(sim_engine())
    s.play.value = 1  # the browser's Play ticks the value
    assert s.engine.step_count == 1
    s.play.value = 0  # Play's stop rewinds: no step
    assert s.engine.step_count == 1
    s.run(1000)
    s.play.playing = True
    s._last_tick = 0.0
    s.play.value = 1
    assert s.play.playing is False
    s.speed.value = 10.0
    assert s.play.interval == 100


def test_without_anywidget_figures_are_redrawn_into_an_output(monkeypatch):
    import ipywidgets as W

    monkeypatch.setattr(live, "anywidget_available", lambda: False)
    s = Stepper(sim_engine())
    assert s.kv_fig.widget is None
    assert isinstance(s._kv_slot.view, W.Output) and isinstance(s._batch_slot.view, W.Output)
    rec = s.step()
    assert_shows(s, rec)


def test_requests_added_later_are_replayed():
    s = Stepper(lambda: sim_engine().engine)
    rid = s.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="late")
    assert rid == "late" and "late" in text(s.queue_html.value)
    s.run(3)
    s.reset()
    assert "late" in s.engine.requests and len(s.engine.requests) == len(TRACE) + 1


def test_preemption_is_explained():
    # 6 blocks of 4 positions: two long requests cannot both grow; one is preempted (recompute).
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=6,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        clock="modeled",
        cost_model=0.01,
    )
    for i in range(2):
        llm.engine.add_request(list(range(10, 18)), SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"P{i}")
    s = Stepper(llm)
    s.run(40)
    pre = [r for r in s.records if r.preempted]
    assert pre, "the trace was built to preempt"
    s.show(pre[0].step)
    assert_shows(s, pre[0])
    ev = pre[0].preempted[0]
    assert f"Preempted: {ev.request_id}, its KV was dropped and will be recomputed" in text(s.reasons_html.value)
    g = F.gantt_figure(s.records, s.engine.requests)
    preempted_trace = [t for t in g.data if t.name.startswith("preempted")][0]
    assert ev.request_id in preempted_trace.y


def test_swapped_requests_are_shown_once():
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=6,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        clock="modeled",
        cost_model="H100-SXM",
        preemption_mode="swap",
        num_swap_blocks=16,
    )
    for i in range(3):
        llm.engine.add_request(list(range(10, 18)), SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"S{i}")
    s = Stepper(llm)
    s.run(200)
    assert s.done
    rec = next(r for r in s.records if r.swapped)
    s.show(rec.step)
    assert_shows(s, rec)
    q = text(s.queue_html.value)
    assert f"Swapped out ({len(rec.swapped)})" in q
    waiting_part = q.split("Waiting queue")[1]
    for rid in rec.swapped:
        assert rid not in waiting_part
    seg = F.gantt_segments(s.records, s.engine.requests)
    assert {r for r, _, _ in seg["swapped"]} >= set(rec.swapped)


def test_prefix_sharing_and_cached_blocks_are_marked():
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=16,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        enable_prefix_caching=True,
        clock="modeled",
        cost_model=0.01,
    )
    prefix = list(range(10, 18))  # two full blocks shared
    llm.engine.add_request(
        prefix + [40, 41], SamplingParams(max_tokens=6, ignore_eos=True), request_id="X", arrival_time=0.0
    )
    llm.engine.add_request(
        prefix + [50, 51, 52], SamplingParams(max_tokens=3, ignore_eos=True), request_id="Y", arrival_time=0.015
    )
    s = Stepper(llm)
    shared_seen = cached_seen = False
    while not s.done:
        rec = s.step()
        assert_kv_matches(s.kv_fig, rec, s)
        labels = list(s.kv_fig.data[4].text)
        if any(b.ref_count > 1 for b in rec.kv.blocks):
            shared_seen = True
            assert any("\u00d72" in t for t in labels)
        if any(b.ref_count == 0 and b.cached for b in rec.kv.blocks):
            cached_seen = True
            assert sum(s.kv_fig.data[3].y) > 0
    assert shared_seen and cached_seen


def test_thousands_of_blocks_are_aggregated():
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=16,
        num_kv_blocks=3000,
        max_num_batched_tokens=512,
        max_num_seqs=32,
        clock="modeled",
        cost_model="H100-SXM",
        record="full",
    )  # the view needs the map
    for i in range(40):
        llm.engine.add_request([10 + i] * (50 + 7 * i), SamplingParams(max_tokens=20, ignore_eos=True))
    s = Stepper(llm, max_cells=300)
    s.run(5)
    cells = F.kv_cells(s.records[-1].kv, max_cells=300)
    assert cells.unit == "blocks" and len(cells) <= 300 and cells.blocks_per_cell == 10
    assert len(s.kv_fig.data[0].x) == len(cells)
    # Aggregated fill still adds up to the positions holding KV.
    kv = s.records[-1].kv
    total = sum(y / F._CELL_H for y in s.kv_fig.data[1].y) * cells.positions_per_cell
    assert math.isclose(total, kv.used, rel_tol=1e-9)
    # Past 4096 blocks the engine records no block map: totals only.
    big = LLM(
        model="random",
        executor="simulated",
        block_size=16,
        num_kv_blocks=5000,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        clock="modeled",
        cost_model="H100-SXM",
    )
    big.engine.add_request(list(range(10, 300)), SamplingParams(max_tokens=5, ignore_eos=True))
    sb = Stepper(big)
    rec = sb.step()
    assert rec.kv.blocks == []
    assert 0 < len(sb.kv_fig.data[0].x) <= 512
    assert "totals only" in sb.kv_fig.layout.annotations[0].text


# --- Figure 4: reservation vs paging, in lockstep ------------------------------------------------


def fig4_engine(kv_allocation):
    llm = LLM(
        model="random",
        block_size=1,
        num_kv_blocks=24,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        kv_allocation=kv_allocation,
        clock="modeled",
        cost_model=0.01,
        max_model_len=64,
    )
    llm.engine.add_request(
        list(range(10, 16)),
        SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.0),
        request_id="B",
        arrival_time=0.0,
    )  # 6 + 14 = a 20-position reservation
    llm.engine.add_request(
        list(range(20, 26)),
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
        request_id="C",
        arrival_time=0.005,
    )  # arrives during B's prefill
    return llm.engine


def cells_by_state(fig):
    bg, filled, reserved = fig.data[0], fig.data[1], fig.data[2]
    out = {"filled": [], "reserved": [], "free": 0}
    for i in range(len(bg.x)):
        owner = bg.customdata[i][1]
        if filled.y[i] > 0:
            out["filled"].append(owner)
        elif reserved.y[i] > 0:
            out["reserved"].append(owner)
        elif not owner:
            out["free"] += 1
    return out


def test_figure4_reservation_vs_paging_in_lockstep():
    lk = LockstepStepper(lambda: fig4_engine("reserved"), lambda: fig4_engine("paged"))
    assert lk.names == ["reserved", "paged"]
    lk.step_button.click()
    lk.step_button.click()
    res, pag = lk.left, lk.right
    assert res.engine.step_count == 2 and pag.engine.step_count == 2
    r0, r1 = res.records
    p0, p1 = pag.records

    # Step 0: B's prefill (6 tokens) in both. Reserved: B holds 20 positions, 4 free.
    assert [(e.request_id, e.num_new_tokens) for e in r0.batch] == [("B", 6)]
    assert (r0.kv.used, r0.kv.reserved_unused, r0.kv.free) == (6, 14, 4)

    # Step 1, reservation: B decodes inside its reservation; C's 6 positions cannot be allocated
    # from the 4 free ones, although only 13 positions would hold KV.
    assert [(e.request_id, e.phase, e.num_new_tokens) for e in r1.batch] == [("B", "decode", 1)]
    assert [w.request_id for w in r1.waiting] == ["C"]
    assert "4 free" in r1.waiting[0].reason
    m = cells_by_state(res.kv_fig)
    assert m["filled"] == ["B"] * 7 and m["reserved"] == ["B"] * 13 and m["free"] == 4
    assert "C waits" in text(res.reasons_html.value)

    # Step 1, paging: C joins: 1 + 6 = 7 tokens of the budget of 8, 7 + 6 = 13 positions of 24.
    assert p1.admitted == ["C"] and p1.num_batched_tokens == 7 and p1.kv.used == 13
    m = cells_by_state(pag.kv_fig)
    assert m["filled"] == ["B"] * 7 + ["C"] * 6 and m["reserved"] == [] and m["free"] == 11
    for s in lk.steppers:
        assert_shows(s, s.records[-1])

    # One colour per request on both sides.
    bi = [i for i, c in enumerate(res.kv_fig.data[0].customdata) if c[1] == "B"][0]
    assert res.kv_fig.data[1].marker.color[bi] == pag.kv_fig.data[1].marker.color[bi] == lk.colors["B"]

    # History moves both; a static side-by-side figure of the same step.
    lk.history.value = 0
    assert res.shown is r0 and pag.shown is p0
    fig = lk.compare_figure(1)
    assert len(fig.data) == 2 * len(F.KV_TRACE_NAMES) + len(F.KV_LEGEND_ENTRIES)
    lk.reset()
    assert [s.engine.step_count for s in lk.steppers] == [0, 0]


def test_the_reservation_vs_paging_helper_shows_c_waiting_then_joining():
    lk = reservation_vs_paging_lockstep()
    lk.run(2)
    r1, p1 = lk.left.records[1], lk.right.records[1]
    assert r1.waiting and r1.waiting[0].request_id == "C" and r1.kv.free == 4
    assert p1.admitted == ["C"] and p1.kv.used == 13
    eng = unused_reservation_engine("paged")
    assert eng.config.block_size == 1 and eng.num_kv_blocks == 24


# --- figures outside the widget -------------------------------------------------------------------


def test_static_figures_from_records_and_metrics():
    from minillm.sim.costmodel import ConstantStepTime, RooflineCostModel

    a, b = sim_engine().engine, sim_engine(max_num_seqs=2).engine
    ra, rb = a.run(), b.run()
    # Gantt: every request prefills then decodes, within [arrival, finish].
    seg = F.gantt_segments(ra, a.requests)
    for rid, req in a.requests.items():
        pre = [s for s in seg["prefill"] if s[0] == rid]
        dec = [s for s in seg["decode"] if s[0] == rid]
        assert pre and dec and pre[0][1] < dec[0][1]
        assert pre[0][1] >= req.metrics.arrival_time - 1e-12
        assert dec[-1][2] == pytest.approx(req.metrics.finish_time)
    g = F.gantt_figure(ra, a.requests)
    assert [t.name for t in g.data][:3] == ["queued", "prefill", "decode"]
    # CDFs: one step line per config and metric, ending at 1.
    cdf = F.latency_cdf_figure({"4 seqs": a.request_metrics(), "2 seqs": b.request_metrics()})
    assert len(cdf.data) == 4
    ttft = cdf.data[0]
    assert ttft.y[0] == 0 and ttft.y[-1] == 1 and len(ttft.x) == len(TRACE) + 1
    assert sorted(ttft.x[1:]) == pytest.approx(sorted(m.ttft * 1e3 for m in a.request_metrics()), rel=1e-5)
    # KV use over time: the stacked layer is kv.used of each record.
    ku = F.kv_usage_figure(ra)
    assert list(ku.data[0].y) == [r.kv.used for r in ra]
    assert len(F.kv_usage_figure({"a": ra, "b": rb}).data) >= 2
    # Roofline from a cost model and from arrays; decode at small batch sits on the memory roof.
    rm = RooflineCostModel("H100-SXM", "llama-2-7b")
    roof = F.roofline_figure(rm, batch_sizes=(1, 8, 64))
    roofline, dec = roof.data[0], roof.data[2]
    assert max(roofline.y) == pytest.approx(rm.flops_per_s)
    assert all(f <= min(rm.flops_per_s, rm.bytes_per_s * i) * (1 + 1e-9) for i, f in zip(dec.x, dec.y))
    F.roofline_figure(peak_flops=1e15, bandwidth=3e12, points={"mine": ([1, 10], [3e12, 2e13])})
    # Throughput / latency vs batch: from arrays and from a cost model with step_time.
    tl = F.throughput_latency_figure([1, 2, 4], latency=[0.01, 0.011, 0.012])
    assert list(tl.data[0].y) == pytest.approx([100, 2 / 0.011, 4 / 0.012])
    tl2 = F.throughput_latency_figure([1, 8], cost_model=ConstantStepTime(0.01))
    assert list(tl2.data[0].y) == pytest.approx([100, 800])
    # A KV map and a batch bar straight from one record.
    F.kv_map_figure(ra[0]).to_dict()
    bf = F.batch_figure(ra[0])
    assert_batch_matches(bf, ra[0])


# --- what the issue of a reader's first run showed: arrivals, labels, cached blocks, guesses, the end ---


def test_a_request_arriving_during_a_step_is_shown():
    # C arrives at t=0.005 s, inside step 0 (B's prefill, 10 ms on the modeled clock): after the
    # batch was formed, before the step ended. The record lists it nowhere; the view must.
    s = Stepper(lambda: fig4_engine("paged"))
    q = text(s.queue_html.value)
    assert "C arrives at t=0.005s" in q
    rec = s.step()
    assert "C" not in rec.running and "C" not in [w.request_id for w in rec.waiting]  # the premise
    q = text(s.queue_html.value)
    assert "Waiting queue (1)" in q and "C arrived during this step" in q
    assert "Not arrived yet" not in q
    assert "Arrived during the step: C (t=0.005s)" in text(s.reasons_html.value)
    rec = s.step()  # the next step admits it
    assert rec.admitted == ["C"]
    assert "arrived during" not in text(s.queue_html.value)
    assert "Arrived during" not in text(s.reasons_html.value)


def test_queue_rows_keep_long_ids_and_statuses_inside_the_panel():
    from minillm.viz.panels import ID_PX

    llm = LLM(**{**SMALL, "executor": "simulated", "clock": "modeled", "cost_model": 0.01})
    long_id = "a-request-with-a-very-long-name-0042"
    llm.engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=4, ignore_eos=True), request_id=long_id)
    s = Stepper(llm)
    s.step()
    h = s.queue_html.value
    # The id is cut with an ellipsis (whole on hover), the status may wrap, the counts never do.
    assert f"title='{long_id}'" in h and f"max-width:{ID_PX}px" in h and "text-overflow:ellipsis" in h
    assert "white-space:normal" in h.split("class='mlw-rid'")[1].split("mlw-count")[0]
    assert h.count("class='mlw-count' style='white-space:nowrap") == 2


def test_kv_labels_fit_their_cells_and_shared_blocks_stay_marked():
    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        enable_prefix_caching=True,
        clock="modeled",
        cost_model=0.01,
    )
    prefix = list(range(10, 26))  # four full blocks shared
    for i, rid in enumerate(["A", "B", "longer-id", "C"]):
        llm.engine.add_request(
            prefix + [40 + i], SamplingParams(max_tokens=3, ignore_eos=True), request_id=rid, arrival_time=0.002 * i
        )
    s = Stepper(llm, fig_width=480)
    rec = s.run(3)[-1]
    shared = [b for b in rec.kv.blocks if b.ref_count > 1]
    assert shared, "the trace was built to share blocks"
    cells = F.kv_cells(rec.kv)
    assert cells.unit == "block"
    x, y, labels, sizes = F.kv_labels(cells, 480)
    px = F._cell_px(cells, 480)
    for t, size in zip(labels, sizes):  # no label is wider than its cell
        char = dict(F._LABEL_SIZES)[size]
        assert len(t) * char <= px, (t, size, px)
    # Every shared block carries its "×n", in this narrow map in the small font.
    marks = [t for t in labels if "\u00d7" in t]
    assert len(marks) == len(shared)
    assert list(s.kv_fig.data[4].text) == labels
    # Wide enough, the owner is named too ("A×4").
    _, _, wide, _ = F.kv_labels(cells, 2400)
    assert any(t.endswith(f"\u00d7{shared[0].ref_count}") and len(t) > 2 for t in wide)
    # One cell per position: one label per shared block, not one per position.
    small = F.kv_cells(s.records[-1].kv, per_position_max=10**6)
    assert small.unit == "position"
    _, _, pos_labels, _ = F.kv_labels(small, 10_000)
    assert sum("\u00d7" in t for t in pos_labels) == len(shared)


def test_cached_free_blocks_have_their_own_fill_and_legend_entry():
    fig = F.kv_map_figure(empty_snapshot_with_cached())
    cached = fig.data[3]
    assert cached.marker.pattern.shape == "." and sum(cached.y) > 0
    legend = {t.name: t for t in fig.data if t.showlegend}
    entry = legend["cached prefix, free (reusable)"]
    assert entry.marker.pattern.shape == "." and entry.marker.color == cached.marker.color
    assert legend["free"].marker.color == "white" and legend["free"].marker.pattern.shape is None
    # The cell outline tells a cached block from a free one too.
    bg = fig.data[0]
    assert bg.marker.line.color[0] == F.CACHED_LINE and bg.marker.line.color[4] == F.FREE_LINE  # blocks 0, 1


def empty_snapshot_with_cached():
    snap = F.empty_kv_snapshot(8, 4)
    snap.blocks[0].cached = True
    snap.blocks[0].num_filled = 4
    snap.cached = 4
    return snap


def test_draft_guesses_are_marked_accepted_or_rejected_in_the_batch_bar():
    def spec_engine():
        llm = LLM(
            speculative_model="default-draft",
            num_speculative_tokens=4,
            block_size=8,
            num_kv_blocks=32,
            max_num_seqs=2,
            max_model_len=256,
            max_num_batched_tokens=32,
            clock="modeled",
            cost_model=0.01,
        )
        llm.engine.add_request(
            "ROMEO:\nBut soft, what light through yonder window breaks?\n",
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            request_id="R",
        )
        return llm

    s = Stepper(spec_engine)
    names = [t.name for t in s.batch_fig.data if t.showlegend is not False]
    assert "draft guess accepted" in names and "draft guess rejected" in names
    seen = set()
    for rec in s.run(6):
        s.show(rec.step)
        assert_batch_matches(s.batch_fig, rec)
        e = rec.entry("R")
        acc, rej = s.batch_fig.data[3], s.batch_fig.data[4]
        if e.num_spec_tokens:
            kept, dropped = e.num_spec_accepted, e.num_spec_tokens - e.num_spec_accepted
            seen.update(["accepted"] * bool(kept) + ["rejected"] * bool(dropped))
            # Own token, then accepted, then rejected guesses, side by side.
            if kept:
                assert list(acc.base) == [1] and list(acc.x) == [kept] and acc.text[0].startswith("\u2713")
            if dropped:
                assert list(rej.base) == [1 + kept] and list(rej.x) == [dropped] and rej.text[0].startswith("\u2717")
            assert f"draft guesses {rec.spec_accepted}/{rec.spec_proposed} accepted" in s.batch_fig.layout.title.text
            assert f"{e.num_spec_accepted} accepted, {dropped} rejected" in text(s.reasons_html.value)
    assert seen == {"accepted", "rejected"}, "the shipped draft both hits and misses on this prompt"


def test_lockstep_says_when_both_runs_are_done():
    lk = LockstepStepper(lambda: fig4_engine("reserved"), lambda: fig4_engine("paged"))
    assert lk.finished_html.value == ""
    lk.run(1000)
    assert lk.done and lk.step_button.disabled
    banner = text(lk.finished_html.value)
    assert "all 2 requests are done" in banner and "Press Reset" in banner
    lk.reset()
    assert lk.finished_html.value == "" and not lk.step_button.disabled


def test_a_running_request_without_tokens_is_given_the_reason_the_step_recorded():
    """The samples of a group forked at the end of a step are running but had no grant in it: the queue panel
    says they were forked (not that a budget was spent)."""
    from minillm.viz.panels import idle_reason

    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=32,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    llm.engine.add_request(list(range(10, 20)), SamplingParams(n=4, max_tokens=4, ignore_eos=True), request_id="g")
    rec = llm.engine.step()
    assert rec.forks, "the prompt ran and the group forked in the first step"
    idle = [rid for rid in rec.running if rec.entry(rid) is None]
    assert idle, "the forked samples are running but had no grant in this step"
    for rid in idle:
        assert idle_reason(rec, rid).startswith("forked from g at the end of this step"), idle_reason(rec, rid)


def test_the_queue_panel_says_when_the_budget_was_the_reason():
    """Six samples decode, the budget holds four tokens: the two left over are running without a grant, and
    the panel gives the scheduler's reason (tests/test_scheduler_unit.py works the case by hand)."""
    from minillm.viz.panels import idle_reason

    llm = LLM(
        model="random",
        executor="simulated",
        block_size=4,
        num_kv_blocks=32,
        max_model_len=32,
        max_num_seqs=8,
        max_num_batched_tokens=4,
    )
    llm.engine.add_request(list(range(10, 20)), SamplingParams(n=6, max_tokens=3, ignore_eos=True), request_id="g")
    for _ in range(3):
        llm.engine.step()  # chunks of 4, 4, then 2 and the fork
    rec = llm.engine.step()
    idle = [rid for rid in rec.running if rec.entry(rid) is None]
    assert idle == ["g#4", "g#5"], idle
    assert {idle_reason(rec, rid) for rid in idle} == {"the token budget of 4 was spent before its turn"}


def _px(size: str) -> int:
    assert size.endswith("px"), size
    return int(size[:-2])


def test_widgets_fit_a_notebook_with_the_file_browser_open():
    """A 1,400 px window with JupyterLab's file browser open leaves about 970 px for a cell's output
    (tests/test_browser.py measures it): a Stepper's queue and figures fit side by side, and a
    LockstepStepper of four engines puts two to a row; both wrap where the notebook is narrower."""
    import ipywidgets as W

    from minillm.viz.stepper import NOTEBOOK_PX

    assert NOTEBOOK_PX <= 970 - 40  # room for a scroll bar
    one = Stepper(lambda: sim_engine())
    body = next(c for c in one.widget.children if isinstance(c, W.HBox) and one.queue_html in c.children)
    assert body.layout.flex_flow == "row wrap"
    queue_px = _px(one.queue_html.layout.max_width) + _px(one.queue_html.layout.margin.split()[1])
    assert queue_px + one.kv_fig.layout.width <= NOTEBOOK_PX and one.batch_fig.layout.width == one.kv_fig.layout.width

    four = LockstepStepper(*[lambda: sim_engine() for _ in range(4)])
    row = four.widget.children[-1]
    assert row.layout.flex_flow == "row wrap" and list(row.children) == [s.widget for s in four.steppers]
    columns = [_px(s.widget.layout.width) + _px(s.widget.layout.margin.split()[1]) for s in four.steppers]
    assert 2 * columns[0] <= _px(row.layout.max_width) < 3 * columns[0]  # two to a row, never three
    assert 2 * columns[0] - _px(four.steppers[0].widget.layout.margin.split()[1]) <= NOTEBOOK_PX
    for s in four.steppers:  # each engine's figures inside its column, its queue under them as tall as its rows
        assert s.kv_fig.layout.width <= _px(s.widget.layout.width) and s.batch_fig.layout.width == s.kv_fig.layout.width
        assert s.queue_html.layout.flex is None and s.queue_html.layout.height is None
