"""store_kv: write the new tokens' keys and values into their cache slots.

The concept: *slot mapping*. Before attention runs, each new token's K and V go into
the paged cache at ``slot = block_id * block_size + offset``, the place its block table
promised (``slot_mapping[i]``). A slot of -1 means "do not store" (a padding token, or
a token whose KV is not retained). After this, paged attention can read every token
of the request, the new ones included, through the block table alone.

Layouts: ``k, v``: ``[N, num_kv_heads, head_dim]``; ``k_cache, v_cache``:
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping``: int64 ``[N]``.

A quantized cache (int8 / fp8 values and ``[num_blocks, num_kv_heads]`` scales) is written by
``store_kv_quant_*``: the store quantizes, and keeps each block's scale covering everything in
the block (it grows, re-quantizing the block's earlier rows; ``kernels/kv_quant.py`` says why).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ._triton_setup import import_triton
from .kv_formats import KV_FORMATS
from .kv_quant import QMAX, kind_of
from .targets import Launch, pointer, require

triton, tl = import_triton()


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    n_tokens,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,  # k, v [N, H_kv, D]
    stride_kcb,
    stride_kcs,
    stride_kch,  # k_cache [num_blocks, block_size, H_kv, D]
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One program per BLOCK_T tokens, all their heads at once (BLOCK_T is 1 on a GPU).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < n_tokens, other=-1).to(tl.int64)  # -1: skip this token
    block = (slot // PAGE)[:, None, None]
    offset = (slot % PAGE)[:, None, None]
    i = t.to(tl.int64)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (slot >= 0)[:, None, None] & (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + i * stride_kn + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + i * stride_vn + h * stride_vh + d, mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


@lru_cache(maxsize=None)
def store_launch(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int, page: int, tokens: int = 1
) -> Launch:
    """The launch of :func:`_store_kv_kernel` for ``dtype`` tokens into a ``cache_dtype`` cache,
    ``tokens`` (a power of two) to a program."""
    return Launch.of(
        _store_kv_kernel,
        dict(
            k_ptr=pointer(dtype),
            v_ptr=pointer(dtype),
            k_cache_ptr=pointer(cache_dtype),
            v_cache_ptr=pointer(cache_dtype),
            slot_ptr="*i64",
        ),
        dict(
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            PAGE=page,
            BLOCK_T=tokens,
        ),
        num_warps=4,
    )


def tokens_per_program(n: int) -> int:
    """How many tokens one program of the store writes: one on a GPU (a program per token, as
    vLLM's ``reshape_and_cache``); in Triton's interpreter, which runs programs one after another
    in Python at a fixed cost each, all ``n`` of them at once (up to 64)."""
    interpreted = type(_store_kv_kernel).__name__ == "InterpretedFunction"
    return min(64, triton.next_power_of_2(n)) if interpreted else 1


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping, tokens=None):
    """In place: ``cache[slot // block_size, slot % block_size] = k`` for every slot >= 0; ``tokens``
    to a program (a power of two; default :func:`tokens_per_program`)."""
    n, num_kv_heads, head_dim = k.shape
    if n == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    tokens = tokens or tokens_per_program(n)
    store_launch(k.dtype, k_cache.dtype, num_kv_heads, head_dim, k_cache.shape[1], tokens)(
        (triton.cdiv(n, tokens),),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        n,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
    )


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    """Torch reference (and CPU backend): one indexed copy per cache, into its view as a
    flat array of slots ``[num_blocks * block_size, H_kv, D]``."""
    slot_mapping = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    for x, cache in ((k, k_cache), (v, v_cache)):
        try:
            slots = cache.view(-1, *cache.shape[2:])
        except RuntimeError:  # a cache whose blocks are not contiguous
            page = cache.shape[1]
            cache[slot_mapping // page, slot_mapping % page] = x.to(cache.dtype)
            continue
        slots.index_copy_(0, slot_mapping, x.to(cache.dtype))


# ------------------------------------------------------------------------------------
# Quantized caches (int8 / fp8 values, one scale per block and KV head): see kv_quant.py
# ------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(t):
    """t rounded to the nearest integer, halves to even (torch.round), in float32."""
    r = tl.floor(t + 0.5)
    tie = (r - t) == 0.5  # t was exactly halfway: floor(t + 0.5) went up
    odd = (r * 0.5) != tl.floor(r * 0.5)
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _round_e4m3(y):
    """``kv_quant.round_to_e4m3`` in Triton: y (within +-448) to the nearest e4m3 value."""
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum(_round_half_even(a * inv_step) * step, 448.0)
    return tl.where(y < 0, -r, r)


@triton.jit
def _quantize(x, s, QMAX: tl.constexpr, FP8: tl.constexpr):
    """float32 x with scale s (a scalar) -> the value to store (still float32, exactly representable)."""
    s_safe = tl.where(s > 0, s, 1.0)
    y = tl.math.div_rn(x, s_safe + tl.zeros_like(x))
    if FP8:
        return _round_e4m3(tl.minimum(tl.maximum(y, -QMAX), QMAX))
    return tl.minimum(tl.maximum(_round_half_even(y), -QMAX), QMAX)


@triton.jit
def _store_one_quantized(
    x_ptr,
    stride_xn,
    stride_xh,
    cache_ptr,
    stride_cb,
    stride_cs,
    stride_ch,
    scale_ptr,
    stride_sb,
    rows,
    mine,
    offs,
    first,
    block,
    h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    QMAX: tl.constexpr,
    FP8: tl.constexpr,
):
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    new_mask = mine[:, None] & d_ok[None, :]
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xn + h * stride_xh + d[None, :], mask=new_mask, other=0.0
    ).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    scale_at = scale_ptr + block * stride_sb + h
    s_old = tl.load(scale_at)
    s_old = tl.where(first > 0, s_old, 0.0)  # a write at offset 0 starts a fresh block
    s_new = tl.maximum(s_old, tl.math.div_rn(amax, QMAX))
    base = cache_ptr + block * stride_cb + h * stride_ch
    # The rows already in the block, re-quantized when the scale grew.
    p = tl.arange(0, BLOCK_P)
    # (the scalar "grew" is broadcast by hand: the interpreter cannot `&` a scalar bool with a block)
    grew = (s_new > s_old).to(tl.int32)
    old_mask = (p < first)[:, None] & d_ok[None, :] & (grew + tl.zeros_like(p)[:, None] > 0)
    q_old = tl.load(base + p[:, None] * stride_cs + d[None, :], mask=old_mask, other=0.0).to(tl.float32)
    q_old = _quantize(q_old * s_old, s_new, QMAX, FP8)
    tl.store(base + p[:, None] * stride_cs + d[None, :], q_old.to(cache_ptr.dtype.element_ty), mask=old_mask)
    # The new rows.
    q = _quantize(x, s_new, QMAX, FP8)
    tl.store(base + offs[:, None] * stride_cs + d[None, :], q.to(cache_ptr.dtype.element_ty), mask=new_mask)
    tl.store(scale_at, s_new)


@triton.jit
def _store_kv_quant_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    n_tokens,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,  # k, v [N, H_kv, D]
    stride_kcb,
    stride_kcs,
    stride_kch,  # k_cache [num_blocks, block_size, H_kv, D]
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_ksb,
    stride_vsb,  # k_scale, v_scale [num_blocks, H_kv], head stride 1
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    QMAX: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per (token, KV head); only the first token of each run of tokens going to the
    # same block works: it handles the whole run, so one program owns the block's scale.
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + i)
    prev = tl.load(slot_ptr + i - 1, mask=i > 0, other=-1)
    block = slot // PAGE
    leads = (slot >= 0) & ((prev < 0) | (prev // PAGE != block))  # (// of a negative: never used)
    if not leads:
        return
    rows = i + tl.arange(0, BLOCK_P)  # a run is at most PAGE tokens long
    rslot = tl.load(slot_ptr + rows, mask=rows < n_tokens, other=-1)
    mine = (rslot >= 0) & (rslot // PAGE == block)
    offs = tl.where(mine, rslot % PAGE, 0)
    first = tl.min(tl.where(mine, offs, PAGE), 0)  # the run's first offset in the block
    _store_one_quantized(
        k_ptr,
        stride_kn,
        stride_kh,
        k_cache_ptr,
        stride_kcb,
        stride_kcs,
        stride_kch,
        k_scale_ptr,
        stride_ksb,
        rows,
        mine,
        offs,
        first,
        block,
        h,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_P,
        QMAX,
        FP8,
    )
    _store_one_quantized(
        v_ptr,
        stride_vn,
        stride_vh,
        v_cache_ptr,
        stride_vcb,
        stride_vcs,
        stride_vch,
        v_scale_ptr,
        stride_vsb,
        rows,
        mine,
        offs,
        first,
        block,
        h,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_P,
        QMAX,
        FP8,
    )


@lru_cache(maxsize=None)
def store_quant_launch(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, page: int) -> Launch:
    """The launch of :func:`_store_kv_quant_kernel` for ``dtype`` tokens into an int8/fp8 cache."""
    kind = kind_of(torch.empty((), dtype=cache_dtype))
    return Launch.of(
        _store_kv_quant_kernel,
        dict(
            k_ptr=pointer(dtype),
            v_ptr=pointer(dtype),
            k_cache_ptr=pointer(cache_dtype),
            v_cache_ptr=pointer(cache_dtype),
            k_scale_ptr="*fp32",
            v_scale_ptr="*fp32",
            slot_ptr="*i64",
        ),
        dict(
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            PAGE=page,
            BLOCK_P=triton.next_power_of_2(page),
            QMAX=QMAX[kind],
            FP8=KV_FORMATS[kind].rounding == "e4m3",
        ),
        num_warps=4,
    )


def check_one_run_per_block(slot_mapping: torch.Tensor, page: int) -> None:
    """The quantizing store's precondition: each block's new tokens are one run of consecutive
    rows of the batch, with no slot written twice. The kernel lets the first row of each run
    (its *lead* program) own the block's scale; two runs into one block would be two lead
    programs growing the same scale and re-quantizing the same rows at once (a race).
    The engine meets it by construction (a request's new tokens are consecutive rows, and a
    block being written belongs to one request); this checks it, on a GPU without a host sync."""
    slots = slot_mapping.to(torch.int64)
    block = torch.where(slots >= 0, slots // page, -1)
    prev = torch.cat([block.new_full((1,), -1), block[:-1]])
    leads = ((block >= 0) & (block != prev)).sum()
    written = torch.sort(torch.where(slots >= 0, slots, -1)).values  # the -1s first, then the slots
    distinct = written[1:] != written[:-1]
    blocks = torch.sort(block).values
    runs_needed = ((blocks[1:] != blocks[:-1]) & (blocks[1:] >= 0)).sum() + (blocks[:1] >= 0).sum()
    require(
        leads == runs_needed,
        "store_kv: a block's new tokens must be one run of consecutive rows (one lead program per block)",
    )
    require((distinct | (written[1:] < 0)).all(), "store_kv: a slot is written twice")


def store_kv_quant_triton(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    """In place: quantize the new tokens into an int8/fp8 cache, growing the blocks' scales
    (re-quantizing their earlier rows) where needed. A block's new tokens must be consecutive
    rows of the batch (they are: a request's tokens are, and blocks being written are not
    shared); :func:`check_one_run_per_block` checks that before the launch."""
    kind = kind_of(k_cache)
    if k_cache.is_cuda:
        from .kv_quant import check_available

        check_available(kind, k_cache.device)
    n, num_kv_heads, head_dim = k.shape
    if n == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    assert k_scale.stride(-1) == 1 and v_scale.stride(-1) == 1, "scales [num_blocks, H_kv] must be contiguous per block"
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    page = k_cache.shape[1]
    check_one_run_per_block(slot_mapping, page)
    store_quant_launch(k.dtype, k_cache.dtype, head_dim, page)(
        (n, num_kv_heads),
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        n,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        k_scale.stride(0),
        v_scale.stride(0),
    )


def store_kv_quant_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, quantizer=None):
    """Torch reference (and CPU backend) of :func:`store_kv_quant_triton`, vectorised over the
    blocks the batch writes: per (block, head), the new amax, the grown scale, the earlier rows
    re-quantized where it grew, then the new rows. ``quantizer`` (``EngineConfig.kv_quantizer``:
    an object with ``new_scale``, ``quantize`` and ``dequantize``) replaces ``minillm_kernels.kv_quant``'s."""
    from . import kv_quant

    fmt = quantizer if quantizer is not None else kv_quant
    dequantize, new_scale, quantize = fmt.dequantize, fmt.new_scale, fmt.quantize

    kind = kind_of(k_cache)
    slot_mapping = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks, offs = slot_mapping // page, slot_mapping % page
    written, which = torch.unique(blocks, return_inverse=True)  # blocks touched, token -> block
    first = torch.full((len(written),), page, dtype=torch.long, device=blocks.device)
    first.scatter_reduce_(0, which, offs, reduce="amin")  # each block's first new offset
    fresh = (first == 0)[:, None]  # starts a block: old scale void
    earlier = torch.arange(page, device=blocks.device)[None, :] < first[:, None]  # [U, page]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x.to(torch.float32)
        amax = torch.zeros(len(written), num_kv_heads, dtype=torch.float32, device=x.device)
        amax.scatter_reduce_(0, which[:, None].expand(-1, num_kv_heads), x.abs().amax(-1), reduce="amax")
        s_old = torch.where(fresh, torch.zeros_like(amax), scale[written])
        s_new = new_scale(s_old, amax, kind)
        # Re-quantize the earlier rows of the blocks whose scale grew (only those: in decode,
        # a block's scale rarely grows once it holds a few tokens).
        redo = earlier[:, :, None] & (s_new > s_old)[:, None, :]  # [U, page, H_kv]
        grown = redo.flatten(1).any(1).nonzero().flatten()
        if grown.numel():
            sel, s_from, s_to = written[grown], s_old[grown], s_new[grown]
            old = cache[sel]  # [G, page, H_kv, D]
            again = quantize(dequantize(old, s_from[:, None, :, None]), s_to[:, None, :, None], kind)
            cache[sel] = torch.where(redo[grown][..., None], again, old)
        scale[written] = s_new
        cache[blocks, offs] = quantize(x, s_new[which][:, :, None], kind)
