"""Speculative decoding: exactness (greedy token for token, sampling in distribution),
rollback without leaks, the scheduling limits, and the modeled cost of the draft.

Targets are the tiny random Llama; drafts are checkpoints written here (a one-layer cut of
the target, or an unrelated random model), so nothing waits for the shipped checkpoints.
The sampling reference comes from Hugging Face ``transformers`` running the target's weights,
not from the engine.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.sim.costmodel import MODELS, RooflineCostModel
from minillm.core.invariants import check_all_free, check_invariants
from minillm.model.loader import load_model
from minillm.spec.speculative import (
    NgramProposer,
    Proposer,
    expected_speedup,
    expected_tokens_per_step,
    modeled_speedup,
    spec_limit,
    spec_stats,
)

from helpers import run_to_end

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matrices: one thread is faster than two fighting over shared cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_draft(path, layers: int, seed: int = 0, **overrides) -> str:
    """The random Llama of ``seed`` cut to its first ``layers`` layers, saved as a checkpoint.
    With ``seed`` equal to the target's it is a plausible draft (same embeddings and LM head,
    fewer layers); with another seed an unrelated one."""
    from safetensors.torch import save_file

    m, cfg = load_model("random", "float32", "cpu", seed, overrides)
    state = {
        k: v.contiguous()
        for k, v in m.state_dict().items()
        if not any(k.startswith(f"model.layers.{i}.") for i in range(layers, cfg.num_hidden_layers))
    }
    cfg.num_hidden_layers = layers
    cfg.save_pretrained(path)
    save_file(state, f"{path}/model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_draft(tmp_path_factory.mktemp("draft"), layers=1)


# --- greedy: identical token for token ------------------------------------------------------------

SHARED = [11, 12, 13, 14, 15, 16, 17, 18]  # a common prefix: prefix-cache hits
PROMPTS = [SHARED + [20 + i] * (1 + 3 * i) for i in range(5)] + [[7, 8, 9, 7, 8, 9, 7, 8]]
MAX_TOKENS = [24, 18, 30, 12, 26, 28]


def greedy_run(**kw):
    llm = LLM("random", block_size=4, max_model_len=64, **kw)
    e = llm.engine
    ids = [e.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(PROMPTS, MAX_TOKENS)]
    recs = run_to_end(e)
    return [e.get_output(i).token_ids for i in ids], recs, e


@pytest.fixture(scope="module")
def greedy_reference():
    out, _, _ = greedy_run()  # no speculation, no memory pressure
    return out


# Memory pressure and every feature on: prefix caching, chunked prefill (16-token budget),
# 20 blocks of 4 positions for six requests of up to 47 positions (preemption); odd k swap.
PRESSURE = dict(
    enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=16, num_kv_blocks=20, max_num_seqs=4
)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_identical_with_speculation(k, proposer, draft_dir, greedy_reference):
    mode = dict(preemption_mode="swap", num_swap_blocks=48) if k % 2 else dict(preemption_mode="recompute")
    model = draft_dir if proposer == "draft" else "ngram"
    out, recs, e = greedy_run(speculative_model=model, num_speculative_tokens=k, **PRESSURE, **mode)
    assert out == greedy_reference
    st = spec_stats(recs)
    # The run really speculated, rejected, accepted, preempted, chunked and hit the prefix cache.
    assert st["proposed"] > 0 and 0 < st["accepted"] < st["proposed"]
    assert any(r.preempted for r in recs)
    assert e.stats()["prefix_cache"]["hit_blocks"] > 0
    assert any(
        b.phase == "prefill" and b.num_new_tokens < len(PROMPTS[4]) and b.request_id == "4"
        for r in recs
        for b in r.batch
    )
    # Per-request metrics add up to the per-step totals; never more guesses than k.
    ms = e.request_metrics()
    assert sum(m.num_spec_proposed for m in ms) == st["proposed"]
    assert sum(m.num_spec_accepted for m in ms) == st["accepted"]
    assert all(b.num_spec_tokens <= k and b.num_spec_accepted <= b.num_spec_tokens for r in recs for b in r.batch)
    assert all(r.num_batched_tokens <= r.token_budget for r in recs)


# --- sampling: the output follows the target's distribution ---------------------------------------

V = 8  # a tiny vocabulary: a chi-square test with 7 degrees of freedom
CHI2_CRIT_7DF = 24.322  # 0.999 quantile of chi-square(7): a false alarm 1 time in 1000
TEMPERATURE = 0.1  # sharpens the random models' flat logits into distinct distributions
PROMPT = [3, 5, 7, 4]
N_SAMPLES = 2000


def exact_marginals(engine_model, prompt, temperature):
    """Marginals of output tokens 1, 2 and 3 under the target, by enumeration, computed with
    Hugging Face's Llama on the target's weights (an independent implementation)."""
    import transformers as tf

    hf = tf.LlamaForCausalLM(engine_model.config)
    hf.load_state_dict(engine_model.state_dict(), strict=False)
    hf.eval()
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        logits = hf(seqs).logits.double() / temperature
    L = len(prompt)
    p1 = torch.softmax(logits[0, L - 1], -1)  # P(t1)
    p2 = torch.softmax(logits[::V, L], -1)  # P(t2 | t1)       [t1, t2]
    p3 = torch.softmax(logits[:, L + 1], -1).view(V, V, V)  # P(t3 | t1, t2)   [t1, t2, t3]
    return [p1, p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)]


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = counts.sum() * p
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory):
    return write_draft(tmp_path_factory.mktemp("draft8"), layers=2, seed=7, vocab_size=V)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampling_follows_target_distribution(proposer, unrelated_draft):
    """Tokens 2 and 3 come out of speculative steps (k = 2: a guess of both, the target's
    correction or a bonus); their empirical distribution over 2000 requests must match the
    target's exact marginal. Token 1 (from the prefill) is the control."""
    model = unrelated_draft if proposer == "draft" else "ngram"
    llm = LLM(
        "random",
        random_model=dict(vocab_size=V),
        speculative_model=model,
        num_speculative_tokens=2,
        max_num_seqs=512,
        max_model_len=16,
        block_size=4,
        seed=1,
    )
    e = llm.engine
    sp = SamplingParams(max_tokens=4, temperature=TEMPERATURE, ignore_eos=True)
    ids = [e.add_request(PROMPT, sp) for _ in range(N_SAMPLES)]
    recs = []
    while e.has_unfinished_requests():
        recs.append(e.step())
    check_all_free(e)
    st = spec_stats(recs)
    assert st["proposed"] > 1000 and 0.05 < st["acceptance_rate"] < 0.95  # both branches exercised
    toks = torch.tensor([e.get_output(i).token_ids for i in ids])
    exact = exact_marginals(e.model, PROMPT, TEMPERATURE)
    for j in range(3):
        counts = torch.bincount(toks[:, j], minlength=V).double()
        assert chi2(counts, exact[j]) < CHI2_CRIT_7DF, f"token {j + 1}: {counts.tolist()} vs {exact[j].tolist()}"


