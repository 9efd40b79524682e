"""Load a Hugging Face checkpoint directory (config.json + *.safetensors), or
build a small seeded random Llama when no checkpoint is wanted.

Only safetensors are read: a pickle file (``*.bin``, ``*.pt``) can run code when
loaded, so a checkpoint directory that has nothing else is refused. Only local
directories are read: nothing here contacts a model hub. A ``config.json`` is
checked (``check_model_config``) before anything is sized or allocated from it.

``load_target`` is what the engine loads: the weights, or only the model's shape for the
simulator and for tensor parallelism (whose ranks load their own shards). torch and transformers are
imported where a model is loaded, so a simulation (the shape only) runs without them.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from types import SimpleNamespace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .families import MODEL_FAMILIES, model_family

if TYPE_CHECKING:
    import torch

SUPPORTED = tuple(MODEL_FAMILIES)  # the model_types the engine runs (families.py)

# The shipped checkpoints: model="default" and speculative_model="default-draft".
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare"
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "shakespeare-draft"

# The default tiny random Llama: small enough for tests, real enough to use GQA.
RANDOM_DEFAULTS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# What EngineConfig.random_model may override: the arguments of transformers' LlamaConfig (5.x), and
# rope_theta (its older name for the rotary base, still accepted). Anything else is a typo.
RANDOM_MODEL_FIELDS = frozenset(
    (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "pretraining_tp",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_theta",
        "attention_bias",
        "attention_dropout",
        "mlp_bias",
        "dtype",
        "architectures",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "is_encoder_decoder",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
    )
)

# Sizes beyond these are a typo, not a model (the largest open models stay far below them).
LIMITS = dict(
    vocab_size=2**22,
    hidden_size=2**17,
    intermediate_size=2**19,
    num_hidden_layers=2**12,
    num_attention_heads=2**12,
    num_key_value_heads=2**12,
    head_dim=2**12,
)


def choose_triton_mode() -> None:
    """Before transformers is imported: on a machine without CUDA, Triton's interpreter is chosen
    (transformers' model modules may import Triton, which fixes its mode when first imported; see
    ``kernels/_triton_setup.py``). Every import of transformers in the engine comes after this call."""
    from minillm_kernels import ops

    try:
        ops.use_interpreter_if_no_cuda()
    except RuntimeError:
        pass  # Triton came first: the torch backend works; attention_backend="triton" explains why not


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
        raise ValueError(
            f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} (and no head_dim is given)"
        )
    eos = getattr(cfg, "eos_token_id", None)
    for t in eos if isinstance(eos, (list, tuple)) else [eos]:
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab):
            raise ValueError(f"{source}: eos_token_id={eos!r}: must be token ids in [0, vocab_size={vocab})")
    if isinstance(eos, (list, tuple)) and not eos:
        raise ValueError(f"{source}: eos_token_id=[]: give a token id or null")
    mpe = getattr(cfg, "max_position_embeddings", None)
    if mpe is not None and (isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1):
        raise ValueError(f"{source}: max_position_embeddings={mpe!r}: must be an integer >= 1")


def check_heads(cfg, world: int) -> None:
    """Attention heads and KV heads must split into whole heads per rank."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % world or kv_heads % world:
        raise ValueError(
            f"tensor_parallel_size={world}: the model has num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads}; both must be divisible by tensor_parallel_size, since "
            f"each rank computes whole heads (try a tensor_parallel_size that divides {kv_heads})"
        )


def load_config(model: str, presets=None):
    """The checked config.json of the local checkpoint directory ``model``; never a download.
    ``presets``: names the caller also accepts, listed in the error for a name that is neither."""
    if not os.path.isdir(model):
        also = f"a model preset ({', '.join(presets)}), " if presets else ""
        raise ValueError(
            f"model={model!r}: not {also}a local checkpoint directory, None (the shipped "
            "default model) or 'random'; nothing is downloaded from a model hub"
        )
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
    check_model_config(SimpleNamespace(**raw), path)  # before transformers computes anything from it
    choose_triton_mode()
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, ArithmeticError) as e:  # e.g. an unknown model_type
        raise ValueError(f"{path}: cannot be read as a model config ({type(e).__name__}: {e})") from e
    check_model_config(cfg, path)
    return cfg


def random_model_config(**overrides):
    choose_triton_mode()
    from transformers import LlamaConfig

    kw = dict(RANDOM_DEFAULTS)
    kw.update(overrides)
    check_model_config(SimpleNamespace(**kw), "EngineConfig.random_model")
    return LlamaConfig(**kw)


def _weights_fit(cfg, model: str) -> None:
    """The float32 model built before its weights are loaded must fit in host memory."""
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, layer = (
        cfg.hidden_size,
        (cfg.num_attention_heads * hd * 2 + kvh * hd * 2) * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size,
    )
    params = cfg.num_hidden_layers * layer + 2 * cfg.vocab_size * h
    need, have = 4 * params, host_memory_bytes()
    if need > have:
        raise ValueError(
            f"model={model!r}: its config.json describes ~{params / 1e9:.3g}B parameters "
            f"({need / 2**30:.1f} GiB in float32), more than this machine's "
            f"{have / 2**30:.1f} GiB of memory"
        )


