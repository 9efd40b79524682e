"""A request alone: its life cycle's transitions, what each changes, and the ones it refuses.

No scheduler, no engine: each test calls ``Request``'s transition methods directly (as the scheduler does
after saving the request in the step's undo log) and checks the fields against values worked out by hand
from ``minillm/core/request.py``: WAITING -> RUNNING -> FINISHED, with the detours through PREEMPTED
(the KV dropped, computed again) and SWAPPED (the KV kept in host memory).
"""

from __future__ import annotations

import pytest

from minillm.core.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

W, R, P, S, F = (
    RequestStatus.WAITING,
    RequestStatus.RUNNING,
    RequestStatus.PREEMPTED,
    RequestStatus.SWAPPED,
    RequestStatus.FINISHED,
)


def request(prompt_len: int = 6, max_tokens: int = 4, **params) -> Request:
    return Request(
        "r", list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **params), arrival_time=1.0
    )


def in_state(status: RequestStatus) -> Request:
    """A request brought to ``status`` through the transitions themselves."""
    r = request()
    if status is W:
        return r
    r.admit(0, 1, 2.0)
    if status in (P, S):
        r.preempt(status, keeps_kv=status is S)
    elif status is F:
        r.finish("stop", 3.0)
    return r


def test_a_new_request_waits_with_nothing_computed():
    r = request(prompt_len=6, max_tokens=4)
    assert r.status is W and r.num_computed_tokens == 0 and r.num_tokens == 6 and r.max_len == 10
    assert r.num_prompt_tokens == 6 and r.num_output_tokens == 0 and not r.is_decoding and not r.is_finished
    assert r.arrival_time == 1.0 and r.metrics.num_prompt_tokens == 6 and r.admit_seq == -1


def test_admit_runs_it_from_its_cached_prefix_and_keeps_the_first_schedule_time():
    r = request()
    r.admit(4, admit_seq=7, now=2.0)  # a prefix-cache hit of 4 positions
    assert r.status is R and r.num_computed_tokens == 4 and r.num_cached_tokens == 4 and r.admit_seq == 7
    assert r.metrics.first_scheduled_time == 2.0 and r.metrics.num_cached_tokens == 4
    assert r.metrics.queue_wait == 1.0
    r.preempt(P, keeps_kv=False)
    r.admit(0, admit_seq=9, now=5.0)  # admitted again, no hit this time
    assert r.num_computed_tokens == 0 and r.admit_seq == 9
    assert r.metrics.first_scheduled_time == 2.0  # the first time stays
    assert r.metrics.num_cached_tokens == 4  # the largest hit stays


def test_a_prefill_then_a_decode_by_the_one_prefill_decode_rule():
    r = in_state(R)
    r.advance(6)  # the whole prompt computed, first token sampled
    r.append_token(50, t=3.0)
    assert r.num_tokens == 7 and r.num_computed_tokens == 6 and r.is_decoding
    assert r.metrics.first_token_time == 3.0 and r.metrics.ttft == 2.0
    r.advance(1)
    r.append_token(51, t=3.5)
    assert r.output_token_ids == [50, 51] and r.all_token_ids == [10, 11, 12, 13, 14, 15, 50, 51]
    assert r.metrics.token_times == [3.0, 3.5] and r.metrics.tpot == 0.5 and r.is_decoding


def test_a_chunk_of_the_prompt_is_not_a_decode():
    r = in_state(R)
    r.advance(4)  # 4 of 6 prompt positions: nothing sampled
    assert not r.is_decoding and r.num_output_tokens == 0


def test_preempt_without_the_kv_recomputes_every_position():
    r = in_state(R)
    r.advance(6)
    r.append_token(50, 3.0)
    r.preempt(P, keeps_kv=False)
    assert r.status is P and r.num_computed_tokens == 0 and r.num_cached_tokens == 0
    assert r.metrics.num_recomputed_tokens == 6 and r.num_preemptions == 1 and r.metrics.num_preemptions == 1
    assert not r.is_decoding  # prompt + output are computed again: a prefill
    assert r.output_token_ids == [50]  # the output is kept


def test_a_swap_keeps_the_kv_and_resume_runs_it_again():
    r = in_state(R)
    r.advance(6)
    r.preempt(S, keeps_kv=True)
    assert r.status is S and r.num_computed_tokens == 6 and r.metrics.num_recomputed_tokens == 0
    r.resume()
    assert r.status is R and r.num_computed_tokens == 6 and r.num_preemptions == 1