def test_chi_square_test_has_power(unrelated_draft):
    """The test above can fail: had the engine emitted the draft's guesses unchecked, the
    expected chi-square statistic (N * sum (q - p)^2 / p) would be far above the critical value."""
    llm = LLM(
        "random", random_model=dict(vocab_size=V), speculative_model=unrelated_draft, num_speculative_tokens=1, seed=1
    )
    p = exact_marginals(llm.engine.model, PROMPT, TEMPERATURE)
    draft_model = llm.engine.speculator.proposer.model
    q = exact_marginals(draft_model, PROMPT, TEMPERATURE)
    for j in (1, 2):
        assert N_SAMPLES * float(((q[j] - p[j]) ** 2 / p[j]).sum()) > 4 * CHI2_CRIT_7DF


def test_draft_model_proposals_are_its_greedy_continuation(draft_dir):
    """The draft's paged KV (its own tensors, the target's block ids) gives the same guesses as
    running the draft checkpoint alone, greedily, from scratch, at every step."""
    llm = LLM("random", speculative_model=draft_dir, num_speculative_tokens=5, max_model_len=64, block_size=4)
    e = llm.engine
    alone = LLM(draft_dir, max_model_len=64)
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=20, **GREEDY), request_id="r")
    req = e.requests["r"]
    e.step()  # prefill: the target's first token
    checked = 0
    while not req.is_finished:
        known = list(req.all_token_ids)
        e.step()  # the draft guesses into its slots; the target verifies
        guesses = e.speculator.proposals.get("r", [])
        if guesses:
            ref = alone.generate([known], SamplingParams(max_tokens=len(guesses), **GREEDY))
            assert guesses == ref[0].token_ids
            checked += 1
    assert checked >= 3


