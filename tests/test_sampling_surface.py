"""The sampling surface a vLLM user reaches for: logprobs, prompt logprobs, penalties,
min_tokens and stop strings, each checked against an outside reference (transformers'
logits and logits processors, a hand-derived OpenAI-style penalty, a plain string search)."""

import math

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.worker.sampler import apply_penalties, mask_stop_tokens

from helpers import random_prompts, run_to_end, tiny_hf_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = tiny_hf_checkpoint(path, "llama")
    return str(path), model


def hf_logprobs(model, ids):
    """log_softmax of transformers' logits at every position of ``ids`` [len(ids), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_match_transformers_log_softmax(tiny):
    path, model = tiny
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4)
    prompts = random_prompts(3, 128, seed=4)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    )
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ref = hf_logprobs(model, p + c.token_ids)
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for j, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(p) - 1 + j]
            assert tok in lp and len(lp) <= 4  # the top 3 and the sampled one
            top = torch.topk(row, 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lp[t].logprob - v) < 1e-5
            assert abs(lp[tok].logprob - row[tok].item()) < 1e-5
            assert lp[tok].rank == int((row > row[tok]).sum()) + 1
            total += lp[tok].logprob
        assert math.isclose(c.cumulative_logprob, total, abs_tol=1e-9)
        # Prompt logprobs: None for the first token, then each prompt token under the model.
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            lp = o.prompt_logprobs[i]
            assert p[i] in lp and abs(lp[p[i]].logprob - ref[i - 1, p[i]].item()) < 1e-5


def test_prompt_logprobs_survive_chunked_prefill(tiny):
    path, model = tiny
    p = random_prompts(1, 128, seed=9)[0][:20] + [5] * 10
    llm = LLM(
        path, dtype="float32", max_model_len=64, block_size=4, max_num_batched_tokens=7, enable_prefix_caching=True
    )
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0))[0]
    ref = hf_logprobs(model, p)
    got = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
    want = [ref[i - 1, p[i]].item() for i in range(1, len(p))]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def test_no_logprobs_unless_asked(tiny):
    llm = LLM(tiny[0], dtype="float32", max_model_len=64)
    c = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=3))[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


# --- penalties: the same logits through transformers' processors ------------------------------


class _Req:
    def __init__(self, prompt, output, sp, eos=None):
        self.prompt_token_ids, self.output_token_ids, self.sampling_params = prompt, output, sp
        self.eos_token_id = eos


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    hist = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (5, 12, 1)]
    reqs = [_Req(h[:3], h[3:], SamplingParams(repetition_penalty=penalty)) for h in hist]
    ours = apply_penalties(logits, reqs)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i, h in enumerate(hist):
        want = proc(torch.tensor([h]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], want, rtol=0, atol=1e-6)


def test_presence_and_frequency_penalties_hand_derived():
    # OpenAI's definition: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty,
    # c[j] = how often token j occurs in the output so far (the prompt does not count).
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 0.0]])
    req = _Req([4, 4, 4], [1, 1, 2, 1], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    want = torch.tensor([[1.0, 2.0 - 3 * 0.25 - 0.5, -1.0 - 0.25 - 0.5, 0.5, 0.0]])
    torch.testing.assert_close(apply_penalties(logits, [req]), want, rtol=0, atol=1e-7)
    # All three together, in vLLM's order: repetition (prompt and output), then the others.
    req = _Req([4], [1, 1], SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=2.0))
    want = torch.tensor([[1.0, 2.0 / 2 + 2 * 0.5 - 1.0, -1.0, 0.5, 0.0 * 2]])
    torch.testing.assert_close(apply_penalties(logits, [req]), want, rtol=0, atol=1e-7)


def test_min_tokens_matches_transformers():
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(1))
    reqs = [
        _Req([3, 4], [5], SamplingParams(min_tokens=3), eos=2),
        _Req([3, 4], [5, 6, 7], SamplingParams(min_tokens=3), eos=2),
    ]
    ours = mask_stop_tokens(logits.clone(), reqs)
    for i, r in enumerate(reqs):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        proc = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=2)
        torch.testing.assert_close(ours[i], proc(ids, logits[i : i + 1].clone())[0])


def test_greedy_with_repetition_penalty_matches_transformers_generate(tiny):
    path, model = tiny
    prompts = random_prompts(3, 128, seed=2)
    llm = LLM(path, dtype="float32", max_model_len=64, block_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.8))
    model.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs):
        ref = model.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, repetition_penalty=1.8, pad_token_id=0
        )[0, len(p) :].tolist()
        assert o.token_ids == ref


def test_min_tokens_keeps_eos_away(tiny):
    path, model = tiny
    p = random_prompts(1, 128, seed=5)[0]
    llm = LLM(path, dtype="float32", max_model_len=64)
    # Make EOS the greedy choice everywhere: stop_token_ids = the first greedy token.
    first = llm.generate([p], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    o = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, min_tokens=4, stop_token_ids=[first]))[0]
    assert len(o.token_ids) >= 4 and first not in o.token_ids[:4]
    c = o.outputs[0]
    if c.finish_reason == "stop":
        assert c.stop_reason == first and c.token_ids[-1] == first


# --- stop strings ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare():
    return LLM(max_model_len=256, block_size=8)


def test_stop_string_ends_text_where_string_search_says(shakespeare):
    llm = shakespeare
    params = dict(temperature=0.9, seed=11, max_tokens=60, ignore_eos=True)
    full = llm.generate(["ROMEO:"], SamplingParams(**params))[0].text
    stop = full[25:28]
    cut = full.find(stop)
    o = llm.generate(["ROMEO:"], SamplingParams(**params, stop=[stop, "\u2603"]))[0]
    c = o.outputs[0]
    assert c.text == full[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
    o = llm.generate(["ROMEO:"], SamplingParams(**params, stop=stop, include_stop_str_in_output=True))[0]
    assert o.text == full[: cut + len(stop)]
    # Not before min_tokens: the first match inside the first 20 tokens' text is skipped.
    early = llm.generate(["ROMEO:"], SamplingParams(**params, stop=full[1:3], min_tokens=20))[0]
    assert len(early.token_ids) >= 20


def test_stop_string_never_found_changes_nothing(shakespeare):
    params = dict(temperature=0, max_tokens=30, ignore_eos=True)
    a = shakespeare.generate(["JULIET:"], SamplingParams(**params))[0]
    b = shakespeare.generate(["JULIET:"], SamplingParams(**params, stop=["\u2603 never"]))[0]
    assert a.text == b.text and a.token_ids == b.token_ids and b.finish_reason == "length"
    assert b.outputs[0].stop_reason is None


# --- checked at the door -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(n=0), ValueError, "n=0"),
        (dict(n=2.0), TypeError, "n=2.0"),
        (dict(stop=[3]), TypeError, r"stop\[0\]=3"),
        (dict(stop=[""]), ValueError, r"stop\[0\]"),
        (dict(min_tokens=-1), ValueError, "min_tokens=-1"),
        (dict(min_tokens=50, max_tokens=10), ValueError, "min_tokens=50"),
        (dict(logprobs=-2), ValueError, "logprobs=-2"),
        (dict(prompt_logprobs="3"), TypeError, "prompt_logprobs='3'"),
        (dict(presence_penalty=3.0), ValueError, "presence_penalty=3.0"),
        (dict(frequency_penalty=float("inf")), ValueError, "frequency_penalty=inf"),
        (dict(repetition_penalty=0.0), ValueError, "repetition_penalty=0.0"),
        (dict(repetition_penalty=float("nan")), ValueError, "repetition_penalty=nan"),
        (dict(repetition_penalty=1e-300), ValueError, r"repetition_penalty=1e-300: .*\[0\.01, 100\.0\]"),
        (dict(repetition_penalty=0.009), ValueError, "repetition_penalty=0.009"),
        (dict(repetition_penalty=101.0), ValueError, "repetition_penalty=101.0"),
        (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output=1"),
    ],
)
def test_new_fields_checked_at_the_door(kw, err, match):
    with pytest.raises(err, match=match):
        SamplingParams(**kw)


def test_repetition_penalty_range_ends_are_accepted_and_stay_finite():
    """The ends of the allowed range keep float32 logits finite (a smaller penalty overflowed them)."""
    for penalty in (0.01, 100.0):
        assert SamplingParams(repetition_penalty=penalty).repetition_penalty == penalty
        req = _Req([0, 1], [], SamplingParams(repetition_penalty=penalty))
        out = apply_penalties(torch.tensor([[3000.0, -3000.0, 1.0]]), [req])
        assert torch.isfinite(out / 1e-6).all()


def test_engine_refuses_what_it_cannot_serve():
    llm = LLM("random", max_model_len=64, num_kv_blocks=8, block_size=4, max_num_seqs=4)
    e = llm.engine
    with pytest.raises(ValueError, match="stop strings"):
        e.add_request([1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="logprobs=100000"):
        e.add_request([1, 2], SamplingParams(logprobs=100000))
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        e.add_request([1, 2], SamplingParams(n=5))
    assert not e.has_unfinished_requests()
    sim = LLM("random", executor="simulated", max_model_len=64).engine
    with pytest.raises(ValueError, match="simulated executor has no logits"):
        sim.add_request([1, 2], SamplingParams(logprobs=1))


@pytest.mark.parametrize(
    "kw, shown",
    [
        (dict(n=2), "n=2"),
        (dict(logprobs=1), "logprobs=1"),
        (dict(prompt_logprobs=0), "prompt_logprobs=0"),
        (dict(min_tokens=3), "min_tokens=3"),
        (dict(presence_penalty=0.5), "presence_penalty=0.5"),
        (dict(frequency_penalty=-1.0), "frequency_penalty=-1.0"),
        (dict(repetition_penalty=1.2), "repetition_penalty=1.2"),
    ],
)
def test_speculative_decoding_refuses_the_sampling_surface_by_field_and_value(kw, shown):
    """Speculative decoding verifies k guesses at once with the target's plain distribution:
    penalties, min_tokens, logprobs and n are refused before the engine holds anything, with
    the field and its value named."""
    e = LLM(
        "random", max_model_len=64, num_kv_blocks=16, block_size=4, speculative_model="ngram", num_speculative_tokens=2
    ).engine
    with pytest.raises(ValueError, match=rf"SamplingParams\.{shown}.*speculative decoding"):
        e.add_request([1, 2, 3], SamplingParams(max_tokens=4, **kw), request_id="r")
    assert not e.has_unfinished_requests() and "r" not in e.requests
    e.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="r")  # id free
    run_to_end(e)
    assert len(e.get_output("r").token_ids) == 4
