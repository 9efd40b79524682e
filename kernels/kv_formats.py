"""The quantized KV cache formats by name: the one table ``EngineConfig.kv_cache_dtype`` is read against.

Each format stores one value per K/V element in ``bytes_per_value`` bytes of ``torch_dtype`` and keeps one
float32 scale per (block, KV head) (``kv_quant.py`` says how the scale is kept). What differs between
formats is the largest storable magnitude ``qmax`` and the rounding: ``"integer"`` (round half to even, then
clamp to +-qmax) or ``"e4m3"`` (the nearest float8 e4m3 number). The engine's config, the cost model's
bytes per position, the cache allocation, the reference quantizer and the Triton store all read this
table, so a new format that rounds like an existing one is one entry here; one with a new rounding is
also its arithmetic in ``kv_quant.quantize`` (the reference) and ``kv_store._quantize`` (the kernel).
This module imports nothing (the simulator's cost model reads it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVFormat:
    name: str  # EngineConfig.kv_cache_dtype
    torch_dtype: str  # the storage element type, as torch names it (getattr(torch, torch_dtype))
    triton_type: str  # the same, as a Triton signature names it
    qmax: float  # the largest magnitude a stored value may take: a scale maps a block's amax onto it
    rounding: str  # "integer" | "e4m3"
    bytes_per_value: int = 1
    min_cuda_capability: tuple = (0, 0)  # the GPU conversions the Triton store needs


KV_FORMATS = {
    f.name: f
    for f in (
        KVFormat("int8", "int8", "i8", 127.0, "integer"),
        KVFormat("fp8", "float8_e4m3fn", "fp8e4nv", 448.0, "e4m3", min_cuda_capability=(8, 9)),
    )
}
SCALE_BYTES = 4  # bytes per scale (one per block, KV head, K or V): float32


def kv_format(name: str) -> KVFormat:
    """The format named ``name``, or a ValueError listing the formats there are."""
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype={name!r}: unknown quantized KV format; expected one of {sorted(KV_FORMATS)}")
    return KV_FORMATS[name]
