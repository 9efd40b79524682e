"""The undo logs alone: a failed step's changes to its requests and to the KV manager's tables, put back.

``StepJournal`` is driven by hand (no scheduler): a request is saved, changed through its transitions or field by
field, and restored; every field ``Request.__slots__`` and ``RequestMetrics`` name must come back, so a field
added to either is covered without anyone listing it. ``KVStepJournal`` is read through a
``PagedKVCacheManager``'s step (``tests/test_kv_cache_unit.py`` checks its rollbacks block by block).
"""

from __future__ import annotations

from minillm.core.kv_cache import PagedKVCacheManager
from minillm.core.request import Request, RequestMetrics, RequestStatus
from minillm.core.scheduler_output import grant
from minillm.core.step_journal import StepJournal
from minillm.sampling_params import SamplingParams


def request(rid: str = "r") -> Request:
    return Request(rid, [10, 11, 12, 13], SamplingParams(max_tokens=8, logprobs=1), arrival_time=0.5)


def fields(r: Request) -> dict:
    """Every field of the request and of its metrics, the lists copied."""

    def plain(v):
        return list(v) if isinstance(v, list) else v

    return {f: plain(getattr(r, f)) for f in Request.__slots__} | {
        f"metrics.{f}": plain(getattr(r.metrics, f)) for f in RequestMetrics.__slots__
    }


def running(r: Request) -> Request:
    """Admitted, its prompt computed and one token sampled."""
    r.admit(0, 1, 1.0)
    r.advance(4)
    r.append_token(50, 2.0)
    r.output_logprobs.append({50: -0.1})
    return r


def test_restore_puts_back_every_slot_of_the_request_and_its_metrics():
    r = running(request())
    before = fields(r)
    lists = (r.output_token_ids, r.metrics.token_times, r.output_logprobs)
    j = StepJournal()
    j.save(r)
    r.output_token_ids.append(51)  # the lists the request had, grown in place
    r.metrics.token_times.append(3.0)
    r.output_logprobs.append({51: -0.2})
    for f in Request.__slots__:  # then every field set to something else
        if f not in ("output_token_ids", "output_logprobs", "metrics"):
            setattr(r, f, object())
    for f in RequestMetrics.__slots__:
        if f != "token_times":
            setattr(r.metrics, f, object())
    j.restore()
    assert fields(r) == before
    assert (r.output_token_ids, r.metrics.token_times, r.output_logprobs) == ([50], [2.0], [{50: -0.1}])
    assert all(a is b for a, b in zip(lists, (r.output_token_ids, r.metrics.token_times, r.output_logprobs)))


def test_a_request_is_saved_once_per_step_as_it_was_before_the_first_change():
    r = running(request())
    before = fields(r)
    j = StepJournal()
    j.save(r)
    r.preempt(RequestStatus.PREEMPTED, keeps_kv=False)
    j.save(r)  # already saved: the first copy stays
    r.admit(0, 2, 3.0)
    j.restore()
    assert fields(r) == before and r.status is RequestStatus.RUNNING and r.num_preemptions == 0
    j.restore()  # the log is empty after a restore: nothing happens
    assert fields(r) == before


def test_applied_results_are_undone_from_the_grants():
    r = running(request())
    g = grant(r, 1)  # a decode from position 4, 1 output token before
    assert (g.num_computed_before, g.num_output_before, g.phase) == (4, 1, "decode")
    before = fields(r)
    j = StepJournal()
    j.save_progress([g])
    r.advance(1)
    r.append_token(51, 3.0)
    r.output_logprobs.append({51: -0.3})
    r.stopped_by(51)
    j.restore()
    assert fields(r) == before and r.stop_reason is None


def test_a_full_save_after_the_results_is_replayed_first():
    # results applied (progress), then the request finishes (a full save of the state after the results):
    # restoring goes backwards, to after the results, then back over them to before the step
    r = running(request())
    before = fields(r)
    j = StepJournal()
    j.save_progress([grant(r, 1)])
    r.advance(1)
    r.append_token(51, 3.0)
    r.output_logprobs.append({51: -0.3})
    j.save(r)
    r.finish("length", 3.0)
    j.restore()
    assert fields(r) == before and r.status is RequestStatus.RUNNING and r.metrics.finish_time is None


def test_the_kv_journal_keeps_a_table_as_it_was_before_the_steps_first_change():
    kv = PagedKVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = request("a")
    kv.allocate(a, 4)  # blocks 0, 1
    a.advance(4)
    kv.begin_step()
    kv.allocate(a, 1)  # position 4: block 2 (the journal keeps [0, 1])
    a.advance(1)
    kv.allocate(a, 2)  # positions 5, 6: block 3 (kept already: nothing more)
    assert kv.block_table("a") == [0, 1, 2, 3] and kv.num_free_blocks == 0
    assert kv.rollback() == {}
    # back to [0, 1]; blocks 2 and 3 hold nothing reusable: each to the front, the deeper (3) first
    assert kv.block_table("a") == [0, 1] and list(kv.pool.free_queue) == [2, 3]


def test_a_prefix_registered_unshared_is_offered_to_lookups_once_the_forward_has_run():
    kv = PagedKVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    b = Request("b", [20, 21, 22, 23, 24], SamplingParams(max_tokens=4), arrival_time=0.0)
    c = Request("c", [20, 21, 22, 23, 24], SamplingParams(max_tokens=4), arrival_time=0.0)
    kv.begin_step()
    kv.allocate(b, 5)  # blocks 0, 1, 2
    kv.cache_full_blocks(b, 5, shareable=False)  # 5 // 2 = 2 full: 0 and 1, not offered this pass
    assert kv.find_cached_prefix(c) == []
    kv.forward_done()
    assert [h.block_id for h in kv.find_cached_prefix(c)] == [0, 1]  # (5 - 1) // 2 = 2 looked up
    kv.end_step()
