"""Load a Hugging Face checkpoint directory (config.json + *.safetensors), or
build a small seeded random Llama when no checkpoint is wanted.

Only safetensors are read: a pickle file (``*.bin``, ``*.pt``) can run code when
loaded, so a checkpoint directory that has nothing else is refused. Only local
directories are read: nothing here contacts a model hub. A ``config.json`` is
checked (``check_model_config``) before anything is sized or allocated from it.
"""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace
from pathlib import Path
from typing import Optional

import torch

from .llama import LlamaModel

SUPPORTED = ("llama", "qwen2", "qwen3")

# The shipped checkpoints: model="default" and speculative_model="default-draft".
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-draft"

# The default tiny random Llama: small enough for tests, real enough to use GQA.
RANDOM_DEFAULTS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2)


# Sizes beyond these are a typo, not a model (the largest open models stay far below them).
LIMITS = dict(vocab_size=2**22, hidden_size=2**17, intermediate_size=2**19, num_hidden_layers=2**12,
              num_attention_heads=2**12, num_key_value_heads=2**12, head_dim=2**12)


def check_model_config(cfg, source: str) -> None:
    """Raise ValueError naming ``source`` (a config.json path) and the field if the model's shape
    cannot be right: every size an integer >= 1 and below ``LIMITS``, whole heads (``head_dim``
    given, or ``hidden_size`` divisible by ``num_attention_heads``), and KV heads that divide the
    attention heads (grouped-query attention)."""
    def get(name, required=True):
        v = getattr(cfg, name, None)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= LIMITS[name]:
            raise ValueError(f"{source}: {name}={v!r}: must be an integer in [1, {LIMITS[name]}]")
        return v

    vocab, hidden = get("vocab_size"), get("hidden_size")
    get("num_hidden_layers")
    heads = get("num_attention_heads")
    get("intermediate_size")
    kv_heads = get("num_key_value_heads", required=False) or heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    if get("head_dim", required=False) is None and hidden % heads:
        raise ValueError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                         "(and no head_dim is given)")
    eos = getattr(cfg, "eos_token_id", None)
    for t in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab):
            raise ValueError(f"{source}: eos_token_id={eos!r}: must be token ids in [0, vocab_size={vocab})")
    if isinstance(eos, (list, tuple)) and not eos:
        raise ValueError(f"{source}: eos_token_id=[]: give a token id or null")
    mpe = getattr(cfg, "max_position_embeddings", None)
    if mpe is not None and (isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1):
        raise ValueError(f"{source}: max_position_embeddings={mpe!r}: must be an integer >= 1")


def load_config(model: str, presets=None):
    """The checked config.json of the local checkpoint directory ``model``; never a download.
    ``presets``: names the caller also accepts, listed in the error for a name that is neither."""
    if not os.path.isdir(model):
        also = f"a model preset ({', '.join(presets)}), " if presets else ""
        raise ValueError(f"model={model!r}: not {also}a local checkpoint directory, None (the shipped "
                         "default model) or 'random'; nothing is downloaded from a model hub")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model={model!r}: no config.json in this directory")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    check_model_config(SimpleNamespace(**raw), path)     # before transformers computes anything from it
    from transformers import AutoConfig
    try:
        cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError) as e:   # e.g. an unknown model_type
        raise ValueError(f"{path}: cannot be read as a model config ({type(e).__name__}: {e})") from e
    check_model_config(cfg, path)
    return cfg


def random_model_config(**overrides):
    from transformers import LlamaConfig
    kw = dict(RANDOM_DEFAULTS)
    kw.update(overrides)
    check_model_config(SimpleNamespace(**kw), "EngineConfig.random_model")
    return LlamaConfig(**kw)


def _weights_fit(cfg, model: str) -> None:
    """The float32 model built before its weights are loaded must fit in host memory."""
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, layer = cfg.hidden_size, (cfg.num_attention_heads * hd * 2 + kvh * hd * 2) * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    params = cfg.num_hidden_layers * layer + 2 * cfg.vocab_size * h
    need, have = 4 * params, host_memory_bytes()
    if need > have:
        raise ValueError(f"model={model!r}: its config.json describes ~{params / 1e9:.3g}B parameters "
                         f"({need / 2**30:.1f} GiB in float32), more than this machine's "
                         f"{have / 2**30:.1f} GiB of memory")


def host_memory_bytes() -> int:
    """Physical memory of this machine (os.sysconf; no psutil needed)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):        # not a POSIX system: assume plenty
        return 2**62


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

    cfg = load_config(model)
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model={model!r}: model_type {cfg.model_type!r} is not supported (only {SUPPORTED})")
    files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise ValueError(f"model={model!r}: no *.safetensors weights found (pickle checkpoints are "
                         "refused: loading them can run arbitrary code)")
    _weights_fit(cfg, model)
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
