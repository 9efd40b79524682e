"""KV-cache quantization (``kv_cache_dtype="int8" | "fp8"``): the format, the kernels against
their torch references, the references against dense float64 attention, the engine's sizing
and cost model, and what it costs the shipped model in quality.

Triton kernels run through Triton's interpreter on a machine without CUDA (importing
``kernels`` arranges that), so every kernel case is tiny.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from minillm_kernels import ops

ops.use_interpreter_if_no_cuda()  # before triton is imported (no-op with CUDA)

from minillm_kernels.kv_quant import QMAX, dequantize, fp8_available, kind_of, quantize, round_to_e4m3, storage_dtype  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.core.invariants import check_all_free, check_invariants  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not ops.triton_available(), reason="triton not installed")
KINDS = [
    "int8",
    pytest.param(
        "fp8", marks=pytest.mark.skipif(fp8_available() is not None, reason=f"fp8 KV unavailable: {fp8_available()}")
    ),
]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """Many small steps: one torch thread is faster than two on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a one-byte float tensor (torch compares fp8 tensors poorly), else itself."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(raw(a), raw(b))


def empty_cache(kind, num_blocks, block_size, num_kv_heads, head_dim):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    dt = storage_dtype(kind)
    return [
        torch.zeros(shape, dtype=dt, device=DEVICE),
        torch.zeros(shape, dtype=dt, device=DEVICE),
        torch.zeros(shape[::2], device=DEVICE),
        torch.zeros(shape[::2], device=DEVICE),
    ]


# --- the format ------------------------------------------------------------------------------


