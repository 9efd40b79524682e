"""The decoder layer with its projections fused: the CPU fast path's layer. A reader can skip this module.

:class:`FusedDecoderLayer` computes what ``llama.DecoderLayer`` computes, with fewer, larger calls:

* q, k and v come out of **one** matrix multiply over the three weights stacked (``[q; k; v]``), and
  the gate and up projections out of one over ``[gate; up]``, on weights laid out once for the CPU
  (``cpu_linear.py``: which layout, and why it pays);
* the residual adds ride on the output projections (``x + o_proj(o)`` is one call, as is
  ``x + down_proj(...)``);
* RMSNorm is one C call (``cpu_attention.rms_norm``; torch's ``F.rms_norm`` is half a dozen
  operations on the CPU); when no per-head norm sits between the projection and the rotation,
  RoPE, the cache write and attention are two C calls over the projection's output through the
  step's ``cpu_attention.StepCalls`` (made at the first layer, which checks and converts what every
  layer shares: block tables, slots, cos/sin): q rotated in place, k rotated into its cache slots
  and v copied to its slots (bit for bit what the torch operations give), then the kernel that
  reads the paged cache in place; else torch's operations, one ``index_copy_`` each for K and V,
  and the kernel through ``cpu_attention.paged_attention_cpu``;
* the MLP's SiLU runs in place on the gate half of the fused projection's output.

Per layer that is 5 matrix multiplies where the plain layer has 7 plus two adds, and about a
third of the small tensor operations, which on a CPU cost microseconds each whatever their size.

The layer keeps the plain layer's modules under the same names (``self_attn.q_proj`` ...), so
the parameters and ``state_dict`` are unchanged; the stacked, laid-out copies are made once, at
:func:`fuse_layers` (the engine never changes a weight afterwards). The engine swaps it in for
each float32 ``DecoderLayer`` when ``attention_backend="cpu"`` (``ModelRunner``'s ``LocalModel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_linear
from .cpu_linear import linear, linear_add, packed
from .llama import DecoderLayer, rotate_half


def _stacked(linears: list[nn.Linear], layout: str, batch_hint: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights stacked along the output, as one copy in ``layout``, and their biases."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    return packed(weight, layout, batch_hint), bias


def stacked_projections(layer: DecoderLayer) -> list[list[nn.Linear]]:
    """A fused layer's four matrix multiplies, each the linears it stacks, in the order it runs them:
    ``[q; k; v]``, ``o``, ``[gate; up]``, ``down``."""
    a, m = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]


def stacked_shapes(layer: DecoderLayer) -> list[tuple[int, int]]:
    """The ``(out, in)`` shapes of a fused layer's four matrix multiplies, in the order it runs them."""
    return [(sum(lin.out_features for lin in group), group[0].in_features) for group in stacked_projections(layer)]


def can_fuse(layer: nn.Module) -> bool:
    """Whether ``layer`` is a plain float32 CPU ``DecoderLayer`` (not, e.g., a tensor-parallel shard)."""
    if type(layer) is not DecoderLayer:
        return False
    return all(
        type(lin) is nn.Linear and lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu"
        for group in stacked_projections(layer)
        for lin in group
    )


class FusedDecoderLayer(nn.Module):
    """``DecoderLayer``'s forward with fused projections (float32, CPU, ``attention_backend="cpu"``)."""

    packs_its_weights = True  # cpu_linear.pack_linears leaves its (unused) nn.Linear modules alone

    def __init__(self, layer: DecoderLayer, layout: str = "transposed", batch_hint: int = 32):
        super().__init__()
        # The plain layer's modules, shared: the same parameters under the same names.
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        a, m = self.self_attn, self.mlp
        self.q_width, self.kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.intermediate = m.gate_proj.out_features
        # Plain attributes, not buffers: outside state_dict.
        self.qkv, self.o, self.gate_up, self.down = (
            _stacked(group, layout, batch_hint) for group in stacked_projections(layer)
        )

    def forward(self, x, cos, sin, kv_cache, meta):
        from minillm_kernels import cpu_attention

        a, ln1, ln2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        T, H, Hkv, D = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        h = cpu_attention.rms_norm(x, ln1.weight, ln1.eps)
        qkv = linear(h, *self.qkv)  # [T, (H + 2 Hkv) D]
        k_cache, v_cache = kv_cache
        if not a.qk_norm:  # RoPE, the cache write and attention: the step's C calls (checked once a step)
            calls = meta.cpu_calls
            if calls is None or not calls.fits(qkv, cos, k_cache, v_cache, a.scale):  # the forward's first layer
                calls = meta.cpu_calls = cpu_attention.StepCalls(qkv, H, Hkv, cos, sin, k_cache, v_cache, meta, a.scale)
            o = calls(qkv, cos, k_cache, v_cache, a.scale)
        else:
            q = a.q_norm(qkv[:, : self.q_width].view(T, H, D))
            k = a.k_norm(qkv[:, self.q_width : self.q_width + self.kv_width].view(T, Hkv, D))
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            v = qkv[:, self.q_width + self.kv_width :].view(T, Hkv, D)
            k_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)  # the engine's slots are all >= 0
            v_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)
            o = cpu_attention.paged_attention_cpu(
                q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, a.scale
            )
        x = linear_add(x, o.view(T, H * D), *self.o)  # x + o_proj(o)
        h = cpu_attention.rms_norm(x, ln2.weight, ln2.eps)
        gate_up = linear(h, *self.gate_up)
        act = F.silu(gate_up[:, : self.intermediate], inplace=True) * gate_up[:, self.intermediate :]  # contiguous
        return linear_add(x, act, *self.down)  # x + down(silu(gate) * up)


def fuse_layers(model: nn.Module, layout: str = "transposed", batch_hint: int = 32) -> int:
    """Replace every fusable ``DecoderLayer`` of ``model.model.layers`` by a :class:`FusedDecoderLayer`
    with its weights in ``layout`` (``cpu_linear.packed``); returns how many."""
    layers = model.model.layers
    n = 0
    for i, layer in enumerate(layers):
        if can_fuse(layer):
            layers[i] = FusedDecoderLayer(layer, layout, batch_hint)
            n += 1
    return n


def step_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The ``(out, in)`` shapes of the matrix multiplies a forward of ``model`` runs once :func:`fuse_layers`
    and ``cpu_linear.pack_linears`` have run (every fusable layer's four, then the other linears: the LM
    head), what ``cpu_linear.choose_layout`` times."""
    fusable = [layer for layer in model.model.layers if can_fuse(layer)]
    inside = {id(m) for layer in fusable for m in layer.modules()}
    shapes = [shape for layer in fusable for shape in stacked_shapes(layer)]
    return shapes + [tuple(lin.weight.shape) for _, _, lin in cpu_linear.packable(model) if id(lin) not in inside]
