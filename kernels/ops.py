"""The kernels' front door: paged attention, KV stores and block copies, each in Triton with
a plain-torch reference beside it (the reference is also the engine's CPU backend). Every
one of them also works on a quantized cache (int8 or fp8 values with one scale per block
and KV head: ``kernels/kv_quant.py``).

The ``kernels/`` folder is installed under the import name ``minillm_kernels`` (see
``pyproject.toml``), so the engine writes ``from minillm_kernels import ops``. The folder has
no ``__init__.py`` on purpose: Hugging Face's hub package is also called ``kernels`` and
``transformers`` imports it; a package of ours by that name would shadow it whenever the
repository root is on ``sys.path`` (``python -m pytest``, ``python -c`` in the root).

Importing this module is cheap and imports no Triton: the kernel modules load on first use,
after :func:`use_interpreter_if_no_cuda` has had the chance to set ``TRITON_INTERPRET=1``
on a machine without CUDA (see ``kernels/_triton_setup.py`` for why that must come first).

Backends: ``"triton"`` (GPU, or Triton's interpreter on CPU: slow, for tests),
``"torch"`` (the reference), ``"auto"`` (Triton on CUDA tensors, torch otherwise), and for
attention ``"cpu"``: the C kernel of ``kernels/cpu_attention.py``, which reads the paged cache
in place instead of gathering it (float32; any other call goes to the torch reference; the
stores and copies it goes with are the torch reference's).
"""

from __future__ import annotations

from ._triton_setup import interpreter_active, triton_available, use_interpreter_if_no_cuda

__all__ = [
    "paged_attention",
    "paged_attention_ref",
    "plan_attention_ref",
    "store_kv",
    "store_kv_ref",
    "copy_blocks",
    "copy_blocks_ref",
    "swap_blocks",
    "swap_blocks_ref",
    "launches",
    "triton_available",
    "use_interpreter_if_no_cuda",
    "interpreter_active",
]

_BACKENDS = ("triton", "torch", "auto", "cpu")