def test_e4m3_rounding_is_torchs_cast_ties_included():
    """round_to_e4m3 (the arithmetic the Triton store does) is torch's float32 -> e4m3 cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].unique()  # every e4m3 number, -448 .. 448
    assert torch.equal(round_to_e4m3(codes), codes)
    halfway = (codes[1:] + codes[:-1]) / 2  # every tie, each exact in float32
    g = torch.Generator().manual_seed(0)
    y = torch.cat([halfway, torch.randn(20000, generator=g) * 100, torch.randn(20000, generator=g) * 1e-2])
    y = y.clamp(-448, 448)
    assert torch.equal(round_to_e4m3(y), y.to(torch.float8_e4m3fn).float())
    assert round_to_e4m3(torch.tensor([7.96, 2.0**-10, 3 * 2.0**-10, 8.5, 9.5])).tolist() == [
        8.0,
        0.0,
        2.0**-8,
        8.0,
        10.0,
    ]  # halves to even
    assert quantize(torch.tensor([2.5, 3.5, -2.5, 200.0]), torch.ones(()), "int8").tolist() == [2, 4, -2, 127]


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_error_is_within_one_step(kind):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 64, generator=g) * torch.tensor([1.0, 30.0])[None, :, None]  # heads of different range
    scale = x.abs().amax(dim=(0, 2)) / QMAX[kind]
    q = quantize(x, scale[None, :, None], kind)
    assert q.dtype == storage_dtype(kind) and kind_of(q) == kind
    err = (dequantize(q, scale[None, :, None]) - x).abs()
    if kind == "int8":
        assert (err <= 0.5 * scale[None, :, None] * (1 + 1e-5)).all()  # half a step
    else:
        assert (err <= x.abs() / 16 + scale[None, :, None] * 2.0**-10).all()  # 3 mantissa bits
    assert torch.equal(quantize(torch.zeros(3), torch.zeros(()), kind).float(), torch.zeros(3))  # scale 0


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_block_is_what_the_store_writes_for_a_whole_block(kind):
    from minillm_kernels.kv_quant import quantize_block

    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(3)) * 3
    q, scale = quantize_block(x, kind)
    cache = empty_cache(kind, 2, 4, 2, 64)
    ops.store_kv(
        x.to(DEVICE),
        x.to(DEVICE),
        *cache[:2],
        torch.arange(4, 8, device=DEVICE),
        k_scale=cache[2],
        v_scale=cache[3],
        backend="torch",
    )
    assert same(cache[0][1].cpu(), q) and torch.equal(cache[2][1].cpu(), scale)


# --- the store: kernel against reference, exactly -------------------------------------------------

# Steps of writes into a cache of blocks of 4: prompts written at once, chunks and single decode
# tokens that continue a block already holding rows (with larger values: the scale grows and the
# earlier rows are re-quantized), padding (-1), and a fresh block reusing a stale scale.
STEPS = [[12, 13, 14, 15, 4, 5, -1, 20, 21], [6, 22], [7, -1, 23], [0], [1, 2, 3, 16]]


def store_steps(kind, backend, head_dim=80, block_size=4, seed=0):
    cache = empty_cache(kind, 6, block_size, 2, head_dim)
    cache[3].fill_(5.0)  # v_scale: stale scales a fresh block must ignore
    g = torch.Generator().manual_seed(seed)
    history = []
    for i, slots in enumerate(STEPS):
        slots = torch.tensor(slots, device=DEVICE)
        k = (torch.randn(len(slots), 2, head_dim, generator=g) * (1 + i)).to(DEVICE)
        v = (torch.randn(len(slots), 2, head_dim, generator=g) * (1 + 2 * i)).to(DEVICE)
        ops.store_kv(k, v, *cache[:2], slots, k_scale=cache[2], v_scale=cache[3], backend=backend)
        history.append((slots, k, v))
    return cache, history


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_store_kernel_matches_reference_exactly(kind):
    got, _ = store_steps(kind, "triton")
    want, _ = store_steps(kind, "torch")
    for a, b in zip(got, want):
        assert same(a, b)


@needs_triton
@pytest.mark.parametrize(
    "slots", [[0, 1, 4, 2], [0, 1, -1, 2], [5, 5]], ids=["block-in-two-runs", "run-broken-by-padding", "slot-twice"]
)
def test_store_kernel_refuses_two_lead_programs_for_one_block(slots):
    """One lead program owns a block's scale; a block written by two runs of rows would have two."""
    k_cache, v_cache, k_scale, v_scale = empty_cache("int8", 3, 4, 2, 16)
    k = torch.randn(len(slots), 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="store_kv"):
        ops.store_kv(
            k,
            k,
            k_cache,
            v_cache,
            torch.tensor(slots, device=DEVICE),
            k_scale=k_scale,
            v_scale=v_scale,
            backend="triton",
        )
    assert not k_scale.any(), "nothing is stored when the check fails"


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_store_kernel_matches_reference_block_size_1_and_16(kind):
    for block_size, steps in ((1, [[3, 0, -1, 5], [1]]), (16, [list(range(16, 27)), [27], [28, 29], [0, 1]])):
        caches = [empty_cache(kind, 3 if block_size == 16 else 8, block_size, 2, 64) for _ in range(2)]
        g = torch.Generator().manual_seed(block_size)
        for i, slots in enumerate(steps):
            slots = torch.tensor(slots, device=DEVICE)
            k = (torch.randn(len(slots), 2, 64, generator=g) * (1 + i)).to(DEVICE)
            for c, backend in zip(caches, ("triton", "torch")):
                ops.store_kv(k, -2 * k, *c[:2], slots, k_scale=c[2], v_scale=c[3], backend=backend)
        assert all(same(a, b) for a, b in zip(*caches))


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_store_kernel_rounds_ties_to_even_like_the_reference(kind):
    """Values exactly halfway between two storable numbers (the block's amax is QMAX, so its
    scale is exactly 1): the kernel's own rounding must pick the reference's (torch's) neighbour."""
    if kind == "int8":
        ties = torch.arange(-126, 127).float() + 0.5
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[torch.isfinite(codes)].unique()
        ties = (codes[1:] + codes[:-1]) / 2
    n = math.ceil((ties.numel() + 1) / 64)
    x = torch.zeros(n * 64)
    x[0], x[1 : ties.numel() + 1] = QMAX[kind], ties
    k = x.view(n, 1, 64).to(DEVICE)
    caches = [empty_cache(kind, 1, n, 1, 64) for _ in range(2)]
    slots = torch.arange(n, device=DEVICE)
    for c, backend in zip(caches, ("triton", "torch")):
        ops.store_kv(k, k, *c[:2], slots, k_scale=c[2], v_scale=c[3], backend=backend)
    assert float(caches[1][2]) == 1.0
    assert all(same(a, b) for a, b in zip(*caches))


