"""Exercise of notebook 02, section 4 ("KV-cache quantization"): quantize and dequantize one block.

A quantized KV cache stores each value ``x`` as a one-byte number ``q`` (int8, or fp8 e4m3) and
keeps one float32 *scale* ``s`` per (block, KV head); the value a slot stands for is ``q * s``
(symmetric: no zero point). The scale maps the largest ``|x|`` of the block's head onto the
largest storable magnitude ``QMAX`` (127 for int8, 448 for e4m3), so nothing overflows and the
whole range is used. vLLM's fp8 KV cache works the same way with coarser scales (per tensor);
e4m3 is the format of Micikevicius et al., "FP8 Formats for Deep Learning" (2022). Going below
8 bits needs finer choices (per-channel keys, outliers kept apart): Liu et al., "KIVI" (ICML
2024); Hooper et al., "KVQuant" (NeurIPS 2024).

* ``new_scale``: the scale after a write, from the largest ``|x|`` per head; it only grows.
* ``quantize``: ``x / s``, rounded to the nearest storable number, clamped to ``+-QMAX``.
* ``dequantize``: what a stored number stands for.
* ``quantize_block``: one block written at once: its scales and its values.

``ExerciseQuantizer`` (given, at the bottom) hands *your* three functions to the engine through
``EngineConfig.kv_quantizer``: ``LLM(kv_cache_dtype="int8", kv_quantizer=ExerciseQuantizer())``
writes every KV block with your arithmetic (torch backend). Each docstring states the contract;
notebook 02's exercise cell has optional hints. Check your work with

    make grade EX=02b           # or: MINILLM_IMPL=exercises pytest -m ex02b tests/test_exercises.py
"""

from __future__ import annotations

import torch

__all__ = ["QMAX", "STORAGE", "new_scale", "quantize", "dequantize", "quantize_block", "ExerciseQuantizer"]

QMAX = {"int8": 127.0, "fp8": 448.0}            # the largest magnitude a stored number may take
STORAGE = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}   # the cache's element dtype


# =====================================================================================
# Exercise 1: the scale
# =====================================================================================

def new_scale(old: torch.Tensor, amax: torch.Tensor, kind: str) -> torch.Tensor:
    """The scale of each head after a write whose largest ``|x|`` per head is ``amax`` (float32,
    same shape as ``old``): ``amax / QMAX[kind]``, but never below ``old``, the scale the block had
    (a block fills over many steps and its scale must cover every value in it; a fresh block
    passes zeros).

    >>> new_scale(torch.zeros(2), torch.tensor([127.0, 254.0]), "int8").tolist()
    [1.0, 2.0]
    >>> new_scale(torch.tensor([3.0]), torch.tensor([448.0]), "fp8").tolist()
    [3.0]
    """
    ### BEGIN SOLUTION
    return torch.maximum(old, amax / QMAX[kind])
    ### END SOLUTION


# =====================================================================================
# Exercise 2: quantize
# =====================================================================================

def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` (float32) stored with ``scale`` (broadcast against ``x``) as ``STORAGE[kind]``:

    * ``y = x / scale``; a scale of 0 (a block of zeros) divides by 1 instead;
    * clamp ``y`` to ``[-QMAX, +QMAX]`` (symmetric: int8's -128 is never used);
    * int8: round to the nearest integer, halves to even (what ``torch.round`` does); fp8: the
      cast ``.to(torch.float8_e4m3fn)`` rounds to the nearest e4m3 number itself.

    >>> quantize(torch.tensor([2.5, 3.5, -2.5, 200.0]), torch.tensor(1.0), "int8").tolist()
    [2, 4, -2, 127]
    >>> quantize(torch.tensor([0.3, 1000.0]), torch.tensor(1.0), "fp8").float().tolist()
    [0.3125, 448.0]
    """
    ### BEGIN SOLUTION
    s = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (x.to(torch.float32) / s).clamp(-QMAX[kind], QMAX[kind])
    if kind == "int8":
        return torch.round(y).to(torch.int8)
    return y.to(STORAGE["fp8"])
    ### END SOLUTION


# =====================================================================================
# Exercise 3: dequantize
# =====================================================================================

def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values the stored numbers ``q`` (int8 or fp8) stand for, with ``scale``
    broadcast against ``q``.

    >>> dequantize(torch.tensor([2, -127], dtype=torch.int8), torch.tensor(0.5)).tolist()
    [1.0, -63.5]
    """
    ### BEGIN SOLUTION
    return q.to(torch.float32) * scale
    ### END SOLUTION


# =====================================================================================
# Exercise 4: one block
# =====================================================================================

def quantize_block(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One fresh block ``x`` ``[block_size, num_kv_heads, head_dim]`` written at once: its scales
    ``[num_kv_heads]`` (one per head, from that head's largest ``|x|`` in the block) and its stored
    values (same shape as ``x``), with your ``new_scale`` and ``quantize``.

    >>> q, s = quantize_block(torch.tensor([[[1.0, -254.0]], [[127.0, 0.0]]]), "int8")
    >>> s.tolist(), q.tolist()
    ([2.0], [[[0, -127]], [[64, 0]]])
    """
    ### BEGIN SOLUTION
    x = x.to(torch.float32)
    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x.abs().amax(dim=(0, 2)), kind)
    return quantize(x, scale[None, :, None], kind), scale
    ### END SOLUTION


# =====================================================================================
# Given: your functions as the engine's quantizer
# =====================================================================================

class ExerciseQuantizer:
    """The int8/fp8 format's arithmetic from this module's functions, for
    ``LLM(kv_cache_dtype="int8", attention_backend="torch", kv_quantizer=ExerciseQuantizer())``
    (``EngineConfig.kv_quantizer``): the engine's store (``kernels/kv_store.py``) calls these three
    for every block it writes, re-quantizing a block's earlier rows when its scale grows."""

    def new_scale(self, old, amax, kind):
        return new_scale(old, amax, kind)

    def quantize(self, x, scale, kind):
        return quantize(x, scale, kind)

    def dequantize(self, q, scale):
        return dequantize(q, scale)

    def __repr__(self) -> str:
        return "ExerciseQuantizer()"
