"""Graders of notebook 02's KV-quantization exercise (``exercises/ex02b_kv_quant.py``): ``make grade EX=02b``.

Each function is held against numbers worked by hand (ties, clamping, a block of zeros, heads
of different ranges) and against minillm's own format (``kernels/kv_quant.py``, whose int8 and
e4m3 rounding is in turn checked against torch's casts in tests/test_kv_quant.py) on random
blocks. Then the engine runs with your functions as its ``kv_quantizer``: every byte of the KV
cache, every scale and every greedy token must equal what minillm's own store writes.
"""

from __future__ import annotations

import pytest
import torch

from minillm_kernels import kv_quant as ref
from minillm import LLM, SamplingParams, impl

FP8 = ref.fp8_available() is None
KINDS = ["int8", pytest.param("fp8", marks=pytest.mark.skipif(not FP8, reason=f"fp8: {ref.fp8_available()}"))]


def ex():
    return impl.load("ex02b_kv_quant")


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an fp8 tensor (torch compares fp8 tensors poorly), else the tensor."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


# --- Exercise 1: new_scale ----------------------------------------------------------------------------


def test_new_scale_by_hand():
    f = ex().new_scale
    assert f(torch.zeros(2), torch.tensor([127.0, 254.0]), "int8").tolist() == [1.0, 2.0]
    assert f(torch.zeros(2), torch.tensor([448.0, 4.48]), "fp8").tolist() == pytest.approx([1.0, 0.01])
    assert f(torch.tensor([3.0, 0.5]), torch.tensor([127.0, 127.0]), "int8").tolist() == [3.0, 1.0]  # only grows
    assert f(torch.zeros(1), torch.zeros(1), "int8").tolist() == [0.0]


# --- Exercise 2: quantize -----------------------------------------------------------------------------


def test_quantize_int8_rounds_half_to_even_and_clamps_symmetrically():
    f = ex().quantize
    q = f(torch.tensor([2.5, 3.5, -2.5, 0.49, -0.51, 126.6, 200.0, -200.0]), torch.tensor(1.0), "int8")
    assert q.dtype == torch.int8, f"quantize(..., 'int8') must return an int8 tensor, got {q.dtype}"
    assert q.tolist() == [2, 4, -2, 0, -1, 127, 127, -127], (
        f"int8 rounds halves to even and clamps to +-127: expected [2, 4, -2, 0, -1, 127, 127, -127], got {q.tolist()}"
    )
    assert f(torch.tensor([1.0, -3.0, 0.75]), torch.tensor(0.5), "int8").tolist() == [2, -6, 2]
    per_head = f(torch.tensor([[10.0, 10.0]]), torch.tensor([[1.0, 4.0]]), "int8")  # broadcast
    assert per_head.tolist() == [[10, 2]]


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_a_block_of_zeros_with_scale_zero(kind):
    q = ex().quantize(torch.zeros(4, 2, 8), torch.zeros(1, 2, 1), kind)
    assert q.dtype == ref.storage_dtype(kind), (
        f"quantize(..., {kind!r}) must return {ref.storage_dtype(kind)}, got {q.dtype}"
    )
    assert torch.equal(q.float(), torch.zeros(4, 2, 8)), "a scale of 0 stores zeros (no 0/0 = nan)"


@pytest.mark.skipif(not FP8, reason="no float8_e4m3fn in this torch")
def test_quantize_fp8_by_hand():
    q = ex().quantize(torch.tensor([0.3, -0.3, 1000.0, -1000.0, 448.0, 17.0, 1.0]), torch.tensor(1.0), "fp8")
    assert q.dtype == torch.float8_e4m3fn, f"quantize(..., 'fp8') must return a float8_e4m3fn tensor, got {q.dtype}"
    # 0.3 lies between e4m3's 0.28125 and 0.3125 (steps of 2^-5 in [0.25, 0.5)); 17 between 16 and 18.
    assert q.float().tolist() == [0.3125, -0.3125, 448.0, -448.0, 448.0, 16.0, 1.0]
    assert ex().quantize(torch.tensor([2.0]), torch.tensor(4.0), "fp8").float().tolist() == [0.5]


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_matches_minillm_at_random(kind):
    g = torch.Generator().manual_seed(5)
    for trial in range(20):
        x = torch.randn(16, 3, 32, generator=g) * (10 ** torch.empty(1).uniform_(-3, 3, generator=g))
        scale = x.abs().amax(dim=(0, 2), keepdim=True) / ref.QMAX[kind]
        scale = scale * torch.tensor([1.0, 0.5, 2.0])[None, :, None]  # head 1 clamps, head 2 has room
        assert same(ex().quantize(x, scale, kind), ref.quantize(x, scale, kind)), trial


