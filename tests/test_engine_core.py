"""Engine core: continuous vs static batching, the API contract, bad input, invariants."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, EngineConfig, SamplingParams
from minillm.core.invariants import check_all_free, check_invariants

from helpers import run_to_end

GREEDY = dict(temperature=0, ignore_eos=True)


def tiny(**kw):
    kw.setdefault("max_model_len", 128)
    return LLM("random", **kw)


def finish_step(recs, rid):
    return next(r.step for r in recs if rid in r.finished)


# --- continuous vs static -----------------------------------------------------------------


def test_continuous_vs_static_step_counts():
    """One long request (40 tokens) among three short ones (4 tokens), then two more short
    ones arriving. max_num_seqs=4. By hand, counting step 0 as the prefill that emits token 1:
    - continuous: a short request emitting n tokens finishes at step n-1 (3); the late ones
      are admitted at step 4 when slots free up and finish at step 4 + 3 = 7;
    - static: the first batch ends with the long request at step 39; every short request
      of that batch is returned then, and the late ones run steps 40..43."""
    results = {}
    for mode in ("continuous", "static"):
        llm = tiny(batching=mode, max_num_seqs=4, block_size=4)
        e = llm.engine
        e.add_request([5] * 6, SamplingParams(max_tokens=40, **GREEDY), request_id="long")
        for i in range(3):
            e.add_request([7] * 3, SamplingParams(max_tokens=4, **GREEDY), request_id=f"s{i}")
        for i in range(3, 5):
            e.add_request([9] * 3, SamplingParams(max_tokens=4, **GREEDY), request_id=f"s{i}")
        recs = run_to_end(e)
        results[mode] = {rid: finish_step(recs, rid) for rid in ["long"] + [f"s{i}" for i in range(5)]}
    c, s = results["continuous"], results["static"]
    assert c == {"long": 39, "s0": 3, "s1": 3, "s2": 3, "s3": 7, "s4": 7}
    assert s == {"long": 39, "s0": 39, "s1": 39, "s2": 39, "s3": 43, "s4": 43}
    # Short requests finish many steps earlier under continuous batching.
    assert s["s0"] - c["s0"] == 36


# --- the public API -------------------------------------------------------------------------


def test_generate_api_and_step_record_contract():
    llm = tiny(block_size=4, max_num_batched_tokens=8)
    outs = llm.generate(
        [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]],
        [SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=5, **GREEDY)],
    )
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    o = outs[0]
    assert o.prompt_token_ids == [3, 4, 5] and o.request_id == "0"
    m = o.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 3
    rec = llm.engine.step_records[0]
    # Chunked prefill: 3 + 5 of the 10-token prompt fit the 8-token budget.
    assert [(b.request_id, b.phase, b.num_new_tokens, b.num_computed_before, b.context_len) for b in rec.batch] == [
        ("0", "prefill", 3, 0, 3),
        ("1", "prefill", 5, 0, 5),
    ]
    assert rec.num_batched_tokens == 8 and rec.token_budget == 8 and rec.admitted == ["0", "1"]
    assert rec.kv.used == 8 and rec.kv.blocks_used == 1 + 2
    assert rec.kv.total == rec.kv.blocks_total * 4 and rec.kv.free == rec.kv.blocks_free * 4
    # The wall clock starts when the engine is built: a step ends at least its duration after the step
    # before it ended (the first: after the engine was built).
    recs = llm.engine.step_records
    assert rec.step == 0 and 0 < rec.duration <= rec.time
    assert all(b.time - a.time >= b.duration > 0 for a, b in zip(recs, recs[1:]))


def test_generate_freezes_the_old_heap_for_its_steps_only():
    """During generate's steps the objects alive before it are frozen (gc.freeze: full collections skip
    them, as vLLM's engine core freezes its startup heap); after it, nothing stays frozen; a heap frozen
    by the caller is left as it was."""
    import gc

    from minillm.llm import _collector_skips_the_old_heap

    llm = tiny()
    seen = []
    step = llm.engine.step
    llm.engine.step = lambda: (seen.append(gc.get_freeze_count()), step())[1]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY))
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with _collector_skips_the_old_heap():
            assert gc.get_freeze_count() == before
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()


def test_a_modeled_clock_ends_each_step_its_duration_after_the_last():
    """On the modeled clock (from 0, requests already there: no idle wait) each record's time is the sum
    of the durations so far, and every duration is the cost model's price of a non-empty step."""
    e = tiny(block_size=4, max_num_batched_tokens=8, clock="modeled").engine
    for prompt in ([3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]):
        e.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY), arrival_time=0.0)
    recs = run_to_end(e)
    assert all(r.duration > 0 for r in recs)
    total = 0.0
    for r in recs:
        total += r.duration
        assert r.time == pytest.approx(total, rel=1e-12, abs=0)


def test_waiting_reason_names_blocks():
    llm = tiny(block_size=4, num_kv_blocks=3, max_num_batched_tokens=64, max_model_len=12)
    e = llm.engine
    e.add_request([3] * 8, SamplingParams(max_tokens=4, **GREEDY), request_id="a")
    e.add_request([4] * 5, SamplingParams(max_tokens=2, **GREEDY), request_id="b")
    rec = e.step()
    assert rec.admitted == ["a"]
    assert rec.waiting[0].request_id == "b" and rec.waiting[0].reason == "needs 2 blocks, 1 free"
    run_to_end(e)


