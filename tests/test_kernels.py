"""Kernels against their torch references, references against naive dense attention.

On a machine without CUDA the Triton kernels run through Triton's interpreter, so every
case is tiny (a few requests, a few dozen tokens). The helper below must run before
anything imports triton; see kernels/_triton_setup.py.
"""

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minillm_kernels import ops

ops.use_interpreter_if_no_cuda()  # before triton is imported (no-op with CUDA)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(not ops.triton_available(), reason="triton not installed")

# Ragged batches: (q_lens, context_lens). context_lens include the new tokens.
SCENARIOS = {
    "decode": ([1, 1, 1], [1, 17, 200]),
    "prefill": ([7, 12], [7, 12]),
    "mixed": ([1, 9, 1, 4], [23, 9, 140, 30]),  # decode + whole prompt + a chunk on context
    "chunked": ([6, 2], [133, 19]),  # q_len > 1 on top of earlier context (chunk / prefix hit)
    "verify": ([4, 4, 3], [12, 150, 20]),  # several speculative tokens per request
}
# Contexts above 128 make the kernel take several 64-key steps, so the online softmax
# must rescale what it summed earlier.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in TOL]


def make_batch(
    q_lens,
    ctx_lens,
    *,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    dtype=torch.float32,
    seed=0,
    permute=True,
    spare_blocks=3,
):
    """A paged KV cache holding each request's K/V, scattered through a (permuted) block
    table. Unused cache slots are NaN and unused table entries are huge: reading either
    would show up in the output."""
    g = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    need = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g) if permute else torch.arange(num_blocks)
    block_tables = torch.full((batch, max(need) + 2), 2**30, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_seqs, v_seqs, used = [], [], 0
    for i, c in enumerate(ctx_lens):
        blocks = order[used : used + need[i]]
        used += need[i]
        block_tables[i, : need[i]] = blocks.int()
        k = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(c, num_kv_heads, head_dim, generator=g).to(dtype)
        t = torch.arange(c)
        k_cache[blocks[t // block_size], t % block_size] = k
        v_cache[blocks[t // block_size], t % block_size] = v
        k_seqs.append(k)
        v_seqs.append(v)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=g).to(dtype)
    args = [x.to(DEVICE) for x in (q, k_cache, v_cache, block_tables, cu, torch.tensor(ctx_lens, dtype=torch.int32))]
    return args + [head_dim**-0.5], (k_seqs, v_seqs)


def naive_attention(args, seqs):
    """Dense causal attention per request, in float64, from the contiguous sequences
    (independent of the block table and of SDPA)."""
    q, _, _, _, cu, ctx, scale = args
    outs = []
    for i, (k, v) in enumerate(zip(*seqs)):
        qi = q[cu[i] : cu[i + 1]].double().cpu()
        group = qi.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        pos = int(ctx[i]) - qi.shape[0] + torch.arange(qi.shape[0])
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def check_attention(args, dtype, **kw):
    ref = ops.paged_attention_ref(*args)
    out = ops.paged_attention(*args, backend="triton", **kw)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- the reference against naive dense attention ------------------------------------


@pytest.mark.parametrize("dtype", [DTYPES[0], DTYPES[2]])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_matches_naive_attention(scenario, dtype):
    args, seqs = make_batch(*SCENARIOS[scenario], num_heads=8, num_kv_heads=2, dtype=dtype, seed=1)
    ref = ops.paged_attention_ref(*args)
    torch.testing.assert_close(
        ref.double().cpu(), naive_attention(args, seqs), atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5
    )


@pytest.mark.parametrize("block_size", [1, 5, 256])
def test_reference_matches_naive_across_block_sizes(block_size):
    args, seqs = make_batch(*SCENARIOS["mixed"], head_dim=80, block_size=block_size, seed=2)
    torch.testing.assert_close(
        ops.paged_attention_ref(*args).double().cpu(), naive_attention(args, seqs), atol=1e-5, rtol=1e-5
    )


def test_length_groups_partition_the_batch():
    from minillm_kernels.attention import length_groups

    q_lens = [1, 1, 5, 1, 1, 30, 1]
    ctx = [900, 20, 5, 880, 25, 400, 30]
    groups = length_groups(q_lens, ctx, overhead=512)
    assert sorted(i for g in groups for i in g) == list(range(len(q_lens)))  # each request once
    for g in groups:
        assert len({q_lens[i] == 1 for i in g}) == 1  # decodes never pad to a prompt's length
    # The two long decodes and the three short ones pad separately: 3 x 870 keys saved > 512.
    assert [0, 3] in groups and sorted([1, 4, 6]) == sorted(next(g for g in groups if 1 in g))
    assert len(length_groups(q_lens, ctx, overhead=10**9)) == 2  # only decode vs the rest


@pytest.mark.parametrize("overhead", [0, 64, 10**9])
def test_reference_with_length_groups_matches_naive(overhead, monkeypatch):
    # Widely spread contexts: with no overhead each length range gets its own group,
    # with a huge one all decodes share one padded batch; the answer must not change.
    import minillm_kernels.attention as attention

    monkeypatch.setattr(attention, "GROUP_OVERHEAD_KEYS", overhead)
    q_lens, ctx = [1, 1, 1, 1, 6, 3, 1], [3, 260, 31, 250, 6, 90, 1]
    args, seqs = make_batch(q_lens, ctx, num_heads=6, num_kv_heads=2, block_size=8, seed=12)
    plan = ops.plan_attention_ref(*args[3:6], 8, 3)
    assert len(plan) == {0: 6, 64: 4, 10**9: 2}[overhead]
    out = ops.paged_attention(*args, backend="torch", plan=plan)
    torch.testing.assert_close(out.double().cpu(), naive_attention(args, seqs), atol=1e-5, rtol=1e-5)
    assert torch.equal(out, ops.paged_attention_ref(*args))  # planning inside gives the same


# --- the Triton kernel against the reference ----------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_kernel_scenarios(scenario, dtype):
    args, _ = make_batch(*SCENARIOS[scenario], dtype=dtype, seed=3)
    check_attention(args, dtype)


@needs_triton
@pytest.mark.parametrize("scenario", ["decode", "mixed", "verify"])
def test_bfloat16_kernel_at_bfloat16_tolerance(scenario):
    """bfloat16 in, bfloat16 out, against the float32 reference at bfloat16's tolerance. On a GPU
    the matmuls take bfloat16 operands; Triton's interpreter cannot multiply bfloat16, so there
    the same values are widened to float32 for the matmuls (the kernel's docstring says what that
    leaves unchecked: the tensor-core products, which ``make gpu-check`` compares)."""
    from minillm_kernels import attention

    args, _ = make_batch(*SCENARIOS[scenario], num_heads=8, num_kv_heads=2, head_dim=80, dtype=torch.bfloat16, seed=7)
    check_attention(args, torch.bfloat16)
    expected = "fp32" if ops.interpreter_active() and DEVICE == "cpu" else "bf16"
    assert attention._dot_dtype(torch.bfloat16).name == expected


@needs_triton
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_kernel_gqa(group):
    args, _ = make_batch(*SCENARIOS["mixed"], num_heads=2 * group, num_kv_heads=2, seed=4)
    check_attention(args, torch.float32)


@needs_triton
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_kernel_block_sizes_and_head_dims(block_size, head_dim):
    args, _ = make_batch(*SCENARIOS["mixed"], head_dim=head_dim, block_size=block_size, dtype=torch.float16, seed=5)
    check_attention(args, torch.float16)


@needs_triton
def test_kernel_head_dim_96_odd_group():
    # 96 is masked up to 128; 3 query heads per KV head leave padding rows in each tile.
    args, _ = make_batch(*SCENARIOS["verify"], num_heads=6, num_kv_heads=2, head_dim=96, seed=6)
    check_attention(args, torch.float32)


@needs_triton
@pytest.mark.parametrize("permute", [False, True])
def test_kernel_block_table_order(permute):
    args, _ = make_batch(*SCENARIOS["chunked"], block_size=4, permute=permute, seed=7)
    check_attention(args, torch.float32)


@needs_triton
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_kernel_split_k(scenario, num_splits):
    # More splits than keys leaves some splits empty: they must weigh nothing.
    args, _ = make_batch(*SCENARIOS[scenario], dtype=torch.float16, seed=8)
    check_attention(args, torch.float16, num_splits=num_splits)


@needs_triton
def test_kernel_long_prefill_several_tiles():
    # 70 new tokens x 2 heads = 140 rows: two 128-row tiles for one request, one of them
    # starting mid-way through a 16-token KV block, plus several 64-key steps.
    args, _ = make_batch([70, 1], [150, 90], dtype=torch.float16, seed=9)
    check_attention(args, torch.float16, max_q_len=70)


@needs_triton
def test_kernel_noncontiguous_q():
    args, _ = make_batch(*SCENARIOS["mixed"], seed=10)
    q = args[0]
    qkv = torch.cat([q, torch.zeros_like(q), torch.ones_like(q)], dim=1)  # fused projection output
    args[0] = qkv[:, : q.shape[1]]
    assert not args[0].is_contiguous()
    check_attention(args, torch.float32)


def test_backend_dispatch_and_empty_batch():
    args, _ = make_batch(*SCENARIOS["mixed"], seed=11)
    ref = ops.paged_attention_ref(*args)
    assert torch.equal(ops.paged_attention(*args, backend="torch"), ref)
    if DEVICE == "cpu":
        assert torch.equal(ops.paged_attention(*args, backend="auto"), ref)
    with pytest.raises(ValueError):
        ops.paged_attention(*args, backend="cuda")
    q, k_cache, v_cache, bt, _, _, scale = args
    empty = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for backend in ("torch", "triton"):
        out = ops.paged_attention(q[:0], k_cache, v_cache, bt[:0], empty, empty[:0], scale, backend=backend)
        assert out.shape == (0, *q.shape[1:])


# --- store_kv, copy_blocks, swap_blocks: exact -----------------------------------------


def _cache(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=80, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(dtype).to(DEVICE), torch.randn(shape, generator=g).to(dtype).to(DEVICE))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [DTYPES[0], DTYPES[2]])
@pytest.mark.parametrize("block_size", [1, 4])
def test_store_kv(backend, dtype, block_size):
    k_cache, v_cache = _cache(num_blocks=24 // block_size, block_size=block_size, dtype=dtype, seed=1)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    g = torch.Generator().manual_seed(2)
    slots = torch.tensor([5, -1, 0, 23, -1, 9, 17], dtype=torch.int64)
    k = torch.randn(len(slots), 2, 80, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(len(slots), 2, 80, generator=g).to(dtype).to(DEVICE)
    ops.store_kv(k, v, k_cache, v_cache, slots.to(DEVICE), backend=backend)
    # Expected, written independently: token i lands at flat slot i of a [slots, H, D] view.
    exp_k, exp_v = before_k.flatten(0, 1), before_v.flatten(0, 1)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            exp_k[s], exp_v[s] = k[i], v[i]
    assert torch.equal(k_cache.flatten(0, 1), exp_k) and torch.equal(v_cache.flatten(0, 1), exp_v)
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched.to(DEVICE)], before_k.flatten(0, 1)[untouched.to(DEVICE)])


@needs_triton
@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
def test_store_kv_tokens_per_program(tokens):
    """One token to a program (a GPU's launch) or several (the interpreter's): the same cache, the
    tail program's missing tokens and the -1 slots written nowhere."""
    from minillm_kernels import kv_store

    caches = [_cache(num_blocks=6, block_size=4, head_dim=80, seed=6) for _ in range(2)]
    g = torch.Generator().manual_seed(7)
    slots = torch.tensor([5, -1, 0, 23, -1, 9, 17], device=DEVICE)
    k = torch.randn(len(slots), 2, 80, generator=g).to(DEVICE)
    kv_store.store_kv_triton(k, -k, *caches[0], slots, tokens=tokens)
    ops.store_kv_ref(k, -k, *caches[1], slots)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_copy_blocks(backend):
    k_cache, v_cache = _cache(num_blocks=8, dtype=torch.float16, seed=3)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    src = torch.tensor([0, 3, 3, 6], device=DEVICE)
    dst = torch.tensor([1, 2, 5, 7], device=DEVICE)
    ops.copy_blocks(k_cache, v_cache, src, dst, backend=backend)
    exp_k, exp_v = before_k.clone(), before_v.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        exp_k[d], exp_v[d] = before_k[s], before_v[s]
    assert torch.equal(k_cache, exp_k) and torch.equal(v_cache, exp_v)


@needs_triton
@pytest.mark.parametrize(
    "src, dst",
    [([0, 3], [4, 4]), ([0, 3], [3, 5]), ([2], [2])],
    ids=["two-copies-into-one-block", "destination-is-a-source", "onto-itself"],
)
def test_copy_blocks_refuses_overlapping_pairs(src, dst):
    """Pairs run in parallel: a destination that is a source, or shared by two pairs, would race."""
    k_cache, v_cache = _cache(num_blocks=8, dtype=torch.float16, seed=3)
    before = k_cache.clone()
    with pytest.raises(AssertionError, match="copy_blocks"):
        ops.copy_blocks(
            k_cache, v_cache, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE), backend="triton"
        )
    assert torch.equal(k_cache, before), "nothing is copied when the check fails"


@needs_triton
def test_copy_and_store_kernels_match_references():
    caches = [_cache(num_blocks=5, block_size=3, head_dim=64, seed=4) for _ in range(2)]
    src, dst = torch.tensor([4, 0], device=DEVICE), torch.tensor([1, 3], device=DEVICE)
    ops.copy_blocks(*caches[0], src, dst, backend="triton")
    ops.copy_blocks_ref(*caches[1], src, dst)
    k = torch.randn(4, 2, 64).to(DEVICE)
    slots = torch.tensor([14, -1, 2, 7], device=DEVICE)
    ops.store_kv(k, -k, *caches[0], slots, backend="triton")
    ops.store_kv_ref(k, -k, *caches[1], slots)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


def test_swap_blocks_roundtrip():
    dev_k, dev_v = _cache(num_blocks=6, dtype=torch.bfloat16, seed=5)
    host_k = torch.zeros(4, *dev_k.shape[1:], dtype=dev_k.dtype, pin_memory=torch.cuda.is_available())
    host_v = torch.zeros_like(host_k)
    ref_k, ref_v = host_k.clone(), host_v.clone()
    ops.swap_blocks(dev_k, dev_v, host_k, host_v, [5, 1, 2], [0, 3, 1])  # swap out
    ops.swap_blocks_ref(dev_k.cpu(), dev_v.cpu(), ref_k, ref_v, [5, 1, 2], [0, 3, 1])
    assert torch.equal(host_k, ref_k) and torch.equal(host_v, ref_v)
    assert torch.equal(host_k[2], torch.zeros_like(host_k[2]))  # not a destination
    new_k, new_v = torch.zeros_like(dev_k), torch.zeros_like(dev_v)
    ops.swap_blocks(host_k, host_v, new_k, new_v, torch.tensor([0, 3, 1]), torch.tensor([0, 4, 2]))  # swap in
    assert torch.equal(new_k[[0, 4, 2]], dev_k[[5, 1, 2]]) and torch.equal(new_v[[0, 4, 2]], dev_v[[5, 1, 2]])
    assert torch.equal(new_k[[1, 3, 5]], torch.zeros_like(new_k[[1, 3, 5]]))
    ops.swap_blocks(host_k, host_v, new_k, new_v, [], [])  # nothing to do


# --- import hygiene: the interpreter flag, lazy imports, the benchmark -------------------


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *args] if not code else [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_import_is_lazy_and_late_triton_import_is_handled():
    # Triton imported before the flag: its own library functions (tl.zeros, ...) are then
    # compiled-mode and fail inside interpreted kernels, so the helper must say so clearly
    # rather than let the attention kernel fail later; the torch path keeps working.
    r = _run("""
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        from minillm_kernels import ops
        assert "triton" not in sys.modules, "importing minillm_kernels.ops must not import triton"
        import triton  # someone imports triton before the helper ran
        try:
            ops.use_interpreter_if_no_cuda()
            raise SystemExit("expected a RuntimeError")
        except RuntimeError as e:
            assert "TRITON_INTERPRET=1" in str(e)
        import torch
        kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
        ops.store_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), kc, vc, torch.tensor([5]), backend="torch")
        assert kc[1, 1].sum() == 16
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_minillm_import_chooses_the_interpreter_before_triton():
    r = _run("""
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        import minillm
        import transformers.models.llama.modeling_llama  # may import triton
        from minillm import LLM, SamplingParams
        llm = LLM("random", attention_backend="triton", block_size=4, num_kv_blocks=8, max_model_len=16)
        out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=2))[0]
        assert len(out.token_ids) == 2
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_torch_only_install_keeps_the_references():
    r = _run("""
        import sys
        sys.modules["triton"] = None  # as if triton were not installed
        import torch
        from minillm_kernels import ops
        assert not ops.triton_available()
        kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
        ops.store_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), kc, vc, torch.tensor([5]), backend="torch")
        cu, ctx = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
        bt = torch.tensor([[0, 1]], dtype=torch.int32)
        out = ops.paged_attention(torch.ones(1, 1, 16), kc, vc, bt, cu, ctx, 0.25, backend="torch")
        w = torch.exp(torch.tensor(4.0)) / (torch.exp(torch.tensor(4.0)) + 5)  # only slot 5 holds k = v = 1
        assert torch.allclose(out, torch.full_like(out, float(w)))
        try:
            ops.paged_attention(torch.ones(1, 1, 16), kc, vc, bt, cu, ctx, 0.25, backend="triton")
        except ImportError as e:
            print("ok", e)
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the benchmark runs for minutes")
def test_bench_without_cuda_exits_cleanly():
    r = _run("", "-m", "minillm_kernels.bench")
    assert r.returncode == 0, r.stderr
    assert "CUDA" in r.stdout