@pytest.mark.parametrize("kind", KINDS)
def test_store_reference_keeps_every_value_within_one_step(kind):
    """What the cache stands for after all the steps: each live slot holds its last write, to
    within one step of its block's final scale (two roundings when it was re-quantized)."""
    cache, history = store_steps(kind, "torch")
    k_cache, v_cache, k_scale, v_scale = [t.cpu() for t in cache]
    block_size = k_cache.shape[1]
    last = {}
    for slots, k, v in history:
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                last[s] = (k[i].cpu(), v[i].cpu())
    grew = False
    for s, (k, v) in last.items():
        b, o = divmod(s, block_size)
        for x, c, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            assert (sc[b] >= x.abs().amax(-1) / QMAX[kind] * (1 - 1e-6)).all(), "the scale covers the values"
            err = (dequantize(c[b, o], sc[b][:, None]) - x).abs()
            bound = sc[b][:, None] * (1 + 1e-5) if kind == "int8" else x.abs() / 8 + sc[b][:, None] * 2.0**-8
            assert (err <= bound).all()
    # The steps did make a scale grow under rows already written (block 1: slots 4, 5 then 6, 7).
    first_k = history[0][1][4:6].cpu()
    grew = bool((k_scale[1] > first_k.abs().amax(dim=(0, 2)) / QMAX[kind]).any())
    assert grew
    assert (v_scale[0] < 5.0).all(), "a block written from offset 0 ignores its stale scale"


def test_store_requires_scales_for_a_quantized_cache():
    k = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="k_scale"):
        ops.store_kv(
            k,
            k,
            torch.zeros(2, 4, 2, 8, dtype=torch.int8),
            torch.zeros(2, 4, 2, 8, dtype=torch.int8),
            torch.tensor([0]),
            backend="torch",
        )


# --- attention: kernel against reference, reference against dense float64 -------------------------

SCENARIOS = {
    "decode": ([1, 1, 1], [1, 17, 150]),
    "mixed": ([1, 9, 1, 4], [23, 9, 140, 30]),
    "chunked": ([6, 2], [133, 19]),
}


