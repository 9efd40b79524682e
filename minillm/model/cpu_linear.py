"""Linear layers with their weights laid out once for the CPU: the CPU fast path's matrix multiplies.

A reader can skip this module: :class:`PackedLinear` computes what ``nn.Linear`` computes,
``x @ weight.T + bias``, only faster on the CPU. The engine swaps it in for every float32
``nn.Linear`` of the model outside the fused decoder layers (``cpu_fused.py``, which lay out their
stacked weights the same way: in a plain Llama that leaves the LM head) when
``attention_backend="cpu"`` (the CPU fast path; ``ModelRunner`` calls :func:`choose_layout`, then
:func:`pack_linears`, once, after loading).

``nn.Linear`` keeps its weight as ``[out, in]`` and multiplies by its transpose, a strided view. Two
layouts made once do better, and which one wins depends on the model and the machine:

* ``"transposed"``: a contiguous ``[in, out]`` copy, read in order by the BLAS: ``torch.mm(x, W_T)``,
  ``torch.addmm(b, x, W_T)`` with a bias, and ``torch.addmm(r, x, W_T)`` adds a residual ``r`` in the
  same call. A call costs a few microseconds beside its arithmetic, but the BLAS lays the weight out
  for its micro-kernel anew at every call.
* ``"onednn"``: the weight reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking torch's own compiler applies to frozen
  CPU models; vLLM's CPU backend keeps oneDNN matmul handlers the same way), the residual as its
  ``add`` post-op. Nothing is laid out per call, but each call costs about 15 us more.

Small weights that stay in the caches favour the first, large ones streamed from memory the second.
Measured on this machine (1 thread, 32 rows, a step's matrix multiplies one after the other): the
3.4M model's 17, 1.28 ms transposed against 1.74 ms oneDNN; the 26M model's 33, 19.3 ms against
17.0 ms. So :func:`choose_layout` times the model's own shapes both ways, once, and keeps the faster.
The copies are made once: changing ``weight`` afterwards would not reach them (the engine never
does). The parameters stay where they were, so ``state_dict`` is unchanged.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

LAYOUTS = ("transposed", "onednn")


def can_use_onednn() -> bool:
    """Whether this torch has oneDNN and its linear prepacking ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed(weight: torch.Tensor, layout: str, batch_hint: int) -> torch.Tensor:
    """``weight`` (``[out, in]``) in ``layout``, outside autograd (``batch_hint``: the rows oneDNN tunes for)."""
    if layout == "transposed":
        return weight.detach().t().contiguous()
    if layout == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    raise ValueError(f"packed: layout={layout!r}; one of {LAYOUTS}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ W.T + bias`` for rows ``x`` (``[rows, in]``) and ``weight = packed(W, ...)``."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def linear_add(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``residual + (x @ W.T + bias)`` in one call."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")
    out = torch.addmm(residual, x, weight)  # the BLAS starts from the residual
    return out if bias is None else out.add_(bias)


def choose_layout(shapes: list[tuple[int, int]], rows: int, rounds: int = 3) -> str:
    """The faster layout for a step's matrix multiplies, ``shapes`` (``(out, in)`` each, in the order a
    forward runs them) on ``rows`` rows: each layout timed on weights of those shapes (filled with one
    value: only the shapes and the memory they take matter), the best of ``rounds`` each."""
    if not can_use_onednn():
        return "transposed"
    with torch.no_grad():
        weights = [torch.full(shape, 0.01) for shape in shapes]
        inputs = [torch.full((rows, shape[1]), 0.5) for shape in shapes]
        best = {}
        for layout in LAYOUTS:
            ws = [packed(w, layout, rows) for w in weights]
            best[layout] = min(_time_chain(inputs, ws) for _ in range(rounds))
    return min(best, key=best.get)


def _time_chain(inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for x, w in zip(inputs, weights):
        linear(x, w)
    return time.perf_counter() - start


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a copy of its weight in ``layout`` (float32, CPU)."""

    def __init__(self, linear: nn.Linear, layout: str = "transposed", batch_hint: int = 32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters, shared
        # Plain attributes, outside state_dict: the weight's copy, and the bias outside autograd (its storage)
        self.packed = packed(linear.weight, layout, batch_hint)
        self.packed_bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return linear(rows, self.packed, self.packed_bias).view(*x.shape[:-1], self.out_features)


def packable(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every float32 CPU ``nn.Linear`` in ``model`` with its parent and name, except inside a module with
    ``packs_its_weights = True`` (``cpu_fused.FusedDecoderLayer``)."""
    found, stack = [], [model]
    while stack:
        parent = stack.pop()
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                found.append((parent, name, child))
            elif not getattr(child, "packs_its_weights", False):
                stack.append(child)
    return found


def pack_linears(model: nn.Module, layout: str = "transposed", batch_hint: int = 32) -> int:
    """Replace every :func:`packable` ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; returns how many."""
    swaps = packable(model)
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, layout, batch_hint))
    return len(swaps)
