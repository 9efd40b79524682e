"""Load a Hugging Face checkpoint directory (config.json + *.safetensors), or
build a small seeded random Llama when no checkpoint is wanted.

Only safetensors are read: a pickle file (``*.bin``, ``*.pt``) can run code when
loaded, so a checkpoint directory that has nothing else is refused.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

import torch

from .llama import LlamaModel

SUPPORTED = ("llama", "qwen2", "qwen3")

# The default tiny random Llama: small enough for tests, real enough to use GQA.
RANDOM_DEFAULTS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2)


def random_model_config(**overrides):
    from transformers import LlamaConfig
    kw = dict(RANDOM_DEFAULTS)
    kw.update(overrides)
    return LlamaConfig(**kw)


def _torch_dtype(name: str, cfg=None) -> torch.dtype:
    if name == "auto":
        d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if isinstance(d, torch.dtype):
            return d
        name = str(d or "float32").replace("torch.", "")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def load_model(model: Optional[str], dtype: str = "float32", device: str = "cpu", seed: int = 0,
               random_overrides: Optional[dict] = None):
    """Returns (LlamaModel, hf_config). ``model`` is a checkpoint dir or "random"."""
    if model == "random":
        cfg = random_model_config(**(random_overrides or {}))
        torch_dtype = _torch_dtype(dtype if dtype != "auto" else "float32")
        gen = torch.Generator().manual_seed(seed)
        with torch.device("cpu"):
            m = LlamaModel(cfg)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                continue
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1 else torch.zeros(p.shape))
        return m.to(device=device, dtype=torch_dtype).eval(), cfg

    if not os.path.isdir(model):
        raise ValueError(f"model={model!r}: not a directory (give a Hugging Face checkpoint directory, "
                         "None for the shipped default model, or 'random')")
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model)
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model={model!r}: model_type {cfg.model_type!r} is not supported (only {SUPPORTED})")
    files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise ValueError(f"model={model!r}: no *.safetensors weights found (pickle checkpoints are "
                         "refused: loading them can run arbitrary code)")
    from safetensors.torch import load_file
    state = {}
    for f in files:
        state.update(load_file(f))
    torch_dtype = _torch_dtype(dtype, cfg)
    with torch.device("meta"):
        m = LlamaModel(cfg)
    m = m.to_empty(device="cpu")
    # Rebuild non-persistent buffers that to_empty left uninitialised.
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    m.inv_freq = LlamaRotaryEmbedding(config=cfg).inv_freq.float().clone()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
        m.lm_head.weight = m.model.embed_tokens.weight
    missing, unexpected = m.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"model={model!r}: checkpoint does not match the architecture; "
                         f"missing={missing[:5]} unexpected={unexpected[:5]}")
    m = m.to(device=device, dtype=torch_dtype)
    m.inv_freq = m.inv_freq.float()
    return m.eval(), cfg
