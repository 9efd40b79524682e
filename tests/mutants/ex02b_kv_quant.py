"""Plausible wrong answers to notebook 02's KV-quantization exercise; each must fail
tests/graders/ex02b_kv_quant.py.

Each entry: (what the mistake is, old text of solutions/ex02b_kv_quant.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # new_scale
    (
        "scale: set by the newest write alone (it may shrink under values already stored)",
        "    return torch.maximum(old, amax / QMAX[kind])\n",
        "    return amax / QMAX[kind]\n",
    ),
    (
        "scale: int8 read as 128 levels a side (amax / 128)",
        "    return torch.maximum(old, amax / QMAX[kind])\n",
        "    return torch.maximum(old, amax / (QMAX[kind] + 1))\n",
    ),
    (
        "scale: upside down (amax x QMAX)",
        "    return torch.maximum(old, amax / QMAX[kind])\n",
        "    return torch.maximum(old, amax * QMAX[kind])\n",
    ),
    # quantize
    (
        "int8: truncated toward zero, not rounded",
        "        return torch.round(y).to(torch.int8)\n",
        "        return y.to(torch.int8)\n",
    ),
    (
        "int8: halves rounded up (floor(y + 0.5)), not to even",
        "        return torch.round(y).to(torch.int8)\n",
        "        return torch.floor(y + 0.5).to(torch.int8)\n",
    ),
    (
        "int8: not clamped (200 wraps around in the int8 cast)",
        "    y = (x.to(torch.float32) / s).clamp(-QMAX[kind], QMAX[kind])\n",
        "    y = x.to(torch.float32) / s\n",
    ),
    (
        "int8: clamped to [-128, 127] (asymmetric)",
        "    y = (x.to(torch.float32) / s).clamp(-QMAX[kind], QMAX[kind])\n",
        "    y = (x.to(torch.float32) / s).clamp(-QMAX[kind] - (kind == 'int8'), QMAX[kind])\n",
    ),
    (
        "scale 0 not guarded: a block of zeros becomes 0/0",
        "    s = torch.where(scale > 0, scale, torch.ones_like(scale))\n",
        "    s = scale\n",
    ),
    (
        "fp8: rounded to an integer first, like int8",
        '    return y.to(STORAGE["fp8"])\n',
        '    return torch.round(y).to(STORAGE["fp8"])\n',
    ),
    (
        "quantize: multiplies by the scale instead of dividing",
        "    y = (x.to(torch.float32) / s).clamp(-QMAX[kind], QMAX[kind])\n",
        "    y = (x.to(torch.float32) * s).clamp(-QMAX[kind], QMAX[kind])\n",
    ),
    # dequantize
    ("dequantize: the scale forgotten", "    return q.to(torch.float32) * scale\n", "    return q.to(torch.float32)\n"),
    (
        "dequantize: divides by the scale",
        "    return q.to(torch.float32) * scale\n",
        "    return q.to(torch.float32) / scale\n",
    ),
    # quantize_block
    (
        "block: one scale for the whole block, not one per head",
        "    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x.abs().amax(dim=(0, 2)), kind)\n",
        "    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x.abs().amax().expand(x.shape[1]), kind)\n",
    ),
    (
        "block: the largest x, not the largest |x| (negative values clipped)",
        "    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x.abs().amax(dim=(0, 2)), kind)\n",
        "    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x.amax(dim=(0, 2)).clamp(min=0), kind)\n",
    ),
    (
        "block: the scale from the first row only (later rows clip)",
        "    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x.abs().amax(dim=(0, 2)), kind)\n",
        "    scale = new_scale(torch.zeros(x.shape[1], device=x.device), x[0].abs().amax(dim=-1), kind)\n",
    ),
]
