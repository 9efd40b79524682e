"""The quantized KV cache format: int8 or fp8 (e4m3) values, one float32 scale per (block, KV head).

The concept: *cache quantization*, the fix for a batch size that KV capacity limits well
below what the compute could serve. A KV position costs ``2 x layers x kv_heads x head_dim x sizeof(dtype)``
bytes; storing the values in one byte instead of two (float16) or four (float32) fits about
twice (four times) the positions, hence the requests, in the same memory.

The format
----------
* ``k_cache, v_cache`` ``[num_blocks, block_size, H_kv, D]`` hold ``torch.int8`` or
  ``torch.float8_e4m3fn`` values ``q``;
* ``k_scale, v_scale`` ``[num_blocks, H_kv]`` float32 hold one scale ``s`` per block and KV head;
* the value a slot stands for is ``q * s`` (symmetric: no zero point). ``s = amax / QMAX`` where
  ``amax`` is the largest ``|x|`` the block has seen for that head, and ``QMAX`` is 127 for int8
  and 448 (the largest finite e4m3 number) for fp8.

How the scale is kept while a block fills token by token
--------------------------------------------------------
A block is written over many steps (a prompt chunk, then one decode token per step), and the
scale must cover every value in it. The choice made here: **the scale only grows, and when a
write brings a larger ``|x|``, the block's earlier rows are re-quantized to the new scale** in
the same store. Why this rather than a scale fixed by the block's first write (with later values
clamped)? In decode the first write is a single token, so a fixed scale would clip every later
token that happens to be larger: a systematic error on exactly the long contexts quantization is
for. Growing keeps every value in range, so the error of a value stays below one quantization
step of its block's final scale (half a step when it was written at that scale, at most one step
when it was re-quantized: two roundings). The kernel stays simple: one program per (run of a
request's new tokens in one block, KV head) does it all (amax, re-quantize the earlier rows when
the scale grew, write the new rows, store the scale), and no other program touches that block
in that step. A write starting at offset 0 begins a fresh block: its old scale (left by a
previous owner) is ignored. The scale of a full block never changes again, which is why prefix
caching can share it, with its scale, between requests.

Rounding: to nearest, halves to even (what torch's casts and the GPU's conversions do).

* int8: ``q = clamp(round(x / s), -127, 127)``;
* fp8: ``q = fp8(clamp(x / s, -448, 448))``, torch's own cast in the reference. The kernel
  rounds to the nearest e4m3 number itself, in float32 arithmetic (:func:`round_to_e4m3` is the
  same computation in torch), and then casts a value that is exact: Triton's interpreter does
  not round float32 to fp8 correctly (a value just below a power of two can lose its carry).

Both divisions are correctly rounded (IEEE), so kernel and reference store the same bytes;
``s == 0`` (a block of zeros) writes zeros.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kv_formats import KV_FORMATS, SCALE_BYTES, kv_format  # noqa: F401  (SCALE_BYTES: the format's)

QMAX = {name: f.qmax for name, f in KV_FORMATS.items()}  # the largest magnitude a stored value may take
SCALE_DTYPE = torch.float32


def format_available(kind: str, device=None) -> Optional[str]:
    """None when the ``kind`` KV format (``kv_formats.KV_FORMATS``) can be used, else why not: this torch
    has no such dtype, or (for a CUDA ``device``, where the Triton kernels run) the GPU lacks the
    conversions (fp8's e4m3 needs compute capability 8.9: Ada, Hopper and later). On the CPU, Triton's
    interpreter handles every format."""
    f = kv_format(kind)
    if not hasattr(torch, f.torch_dtype):
        return f"torch {torch.__version__} has no {f.torch_dtype} dtype"
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < f.min_cuda_capability:
            need = ".".join(map(str, f.min_cuda_capability))
            return f"the GPU (compute capability {cap[0]}.{cap[1]}) has no {kind} conversions; {kind} needs {need}+"
    return None


def check_available(kind: str, device) -> None:
    """Raise a clear error when the ``kind`` KV format cannot run on ``device`` (see :func:`format_available`)."""
    why = format_available(kind, device)
    if why:
        others = sorted(k for k in KV_FORMATS if k != kind and format_available(k, device) is None)
        raise ValueError(
            f"kv_cache_dtype={kind!r} is unavailable here: {why}"
            + (f"; use {' or '.join(map(repr, others))}" if others else "")
        )


def fp8_available(device=None) -> Optional[str]:
    """``format_available("fp8", device)``."""
    return format_available("fp8", device)


def check_fp8(device) -> None:
    """``check_available("fp8", device)``."""
    check_available("fp8", device)


def storage_dtype(kind: str) -> torch.dtype:
    """The element dtype of a cache holding ``kind`` values (``kv_formats.KV_FORMATS``)."""
    why = format_available(kind)
    if why:
        raise ValueError(f"kv_cache_dtype={kind!r} is unavailable: {why}")
    return getattr(torch, kv_format(kind).torch_dtype)


def kind_of(cache: torch.Tensor) -> Optional[str]:
    """The KV format of a quantized cache ("int8", "fp8", ...), None for a float one."""
    for name, f in KV_FORMATS.items():
        if cache.dtype == getattr(torch, f.torch_dtype, None):
            return name
    return None


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float32 ``y`` (already within +-448) to the nearest e4m3 value, halves to even, in
    float32 arithmetic: what ``y.to(torch.float8_e4m3fn)`` does, spelled out (the Triton store
    does exactly this). e4m3 has 3 mantissa bits: between 2^e and 2^(e+1) its numbers are 2^(e-3)
    apart, for e from -6 up; below 2^-6 (subnormals) they are 2^-9 apart."""
    a = y.abs()
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127  # the binary exponent of |y|, exactly
    e = e.clamp(min=-6)
    step = ((e - 3 + 127) << 23).view(torch.float32)  # 2^(e-3), built from its bits
    inv_step = ((127 - (e - 3)) << 23).view(torch.float32)  # 2^-(e-3)
    r = torch.round(a * inv_step) * step  # both products are exact
    return torch.copysign(r.clamp(max=448.0), y)


def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Quantize float32 ``x`` with ``scale`` (broadcast against it) to the storage dtype."""
    s = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / s
    f = kv_format(kind)
    if f.rounding == "integer":
        return torch.round(y).clamp(-f.qmax, f.qmax).to(storage_dtype(kind))
    return y.clamp(-f.qmax, f.qmax).to(storage_dtype(kind))  # "e4m3": torch's cast rounds


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values ``q * scale`` stand for (``scale`` broadcast against ``q``)."""
    return q.to(torch.float32) * scale


def new_scale(old: torch.Tensor, amax: torch.Tensor, kind: str) -> torch.Tensor:
    """The scale after a write whose largest ``|x|`` is ``amax``: it only grows."""
    return torch.maximum(old, amax / QMAX[kind])


def quantize_block(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One block ``[block_size, H_kv, D]`` written at once: its values and its scales ``[H_kv]``."""
    x = x.float()
    scale = new_scale(torch.zeros(x.shape[1]), x.abs().amax(dim=(0, 2)), kind)
    return quantize(x, scale[None, :, None], kind), scale
