"""Linear layers with their weights packed once for oneDNN: the CPU fast path's matrix multiplies.

A reader can skip this module: :class:`PackedLinear` computes what ``nn.Linear`` computes,
``x @ weight.T + bias``, only faster on the CPU. The engine swaps it in for every float32
``nn.Linear`` of the model outside the fused decoder layers (``cpu_fused.py``, which pack their
stacked weights the same way: in a plain Llama that leaves the LM head) when
``attention_backend="cpu"`` (the CPU fast path; ``ModelRunner`` calls :func:`pack_linears` once,
after loading).

Why: at a decode batch of a few dozen rows a float32 ``F.linear`` is compute-bound, and the BLAS
behind it lays the weight out for its micro-kernel anew at every call. oneDNN can do that once
(``torch.ops.mkldnn._reorder_linear_weight``, the prepacking torch's own compiler applies to frozen
CPU models) and keep the blocked copy, as vLLM's CPU backend keeps its oneDNN matmul handlers.
Measured on this machine (1 thread, a ``[32, 512] x [512, 1376]`` layer): 634 us -> 481 us;
``[7, 512]``: 313 -> 131 us. The packed copy is made once: changing ``weight`` afterwards would not
reach it (the engine never does). The parameters stay where they were, so ``state_dict`` is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack() -> bool:
    """Whether this torch has oneDNN and its linear prepacking ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-blocked copy of its weight (float32, CPU)."""

    def __init__(self, linear: nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters, shared
        # The blocked copy, tuned for about batch_hint rows (any number works).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, batch_hint: int = 32) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; returns how many.
    A module with ``packs_its_weights = True`` (``cpu_fused.FusedDecoderLayer``) is left as it is."""
    swaps, stack = [], [model]
    while stack:  # every module, except inside one that packs its own weights
        parent = stack.pop()
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                swaps.append((parent, name, child))
            elif not getattr(child, "packs_its_weights", False):
                stack.append(child)
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(swaps)
