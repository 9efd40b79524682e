"""Paged attention: one Triton kernel for every step of serving, and its torch reference.

The concept: *the paged KV cache* (PagedAttention, Kwon et al., SOSP 2023). A request's keys and
values do not sit in one contiguous tensor; they sit in fixed-size blocks of a shared pool, and the request's
*block table* lists which blocks, in order. Token ``t`` of request ``i`` lives in block
``block_tables[i, t // block_size]`` at offset ``t % block_size``.

One rule covers decode, prefill, chunked prefill, prefill after a prefix-cache hit and
verifying speculative tokens (the vLLM v1 view: there is no prefill *phase*): request
``i`` brings ``q_len_i`` new query tokens and has ``ctx_len_i`` tokens of KV retained in
the cache, the new tokens' own K/V included (``store_kv`` ran first). Query ``j`` of the
request sits at absolute position ``ctx_len_i - q_len_i + j`` and attends to every
position up to and including its own (causal). Decode is ``q_len = 1``; a whole prompt
is ``q_len = ctx_len``; a chunk or a prefix hit is ``1 < q_len < ctx_len``.

Layouts (per layer)::

    q, out         [total_q, num_heads, head_dim]        the batch's new tokens, ragged
    k/v_cache      [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables   int32 [batch, max_blocks]             padding entries never read
    cu_seqlens_q   int32 [batch + 1]                     request i owns q[cu[i]:cu[i+1]]
    context_lens   int32 [batch]                         ctx_len_i, new tokens included

The kernel (FlashAttention's online softmax over a paged, ragged batch)
-----------------------------------------------------------------------
A program owns one *tile*: up to ``BLOCK_Q`` consecutive query tokens of one request
times the ``GROUP`` query heads that share one KV head (GQA), so every K/V byte it
loads serves all of them. The tile's ``BLOCK_M = BLOCK_Q * GROUP`` rows (padded to a
power of two) form the left operand of the tensor-core matmuls. The program walks the
request's keys ``BLOCK_N`` at a time, finding each key through the block table, and
keeps a running max ``m``, running denominator ``l`` and running numerator ``acc``
(online softmax), so scores never materialise beyond one ``BLOCK_M x BLOCK_N`` tile.

Tiles are numbered across the ragged batch without padding: request ``i``'s tiles
start at ``cu_seqlens_q[i] // BLOCK_Q + i``, and each program finds its request by a
binary search over that (no host sync, no idle programs for short requests).

Split-K (flash-decoding): in decode, a tile has one query token per head and the grid
has only ``batch * num_kv_heads`` programs, too few to keep every SM streaming HBM
when the batch is small and the contexts long. Then each tile's keys are cut into
``num_splits`` ranges handled by separate programs, which write partial results (the
normalised partial output and its log-sum-exp); a small second kernel merges them.

Quantized caches (int8 or fp8 values, one float32 scale per block and KV head; see
``kernels/kv_quant.py``) are dequantized on load. The matmuls run on the stored values
themselves, exact in the compute type, and the scales enter where they cost least: a key's
scale multiplies its column of scores after ``q k^T``, a value's scale multiplies its column
of probabilities before ``p v``. The torch reference dequantizes the gathered blocks first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ._triton_setup import import_triton, interpreter_active
from .kv_quant import kind_of
from .targets import Launch, Target, device_target, fits, pointer, shared_memory

triton, tl = import_triton()

# ------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------


@triton.jit
def _find_request(cu_seqlens_q_ptr, tile_id, batch, BLOCK_Q: tl.constexpr):
    """The request whose tiles include ``tile_id``: the last i with
    ``cu_seqlens_q[i] // BLOCK_Q + i <= tile_id`` (binary search)."""
    lo: tl.int32 = 0
    hi = batch
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["batch"])  # batch == 1 would become a constant, and the search needs a variable
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    part_out_ptr,
    part_lse_ptr,  # split-K scratch, unused when not SPLIT
    k_scale_ptr,
    v_scale_ptr,  # [num_blocks, H_kv] float32 scales of a quantized cache; unused if not QUANT
    scale,
    batch,
    num_splits,  # programs sharing one tile's keys (split-K); 1 when not SPLIT
    stride_qt,
    stride_qh,  # q [total_q, H, D]; the last dim of every tensor is contiguous
    stride_ot,
    stride_oh,  # out [total_q, H, D]
    stride_kb,
    stride_ks,
    stride_kh,  # k_cache [num_blocks, block_size, H_kv, D]
    stride_vb,
    stride_vs,
    stride_vh,  # v_cache
    stride_bt,  # block_tables [batch, max_blocks]
    stride_ksb,
    stride_vsb,  # k_scale, v_scale [num_blocks, H_kv] (head stride 1)
    stride_pt,
    stride_ph,
    stride_ps,  # part_out [total_q, H, num_splits, D] float32
    stride_lt,
    stride_lh,  # part_lse [total_q, H, num_splits] float32
    HEAD_DIM: tl.constexpr,  # real head dim, e.g. 80
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two, e.g. 128; the tail is masked
    GROUP: tl.constexpr,  # query heads per KV head (GQA ratio)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile: BLOCK_Q * GROUP, padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    PAGE: tl.constexpr,  # KV cache block size (tokens per block)
    SPLIT: tl.constexpr,  # split-K: write partial results for _merge_splits_kernel
    DOT_DTYPE: tl.constexpr,  # matmul operand type: the input dtype (see _dot_dtype)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, so float32 stays exact
    QUANT: tl.constexpr,  # int8/fp8 cache: multiply by the (block, head) scales on load
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- which request, which of its query tokens ------------------------------------
    req = _find_request(cu_seqlens_q_ptr, tile_id, batch, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    local_tile = tile_id - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= q_len:
        return  # a spare tile number (the numbering leaves at most one per request)
    ctx_len = tl.load(context_lens_ptr + req)

    # Row r of the tile is query token r // GROUP of the tile, query head r % GROUP of
    # this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + rows // GROUP  # index among the request's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len - q_len + q_idx  # absolute position = last key this row may see
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # --- which keys: causal end of the tile, then this program's split ----------------
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (local_tile + 1) * BLOCK_Q)
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end

    # --- online softmax over the keys, in base 2 (exp2 is the hardware instruction) ---
    qk_scale = scale * 1.4426950408889634  # log2(e)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(...) * v
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # key positions
        n_ok = n < kv_hi
        # The block table turns a position into (physical block, offset in block).
        block = tl.load(block_table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        offset = n % PAGE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if QUANT:
            # Dequantize on load: a key's scale is one number per (block, head), so it
            # multiplies the whole score column. The matmul ran on the stored values
            # themselves (int8 and e4m3 numbers are exact in every DOT_DTYPE).
            k_s = tl.load(k_scale_ptr + block * stride_ksb + kv_head, mask=n_ok, other=0.0)
            s = s * k_s[None, :]
        s = s * qk_scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)  # rescales what was summed under the old max
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if QUANT:
            # sum_n p[m, n] * (v_s[n] * v_q[n, d]): the value scales go onto the probabilities
            # (one per key column, as for k), in the compute precision.
            v_s = tl.load(v_scale_ptr + block * stride_vsb + kv_head, mask=n_ok, other=0.0)
            p = (p * v_s[None, :]).to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        else:
            p = p.to(v.dtype).to(DOT_DTYPE)  # probabilities in the cache's precision, as FlashAttention does
        acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # Partial result of this split, and its log2-sum-exp2 (-inf for an empty split).
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + d[None, :], out, mask=mask)
        tl.store(part_lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,  # MAX_SPLITS: one compiled kernel for every split count
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Split-K epilogue: out = sum_s w_s * out_s / sum_s w_s, w_s = 2^(lse_s - max lse)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse = tl.load(part_lse_ptr + token * stride_lt + head * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # each split's share of the softmax mass (0 for an empty split)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    o = tl.load(
        part_out_ptr + token * stride_pt + head * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


# ------------------------------------------------------------------------------------
# Host side: tile sizes, split-K, launch
# ------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def tile_choices(head_dim: int, group: int, max_q_len: int, elem_size: int = 2):
    """Tile sizes for one launch, best first; the launcher takes the first that fits the GPU.

    Decode (and short speculative verifies) get 16-row tiles, the smallest a tensor-core
    matmul takes; prefill chunks get 128-row tiles (64 for head dims above 128 or float32
    data, to stay within registers). Each smaller choice halves the keys per step
    (``BLOCK_N``), then the rows (``BLOCK_M``): shared memory holds the query tile and
    ``num_stages`` K/V tiles in flight, so that is what a GPU with less of it gets."""
    block_d = max(16, _next_pow2(head_dim))
    cap = 128 if block_d <= 128 and elem_size <= 2 else 64
    block_m = min(cap, max(16, _next_pow2(max_q_len * group)))
    smallest_m = max(16, _next_pow2(group))  # at least one whole token per tile
    block_m = max(block_m, smallest_m)
    block_n = 64 if block_d <= 128 else 32
    num_warps, num_stages = (4, 3) if block_m <= 64 else (8, 2)
    while True:
        yield dict(
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_Q=block_m // group,
            BLOCK_N=block_n,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if block_n > 16:
            block_n //= 2
        elif block_m > smallest_m:
            block_m //= 2
        else:
            return


def pick_tiles(head_dim: int, group: int, max_q_len: int, elem_size: int = 2) -> dict:
    """The preferred tile sizes (:func:`tile_choices`' first), before any GPU is asked."""
    return next(tile_choices(head_dim, group, max_q_len, elem_size))


def _dot_dtype(dtype: torch.dtype):
    """The matmul operand type: the input dtype on a GPU. Triton's interpreter keeps
    bfloat16 as raw uint16 and its ``tl.dot`` multiplies those as integers, so there we
    widen bfloat16 operands to float32 (exact: every bfloat16 is a float32)."""
    if dtype == torch.bfloat16 and interpreter_active():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


MAX_SPLITS = 32  # the most programs that share one tile's keys (split-K)


@lru_cache(maxsize=None)
def attention_launch(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
    group: int,
    page: int,
    max_q_len: int,
    split: bool,
    target: Optional[Target] = None,
) -> Launch:
    """The launch of :func:`_paged_attention_kernel` for one step: queries of ``dtype``, a cache
    of ``kv_dtype`` (``dtype``, or int8/fp8 with scales), ``group`` query heads per KV head,
    ``page`` tokens per KV block, at most ``max_q_len`` new tokens per request, split-K or not.
    The tiles are the first of :func:`tile_choices` whose compiled kernel fits ``target``'s
    shared memory (``None``: the interpreter, where anything fits)."""
    elem = torch.empty((), dtype=dtype).element_size()
    tried = []
    for t in tile_choices(head_dim, group, max(1, max_q_len), elem):
        launch = Launch.of(
            _paged_attention_kernel,
            dict(
                q_ptr=pointer(dtype),
                out_ptr=pointer(dtype),
                k_cache_ptr=pointer(kv_dtype),
                v_cache_ptr=pointer(kv_dtype),
                block_tables_ptr="*i32",
                cu_seqlens_q_ptr="*i32",
                context_lens_ptr="*i32",
                part_out_ptr="*fp32",
                part_lse_ptr="*fp32",
                k_scale_ptr="*fp32",
                v_scale_ptr="*fp32",
                scale="fp32",
            ),
            dict(
                HEAD_DIM=head_dim,
                BLOCK_D=t["BLOCK_D"],
                GROUP=group,
                BLOCK_Q=t["BLOCK_Q"],
                BLOCK_M=t["BLOCK_M"],
                BLOCK_N=t["BLOCK_N"],
                PAGE=page,
                SPLIT=bool(split),
                DOT_DTYPE=_dot_dtype(dtype),
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                QUANT=kind_of(torch.empty((), dtype=kv_dtype)) is not None,
            ),
            t["num_warps"],
            t["num_stages"],
        )
        if fits(launch, target):
            return launch
        tried.append(f"{launch.describe()}: {shared_memory(launch, target)} B")
    raise RuntimeError(
        f"no attention tile fits the {target.shared_memory} B of shared memory of "
        f"sm_{target.capability}:\n  " + "\n  ".join(tried)
    )


@lru_cache(maxsize=None)
def merge_launch(dtype: torch.dtype, head_dim: int) -> Launch:
    """The launch of :func:`_merge_splits_kernel`: one compiled kernel for any split count."""
    return Launch.of(
        _merge_splits_kernel,
        dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=pointer(dtype)),
        dict(BLOCK_S=MAX_SPLITS, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim))),
        num_warps=4,
    )


