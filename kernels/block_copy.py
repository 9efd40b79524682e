"""Moving whole KV blocks: copy-on-write inside the cache, and swapping to host memory.

The concepts:

* *Copy-on-write.* Requests that share a prefix share its blocks (reference counts).
  When one of them must write into a shared, partly filled block, the block manager
  gives it a fresh block and ``copy_blocks`` copies the contents: ``src[i] -> dst[i]``.
* *Swapping (preemption).* Under memory pressure a request's blocks can be moved to a
  pool of blocks in host memory (``swap_blocks`` device -> host) and moved back when it
  resumes (host -> device), instead of recomputing its KV.

Both work on one layer's ``k_cache, v_cache`` ``[num_blocks, block_size, H_kv, D]``;
the host pool has the same per-block shape (pinned memory on CUDA, so copies overlap).
Both move whole blocks of any dtype and per-block shape, so a quantized cache's scales
``[num_blocks, H_kv]`` move by the same calls (``minillm_kernels.ops.copy_blocks`` and
``minillm_kernels.ops.swap_blocks`` do that when given the scales).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ._triton_setup import import_triton
from .targets import Launch, pointer, require

triton, tl = import_triton()


@triton.jit
def _copy_blocks_kernel(k_cache_ptr, v_cache_ptr, src_ptr, dst_ptr, block_numel, BLOCK: tl.constexpr):
    pair = tl.program_id(0)  # which (src, dst) pair
    chunk = tl.program_id(1)  # which BLOCK elements of the block
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    k = tl.load(k_cache_ptr + src * block_numel + offs, mask=mask)
    tl.store(k_cache_ptr + dst * block_numel + offs, k, mask=mask)
    v = tl.load(v_cache_ptr + src * block_numel + offs, mask=mask)
    tl.store(v_cache_ptr + dst * block_numel + offs, v, mask=mask)


@lru_cache(maxsize=None)
def copy_launch(dtype: torch.dtype, block_numel: int) -> Launch:
    """The launch of :func:`_copy_blocks_kernel` for blocks of ``block_numel`` ``dtype`` elements."""
    return Launch.of(
        _copy_blocks_kernel,
        dict(k_cache_ptr=pointer(dtype), v_cache_ptr=pointer(dtype), src_ptr="*i64", dst_ptr="*i64"),
        dict(BLOCK=min(4096, triton.next_power_of_2(block_numel))),
        num_warps=4,
    )


def check_disjoint(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The block copy's precondition: the destinations are distinct and none is a source.
    Pairs run in parallel, in no order, so a destination that is also a source could be read
    before or after it is overwritten, and two pairs with one destination race. Copy-on-write
    meets it by construction (its destinations are fresh blocks); this checks it, on a GPU
    without a host sync."""
    ordered = torch.sort(dst).values
    require((ordered[1:] != ordered[:-1]).all(), "copy_blocks: two copies into one block")
    require(~torch.isin(dst, src).any(), "copy_blocks: a destination block is also a source")


def copy_blocks_triton(k_cache, v_cache, src, dst):
    """In place: block ``src[i]`` -> block ``dst[i]`` in both caches. The ``dst`` blocks
    must be distinct and not among ``src`` (copy-on-write targets are fresh blocks):
    pairs run in parallel, in no order (:func:`check_disjoint`)."""
    assert src.numel() == dst.numel()
    if src.numel() == 0:
        return
    src = src.to(device=k_cache.device, dtype=torch.int64).contiguous()
    dst = dst.to(device=k_cache.device, dtype=torch.int64).contiguous()
    check_disjoint(src, dst)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return copy_blocks_ref(k_cache, v_cache, src, dst)
    block_numel = k_cache[0].numel()
    launch = copy_launch(k_cache.dtype, block_numel)
    launch(
        (src.numel(), triton.cdiv(block_numel, dict(launch.constants)["BLOCK"])),
        k_cache,
        v_cache,
        src,
        dst,
        block_numel,
    )


def copy_blocks_ref(k_cache, v_cache, src, dst):
    """Torch reference (and CPU backend): gather the sources, then scatter them."""
    src = src.to(device=k_cache.device, dtype=torch.long)
    dst = dst.to(device=k_cache.device, dtype=torch.long)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def swap_blocks(src_k, src_v, dst_k, dst_v, src_ids, dst_ids):
    """Copy blocks ``src_ids[i]`` of ``(src_k, src_v)`` to blocks ``dst_ids[i]`` of
    ``(dst_k, dst_v)``; the two sides may live on different devices (GPU cache <-> host
    pool), or both on the CPU.

    No Triton kernel here on purpose: moving bytes between host and device is the job
    of the GPU's copy engines (DMA), not of its SMs. We gather the blocks into one
    contiguous buffer on the source device, move it in one transfer, and scatter it on
    the destination: three bulk operations whatever the number of blocks. The call
    returns once the destination is written (a swap-out must finish before its device
    blocks are reused).
    """
    assert len(src_ids) == len(dst_ids)
    if len(src_ids) == 0:
        return
    src_ids = torch.as_tensor(src_ids, dtype=torch.long).to(src_k.device)
    dst_ids = torch.as_tensor(dst_ids, dtype=torch.long).to(dst_k.device)
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        src, dst = _bytes(src), _bytes(dst)
        staged = src.index_select(0, src_ids)  # contiguous [n, block_size, H_kv, D]
        staged = staged.to(dst.device, dtype=dst.dtype)  # one transfer (no-op on one device)
        dst.index_copy_(0, dst_ids, staged)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as raw bytes: moving them needs no arithmetic, and torch's CPU
    ``index_copy_`` has no float8 kernel."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def swap_blocks_ref(src_k, src_v, dst_k, dst_v, src_ids, dst_ids):
    """Naive reference: one block at a time."""
    for s, d in zip(list(map(int, src_ids)), list(map(int, dst_ids))):
        dst_k[d].copy_(src_k[s])
        dst_v[d].copy_(src_v[s])
