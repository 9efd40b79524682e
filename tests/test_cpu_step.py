"""The CPU fast path's step inputs and greedy sampling (minillm/worker/cpu_step.py) against the
references they must equal: ``flat_batch.flat_batch`` and ``sampler.sample_plain``; and the engine
with them against transformers."""

import random
from types import SimpleNamespace

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.executor import ExecutionResult
from minillm.worker import cpu_step, sampler
from minillm.worker.flat_batch import flat_batch
from minillm_kernels import cpu_attention

from helpers import hf_greedy, random_prompts, tiny_hf_checkpoint


def random_batch(rng: random.Random, attn_block_size: int):
    """A ragged batch: decodes (one token) and prefills (several), each with its own block table."""
    b = rng.randint(1, 9)
    q_lens = [rng.choice([1, 1, 1, rng.randint(2, 40)]) for _ in range(b)]
    starts = [rng.randint(0, 60) for _ in range(b)]
    tables = []
    for q, s in zip(q_lens, starts):
        need = (s + q + attn_block_size - 1) // attn_block_size
        tables.append([rng.randrange(1, 500) for _ in range(need + rng.randint(0, 2))])
    ids = [rng.randrange(1000) for _ in range(sum(q_lens))]
    return ids, q_lens, starts, tables


@pytest.mark.parametrize("attn_block_size", [1, 4, 16])
def test_input_buffers_equal_flat_batch(attn_block_size):
    """Step after step (the buffers grow, shrink back to a smaller batch and keep stale values
    past its end), every tensor equals the reference's, and the block tables are contiguous."""
    rng = random.Random(attn_block_size)
    buffers = cpu_step.InputBuffers()
    for _ in range(40):
        args = (*random_batch(rng, attn_block_size), attn_block_size, torch.device("cpu"), "cpu")
        ids, pos, meta, cu = buffers.flat_batch(*args)
        r_ids, r_pos, r_meta, r_cu = flat_batch(*args)
        for got, want in [
            (ids, r_ids),
            (pos, r_pos),
            (meta.slot_mapping, r_meta.slot_mapping),
            (meta.block_tables, r_meta.block_tables),
            (meta.cu_seqlens_q, r_meta.cu_seqlens_q),
            (meta.context_lens, r_meta.context_lens),
            (cu, r_cu),
        ]:
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert meta.block_tables.is_contiguous()
        assert (meta.max_q_len, meta.backend) == (r_meta.max_q_len, r_meta.backend)


def scheduled(params: SamplingParams, i: int, output=(5, 6)):
    req = SimpleNamespace(
        request_id=f"r{i}",
        sampling_params=params,
        parent=None,
        prompt_token_ids=[1, 2, 3],
        output_token_ids=list(output),
        eos_token_id=None,
    )
    return SimpleNamespace(request=req)


def both(logits, plain):
    """(fast path's result, reference's result), each with a fresh sampler of the same seed."""
    results = []
    for sample in (cpu_step.sample_plain, sampler.sample_plain):
        res = ExecutionResult(sampled=[()] * len(plain))
        sample(sampler.Sampler(seed=3), logits, plain, res)
        results.append(res)
    return results


GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize(
    "others",
    [
        [],  # all greedy: the shortcut
        [SamplingParams(temperature=0.8, seed=1, max_tokens=4)],
        [SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)],
        [SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=4)],
        [SamplingParams(temperature=0.0, min_tokens=3, max_tokens=4, stop_token_ids=[7])],
    ],
)
def test_sample_plain_equals_the_reference(others):
    torch.manual_seed(0)
    params = [GREEDY] * 5 + others
    logits = torch.randn(len(params) + 2, 50)  # two more rows: e.g. a prompt's logprob rows
    rows = [0, 2, 3, 4, 5, 6][: len(params)]
    plain = [(r, g, scheduled(p, g)) for g, (r, p) in enumerate(zip(rows, params))]
    fast, ref = both(logits, plain)
    assert fast == ref
    assert all(len(t) == 1 for t in fast.sampled)


def test_sample_plain_ties_pick_the_first_maximum():
    """Equal maxima in a row: the shortcut (numpy's argmax) picks the first, as the reference does."""
    logits = torch.zeros(3, 40)  # row 0: all equal -> token 0
    logits[1, [7, 3, 30]] = 2.5  # row 1: three maxima -> token 3
    logits[2, [39, 12]] = -1e-3  # row 2: the zeros win; the first is token 0
    logits[2, :12] = -5.0  # ... but only from 12 on -> token 13
    plain = [(r, r, scheduled(GREEDY, r)) for r in range(3)]
    fast, ref = both(logits, plain)
    assert fast == ref
    assert [t[0] for t in fast.sampled] == [0, 3, 13]


def test_sample_plain_shortcut_leaves_a_bad_row_to_the_reference():
    """A NaN row fails with the reference's reason; the other rows get their argmax."""
    logits = torch.randn(4, 30)
    logits[2, 5] = float("nan")
    plain = [(r, r, scheduled(GREEDY, r)) for r in range(4)]
    fast, ref = both(logits, plain)
    assert fast == ref
    assert "r2" in fast.failed and fast.sampled[0] == [int(logits[0].argmax())]


def test_engine_uses_them_and_matches_transformers(tmp_path):
    """attention_backend="cpu": the runner builds its batches in reused buffers and samples greedy
    rows with one argmax; the tokens equal transformers' and the torch reference backend's."""
    if cpu_attention.compiler() is None:
        pytest.skip("no C compiler for the CPU kernel")
    model = tiny_hf_checkpoint(tmp_path, "llama")
    prompts = random_prompts(7, 128, seed=4, lo=3, hi=30)
    ref = [hf_greedy(model, p, 8) for p in prompts]
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(str(tmp_path), max_model_len=64, dtype="float32", attention_backend=backend, max_num_seqs=4)
        runner = llm.engine.executor
        assert (runner.sample_plain is cpu_step.sample_plain) == (backend == "cpu")
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outs[backend] = [o.outputs[0].token_ids for o in got]
    assert outs["cpu"] == ref
    assert outs["torch"] == ref