def quantized_batch(kind, q_lens, ctx_lens, *, q_dtype=torch.float32, block_size=16, head_dim=64, seed=0):
    """A paged, quantized cache written the way the engine writes it (a prompt, then chunks and
    single tokens), the block table permuted; returns the attention args and each request's
    dequantized K/V (what the cache stands for)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(need) + 2
    cache = empty_cache(kind, num_blocks, block_size, 2, head_dim)
    order = torch.randperm(num_blocks, generator=g)
    bt = torch.full((len(ctx_lens), max(need) + 1), 2**30, dtype=torch.int32)
    used = 0
    for i, c in enumerate(ctx_lens):
        bt[i, : need[i]] = order[used : used + need[i]].int()
        used += need[i]
        t = torch.arange(c)
        slots = (bt[i, t // block_size].long() * block_size + t % block_size).to(DEVICE)
        k = torch.randn(c, 2, head_dim, generator=g).to(DEVICE) * 2
        v = torch.randn(c, 2, head_dim, generator=g).to(DEVICE)
        # A prompt, a chunk of up to 3 tokens, then one token at a time.
        writes = [(0, c // 2), (c // 2, min(c, c // 2 + 3))] + [(j, j + 1) for j in range(c // 2 + 3, c)]
        for a, b in [(a, b) for a, b in writes if b > a]:
            ops.store_kv(k[a:b], v[a:b], *cache[:2], slots[a:b], k_scale=cache[2], v_scale=cache[3], backend="torch")
    k_cache, v_cache, k_scale, v_scale = cache
    seqs = []
    for i, c in enumerate(ctx_lens):
        t = torch.arange(c)
        blocks = bt[i, t // block_size].long().to(DEVICE)
        off = (t % block_size).to(DEVICE)
        seqs.append(
            tuple(
                dequantize(kc[blocks, off], sc[blocks][:, :, None]).cpu()
                for kc, sc in ((k_cache, k_scale), (v_cache, v_scale))
            )
        )
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 4, head_dim, generator=g).to(q_dtype)
    args = [
        q.to(DEVICE),
        k_cache,
        v_cache,
        bt.to(DEVICE),
        cu.to(DEVICE),
        torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE),
        head_dim**-0.5,
    ]
    return args, dict(k_scale=k_scale, v_scale=v_scale), seqs


def dense_float64(args, seqs):
    q, cu, ctx, scale = args[0], args[4], args[5], args[6]
    outs = []
    for i, (k, v) in enumerate(seqs):
        qi = q[cu[i] : cu[i + 1]].double().cpu()
        group = qi.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        pos = int(ctx[i]) - qi.shape[0] + torch.arange(qi.shape[0])
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_matches_dense_float64_on_dequantized_values(kind, scenario):
    args, scales, seqs = quantized_batch(kind, *SCENARIOS[scenario])
    ref = ops.paged_attention(*args, backend="torch", **scales)
    torch.testing.assert_close(ref.double().cpu(), dense_float64(args, seqs), atol=2e-5, rtol=2e-5)


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_attention_kernel_matches_reference_on_quantized_cache(kind, scenario, q_dtype):
    args, scales, _ = quantized_batch(kind, *SCENARIOS[scenario], q_dtype=q_dtype)
    ref = ops.paged_attention(*args, backend="torch", **scales)
    out = ops.paged_attention(*args, backend="triton", **scales)
    tol = 2e-5 if q_dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@needs_triton
def test_attention_kernel_split_k_on_quantized_cache():
    args, scales, _ = quantized_batch("int8", *SCENARIOS["decode"])
    ref = ops.paged_attention(*args, backend="torch", **scales)
    out = ops.paged_attention(*args, backend="triton", num_splits=3, **scales)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_attention_without_scales_is_refused():
    args, _, _ = quantized_batch("int8", [1], [5])
    with pytest.raises(ValueError, match="k_scale"):
        ops.paged_attention(*args, backend="torch")


# --- block copies and swaps carry the scales -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_copy_blocks_carries_scales(kind, backend):
    cache, _ = store_steps(kind, "torch")
    before = [t.clone() for t in cache]
    src, dst = torch.tensor([3, 1], device=DEVICE), torch.tensor([2, 4], device=DEVICE)
    ops.copy_blocks(cache[0], cache[1], src, dst, k_scale=cache[2], v_scale=cache[3], backend=backend)
    for a, b in zip(cache, before):
        assert same(a[dst], b[src]) and same(a[[0, 5]], b[[0, 5]])


@pytest.mark.parametrize("kind", KINDS)
def test_swap_round_trip_carries_scales(kind):
    cache, _ = store_steps(kind, "torch")
    host = [torch.zeros((4,) + t.shape[1:], dtype=t.dtype) for t in cache]
    ops.swap_blocks(
        cache[0],
        cache[1],
        host[0],
        host[1],
        [3, 1],
        [0, 2],
        src_scales=(cache[2], cache[3]),
        dst_scales=(host[2], host[3]),
    )
    back = [torch.zeros_like(t) for t in cache]
    ops.swap_blocks(
        host[0], host[1], back[0], back[1], [0, 2], [5, 0], src_scales=(host[2], host[3]), dst_scales=(back[2], back[3])
    )
    for a, b in zip(back, cache):
        assert same(a[[5, 0]], b[[3, 1]])


# --- configuration, sizing, cost model ---------------------------------------------------------------


def test_config_validation():
    from minillm.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="paged"):
        EngineConfig(kv_cache_dtype="int8", kv_allocation="reserved")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


class _Halving:
    """A quantizer whose scales are twice minillm_kernels.kv_quant's (values use half the range)."""

    quantize, dequantize = staticmethod(quantize), staticmethod(dequantize)

    @staticmethod
    def new_scale(old, amax, kind):
        return torch.maximum(old, 2 * amax / QMAX[kind])