def test_reject_hold_and_finish():
    r = request()
    r.reject("queue full")
    assert r.status is W and r.finish_reason == "rejected" and r.finish_detail == "queue full"
    r.finish("rejected", 4.0)
    assert r.is_finished and r.metrics.finish_time == 4.0 and r.metrics.e2e_latency == 3.0
    held = in_state(R)
    held.hold("length", "the batch is not done")
    assert held.pending_finish_reason == "length" and held.status is R
    held.finish("length", 6.0)
    assert held.finish_reason == "length" and held.finish_detail == "the batch is not done"
    assert held.metrics.finish_reason == "length" and held.metrics.num_output_tokens == 0


@pytest.mark.parametrize("status", [W, P, S, F])
def test_only_a_running_request_is_preempted_or_held(status):
    r = in_state(status)
    with pytest.raises(RuntimeError, match=f"'r': preempt from {status.value}; only from running"):
        r.preempt(P, keeps_kv=False)
    with pytest.raises(RuntimeError, match=f"'r': hold from {status.value}; only from running"):
        r.hold("length")


@pytest.mark.parametrize("status", [R, S, F])
def test_only_a_queued_request_is_admitted_or_rejected(status):
    r = in_state(status)
    with pytest.raises(RuntimeError, match=f"admit from {status.value}; only from waiting or preempted"):
        r.admit(0, 2, 4.0)
    with pytest.raises(RuntimeError, match=f"reject from {status.value}; only from waiting or preempted"):
        r.reject("late")


@pytest.mark.parametrize("status", [W, R, P, F])
def test_only_a_swapped_request_resumes(status):
    with pytest.raises(RuntimeError, match=f"resume from {status.value}; only from swapped"):
        in_state(status).resume()


def test_a_finished_request_does_not_finish_again_and_preemption_goes_to_the_queue_or_host():
    r = in_state(F)
    with pytest.raises(RuntimeError, match="finish from finished"):
        r.finish("abort", 9.0)
    assert r.finish_reason == "stop" and r.metrics.finish_time == 3.0  # unchanged
    with pytest.raises(ValueError, match="preempt to finished; only to preempted or swapped"):
        in_state(R).preempt(F, keeps_kv=False)


def test_refused_transitions_change_nothing():
    r = in_state(S)
    before = r.snapshot()
    for bad in (lambda: r.admit(3, 5, 9.0), lambda: r.preempt(P, False), lambda: r.hold("x")):
        with pytest.raises(RuntimeError):
            bad()
    assert r.snapshot() == before


def test_guesses_settle_to_the_accepted_ones_and_a_stop_drops_what_follows():
    r = in_state(R)
    r.advance(6)
    r.append_token(50, 3.0)
    r.spec_token_ids = [1, 2, 3]
    r.advance(4)  # the newest token and 3 guesses computed: 10 positions
    r.settle_guesses(num_proposed=3, num_accepted=1)
    assert r.num_computed_tokens == 8 and r.spec_token_ids == []
    assert r.metrics.num_spec_proposed == 3 and r.metrics.num_spec_accepted == 1
    r.append_token(1, 3.1)
    r.append_token(60, 3.1)  # 9 tokens known, 8 computed
    r.drop_past_stop()
    assert r.num_computed_tokens == 8  # min(8, 9 - 1)
    r.advance(1)
    r.drop_past_stop()
    assert r.num_computed_tokens == 8  # KV only up to the newest output token kept


def test_rewind_undoes_applied_results_and_lose_kv_from_cuts_computed_positions():
    r = in_state(R)
    r.advance(6)
    r.append_token(50, 3.0)
    r.advance(1)
    r.append_token(51, 3.5)
    r.stopped_by(51)
    r.rewind(num_computed_tokens=6, num_output_tokens=1)
    assert r.num_computed_tokens == 6 and r.output_token_ids == [50] and r.metrics.token_times == [3.0]
    assert r.stop_reason is None and r.metrics.first_token_time == 3.0
    r.rewind(0, 0)
    assert r.output_token_ids == [] and r.metrics.first_token_time is None
    r = request()
    r.admit(4, 2, 4.0)
    r.advance(2)
    r.lose_kv_from(3)
    assert r.num_computed_tokens == 3 and r.num_cached_tokens == 3
    r.lose_kv_from(5)  # beyond what it has: nothing changes
    assert r.num_computed_tokens == 3


def test_a_fork_starts_running_where_its_parent_stands():
    r = request(prompt_len=6, max_tokens=4)
    r.admit(4, 3, 2.0)
    r.advance(2)
    seq = r.fork("r#1", SamplingParams(max_tokens=2), index=1)
    assert seq.status is R and seq.request_id == "r#1" and seq.index == 1
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.admit_seq) == (6, 4, 3)
    assert seq.metrics.first_scheduled_time == 2.0 and seq.prompt_token_ids == r.prompt_token_ids
    assert seq.prompt_token_ids is not r.prompt_token_ids and seq.max_len == 8
