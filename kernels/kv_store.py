"""store_kv: write the new tokens' keys and values into their cache slots.

Seed concept: *slot mapping*. Before attention runs, each new token's K and V go into
the paged cache at ``slot = block_id * block_size + offset``, the place its block table
promised (``slot_mapping[i]``). A slot of -1 means "do not store" (a padding token, or
a token whose KV is not retained). After this, paged attention can read every token
of the request, the new ones included, through the block table alone.

Layouts: ``k, v``: ``[N, num_kv_heads, head_dim]``; ``k_cache, v_cache``:
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping``: int64 ``[N]``.
"""

from __future__ import annotations

import torch

from ._triton_setup import import_triton

triton, tl = import_triton()


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,  # k, v [N, H_kv, D]
    stride_kcb, stride_kcs, stride_kch,  # k_cache [num_blocks, block_size, H_kv, D]
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    i = tl.program_id(0)  # one program per token: all its heads at once
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot < 0:
        return  # -1: skip this token
    block = slot // PAGE
    offset = slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + i * stride_kn + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + i * stride_vn + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping):
    """In place: ``cache[slot // block_size, slot % block_size] = k`` for every slot >= 0."""
    n, num_kv_heads, head_dim = k.shape
    if n == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    slot_mapping = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=k_cache.shape[1],
        num_warps=4,
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
        except RuntimeError:                      # a cache whose blocks are not contiguous
            page = cache.shape[1]
            cache[slot_mapping // page, slot_mapping % page] = x.to(cache.dtype)
            continue
        slots.index_copy_(0, slot_mapping, x.to(cache.dtype))