def test_kv_quantizer_is_validated_and_used_by_the_store():
    from minillm.config import EngineConfig

    with pytest.raises(TypeError, match="kv_quantizer.*new_scale"):
        EngineConfig(kv_cache_dtype="int8", kv_quantizer=object())
    with pytest.raises(ValueError, match="kv_quantizer.*kv_cache_dtype"):
        EngineConfig(kv_quantizer=_Halving())
    with pytest.raises(ValueError, match="kv_quantizer.*attention_backend"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="triton", kv_quantizer=_Halving())
    scales = {}
    for name, q in (("default", None), ("halving", _Halving())):
        e = LLM("random", kv_cache_dtype="int8", kv_quantizer=q, max_model_len=32).engine
        e.add_request(list(range(3, 20)), SamplingParams(max_tokens=4, **GREEDY))
        while e.has_unfinished_requests():
            e.step()
        scales[name] = e.executor.kv_scales[0][0]
    used = scales["default"] > 0
    assert used.any() and torch.allclose(scales["halving"][used], 2 * scales["default"][used])


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_at_a_fixed_memory_budget(kind):
    """The same kv_cache_memory_gb buys >= 1.9x the blocks of fp16 (>= 3.8x of fp32), and the
    runner's tensors (values and scales) fit in the budget."""
    blocks = {}
    for dtype, kv in (("float16", "auto"), ("float32", "auto"), ("float32", kind)):
        e = LLM(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gb=0.01).engine
        blocks[(dtype, kv)] = e.num_kv_blocks
        r = e.executor
        held = sum(t.nbytes for pair in r.kv_caches + r.kv_scales for t in pair)
        assert held == e.num_kv_blocks * r.bytes_per_block <= 0.01 * 2**30
        if kv != "auto":
            assert r.kv_caches[0][0].dtype == storage_dtype(kind) and len(r.kv_scales) == len(r.kv_caches)
    assert blocks[("float32", kind)] >= 1.9 * blocks[("float16", "auto")]
    assert blocks[("float32", kind)] >= 3.8 * blocks[("float32", "auto")]


def test_cost_model_follows_the_kv_dtype():
    from minillm.sim.costmodel import MODELS, RooflineCostModel, kv_block_bytes, max_batch_size

    fp16 = RooflineCostModel("H100-SXM", "llama-2-7b")
    int8 = RooflineCostModel("H100-SXM", "llama-2-7b", kv_cache_dtype="int8")
    assert int8.kv_bytes_per_token * 2 == fp16.kv_bytes_per_token
    assert int8.model.weight_bytes == fp16.model.weight_bytes
    assert int8.kv_capacity_tokens() >= 1.99 * fp16.kv_capacity_tokens()
    spec8 = MODELS["llama-2-7b"].with_kv_cache_dtype("int8")
    assert max_batch_size("H100-SXM", spec8, 4096) >= 2 * max_batch_size("H100-SXM", "llama-2-7b", 4096) - 1
    # A decode step at a large batch and long context reads less KV, so it is faster.
    assert int8.step_time([1] * 64, [4096] * 64) < fp16.step_time([1] * 64, [4096] * 64)
    assert kv_block_bytes(4, 16, 2, 64, 2, "int8") == 2 * 4 * 2 * (16 * 64 + 4)
    # The engine's modeled clock uses it.
    e = LLM("random", kv_cache_dtype="int8", clock="modeled", cost_model="H100-SXM").engine
    base = LLM("random", clock="modeled", cost_model="H100-SXM").engine
    assert e.cost_model.kv_bytes_per_token * 2 == base.cost_model.kv_bytes_per_token


