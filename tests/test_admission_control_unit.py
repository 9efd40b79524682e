"""Admission control alone: load shedding by queue length and by queue age.

The scheduler is built without an engine and driven with hand-made runner outputs (the helpers of
``tests/test_scheduler_unit.py``); ``max_num_seqs=1`` keeps every request after the first waiting, so the
queue's length and age are known at each pass.
"""

from __future__ import annotations

from minillm.core.request import RequestStatus
from test_scheduler_unit import request, scheduler, step


def test_the_queue_beyond_max_queue_len_is_rejected_latest_arrivals_first():
    s = scheduler(max_num_seqs=1, max_queue_len=1, max_model_len=32, block_size=4, num_kv_blocks=16)
    a, b, c = (request(rid, 4, max_tokens=4) for rid in "abc")
    for r in (a, b, c):
        s.add(r)
    out, upd = step(s, 0.0)
    # a runs; b and c wait: 2 > 1, so c (the later) is turned away and finishes at once
    assert out.admitted == ["a"] and [w.request_id for w in out.waiting] == ["b"]
    assert [(w.request_id, w.reason) for w in out.rejected] == [("c", "queue full: 2 waiting > max_queue_len=1")]
    assert [r.request_id for r in upd.finished] == ["c"] and c.status is RequestStatus.FINISHED
    assert c.finish_reason == "rejected" and c.finish_detail == "queue full: 2 waiting > max_queue_len=1"
    assert s.counters["rejected"] == 1 and [r.request_id for r in s.waiting] == ["b"]
    assert c.request_id not in s.kv.req_blocks


def test_a_request_that_waited_longer_than_max_queue_delay_is_rejected_before_the_pass():
    s = scheduler(max_num_seqs=1, max_queue_delay=2.0, max_model_len=32, block_size=4, num_kv_blocks=16)
    a, b = request("a", 4, max_tokens=8), request("b", 4, max_tokens=8)
    s.add(a)
    s.add(b)
    for t in (0.0, 1.0, 2.0):  # b has waited 0, 1, 2 s: not more than 2
        out, _ = step(s, t)
        assert out.rejected == [] and b.status is RequestStatus.WAITING
    out, upd = step(s, 3.0)  # 3 s > 2
    assert [(w.request_id, w.reason) for w in out.rejected] == [("b", "waited 3.000s > max_queue_delay=2.0")]
    assert [r.request_id for r in upd.finished] == ["b"] and b.finish_reason == "rejected"
    assert a.status is RequestStatus.RUNNING and s.waiting == []