def host_memory_bytes() -> int:
    """Physical memory of this machine (os.sysconf; no psutil needed)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: assume plenty
        return 2**62


def torch_dtype(name: str, cfg=None) -> torch.dtype:
    """The torch dtype named ``name`` ("auto": the checkpoint's own, else float32)."""
    import torch

    if name == "auto":
        d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if isinstance(d, torch.dtype):
            return d
        name = str(d or "float32").replace("torch.", "")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def load_model(
    model: Optional[str],
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    random_overrides: Optional[dict] = None,
):
    """Returns (LlamaModel, hf_config). ``model`` is a checkpoint dir or "random"."""
    import torch

    from .llama import LlamaModel

    if model == "random":
        cfg = random_model_config(**(random_overrides or {}))
        dt = torch_dtype(dtype if dtype != "auto" else "float32")
        gen = torch.Generator().manual_seed(seed)
        with torch.device("cpu"):
            m = LlamaModel(cfg)
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                continue
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1 else torch.zeros(p.shape))
        return m.to(device=device, dtype=dt).eval(), cfg

    cfg = load_config(model)
    model_family(cfg, model)  # a model_type the engine runs, else a ValueError naming it
    files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise ValueError(
            f"model={model!r}: no *.safetensors weights found (pickle checkpoints are "
            "refused: loading them can run arbitrary code)"
        )
    _weights_fit(cfg, model)
    from safetensors.torch import load_file

    state = {}
    for f in files:
        state.update(load_file(f))
    dt = torch_dtype(dtype, cfg)
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
        raise ValueError(
            f"model={model!r}: checkpoint does not match the architecture; "
            f"missing={missing[:5]} unexpected={unexpected[:5]}"
        )
    m = m.to(device=device, dtype=dt)
    m.inv_freq = m.inv_freq.float()
    return m.eval(), cfg


# --- what the engine loads: the target model (or only its shape), its tokenizer ------------------------


def resolve_device(name: str) -> torch.device:
    """``EngineConfig.device``: "auto" is the GPU when there is one."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: Optional[torch.device]) -> str:
    """``EngineConfig.dtype``: "auto" is bfloat16 on a GPU, float32 on the CPU (and without a device)."""
    if name == "auto":
        return "bfloat16" if device is not None and device.type == "cuda" else "float32"
    return name


def resolve_model_path(model: Optional[str]) -> str:
    """``LLM(model=...)``: None is the shipped checkpoint (a small random Llama when it is missing)."""
    if model is None:
        if (DEFAULT_MODEL_DIR / "config.json").exists():
            return str(DEFAULT_MODEL_DIR)
        warnings.warn("the shipped default model is missing; using a small random Llama")
        return "random"
    if model == "default-draft":
        return str(DEFAULT_DRAFT_DIR)
    if model == "random":
        return "random"
    return os.fspath(model)


def load_target(path: str, config, dtype_name: str, device: Optional[torch.device]):
    """(model, hf_config, model_spec): the weights on this process, or only the shape (the simulator;
    tensor parallelism, whose weights live in the ranks' processes)."""
    from ..sim.costmodel import ModelSpec

    if not config.runs_model:
        return (None, *simulated_shape(path, config))
    if config.tensor_parallel_size > 1:
        hf_config = tensor_parallel_config(path, config)
        return None, hf_config, ModelSpec.from_hf_config(hf_config)
    model, hf_config = load_model(path, dtype_name, str(device), config.seed, config.random_model)
    return model, hf_config, ModelSpec.from_hf_config(hf_config)


def simulated_shape(path: str, cfg):
    """The simulator needs only the model's shape: a preset of ``costmodel.MODELS``
    (``model="llama-2-70b"``), the tiny random Llama, or a checkpoint's config.json."""
    from ..sim.costmodel import MODELS, ModelSpec

    if path in MODELS and not os.path.isdir(path):
        m = MODELS[path]
        shape = SimpleNamespace(
            num_hidden_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            intermediate_size=m.intermediate_size,
            vocab_size=m.vocab_size,
            eos_token_id=None,
        )
        return shape, m
    if path == "random":  # a plain namespace: no need to import transformers
        shape = SimpleNamespace(**{**RANDOM_DEFAULTS, **cfg.random_model})
        check_model_config(shape, "EngineConfig.random_model")
    else:  # a local checkpoint directory; never a model hub
        shape = load_config(path, presets=sorted(MODELS))
    return shape, ModelSpec.from_hf_config(shape)


def tensor_parallel_config(model_path: str, config):
    """The model's config, read in the driver (which loads no weights), checked for
    ``config.tensor_parallel_size`` ranks: whole heads per rank."""
    if model_path == "random":
        cfg = random_model_config(**config.random_model)
    else:
        cfg = load_config(model_path)
        model_family(cfg, model_path)
    check_heads(cfg, config.tensor_parallel_size)
    return cfg


def load_tokenizer(path: str, must_exist: bool = False):
    """The checkpoint's tokenizer, or None when the directory has none (with ``must_exist``, a
    ValueError naming the directory: ``LLM(tokenizer=DIR)``)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        if must_exist:
            raise ValueError(
                f"tokenizer={path!r}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json) in this directory"
            )
        return None
    choose_triton_mode()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