# --- the engine -------------------------------------------------------------------------------------

PROMPTS = [[3 + i, 4 + i, 5 + i, 6 + i, 7 + i, 8 + i] for i in range(6)]


def run_engine(**kw):
    e = LLM("random", block_size=2, max_model_len=64, **kw).engine
    ids = [e.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in PROMPTS]
    recs = []
    while e.has_unfinished_requests():
        recs.append(e.step())
        check_invariants(e, recs[-1])
    check_all_free(e)
    return [e.get_output(i).token_ids for i in ids], recs, e


@pytest.mark.parametrize("kind", KINDS)
def test_swap_restores_blocks_with_their_scales(kind, monkeypatch):
    """Swapped out and back in, a request's blocks and scales are what they were: its greedy
    tokens equal those of a run that never ran out of memory. Dropping the scales on the way
    breaks that, so the test can fail."""
    base, _, _ = run_engine(kv_cache_dtype=kind)
    swapped, recs, e = run_engine(kv_cache_dtype=kind, num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=40)
    assert e.stats()["swapped_out_blocks"] > 0
    assert swapped == base
    real = ops.swap_blocks
    monkeypatch.setattr(ops, "swap_blocks", lambda *a, src_scales=None, dst_scales=None: real(*a))  # forgets the scales
    dropped, _, _ = run_engine(kv_cache_dtype=kind, num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=40)
    assert dropped != base


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_engine_int8_with_prefix_caching_and_swap_keeps_invariants(backend):
    n, blocks, new = (5, 14, 10) if backend == "torch" else (3, 8, 6)  # the interpreter is slow: fewer
    llm = LLM(
        "random",
        kv_cache_dtype="int8",
        attention_backend=backend,
        block_size=4,
        num_kv_blocks=blocks,
        enable_prefix_caching=True,
        preemption_mode="swap",
        num_swap_blocks=24,
        max_model_len=48,
        max_num_batched_tokens=24,
    )
    e = llm.engine
    shared = list(range(10, 22))  # three full blocks shared by every request
    ids = [e.add_request(shared + [30 + i, 31 + i], SamplingParams(max_tokens=new, **GREEDY)) for i in range(n)]
    recs = []
    while e.has_unfinished_requests():
        recs.append(e.step())
        check_invariants(e, recs[-1])
        assert len(recs) < 500
    check_all_free(e)
    st = e.stats()
    assert st["swapped_out_blocks"] > 0, "memory pressure must have swapped"
    assert sum(r.num_cached_tokens for r in e.requests.values()) > 0, "the shared prefix must have hit the cache"
    assert all(len(e.get_output(i).token_ids) == new for i in ids)


# --- quality on the shipped model ----------------------------------------------------------------------

SHIPPED = os.path.isfile(
    os.path.join(os.path.dirname(__file__), "..", "minillm", "checkpoints", "shakespeare", "model.safetensors")
)
needs_shipped = pytest.mark.skipif(not SHIPPED, reason="the shipped model is missing")


@pytest.fixture(scope="module")
def shipped():
    from minillm.bench.kv_quant import shipped_heldout

    return shipped_heldout(520)  # two windows of 256 tokens (and a few more) of held-out text


@needs_shipped
def test_int8_kv_heldout_loss_within_one_percent_of_fp32(shipped):
    """Teacher forced over held-out text, one token per step (every block fills token by token,
    so scales grow and rows are re-quantized): int8 KV within 1% of float32 KV in nats/char."""
    from minillm.bench.kv_quant import teacher_forced

    model, _, text, ids = shipped
    fp32 = teacher_forced(model, ids, "float32", context=256)
    int8 = teacher_forced(model, ids, "int8", context=256)
    assert fp32["predicted"] == int8["predicted"] == len(ids) - 1
    a, b = fp32["nats"] / len(text), int8["nats"] / len(text)
    assert 1.0 < a < 2.5, "the model reads the held-out text (the card says about 1.47 nats/char)"
    assert abs(b / a - 1) < 0.01, f"int8 KV {b:.4f} vs fp32 KV {a:.4f} nats/char"
    top1 = sum(x == y for x, y in zip(fp32["argmax"], int8["argmax"])) / len(ids)
    print(
        f"\nheld-out nats/char: fp32 KV {a:.4f}, int8 KV {b:.4f} ({100 * (b / a - 1):+.3f}%); "
        f"top-1 agreement {top1:.1%}"
    )
    assert top1 > 0.9