def test_sampling_seeded_reproducible_and_top_k_1_is_greedy():
    llm = tiny()
    p = [[3, 4, 5, 6]]
    a = llm.generate(p, SamplingParams(temperature=1.0, seed=7, max_tokens=12))[0].token_ids
    b = llm.generate(p, SamplingParams(temperature=1.0, seed=7, max_tokens=12))[0].token_ids
    g = llm.generate(p, SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    k1 = llm.generate(p, SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=12))[0].token_ids
    assert a == b and k1 == g


def test_stop_token_and_eos():
    llm = tiny()
    g = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    stop = g[4]
    first = g.index(stop)
    out = llm.generate(
        [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop])
    )[0]
    assert out.token_ids == g[: first + 1] and out.finish_reason == "stop"


def test_max_model_len_stops():
    llm = tiny(max_model_len=10)
    out = llm.generate([[3] * 6], SamplingParams(max_tokens=50, **GREEDY))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_abort():
    e = tiny().engine
    a = e.add_request([3, 4], SamplingParams(max_tokens=30, **GREEDY))
    b = e.add_request([5, 6], SamplingParams(max_tokens=3, **GREEDY))
    e.step()
    e.abort_request(a)
    run_to_end(e)
    assert e.get_output(a).finish_reason == "abort" and e.get_output(b).finish_reason == "length"
    with pytest.raises(KeyError, match="nope"):
        e.abort_request("nope")


# --- bad input: a clear error, and the engine goes on ------------------------------------------


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], dict(max_tokens=2), "empty"),
        ([3, 999999], dict(max_tokens=2), r"prompt\[1\]=999999"),
        ([3, -1], dict(max_tokens=2), r"prompt\[1\]=-1"),
        ([3] * 40, dict(max_tokens=2), "max_model_len=32"),
        ([3] * 10, dict(max_tokens=30), "would not fit the KV cache"),
    ],
)
def test_bad_request_rejected_and_others_finish(prompt, params, match):
    e = tiny(max_model_len=32, block_size=4, num_kv_blocks=6).engine
    good = e.add_request([3, 4, 5], SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(ValueError, match=match):
        e.add_request(prompt, SamplingParams(**params, temperature=0))
    run_to_end(e)
    assert len(e.get_output(good).token_ids) == 3


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
    ],
)
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_size=0), "block_size=0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (dict(kv_allocation="contiguous"), "kv_allocation='contiguous'"),
        (dict(num_kv_blocks=0), "num_kv_blocks=0"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_budget_that_cannot_hold_a_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        tiny(max_model_len=64, max_num_batched_tokens=16, enable_chunked_prefill=False)


def test_unknown_config_field():
    with pytest.raises(TypeError, match="blok_size"):
        LLM("random", blok_size=3)


def test_string_prompt_without_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        tiny().engine.add_request("hello", SamplingParams())


# --- invariants after every step of random workloads ---------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workloads_keep_invariants(data):
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = data.draw(st.integers(12, 40)) // block_size + 4
    budget = data.draw(st.integers(4, 32))
    seqs = data.draw(st.integers(1, 6))
    chunked = data.draw(st.booleans())
    llm = LLM(
        "random",
        executor="simulated",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget if chunked else 64,
        max_num_seqs=seqs,
        enable_chunked_prefill=chunked,
        max_model_len=64,
    )
    e = llm.engine
    cap = num_blocks * block_size
    n = data.draw(st.integers(1, 10))
    ids = []
    for i in range(n):
        plen = data.draw(st.integers(1, 20))
        out = data.draw(st.integers(1, 20))
        if min(plen + out, 64) > cap:
            continue
        ids.append(e.add_request([3] * plen, SamplingParams(max_tokens=out, **GREEDY)))
    aborts = set(data.draw(st.lists(st.sampled_from(ids), max_size=2, unique=True))) if ids else set()
    steps = 0
    while e.has_unfinished_requests():
        rec = e.step()
        check_invariants(e, rec)
        assert len(rec.batch) <= seqs and rec.num_batched_tokens <= rec.token_budget
        steps += 1
        if steps == 3:
            for rid in aborts:
                e.abort_request(rid)
        assert steps < 2000, "no progress"
    check_all_free(e)
    for rid in ids:
        o = e.get_output(rid)
        if rid not in aborts:
            assert o.finish_reason == "length"
            assert len(o.token_ids) == e.requests[rid].sampling_params.max_tokens


def test_pickle_checkpoints_are_refused(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 16,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 8,
            }
        )
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_phase_times_are_measured_on_the_configured_clock_and_only_then():
    """``EngineConfig.phase_clock``: each StepRecord holds the host time of every phase of its step, read
    off that clock (here a fake one that advances 1 per reading: a phase with no timed phase inside spans
    1 unit, "execute" spans the 6 readings of its prepare, forward and sample plus 1); without a clock
    nothing is timed."""
    readings = iter(range(10**6))
    llm = LLM("random", phase_clock=lambda: float(next(readings)))
    e = llm.engine
    e.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    rec = e.step()
    assert rec.phase_times == {
        "schedule": 1.0,
        "execute": 7.0,
        "prepare": 1.0,
        "forward": 1.0,
        "sample": 1.0,
        "update": 1.0,
        "record": 1.0,
    }
    plain = LLM("random").engine
    plain.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    assert plain.step().phase_times == {}
    with pytest.raises(TypeError, match="EngineConfig.phase_clock=3"):
        LLM("random", phase_clock=3)