def _use_triton(backend: str, tensor) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return tensor.is_cuda
    if backend == "triton" and not tensor.is_cuda:
        use_interpreter_if_no_cuda()  # raises a clear error if the interpreter cannot be used
    return backend == "triton"


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale,
    *,
    max_q_len=None,
    backend="triton",
    num_splits=None,
    plan=None,
    k_scale=None,
    v_scale=None,
):
    """Causal attention of a ragged batch of new query tokens over the paged KV cache.

    q ``[total_q, H, D]``; k/v_cache ``[num_blocks, block_size, H_kv, D]``;
    block_tables int32 ``[batch, max_blocks]``; cu_seqlens_q int32 ``[batch + 1]``;
    context_lens int32 ``[batch]`` (KV length, the new tokens included). Query j of
    request i sits at position ``context_lens[i] - q_len_i + j`` and sees keys up to it.
    Returns ``[total_q, H, D]`` in ``q.dtype``. See ``kernels/attention.py``.
    ``plan``: the torch backend's per-step :func:`plan_attention_ref` (ignored by Triton and "cpu").
    ``k_scale, v_scale`` ``[num_blocks, H_kv]``: the scales of an int8/fp8 cache, which is
    dequantized on load (``kernels/kv_quant.py``).
    """
    from . import attention

    if backend == "cpu":
        from . import cpu_attention

        if cpu_attention.supports(q, k_cache, k_scale):
            return cpu_attention.paged_attention_cpu(
                q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
            ).to(q.dtype)
        backend = "torch"
    if _use_triton(backend, q):
        return attention.paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q,
            context_lens,
            scale,
            max_q_len=max_q_len,
            num_splits=num_splits,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return attention.paged_attention_ref(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        max_q_len=max_q_len,
        plan=plan,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def paged_attention_ref(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, *, max_q_len=None, k_scale=None, v_scale=None
):
    """Torch reference of :func:`paged_attention` (also the CPU backend)."""
    from .attention import paged_attention_ref as ref

    return ref(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        max_q_len=max_q_len,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def plan_attention_ref(block_tables, cu_seqlens_q, context_lens, page, group):
    """The torch backend's layer-independent plan (length groups, gather indices, masks)
    for one step; pass it to :func:`paged_attention` as ``plan=`` in every layer."""
    from .attention import plan_attention_ref as impl

    return impl(block_tables, cu_seqlens_q, context_lens, page, group)


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, backend="auto", quantizer=None):
    """In place: write token i's ``k[i], v[i]`` ``[H_kv, D]`` to cache slot
    ``slot_mapping[i]`` (= block_id * block_size + offset); -1 skips the token.

    A quantized cache (int8 or fp8 values, see ``kernels/kv_quant.py``) comes with its scales
    ``k_scale, v_scale`` ``[num_blocks, H_kv]``: the tokens are quantized on the way in, and a
    block's scale grows (its earlier rows re-quantized) when a larger value arrives.
    ``quantizer``: an object with ``new_scale``, ``quantize`` and ``dequantize`` used instead of
    ``minillm_kernels.kv_quant``'s by the torch reference (the Triton kernel has its own compiled in)."""
    from . import kv_store
    from .kv_quant import kind_of

    if kind_of(k_cache) is not None:
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_cache.dtype} KV cache needs its k_scale and v_scale")
        if _use_triton(backend, k_cache):
            if quantizer is not None:
                raise ValueError("store_kv: a quantizer runs in the torch reference only (backend='torch')")
            return kv_store.store_kv_quant_triton(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
        return kv_store.store_kv_quant_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, quantizer=quantizer)
    if _use_triton(backend, k_cache):
        return kv_store.store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return kv_store.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Torch reference of :func:`store_kv`."""
    from . import kv_store
    from .kv_quant import kind_of

    if kind_of(k_cache) is not None:
        return kv_store.store_kv_quant_ref(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
    return kv_store.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def copy_blocks(k_cache, v_cache, src, dst, *, k_scale=None, v_scale=None, backend="auto"):
    """In place: copy block ``src[i]`` to block ``dst[i]`` in both caches (copy-on-write),
    and in the scales of a quantized cache when given (a block's values mean nothing
    without its scales)."""
    from . import block_copy

    pairs = [(k_cache, v_cache)] + ([(k_scale, v_scale)] if k_scale is not None else [])
    for a, b in pairs:
        if _use_triton(backend, k_cache):
            block_copy.copy_blocks_triton(a, b, src, dst)
        else:
            block_copy.copy_blocks_ref(a, b, src, dst)


def copy_blocks_ref(k_cache, v_cache, src, dst, *, k_scale=None, v_scale=None):
    """Torch reference of :func:`copy_blocks`."""
    from .block_copy import copy_blocks_ref as ref

    ref(k_cache, v_cache, src, dst)
    if k_scale is not None:
        ref(k_scale, v_scale, src, dst)


def swap_blocks(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, *, src_scales=None, dst_scales=None):
    """Copy blocks ``src_ids[i] -> dst_ids[i]`` between a device cache and a host pool
    (either direction; CPU <-> CPU works too). A quantized cache's scales travel with its
    blocks: ``src_scales = (k_scale, v_scale)`` of the source, ``dst_scales`` of the destination."""
    from .block_copy import swap_blocks as impl

    impl(src_k, src_v, dst_k, dst_v, src_ids, dst_ids)
    if src_scales is not None:
        impl(*src_scales, *dst_scales, src_ids, dst_ids)


def swap_blocks_ref(src_k, src_v, dst_k, dst_v, src_ids, dst_ids, *, src_scales=None, dst_scales=None):
    """Naive one-block-at-a-time reference of :func:`swap_blocks`."""
    from .block_copy import swap_blocks_ref as ref

    ref(src_k, src_v, dst_k, dst_v, src_ids, dst_ids)
    if src_scales is not None:
        ref(*src_scales, *dst_scales, src_ids, dst_ids)


def launches(dtype, kv_dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, target=None):
    """Every distinct kernel launch (``minillm_kernels.targets.Launch``) the engine can make for
    one model shape (``num_heads``, ``num_kv_heads``, ``head_dim``), activation ``dtype``, cache
    ``kv_dtype`` (``dtype``, ``torch.int8`` or ``torch.float8_e4m3fn``) and ``block_size``, over
    every step: each comes from the launcher that makes it, with the tiles it picks for
    ``target`` (a ``Target``; None: no shared-memory limit). ``tests/test_kernels_targets.py``
    compiles them all for each GPU target."""
    import torch

    from . import attention, block_copy, kv_store
    from .kv_quant import SCALE_DTYPE, kind_of

    group = num_heads // num_kv_heads
    out = attention.attention_launches(dtype, kv_dtype, head_dim, group, block_size, target)
    if kind_of(torch.empty((), dtype=kv_dtype)) is None:
        out.append(kv_store.store_launch(dtype, kv_dtype, num_kv_heads, head_dim, block_size))
    else:
        out.append(kv_store.store_quant_launch(dtype, kv_dtype, head_dim, block_size))
        out.append(block_copy.copy_launch(SCALE_DTYPE, num_kv_heads))  # the scales move with their blocks
    out.append(block_copy.copy_launch(kv_dtype, block_size * num_kv_heads * head_dim))
    return list(dict.fromkeys(out))