def attention_launches(
    dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int, page: int, target: Optional[Target] = None
) -> list[Launch]:
    """Every launch :func:`paged_attention_triton` can make for one model shape and cache, over
    every step the engine can take (any ``max_q_len``, split-K or not): the distinct results of
    :func:`attention_launch` and :func:`merge_launch` over their whole range."""
    launches = []
    q_len = 1
    while True:  # max_q_len changes the tiles only at powers of two, up to the largest tile
        for split in (False, True) if _splits_allowed(q_len, group) else (False,):
            launches.append(attention_launch(dtype, kv_dtype, head_dim, group, page, q_len, split, target))
        if q_len * group >= 128:
            break
        q_len *= 2
    launches.append(merge_launch(dtype, head_dim))
    return list(dict.fromkeys(launches))


def _splits_allowed(max_q_len: int, group: int) -> bool:
    """Split-K (flash-decoding) is for decode-shaped steps: tiles of a single row block."""
    return max_q_len * group <= 16


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def auto_num_splits(programs: int, max_kv_len: int, device: torch.device) -> int:
    """How many programs share one tile's keys (split-K). Aim for ~4 programs per SM so
    that enough loads are in flight to saturate HBM, but keep >= 128 keys per split.
    Off the GPU (interpreter) there is nothing to fill: 1."""
    if device.type != "cuda" or programs <= 0:
        return 1
    want = math.ceil(4 * _sm_count(device.index or 0) / programs)
    return max(1, min(want, max_kv_len // 128, MAX_SPLITS))


def paged_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    *,
    max_q_len=None,
    num_splits=None,
    k_scale=None,
    v_scale=None,
):
    """Causal attention of a ragged batch of new tokens over the paged KV cache (Triton).

    ``max_q_len``: the longest ``q_len_i`` in the batch, known to the scheduler; passing
    it avoids a device-to-host sync. ``num_splits``: split-K factor, at most
    :data:`MAX_SPLITS` (None = automatic: decode-shaped steps only).
    ``k_scale, v_scale``: the ``[num_blocks, H_kv]`` scales of an int8/fp8 cache.

    bfloat16: on a GPU the matmuls take bfloat16 operands (tensor cores, float32
    accumulation). Triton's interpreter cannot multiply bfloat16 (it holds them as raw
    16-bit integers), so there the same bfloat16 values are widened to float32 first: the
    interpreter checks the indexing, masking and online softmax at bfloat16 inputs and
    outputs, but not the tensor-core products, whose rounding only a GPU run shows
    (``scripts/gpu_check.py`` holds them against the reference at bfloat16 tolerances).
    """
    total_q, num_heads, head_dim = q.shape
    _, page, num_kv_heads, head_dim_kv = k_cache.shape
    assert head_dim_kv == head_dim and v_cache.shape == k_cache.shape, "k/v cache shape mismatch"
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads (GQA)"
    group = num_heads // num_kv_heads
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if total_q == 0 or batch == 0:
        return out

    # Kernels index the last dim with unit stride; everything else goes by strides.
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    quant = _check_scales(k_cache, k_scale, v_scale)
    if quant:
        assert k_scale.stride(-1) == 1 and v_scale.stride(-1) == 1, "scales must be contiguous per block"
        scale_strides = (k_scale.stride(0), v_scale.stride(0))
    else:
        k_scale = v_scale = k_cache  # never touched
        scale_strides = (0, 0)
    block_tables = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    cu_seqlens_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    context_lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # syncs on a GPU
    max_q_len = max(1, max_q_len)

    target = device_target(q.device.index or 0) if q.is_cuda else None
    shape = (q.dtype, k_cache.dtype, head_dim, group, page, max_q_len)
    if num_splits is None:
        num_splits = 1
        if _splits_allowed(max_q_len, group):
            tiles = total_q // dict(attention_launch(*shape, False, target).constants)["BLOCK_Q"] + batch
            num_splits = auto_num_splits(tiles * num_kv_heads, block_tables.shape[1] * page, q.device)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]"
    launch = attention_launch(*shape, num_splits > 1, target)
    n_tiles = total_q // dict(launch.constants)["BLOCK_Q"] + batch  # upper bound of the ragged tile numbering
    if num_splits > 1:
        part_out = torch.empty((total_q, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((total_q, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides = (*part_out.stride()[:3], *part_lse.stride()[:2])
    else:
        part_out = part_lse = out  # never touched
        part_strides = (0, 0, 0, 0, 0)

    launch(
        (n_tiles, num_kv_heads, num_splits),
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        context_lens,
        part_out,
        part_lse,
        k_scale,
        v_scale,
        float(scale),
        batch,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *scale_strides,
        *part_strides,
    )
    if num_splits > 1:
        merge_launch(q.dtype, head_dim)(
            (total_q, num_heads),
            part_out,
            part_lse,
            out,
            num_splits,
            *part_strides,
            out.stride(0),
            out.stride(1),
        )
    return out


# ------------------------------------------------------------------------------------
# Torch reference (and the engine's CPU backend)
# ------------------------------------------------------------------------------------


# Requests of very different context lengths padded to one length waste the gather and
# the matmuls on padding; one more group costs a dozen more torch calls per layer, about
# what gathering this many more key positions costs (on a CPU, for a small model).
GROUP_OVERHEAD_KEYS = 512
GROUP_MAX_PAD = 1.5  # no request pads to more than this times its own context


def length_groups(q_lens: list[int], ctx_lens: list[int], overhead: Optional[int] = None) -> list[list[int]]:
    """Split a batch into groups, each attended as one padded batch.

    Decode requests (one new token) and the rest never share a group, so one long prompt
    does not pad every decode row to its length. Within each kind, requests are sorted by
    context length, longest first, and cut wherever a request would pad to more than
    :data:`GROUP_MAX_PAD` times its own context. A cut is then undone where it saves less
    padding than a group's fixed cost: when ``(requests in the shorter group) x (difference of
    the two groups' longest contexts) <= overhead`` (default :data:`GROUP_OVERHEAD_KEYS`).
    """
    overhead = GROUP_OVERHEAD_KEYS if overhead is None else overhead
    groups = []
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    others = [i for i, n in enumerate(q_lens) if n != 1]
    for order in (decodes, others):
        order.sort(key=ctx_lens.__getitem__, reverse=True)  # longest first (stable)
        cuts: list[list[int]] = []
        longest = 0
        for i in order:
            if cuts and GROUP_MAX_PAD * ctx_lens[i] >= longest:
                cuts[-1].append(i)
            else:
                cuts.append([i])
                longest = ctx_lens[i]
        kind: list[list[int]] = []
        for g in cuts:
            if kind and len(g) * (ctx_lens[kind[-1][0]] - ctx_lens[g[0]]) <= overhead:
                kind[-1] += g
            else:
                kind.append(g)
        groups += kind
    return groups


@dataclass
class PaddedGroup:
    """Everything about one group that does not depend on the layer: where its queries
    sit in ``q``, which cache blocks hold its keys, and which scores each query may see.
    Keys are gathered in whole blocks (``nb * page`` positions per request) and attended up
    to ``Lk``, the longest context in the group."""

    batch: int
    lq: int  # longest q_len in the group (queries are padded to it)
    lk: int  # longest ctx_len in the group (keys are padded to it)
    q_rows: torch.Tensor  # [B * Lq] row of q for each (request, query j); 0 for padding
    real: Optional[torch.Tensor]  # indices into the B * Lq padded queries that are real (None: all)
    out_rows: torch.Tensor  # the rows of q (and out) those real queries are
    blocks: torch.Tensor  # [B * nb] cache blocks to gather
    stale: torch.Tensor  # indices into the B * nb * page gathered positions in [ctx_len, Lk)
    visible: torch.Tensor  # [B, 1, Lq * group, Lk] causal and in-context


def plan_attention_ref(block_tables, cu_seqlens_q, context_lens, page: int, group: int) -> list[PaddedGroup]:
    """The layer-independent part of :func:`paged_attention_ref`: every layer of a step
    attends the same requests over the same blocks, so the engine plans once per step.

    Index arithmetic on a few hundred integers: numpy on the host does it with calls of
    about a microsecond each (torch's cost several), and the results become tensors once."""
    dev = block_tables.device
    bt = block_tables.cpu().numpy()
    cu = cu_seqlens_q.cpu().numpy().astype(np.int64)
    ctx_all = context_lens.cpu().numpy().astype(np.int64)
    q_all = cu[1:] - cu[:-1]
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    plans = []
    for reqs in length_groups(q_all.tolist(), ctx_all.tolist()):
        r = np.asarray(reqs)
        q_lens, ctx_lens, q_starts = q_all[r], ctx_all[r], cu[r]
        lq, lk = int(q_lens.max()), int(ctx_lens.max())
        nb = -(-lk // page)
        j = np.arange(lq)  # query index within a request
        n = np.arange(lk)  # key position
        q_ok = j < q_lens[:, None]  # [B, Lq]
        kv_ok = n < ctx_lens[:, None]  # [B, Lk] positions holding this request's KV
        rows = np.where(q_ok, q_starts[:, None] + j, 0)
        # Gather whole blocks through the block table. Padding entries of the table may
        # hold anything, and cache slots past ctx_len hold stale data (maybe NaN, and
        # 0 * NaN is NaN): point the one at block 0, zero the other after the gather.
        blocks_used = np.arange(nb) * page < ctx_lens[:, None]  # a block is used if its first slot is
        blocks = np.where(blocks_used, bt[r, :nb], 0)
        stale_req, stale_pos = np.nonzero(~kv_ok)
        if lq == 1:  # decode: no padding queries, and the causal mask is the context mask
            visible = torch.from_numpy(kv_ok).to(dev)[:, None, None, :].expand(len(reqs), 1, group, lk)
        else:
            # Query j of a request sits at position ctx_len - q_len + j and sees keys <= it.
            q_pos = (ctx_lens - q_lens)[:, None] + j  # [B, Lq]
            vis = (n[None, None, :] <= q_pos[:, :, None]) & kv_ok[:, None, :]  # [B, Lq, Lk]
            visible = as_tensor(np.repeat(vis, group, axis=1)[:, None])  # one row per (query, head in group)
        plans.append(
            PaddedGroup(
                batch=len(reqs),
                lq=lq,
                lk=lk,
                q_rows=as_tensor(rows.ravel()),
                real=None if q_ok.all() else as_tensor(np.flatnonzero(q_ok)),
                out_rows=as_tensor(rows[q_ok]),
                blocks=as_tensor(blocks.ravel().astype(np.int64)),
                stale=as_tensor(stale_req * (nb * page) + stale_pos),
                visible=visible,
            )
        )
    return plans


def _check_scales(k_cache, k_scale, v_scale) -> bool:
    """Whether the cache is quantized (and then that its scales came with it)."""
    if kind_of(k_cache) is None:
        return False
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs its k_scale and v_scale")
    assert k_scale.shape == k_cache.shape[::2] and v_scale.shape == k_scale.shape, "scales: [num_blocks, H_kv]"
    return True


def paged_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    *,
    max_q_len=None,
    plan=None,
    k_scale=None,
    v_scale=None,
):
    """Same contract as the kernel, in plain torch: gather each request's keys and values
    out of the paged cache into padded dense batches, then one masked
    ``scaled_dot_product_attention`` per batch. Computes in float32, returns ``q.dtype``.

    Requests are attended in groups of similar length (:func:`length_groups`), so a few
    long contexts do not pad every request to their length. ``plan`` is
    :func:`plan_attention_ref`'s result for these arguments, computed once per step and
    reused by every layer (None: planned here). ``max_q_len`` is accepted for signature
    parity and unused. A quantized cache (int8/fp8 with ``k_scale, v_scale``) is dequantized
    as it is gathered: ``value * scale`` of its (block, head), in float32.
    """
    if not _check_scales(k_cache, k_scale, v_scale):
        k_scale = v_scale = None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan is None:
        group = q.shape[1] // k_cache.shape[2]
        plan = plan_attention_ref(
            block_tables.to(q.device), cu_seqlens_q.to(q.device), context_lens.to(q.device), k_cache.shape[1], group
        )
    for g in plan:
        _attend_padded(q, k_cache, v_cache, g, scale, out, k_scale, v_scale)
    return out


def _attend_padded(q, k_cache, v_cache, g: PaddedGroup, scale, out, k_scale=None, v_scale=None):
    num_blocks, page, num_kv_heads, head_dim = k_cache.shape
    batch, num_heads = g.batch, q.shape[1]
    group = num_heads // num_kv_heads
    span = g.blocks.numel() // batch * page  # positions gathered per request: whole blocks
    k = k_cache.index_select(0, g.blocks)
    v = v_cache.index_select(0, g.blocks)
    if k_scale is None:
        k, v = k.float(), v.float()
    else:  # dequantize: one scale per (block, KV head); int8 * float32 is float32 in one pass
        if k.dtype.is_floating_point:
            k, v = k.float(), v.float()  # fp8: torch does not promote it
        k = k * k_scale.index_select(0, g.blocks)[:, None, :, None]
        v = v * v_scale.index_select(0, g.blocks)[:, None, :, None]
    k = k.view(batch * span, num_kv_heads, head_dim)
    v = v.view(batch * span, num_kv_heads, head_dim)
    if g.stale.numel():
        k.index_fill_(0, g.stale, 0.0)  # in place (k is our own gathered copy)
        v.index_fill_(0, g.stale, 0.0)
    k = k.view(batch, span, num_kv_heads, head_dim)[:, : g.lk].transpose(1, 2)
    v = v.view(batch, span, num_kv_heads, head_dim)[:, : g.lk].transpose(1, 2)

    # GQA without copying K/V per query head: the `group` query heads that share a KV
    # head become extra rows (as in the Triton kernel), [B, Hkv, Lq * group, D].
    qb = q.index_select(0, g.q_rows).float().view(batch, g.lq, num_kv_heads, group, head_dim)
    qb = qb.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, g.lq * group, head_dim)
    o = F.scaled_dot_product_attention(qb, k, v, attn_mask=g.visible, scale=scale)
    o = o.view(batch, num_kv_heads, g.lq, group, head_dim).permute(0, 2, 1, 3, 4)
    o = o.reshape(batch * g.lq, num_heads, head_dim)
    if g.real is not None:
        o = o.index_select(0, g.real)
    out.index_copy_(0, g.out_rows, o.to(out.dtype))