# --- rollback, limits, budget ---------------------------------------------------------------------


class WrongGuesses(Proposer):
    """Always proposes k tokens the target will reject (as far as we know): token 0 repeated."""

    name = "wrong"

    def propose(self, requests, k):
        return {r.request_id: [0] * ki for r, ki in zip(requests, self._per_request(requests, k))}


def test_rollback_returns_emptied_blocks():
    llm = LLM("random", speculative_model="ngram", num_speculative_tokens=5, block_size=2, max_model_len=64)
    e = llm.engine
    e.speculator.proposer = WrongGuesses()
    e.add_request([5, 6, 7], SamplingParams(max_tokens=20, **GREEDY), request_id="r")
    req = e.requests["r"]
    while e.has_unfinished_requests():
        rec = e.step()
        check_invariants(e, rec)
        entry = rec.entry("r")
        if entry.num_spec_tokens:
            rejected = entry.num_spec_tokens - entry.num_spec_accepted
            assert entry.context_len == entry.num_computed_before + entry.num_new_tokens - rejected
        if not req.is_finished:
            # Exactly the blocks its KV needs: the rejected positions' blocks went back.
            assert e.kv.num_held_blocks("r") == math.ceil(req.num_computed_tokens / 2)
    check_all_free(e)


def test_never_proposes_past_max_tokens_or_max_model_len():
    llm = LLM("random", speculative_model="ngram", num_speculative_tokens=4, block_size=4, max_model_len=20)
    e = llm.engine
    e.speculator.proposer = WrongGuesses()
    e.add_request([3, 4, 5], SamplingParams(max_tokens=6, **GREEDY), request_id="short")
    e.add_request(list(range(3, 17)), SamplingParams(max_tokens=30, **GREEDY), request_id="long")  # 14 of 20
    recs = run_to_end(e)
    outs = {rid: e.get_output(rid) for rid in ("short", "long")}
    assert len(outs["short"].token_ids) == 6 and len(outs["long"].token_ids) == 20 - 14
    produced = {"short": 0, "long": 0}
    for r in recs:
        for b in r.batch:
            req = e.requests[b.request_id]
            if b.num_spec_tokens:
                assert produced[b.request_id] + b.num_spec_tokens + 1 <= req.sampling_params.max_tokens
                assert b.num_computed_before + b.num_new_tokens <= 20
            produced[b.request_id] += b.num_output_tokens
    assert spec_limit(e.requests["short"], 4, 20) == 0