# --- Exercise 3: dequantize ---------------------------------------------------------------------------


def test_dequantize_by_hand():
    f = ex().dequantize
    out = f(torch.tensor([2, -127, 0], dtype=torch.int8), torch.tensor(0.5))
    assert out.dtype == torch.float32 and out.tolist() == [1.0, -63.5, 0.0]
    q = torch.tensor([[[4, 4]], [[-1, 2]]], dtype=torch.int8)  # [2 rows, 1 head, 2]
    assert f(q, torch.tensor([0.25])[None, :, None]).tolist() == [[[1.0, 1.0]], [[-0.25, 0.5]]]
    if FP8:
        e = torch.tensor([0.3125, -448.0]).to(torch.float8_e4m3fn)
        assert f(e, torch.tensor(2.0)).tolist() == [0.625, -896.0]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_stays_within_one_step(kind):
    x = torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 30.0])[None, :, None]
    scale = x.abs().amax(dim=(0, 2)) / ref.QMAX[kind]
    back = ex().dequantize(ex().quantize(x, scale[None, :, None], kind), scale[None, :, None])
    err = (back - x).abs()
    bound = 0.5 * scale[None, :, None] * (1 + 1e-5) if kind == "int8" else x.abs() / 16 + scale[None, :, None] / 2**10
    worst = int(err.argmax())
    limit = float(bound.expand_as(err).flatten()[worst])
    assert (err <= bound).all(), (
        f"dequantize(quantize(x)) must be within half a step of x; the largest error is "
        f"{float(err.max()):.4g} where the bound is {limit:.4g}"
    )


# --- Exercise 4: quantize_block -----------------------------------------------------------------------


def test_quantize_block_by_hand():
    x = torch.tensor(
        [
            [[1.0, -254.0], [0.0, 0.25]],  # [2 rows, 2 heads, head_dim 2]
            [[127.0, 0.0], [-1.0, 0.0]],
        ]
    )
    q, s = ex().quantize_block(x, "int8")
    assert torch.equal(s, torch.tensor([254.0, 1.0]) / 127), "one scale per head, from its largest |x| (here negative)"
    assert q.tolist() == [[[0, -127], [0, 32]], [[64, 0], [-127, 0]]]  # 0.5 -> 0 and 63.5 -> 64: halves to even


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_block_matches_minillm_at_random(kind):
    g = torch.Generator().manual_seed(3)
    for trial in range(10):
        ranges = torch.tensor([0.01, 1.0, 50.0, 0.0])[None, :, None]  # heads of different range, one zero
        x = torch.randn(16, 4, 64, generator=g) * ranges - 0.3 * ranges  # skewed: the largest |x| often negative
        q, s = ex().quantize_block(x, kind)
        rq, rs = ref.quantize_block(x, kind)
        assert s.shape == (4,) and torch.allclose(s, rs, rtol=0, atol=0), trial
        assert same(q, rq), trial


# --- the engine with your quantizer -------------------------------------------------------------------

PROMPTS = [[3 + i, 4 + i, 5 + i, 6 + i, 7 + i] for i in range(5)]


def _run(kind, quantizer):
    llm = LLM(
        "random", kv_cache_dtype=kind, attention_backend="torch", kv_quantizer=quantizer, block_size=4, max_model_len=64
    )
    e = llm.engine
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ids = [e.add_request(p, sp) for p in PROMPTS]
    while e.has_unfinished_requests():
        e.step()
    return e, [e.get_output(i).token_ids for i in ids]


@pytest.mark.parametrize("kind", KINDS)
def test_engine_with_your_quantizer_writes_minillms_cache(kind):
    """Prompts written at once, then one token per step: blocks fill token by token, scales grow
    and earlier rows are re-quantized, all with your functions. The cache left behind (values and
    scales of every layer) and the greedy tokens must be minillm's, byte for byte."""
    mine, mine_out = _run(kind, ex().ExerciseQuantizer())
    base, base_out = _run(kind, None)
    assert mine.config.kv_quantizer is not None, "ExerciseQuantizer() must reach the engine as its kv_quantizer"
    for (a, b), (c, d) in zip(mine.executor.kv_caches, base.executor.kv_caches):
        assert same(a, c) and same(b, d)
    for (a, b), (c, d) in zip(mine.executor.kv_scales, base.executor.kv_scales):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert mine_out == base_out, "with your quantizer the engine's greedy tokens must be minillm's own"
