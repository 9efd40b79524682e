"""The KV cache's tensors: one (K, V) pair per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]``,
on the device or in pinned host memory (the swap pool).

With ``kv_cache_dtype="int8"`` or ``"fp8"`` the caches hold one-byte values and each layer also has
its scales (one (K, V) pair of ``[num_blocks, num_kv_heads]`` float32 tensors, ``kernels/kv_quant.py``),
which travel with their blocks wherever the blocks go (swap out, swap in, copy-on-write).
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    device="cpu",
    pin_memory: bool = False,
):
    """Zeroed KV caches for ``num_layers`` layers: ``(caches, scales)``, where ``caches[layer] =
    (k, v)`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` and ``scales[layer] = (k_scale,
    v_scale)`` ``[num_blocks, num_kv_heads]`` for a quantized cache ("int8" | "fp8"), else ``[]``.
    ``kv_cache_dtype`` "auto" stores the model's ``dtype``; "float32" / "float16" / "bfloat16"
    store that float type (for comparisons: the engine's config takes "auto", "int8", "fp8")."""
    from minillm_kernels.kv_quant import SCALE_DTYPE, storage_dtype

    floats = {"auto": dtype, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    quantized = kv_cache_dtype not in floats
    elt = storage_dtype(kv_cache_dtype) if quantized else floats[kv_cache_dtype]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def zeros(shape, dt):
        return torch.zeros(shape, dtype=dt, device=device, pin_memory=pin_memory)

    caches = [(zeros(shape, elt), zeros(shape, elt)) for _ in range(num_layers)]
    scales = (
        [(zeros(shape[::2], SCALE_DTYPE), zeros(shape[::2], SCALE_DTYPE)) for _ in range(num_layers)]
        if quantized
        else []
    )
    return caches, scales