def test_budget_truncates_guesses_and_mixes_plain_decode():
    """Three decoding requests, k = 4, an 8-token budget. Guesses never crowd out a later request's
    next token: r0 verifies 4 guesses (5 tokens), r1 keeps 1 of its 4 (2 tokens), r2 decodes
    plainly (1 token), in the same step."""
    llm = LLM(
        "random",
        speculative_model="ngram",
        num_speculative_tokens=4,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
    )
    e = llm.engine
    e.speculator.proposer = WrongGuesses()
    for i in range(3):
        e.add_request([3 + i, 4], SamplingParams(max_tokens=10, **GREEDY), request_id=f"r{i}")
    e.step()  # prefill of all three (6 tokens)
    rec = e.step()
    check_invariants(e, rec)
    assert [(b.request_id, b.num_new_tokens, b.num_spec_tokens) for b in rec.batch] == [
        ("r0", 5, 4),
        ("r1", 2, 1),
        ("r2", 1, 0),
    ]
    assert rec.num_batched_tokens == 8
    for rid in ("r1", "r2"):  # blocks reserved for dropped guesses went back
        req = e.requests[rid]
        assert e.kv.num_held_blocks(rid) == math.ceil(req.num_computed_tokens / 4)
    run_to_end(e)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_kv_blocks=st.integers(14, 40),
    k=st.integers(1, 5),
    budget=st.integers(6, 24),
    caching=st.booleans(),
    swap=st.booleans(),
    temperature=st.sampled_from([0, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_invariants(block_size, num_kv_blocks, k, budget, caching, swap, temperature, seed):
    """Random memory, budget, k and sampling; prompts that repeat (so prompt lookup guesses):
    the invariants hold after every step and every block comes back."""
    num_kv_blocks = max(num_kv_blocks, 48 // block_size)  # the longest request fits alone
    mode = dict(preemption_mode="swap", num_swap_blocks=64) if swap else {}
    llm = LLM(
        "random",
        speculative_model="ngram",
        num_speculative_tokens=k,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=max(budget, k + 1),
        max_model_len=48,
        enable_prefix_caching=caching and block_size > 1,
        max_num_seqs=4,
        **mode,
    )
    g = torch.Generator().manual_seed(seed)
    for i in range(6):
        unit = torch.randint(3, 20, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        prompt = (unit * 12)[: int(torch.randint(2, 16, (1,), generator=g))]
        e_sp = SamplingParams(
            max_tokens=int(torch.randint(1, 30, (1,), generator=g)), temperature=temperature, ignore_eos=True, seed=i
        )
        llm.engine.add_request(prompt, e_sp)
    run_to_end(llm.engine)


# --- the n-gram proposer ----------------------------------------------------------------------------


def test_ngram_prompt_lookup():
    p = NgramProposer(n_max=3)
    assert p.propose_tokens([1, 2, 3, 1, 2], 3) == [3, 1, 2]  # "1 2" was followed by "3 1 2"
    assert p.propose_tokens([5, 6, 5, 6], 4) == [5, 6, 5, 6]  # the copy runs over its own output
    assert p.propose_tokens([9, 1, 2, 8, 1, 2], 2) == [8, 1]  # the most recent match wins
    assert p.propose_tokens([1, 2, 3, 4], 3) == []  # nothing repeats: no guess
    assert p.propose_tokens([4, 1, 2, 3, 9, 2, 3], 1) == [9]  # longest suffix first ("2 3")


# --- the modeled clock and the analysis helpers --------------------------------------------------------


def test_modeled_clock_charges_draft_and_verification(draft_dir):
    llm = LLM(
        "random",
        speculative_model=draft_dir,
        num_speculative_tokens=3,
        clock="modeled",
        cost_model="H100-SXM",
        max_model_len=64,
    )
    e = llm.engine
    cm, dcm = e.cost_model, e.speculator.draft_cost_model
    assert isinstance(dcm, RooflineCostModel) and dcm.model.num_layers == 1
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=12, **GREEDY))
    drafted = 0
    while e.has_unfinished_requests():
        rec = e.step()
        draft = e.speculator.last_draft_time
        target = cm.step_time(
            [b.num_new_tokens for b in rec.batch], [b.num_computed_before + b.num_new_tokens for b in rec.batch]
        )
        assert rec.duration == pytest.approx(target + rec.schedule_time + rec.swap_time + draft)
        if rec.spec_proposed:
            drafted += 1
            assert draft > 0 and draft == pytest.approx(
                sum(dcm.step_time(q, c) for q, c in e.speculator.proposer.forwards)
            )
    assert drafted > 0


def test_expected_speedup_formula():
    # Leviathan et al. (2023), by hand: alpha = 0.8, k = 4, c = 0.05:
    # (1 - 0.8^5) / ((1 - 0.8) * (4 * 0.05 + 1)) = 0.67232 / 0.24 = 2.80133...
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(0.67232 / 0.24)
    assert expected_tokens_per_step(1.0, 4) == 5 and expected_tokens_per_step(0.0, 4) == 1
    assert expected_speedup(0.1, 4, 0.3) < 1  # a poor draft makes decoding slower


def test_modeled_speedup_shrinks_with_batch():
    target = RooflineCostModel("H100-SXM", "llama-2-7b")
    draft = RooflineCostModel("H100-SXM", MODELS["qwen3-0.6b"])
    small = modeled_speedup(target, draft, batch=1, context_len=512, k=4, alpha=0.8)
    large = modeled_speedup(target, draft, batch=256, context_len=512, k=4, alpha=0.8)
    assert small["speedup"] > 1.5  # memory bound: verification ~ a plain step
    assert large["speedup"] < small["speedup"]  # compute bound: k + 1 positions cost more
    assert modeled_speedup(target, draft, 1, 512, 4, alpha=0.1)["speedup"] < 1


# --- configuration errors ---------------------------------------------------------------------------


def test_bad_configurations_are_named(tmp_path, unrelated_draft):
    with pytest.raises(ValueError, match="speculative_model"):
        LLM("random", speculative_model=str(tmp_path / "nope"), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM("random", speculative_model=unrelated_draft, num_speculative_tokens=2)  # 8 vs 512 tokens
    with pytest.raises(ValueError, match="executor"):
        LLM("random", executor="simulated", speculative_model="ngram", num_speculative_tokens=2)
