"""The model families the engine runs, by ``config.json``'s ``model_type``: one table, read everywhere.

Every family is the Llama decoder (``llama.py``: RoPE, grouped-query attention, RMSNorm, SwiGLU); a
family differs from it only in the switches below. The loader accepts exactly these ``model_type``s,
the model builds its attention from the family's switches, and the cost model counts the parameters
they add. A new family that is a combination of existing switches is one entry here; a new switch is
also its code in ``llama.py`` (and, if it adds parameters, its count in ``sim/costmodel.py``).
This module imports nothing (the simulator reads it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    qkv_bias: Optional[bool] = None  # q, k and v projections have a bias; None: as config.attention_bias
    o_bias: Optional[bool] = None  # the output projection has a bias; None: as config.attention_bias
    qk_norm: bool = False  # an RMSNorm of q and of k per head, before RoPE

    def biases(self, cfg: Any) -> tuple[bool, bool]:
        """(q/k/v bias, output bias) of a model with config ``cfg``."""
        declared = bool(getattr(cfg, "attention_bias", False))
        return (declared if self.qkv_bias is None else self.qkv_bias, declared if self.o_bias is None else self.o_bias)


MODEL_FAMILIES = {
    f.model_type: f
    for f in (
        ModelFamily("llama"),
        ModelFamily("qwen2", qkv_bias=True, o_bias=False),  # Qwen2: biased q/k/v, unbiased output
        ModelFamily("qwen3", qk_norm=True),  # Qwen3: q and k normalised per head
    )
}


def model_family(cfg: Any, model: str = "") -> ModelFamily:
    """The family of a model config (its ``model_type``; a config without one is a Llama), or a
    ValueError naming the model, its type and the families there are."""
    model_type = getattr(cfg, "model_type", None) or "llama"
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model={model!r}: model_type {model_type!r} is not supported (only {tuple(MODEL_FAMILIES)})")
    return MODEL_FAMILIES[model_type]