@needs_shipped
def test_engine_int8_greedy_matches_fp32_on_most_tokens(shipped):
    """The engine end to end (scheduler, runner, store, attention): greedy continuations of
    held-out prompts with int8 KV agree with float32 KV on most tokens."""
    _, _, _, ids = shipped
    prompts = [ids[i : i + 24] for i in range(0, 480, 120)]
    sp = SamplingParams(max_tokens=24, **GREEDY)
    outs = {}
    for kv in ("auto", "int8"):
        llm = LLM(kv_cache_dtype=kv, kv_cache_memory_gb=0.01)
        outs[kv] = [o.token_ids for o in llm.generate(prompts, sp)]
    same = sum(a == b for x, y in zip(outs["auto"], outs["int8"]) for a, b in zip(x, y))
    total = sum(len(x) for x in outs["auto"])
    print(f"\nengine greedy agreement, int8 vs fp32 KV: {same}/{total}")
    assert same >= 0.8 * total


@needs_shipped
def test_engine_int8_with_speculative_decoding(shipped):
    """Verification writes several tokens into a block at once and rolls rejected ones back (their
    rows are overwritten from mid-block later, under a scale they may have grown): the engine
    keeps its invariants and the greedy tokens of plain int8 decoding."""
    _, _, _, ids = shipped
    prompts = [ids[i : i + 24] for i in range(0, 480, 160)]
    sp = SamplingParams(max_tokens=20, **GREEDY)
    outs = {}
    for name, kw in (("plain", {}), ("ngram", dict(speculative_model="ngram", num_speculative_tokens=3))):
        e = LLM(kv_cache_dtype="int8", kv_cache_memory_gb=0.01, **kw).engine
        rids = [e.add_request(p, sp) for p in prompts]
        while e.has_unfinished_requests():
            check_invariants(e, e.step())
        outs[name] = [e.get_output(r).token_ids for r in rids]
    same = sum(a == b for x, y in zip(outs["plain"], outs["ngram"]) for a, b in zip(x, y))
    assert same >= 0.8 * sum(len(x) for x in outs["plain"])


def prefix_runs(caching: bool, forget_scales: bool = False):
    e = LLM("random", kv_cache_dtype="int8", block_size=4, enable_prefix_caching=caching, max_model_len=64).engine
    shared = list(range(10, 22))  # three full blocks
    outs = []
    for i in range(4):  # one after another: later ones hit the cache
        rid = e.add_request(shared + [30 + i, 31 + i], SamplingParams(max_tokens=12, **GREEDY))
        while e.has_unfinished_requests():
            check_invariants(e, e.step())
        outs.append(e.get_output(rid).token_ids)
        if forget_scales:
            for ks, vs in e.executor.kv_scales:
                ks.zero_()
                vs.zero_()
    return outs, sum(r.num_cached_tokens for r in e.requests.values())


def test_prefix_cache_hits_read_the_shared_blocks_with_their_scales():
    """Requests served from cached int8 blocks produce the tokens they produce when they compute
    the prefix themselves; wiping the scales between requests breaks that."""
    computed, none = prefix_runs(caching=False)
    cached, hits = prefix_runs(caching=True)
    assert none == 0 and hits >= 3 * 12
    assert cached == computed
    wiped, _ = prefix_runs(caching=True, forget_scales=True)
    assert wiped[0] == computed[0] and wiped[1:] != computed[1:]


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bench_case_on_a_quantized_cache(kind):
    """``python -m minillm_kernels.bench --kv-cache-dtype int8|fp8`` (GPU only) times these two sides:
    they must agree, and the bytes it counts are one per value plus the scales."""
    from minillm_kernels.bench import Case

    c = Case(2, 40, 3, 4, 2, 64, 16, torch.float32, torch.device(DEVICE), kv_cache_dtype=kind)
    torch.testing.assert_close(c.ours(), c.sdpa(), atol=2e-5, rtol=2e-5)
    assert c.kv_bytes() == 2 * 2 * 40 * 2 * 64 + 2 * 2 * 3 * 2 * 4


