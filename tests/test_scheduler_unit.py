"""The scheduler alone: built from a config, a KV manager and a policy, driven with hand-made runner outputs.

No engine, no model, no executor: each test calls ``schedule`` and then ``update_from_output`` with the
tokens a runner would have sampled (as vLLM's scheduler tests do with mocked runner outputs), and checks the
grants, the reasons, the block tables and the free count against values worked out by hand in the comments.
"""

from __future__ import annotations

import pytest

from minillm.config import EngineConfig
from minillm.core.kv_cache import make_kv_manager
from minillm.core.policies import make_policy
from minillm.core.request import Request, RequestStatus
from minillm.core.scheduler import Scheduler
from minillm.sampling_params import SamplingParams
from minillm.worker.model_runner import ExecutionResult

TOKEN = 99  # what the mocked runner samples (not the end-of-sequence token of any request here)


def scheduler(**config) -> Scheduler:
    cfg = EngineConfig(**config)
    return Scheduler(cfg, make_kv_manager(cfg, cfg.num_kv_blocks), make_policy(cfg.policy))


def request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, eos: int | None = None) -> Request:
    return Request(
        rid,
        list(range(10, 10 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0),
        arrival_time=arrival,
        eos_token_id=eos,
    )


def runner_output(out, token: int = TOKEN) -> ExecutionResult:
    """What a runner returns for ``out``: one token for each grant that reaches the end of its known
    tokens (``samples``), none for a prompt chunk short of it."""
    return ExecutionResult(sampled=[[token] if g.samples else [] for g in out.scheduled])


def step(s: Scheduler, t: float, token: int = TOKEN):
    """One step as the engine runs it: checkpoint, schedule, the runner's output applied, commit."""
    s.checkpoint()
    out = s.schedule(t)
    upd = s.update_from_output(out, runner_output(out, token), t + 1.0)
    s.commit()
    return out, upd


def free_order(s: Scheduler) -> list[int]:
    return list(s.kv.pool.free_queue)


def grants(out) -> list[tuple]:
    return [(g.request.request_id, g.num_new_tokens, g.num_computed_before, g.phase) for g in out.scheduled]


def tables(s: Scheduler) -> dict[str, list[int]]:
    return {rid: [b.block_id for b in blocks] for rid, blocks in s.kv.req_blocks.items()}


def test_the_token_budget_chunks_the_second_prompt_and_decodes_take_one_token():
    # Budget 8: a's 6-token prompt, then 2 of b's 5 (a chunk: nothing sampled for b). Blocks of 4:
    # a holds ceil(6/4) = 2, b ceil(2/4) = 1, so 6 - 3 = 3 are free.
    s = scheduler(block_size=4, num_kv_blocks=6, max_num_batched_tokens=8, max_model_len=32)
    a, b = request("a", 6, max_tokens=2), request("b", 5, max_tokens=3)
    s.add(a)
    s.add(b)
    out, upd = step(s, 0.0)
    assert grants(out) == [("a", 6, 0, "prefill"), ("b", 2, 0, "prefill")]
    assert out.admitted == ["a", "b"] and out.num_batched_tokens == 8 and out.num_decode_tokens == 0
    assert a.output_token_ids == [TOKEN] and b.output_token_ids == []
    assert tables(s) == {"a": [0, 1], "b": [2]} and s.kv.num_free_blocks == 3
    # Step 1: a decodes (position 6, inside its second block); b's last 3 prompt tokens (5 positions: a
    # second block). a reaches max_tokens=2 and finishes: its 2 blocks come back, 6 - 2 = 4 free.
    out, upd = step(s, 1.0)
    assert grants(out) == [("a", 1, 6, "decode"), ("b", 3, 2, "prefill")]
    assert [r.request_id for r in upd.finished] == ["a"] and a.finish_reason == "length"
    assert a.status == RequestStatus.FINISHED and a.metrics.finish_time == 2.0
    assert tables(s) == {"b": [2, 3]} and s.kv.num_free_blocks == 4
    # Steps 2 and 3: b decodes positions 5 and 6 (both in its second block), then finishes with 3 tokens.
    assert grants(step(s, 2.0)[0]) == [("b", 1, 5, "decode")]
    out, upd = step(s, 3.0)
    assert grants(out) == [("b", 1, 6, "decode")] and [r.request_id for r in upd.finished] == ["b"]
    assert b.output_token_ids == [TOKEN] * 3 and b.metrics.token_times == [2.0, 3.0, 4.0]
    assert s.kv.num_free_blocks == 6 and not s.has_work()


@pytest.mark.parametrize(
    "config, prompts, reason",
    [
        # 3 blocks of 4: a's 8 tokens take 2, b's 8 need 2 with 1 free; c queues behind b (FCFS head-of-line).
        (
            dict(block_size=4, num_kv_blocks=3, max_num_batched_tokens=64),
            [("a", 8), ("b", 8), ("c", 2)],
            {"b": "needs 2 blocks, 1 free", "c": "queued behind b"},
        ),
        (
            dict(block_size=4, num_kv_blocks=8, max_num_batched_tokens=64, max_num_seqs=1),
            [("a", 3), ("b", 3)],
            {"b": "max_num_seqs=1 requests already running"},
        ),
        # Budget 4, a takes 3: b's 3-token prompt does not fit the 1 token left, and may not be cut.
        (
            dict(block_size=4, num_kv_blocks=8, max_num_batched_tokens=4, enable_chunked_prefill=False),
            [("a", 3), ("b", 3)],
            {"b": "prefill of 3 tokens does not fit the 1 tokens left in the budget of 4 (chunked prefill is off)"},
        ),
    ],
)
def test_the_admission_check_says_why_each_request_waits(config, prompts, reason):
    s = scheduler(max_model_len=12, **config)
    for rid, n in prompts:
        s.add(request(rid, n, max_tokens=2))
    out = s.schedule(0.0)
    assert out.admitted == ["a"]
    assert {w.request_id: w.reason for w in out.waiting} == reason
    assert [r.request_id for r in s.waiting] == list(reason)


def a_full_cache():
    """Blocks of 2, 4 in all: after one step two 4-token prompts (a, then b) fill them."""
    s = scheduler(block_size=2, num_kv_blocks=4, max_num_batched_tokens=8, max_model_len=12)
    a, b = request("a", 4, max_tokens=3), request("b", 4, max_tokens=3)
    s.add(a)
    s.add(b)
    step(s, 0.0)
    return s, a, b


def test_a_running_request_without_a_block_preempts_the_last_admitted_by_recompute():
    # At step 1 a's 5th position needs a block: b (admitted last) is preempted, its 2 blocks freed last
    # first (3, then 2), and a takes block 3.
    s, a, b = a_full_cache()
    assert tables(s) == {"a": [0, 1], "b": [2, 3]} and s.kv.num_free_blocks == 0
    out, _ = step(s, 1.0)
    assert grants(out) == [("a", 1, 4, "decode")]
    assert [(p.request_id, p.mode) for p in out.preempted] == [("b", "recompute")]
    # b keeps its sampled token and recomputes prompt + output: 5 tokens, 3 blocks, 1 free.
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.output_token_ids == [TOKEN]
    assert {w.request_id: w.reason for w in out.waiting} == {"b": "needs 3 blocks, 1 free"}
    assert tables(s) == {"a": [0, 1, 3]} and s.counters["preemptions_recompute"] == 1
    assert s.counters["recomputed_tokens"] == 4
    # Step 2: a's third token ends it; its blocks go back last first (3, 1, 0) behind block 2.
    _, upd = step(s, 2.0)
    assert [r.request_id for r in upd.finished] == ["a"] and s.kv.num_free_blocks == 4
    # Step 3: b comes back as one prefill of its 5 tokens, on the first 3 blocks of the free list.
    out, _ = step(s, 3.0)
    assert grants(out) == [("b", 5, 0, "prefill")] and tables(s) == {"b": [2, 3, 1]}
    assert b.num_preemptions == 1


def test_an_end_of_sequence_token_finishes_the_request_and_frees_its_blocks():
    s = scheduler(block_size=4, num_kv_blocks=8, max_model_len=12)
    a = request("a", 3, max_tokens=5, eos=2)
    s.add(a)
    out, upd = step(s, 0.0, token=2)
    assert [r.request_id for r in upd.finished] == ["a"]
    assert (a.finish_reason, a.output_token_ids) == ("stop", [2]) and s.kv.num_free_blocks == 8


def test_a_request_from_the_future_waits_for_the_clock():
    s = scheduler(block_size=4, num_kv_blocks=8, max_model_len=12)
    s.add(request("a", 3, max_tokens=2, arrival=5.0))
    out, _ = step(s, 0.0)
    assert out.scheduled == [] and out.waiting == [] and s.next_arrival() == 5.0
    out, _ = step(s, 5.0)
    assert grants(out) == [("a", 3, 0, "prefill")] and s.next_arrival() is None


def test_the_runner_output_must_have_one_token_list_per_grant():
    s = scheduler(block_size=4, num_kv_blocks=8, max_model_len=12)
    s.add(request("a", 3, max_tokens=2))
    s.add(request("b", 3, max_tokens=2))
    out = s.schedule(0.0)
    with pytest.raises(RuntimeError, match="1 token lists for 2 grants"):
        s.update_from_output(out, ExecutionResult(sampled=[[TOKEN]]), 1.0)


def test_rollback_puts_the_queues_and_requests_back_and_distrusts_blocks_handed_on():
    s, a, b = a_full_cache()
    checkpoint = s.checkpoint()
    out = s.schedule(1.0)  # the pass that preempts b and hands its block 3 to a ...
    s.update_from_output(out, runner_output(out), 2.0)
    assert out.preempted and a.num_computed_tokens == 5 and a.output_token_ids == [TOKEN, TOKEN]
    s.rollback(checkpoint)  # ... in a step that then failed
    assert [r.request_id for r in s.running] == ["a", "b"] and s.waiting == []
    assert s.counters["preemptions_recompute"] == 0
    assert (a.num_computed_tokens, a.output_token_ids, a.status) == (4, [TOKEN], RequestStatus.RUNNING)
    assert b.status == RequestStatus.RUNNING and b.output_token_ids == [TOKEN]
    # Block 3 was handed to a during the step, so its KV may have been written over: b keeps block 2
    # (positions 0-1) and recomputes from position 2; block 3 is free again.
    assert tables(s) == {"a": [0, 1], "b": [2]} and b.num_computed_tokens == 2 and free_order(s) == [3]


def test_a_running_request_given_no_tokens_carries_the_schedulers_reason():
    # Blocks of 4, a budget of 4 tokens, chunked prefill. g asks for n=6 samples of a 10-token prompt:
    # steps 0 and 1 run chunks of 4, step 2 the last 2 (its token is sampled, and the group forks: g#1..g#5
    # start running with no grant in step 2). Step 3: six sequences want one token each, the budget holds
    # 4: g#0..g#3 (running order) decode, g#4 and g#5 wait for the budget.
    from minillm.core.parallel_sampling import first_sequence

    s = scheduler(block_size=4, num_kv_blocks=32, max_num_batched_tokens=4, max_model_len=32, max_num_seqs=8)
    s.add(
        first_sequence(
            "g",
            SamplingParams(n=6, max_tokens=3, temperature=0),
            prompt_token_ids=list(range(10, 20)),
            arrival_time=0.0,
        )
    )
    for t in (0.0, 1.0):
        out, _ = step(s, t)
        assert grants(out) == [("g#0", 4, 4 * int(t), "prefill")] and out.not_scheduled == []
    out, upd = step(s, 2.0)
    assert grants(out) == [("g#0", 2, 8, "prefill")]
    assert {w.request_id: w.reason for w in out.not_scheduled} == {
        f"g#{i}": "forked from g at the end of this step: it decodes from the next step" for i in range(1, 6)
    }
    out, _ = step(s, 3.0)
    assert grants(out) == [(f"g#{i}", 1, 10, "decode") for i in range(4)]
    assert {w.request_id: w.reason for w in out.not_scheduled} == {
        f"g#{i}": "the token budget of 4 was spent before its turn" for i in (4, 5)
    }


def test_a_prefill_priority_step_records_why_the_decodes_stall():
    # a (4-token prompt) prefills in step 0; b arrives at t=0.5. Step 1 under prefill-priority runs b's
    # prefill alone: a, running, gets no token, and the step says why.
    s = scheduler(
        block_size=4, num_kv_blocks=8, max_num_batched_tokens=8, max_model_len=16, interference="prefill-priority"
    )
    s.add(request("a", 4, max_tokens=3))
    s.add(request("b", 4, max_tokens=3, arrival=0.5))
    out, _ = step(s, 0.0)
    assert grants(out) == [("a", 4, 0, "prefill")] and out.not_scheduled == []
    out, _ = step(s, 1.0)
    assert grants(out) == [("b", 4, 0, "prefill")]
    assert [(w.request_id, w.reason) for w in out.not_scheduled] == [
        ("a", "prefill-priority: this step runs a new prompt's prefill, decodes wait")
    ]
    out, _ = step(s, 2.0)  # no new prompt: both decode
    assert grants(out) == [("a", 1, 4, "decode"), ("b", 1, 4, "decode")] and out.not_scheduled == []