# --- what "the same tokens as alone" means on a quantized cache --------------------------------


def _int8_prompts(seed=4):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(9, 16))] for _ in range(4)]


def _greedy_tokens(prompts, kind, **config):
    llm = LLM(model="random", max_model_len=96, kv_cache_dtype=kind, block_size=4, **config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    return [o.token_ids for o in outs], [o.metrics for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantized_request_written_in_the_same_pieces_gets_its_tokens_alone(kind):
    """docs/architecture.md (KV-cache quantization): on an int8 / fp8 cache a request gets the tokens it gets alone when
    its blocks are written in the same pieces: here batched with others, its prompt written whole
    (no chunked prefill) and swapped out and back in (bytes and scales travel); and alone with its
    prompt cut into chunks at block boundaries only (a budget of one block, then of two)."""
    prompts = _int8_prompts()
    alone = [_greedy_tokens([p], kind, num_kv_blocks=64, max_num_batched_tokens=96)[0][0] for p in prompts]
    batched, metrics = _greedy_tokens(
        prompts,
        kind,
        num_kv_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=96,
        enable_chunked_prefill=False,
        preemption_mode="swap",
        num_swap_blocks=64,
    )
    assert sum(m.num_preemptions for m in metrics) > 0 and all(m.num_recomputed_tokens == 0 for m in metrics)
    assert batched == alone
    for budget in (4, 8):
        assert (
            _greedy_tokens(prompts, kind, num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=budget)[0] == alone
        )


def test_a_prompt_cut_inside_a_block_can_change_a_quantized_requests_tokens():
    """The caveat in docs/architecture.md (KV-cache quantization): with a budget of 3 tokens (block size 4)
    a prompt's chunks end inside blocks; a block written in two pieces is re-quantized when its scale grows,
    so its bytes, and here prompt 3's greedy tokens, differ from the prompt written whole. A float cache
    does not care how the prompt was cut."""
    prompts = _int8_prompts()
    whole, _ = _greedy_tokens(prompts, "int8", num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=96)
    cut, _ = _greedy_tokens(prompts, "int8", num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=3)
    assert [i for i in range(4) if whole[i] != cut[i]] == [3]
    assert (
        _greedy_tokens(prompts, "auto", num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=96)[0]
        == _greedy_tokens(prompts, "auto", num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=3)[0]
    )


@needs_shipped
def test_few_levels_with_int8s_127_levels_is_the_int8_store_and_7_levels_costs_more(shipped):
    """``FewLevels(127)`` is the int8 store's arithmetic (same scale, rounding and clamp): its loss and argmaxes
    equal the engine's int8 cache exactly. ``FewLevels(7)`` (notebook 02's int4-like case) has 18 times coarser
    steps: its loss moves away from float32's by more than int8's does."""
    from minillm.bench.kv_quant import FewLevels, teacher_forced

    model, _, text, ids = shipped
    ids = ids[:257]
    base, int8 = (teacher_forced(model, ids, kind, context=256) for kind in ("float32", "int8"))
    same = teacher_forced(model, ids, ("int8", FewLevels(127)), context=256)
    coarse = teacher_forced(model, ids, "int4-like", context=256)
    assert same["nats"] == int8["nats"] and same["argmax"] == int8["argmax"]
    assert abs(coarse["nats"] / base["nats"] - 1) > 10 * abs(int8["nats"] / base["nats"] - 1)
    with pytest.raises(ValueError, match="levels=0"):
        FewLevels(0)
