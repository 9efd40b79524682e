"""The modeled GPU clock: how long one forward step, one swap, one scheduling pass take.

The engine can run on three clocks (``EngineConfig.clock``): "wall" measures what the
step actually took, "cpu" the CPU time this process spent on it, "modeled" advances by
what a cost model says the step *would* cost on a real accelerator. The cost model is
what lets a laptop show the batching math (from batch 1 to 32, about 20x the throughput
for about 1.5x the step time) and the swap-vs-recompute rule with the numbers of an H100 serving Llama-2-7B.

Three cost models implement one interface (``CostModel``):

* ``ConstantStepTime(0.010)``: the worked examples' assumption: the time of a step is
  independent of the batch size, a constant 10 ms.
* ``LinearStepCost``: a step's time as a sum of terms fitted to the real engine's steps
  measured on this machine (``minillm/sim/calibration.py``), saved as a profile and loaded
  with ``CostModel.from_profile(path)``:

      step_time = fixed + new_tokens * t_token + sequences * t_sequence
                + context_tokens * t_context + attention_pairs * t_pair
* ``RooflineCostModel(hardware, model)``: a roofline. A step is bound either by
  arithmetic (FLOPs / achievable FLOP/s) or by memory traffic (bytes / achievable
  HBM bandwidth), whichever is slower, plus a fixed per-step overhead:

      step_time = max(FLOPs / (peak_flops * flops_efficiency),
                      bytes / (hbm_bandwidth * bandwidth_efficiency)) + all-reduce + step_overhead

      FLOPs = 2 * params * (new tokens)                           # every linear layer
            + 4 * layers * heads * head_dim * (query-key pairs)   # QK^T and PV, causal
      bytes = weights (read once per step, shared by the whole batch)
            + KV read (every request's context) + KV written (its new tokens)

  Decode (one new token per request) moves the whole weight set to make one token
  per request, so at small batch it is memory bound and batching is nearly free;
  prefill (many tokens) is compute bound. That asymmetry is why batching pays: it
  turns a matrix-vector product into a matrix-matrix one that reads the weights once.

  Tensor parallelism over N GPUs (``simulated.tensor_parallel(hw, N, link=...)``) divides
  both terms by N and, when a ``link`` (``LINKS``: NVLink, PCIe, InfiniBand) is given, adds
  the all-reduces: 2 per layer of ``tokens x hidden x dtype_bytes`` each, a ring moving
  ``2 (N-1)/N`` of those bytes over the link plus a fixed latency. Without a link the TP is
  ideal (no communication), the optimistic bound.

The module also holds the small formulas the batching-math notebook uses:
``kv_cache_bytes`` (M_KV), ``max_batch_size``, ``bytes_per_generated_token``,
``decode_step_time_vs_batch`` and ``swap_or_recompute`` (the preemption cost rule), and
``kv_block_bytes``, what one KV block costs for a given ``kv_cache_dtype`` (cache
quantization: int8 or fp8 KV halves M_KV against fp16, so about twice the batch fits).
No torch here: this module is plain arithmetic and stays importable anywhere.
"""

from __future__ import annotations

import math
import operator
from operator import add, attrgetter, countOf
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from minillm_kernels.kv_formats import KV_FORMATS, SCALE_BYTES as KV_SCALE_BYTES
from ..model.families import MODEL_FAMILIES

__all__ = [
    "HardwareSpec",
    "HARDWARE",
    "ModelSpec",
    "MODELS",
    "LinkSpec",
    "LINKS",
    "get_link",
    "CostModel",
    "ConstantStepTime",
    "LinearStepCost",
    "RooflineCostModel",
    "get_cost_model",
    "batch_terms",
    "get_hardware",
    "get_model_spec",
    "kv_cache_bytes",
    "max_kv_tokens",
    "bytes_per_generated_token",
    "max_batch_size",
    "decode_step_time_vs_batch",
    "swap_or_recompute",
    "kv_block_bytes",
    "kv_element_bytes",
]

GB = 1e9  # datasheets quote decimal gigabytes (and GB/s, TFLOP/s)


# =====================================================================================
# Hardware
# =====================================================================================


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator, as the roofline sees it. Peak figures are *dense* (no sparsity)."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bandwidth: float  # device memory bandwidth, bytes/s
    hbm_bytes: float  # device memory capacity, bytes
    pcie_bandwidth: float  # host <-> device, one direction, bytes/s (swap)
    step_overhead: float = 3e-4  # s: fixed cost of one forward (launches, sampling, sync)
    schedule_overhead_base: float = 1e-4  # s: one scheduling pass, fixed part
    schedule_overhead_per_request: float = 5e-6  # s: per running request per pass
    schedule_overhead_per_waiting: float = 5e-7  # s: per queued request per pass (queue upkeep)
    tp_size: int = 1  # GPUs joined by tensor parallelism (simulated.tensor_parallel)
    link: Optional["LinkSpec"] = None  # their interconnect; None = ideal TP (no all-reduce cost)

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, (int, np.integer)) or self.tp_size < 1:
            raise ValueError(f"HardwareSpec.tp_size={self.tp_size!r}: must be an integer >= 1")
        for f in ("peak_flops", "hbm_bandwidth", "hbm_bytes", "pcie_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"HardwareSpec.{f}={getattr(self, f)!r}: must be > 0")
        for f in (
            "step_overhead",
            "schedule_overhead_base",
            "schedule_overhead_per_request",
            "schedule_overhead_per_waiting",
        ):
            if getattr(self, f) < 0:
                raise ValueError(f"HardwareSpec.{f}={getattr(self, f)!r}: must be >= 0")

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from memory- to compute-bound."""
        return self.peak_flops / self.hbm_bandwidth


# Figures from NVIDIA's datasheets. Tensor-core numbers there are quoted "with sparsity";
# the dense figure is half of it. PCIe is quoted bidirectional; one direction is half.
# The overheads (step, scheduling) are not datasheet figures: they are round guesses of
# what a CUDA-graph'd engine with a Python scheduler spends, kept the same on every GPU.
HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOPS dense (624 sparse),
    # HBM2e 2,039 GB/s, 80 GB; PCIe Gen4 x16 64 GB/s bidirectional -> 32 GB/s each way
    "A100-80GB": HardwareSpec(
        "A100-80GB", peak_flops=312e12, hbm_bandwidth=2039 * GB, hbm_bytes=80 * GB, pcie_bandwidth=32 * GB
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense,
    # HBM3 3.35 TB/s, 80 GB; PCIe Gen5 x16 128 GB/s bidirectional -> 64 GB/s each way.
    "H100-SXM": HardwareSpec(
        "H100-SXM", peak_flops=989e12, hbm_bandwidth=3350 * GB, hbm_bytes=80 * GB, pcie_bandwidth=64 * GB
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense,
    # HBM3e 4.8 TB/s, 141 GB; PCIe Gen5 x16 128 GB/s bidirectional -> 64 GB/s each way.
    "H200": HardwareSpec(
        "H200", peak_flops=989e12, hbm_bandwidth=4800 * GB, hbm_bytes=141 * GB, pcie_bandwidth=64 * GB
    ),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity -> 121 dense,
    # GDDR6 300 GB/s, 24 GB; PCIe Gen4 x16 64 GB/s bidirectional -> 32 GB/s each way.
    "L4": HardwareSpec("L4", peak_flops=121e12, hbm_bandwidth=300 * GB, hbm_bytes=24 * GB, pcie_bandwidth=32 * GB),
    # Not a datasheet: a rough laptop/desktop CPU (a few hundred GFLOP/s of vector math,
    # ~50 GB/s DRAM; "swap" is a memcpy within the same DRAM). For orders of magnitude only.
    "cpu": HardwareSpec(
        "cpu", peak_flops=0.5e12, hbm_bandwidth=50 * GB, hbm_bytes=16 * GB, pcie_bandwidth=20 * GB, step_overhead=1e-3
    ),
}


@dataclass(frozen=True)
class LinkSpec:
    """The interconnect tensor-parallel GPUs all-reduce over: one direction's bandwidth per GPU
    (bytes/s) and a fixed cost per collective (s: launch and synchronisation)."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"LinkSpec({self.name!r}): bandwidth must be > 0 and latency >= 0")

    def allreduce_time(self, num_bytes: float, num_gpus: int) -> float:
        """A ring all-reduce of ``num_bytes`` over ``num_gpus``: each GPU sends and receives
        ``2 (N-1)/N x bytes`` (reduce-scatter, then all-gather), plus the fixed latency.
        0 for one GPU (nothing to reduce)."""
        if num_gpus <= 1:
            return 0.0
        return self.latency + 2 * (num_gpus - 1) / num_gpus * num_bytes / self.bandwidth


# Bandwidths from the vendors' published figures, one direction per GPU. The latencies are
# not datasheet figures: round orders of magnitude of a small NCCL all-reduce on each fabric.
LINKS: dict[str, LinkSpec] = {
    # NVLink 4 (H100 SXM datasheet): 900 GB/s per GPU bidirectional -> 450 GB/s each way.
    "NVLink": LinkSpec("NVLink", bandwidth=450 * GB, latency=10e-6),
    # NVLink 3 (A100 SXM datasheet): 600 GB/s bidirectional -> 300 GB/s each way.
    "NVLink3": LinkSpec("NVLink3", bandwidth=300 * GB, latency=10e-6),
    # PCIe Gen5 x16: 128 GB/s bidirectional -> 64 GB/s each way (GPUs without NVLink).
    "PCIe": LinkSpec("PCIe", bandwidth=64 * GB, latency=20e-6),
    # PCIe Gen4 x16: 64 GB/s bidirectional -> 32 GB/s each way.
    "PCIe4": LinkSpec("PCIe4", bandwidth=32 * GB, latency=20e-6),
    # InfiniBand NDR: 400 Gb/s per port = 50 GB/s each way (TP across two nodes).
    "InfiniBand": LinkSpec("InfiniBand", bandwidth=50 * GB, latency=30e-6),
}


def get_link(link: Union[str, LinkSpec, None]) -> Optional[LinkSpec]:
    """A ``LinkSpec`` from itself or a preset name in ``LINKS``; None stays None (ideal TP)."""
    if link is None or isinstance(link, LinkSpec):
        return link
    if isinstance(link, str):
        return _lookup(LINKS, link, "link preset")
    raise TypeError(f"link must be a LinkSpec, a preset name or None, got {link!r}")


def _lookup(table: Mapping[str, Any], key: str, what: str) -> Any:
    if key in table:
        return table[key]
    folded = {k.lower(): v for k, v in table.items()}
    if key.lower() in folded:
        return folded[key.lower()]
    raise ValueError(f"unknown {what} {key!r}; choose one of {sorted(table)}")


def get_hardware(hw: Union[str, HardwareSpec]) -> HardwareSpec:
    """A ``HardwareSpec`` from itself or from a preset name in ``HARDWARE``."""
    if isinstance(hw, HardwareSpec):
        return hw
    if isinstance(hw, str):
        return _lookup(HARDWARE, hw, "hardware preset")
    raise TypeError(f"hardware must be a HardwareSpec or a preset name, got {hw!r}")


# =====================================================================================
# Model
# =====================================================================================

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    **{name: f.bytes_per_value for name, f in KV_FORMATS.items()},
}

# A quantized KV cache (EngineConfig.kv_cache_dtype: a format of kernels/kv_formats.py) stores
# bytes_per_value per value plus one float32 scale per (block, KV head), for K and for V.
KV_QUANTIZED = tuple(KV_FORMATS)


def kv_element_bytes(kv_cache_dtype: Optional[str], dtype_bytes: int) -> int:
    """sizeof one stored K or V value: the model's ``dtype_bytes`` for "auto" (or None), else
    that of the named dtype ("int8", "fp8", "float16", ...)."""
    if kv_cache_dtype in (None, "auto"):
        return int(dtype_bytes)
    key = str(kv_cache_dtype).replace("torch.", "").lower()
    if key not in _DTYPE_BYTES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: unknown; expected 'auto', one of "
            f"{sorted(KV_FORMATS)} or a float dtype name"
        )
    return _DTYPE_BYTES[key]


def kv_block_bytes(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    kv_cache_dtype: Optional[str] = "auto",
) -> int:
    """Bytes one KV block takes over all layers: K and V values (``2 x layers x block_size x
    kv_heads x head_dim x sizeof``) and, for an int8/fp8 cache, their scales (``2 x layers x
    kv_heads x 4``). With head_dim 64 and blocks of 16 the scales add 0.4%, so int8 gives
    1.99x the blocks of fp16 in the same memory (1.88x with blocks of one position)."""
    elt = kv_element_bytes(kv_cache_dtype, dtype_bytes)
    scales = KV_SCALE_BYTES if kv_cache_dtype in KV_QUANTIZED else 0
    return 2 * num_layers * num_kv_heads * (block_size * head_dim * elt + scales)


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a decoder-only transformer that set its compute and memory cost."""

    name: str
    num_params: int  # all parameters (embeddings included)
    num_layers: int  # n_layer
    hidden_size: int  # d_model
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (< num_heads under GQA, 1 under MQA)
    head_dim: int  # d_head
    dtype_bytes: int = 2  # sizeof(dtype): 2 for bf16/fp16 weights and KV
    vocab_size: int = 32000
    intermediate_size: Optional[int] = None  # MLP width (informational)
    kv_dtype_bytes: Optional[int] = None  # sizeof a stored K/V value if not dtype_bytes (int8/fp8 KV: 1)

    def __post_init__(self) -> None:
        for f in (
            "num_params",
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "dtype_bytes",
            "vocab_size",
        ):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"ModelSpec.{f}={v!r}: must be an integer >= 1")
        if self.kv_dtype_bytes is not None and (
            not isinstance(self.kv_dtype_bytes, (int, np.integer)) or self.kv_dtype_bytes < 1
        ):
            raise ValueError(f"ModelSpec.kv_dtype_bytes={self.kv_dtype_bytes!r}: must be an integer >= 1 or None")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_kv_heads={self.num_kv_heads}: must divide num_heads={self.num_heads}")

    @property
    def kv_bytes_per_token(self) -> int:
        """M_KV per position: a K and a V vector per layer per KV head (the 2 in the formula),
        each value ``kv_dtype_bytes`` (default: ``dtype_bytes``). A quantized cache's per-block
        scales (under 1% of it) are left out here; ``kv_block_bytes`` counts them."""
        elt = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elt

    def kv_block_bytes(self, block_size: int, dtype_bytes: int, kv_cache_dtype: Optional[str] = "auto") -> int:
        """``kv_block_bytes`` for this shape: the bytes one KV block of ``block_size`` positions takes."""
        return kv_block_bytes(
            self.num_layers, block_size, self.num_kv_heads, self.head_dim, dtype_bytes, kv_cache_dtype
        )

    def with_kv_cache_dtype(self, kv_cache_dtype: Optional[str]) -> "ModelSpec":
        """The same model with its KV stored as ``kv_cache_dtype`` ("auto" | "int8" | "fp8" | a
        float name): weights unchanged, ``kv_bytes_per_token`` follows."""
        if kv_cache_dtype in (None, "auto"):
            return replace(self, kv_dtype_bytes=None)
        return replace(self, kv_dtype_bytes=kv_element_bytes(kv_cache_dtype, self.dtype_bytes))

    @property
    def weight_bytes(self) -> int:
        """Bytes read from memory to run all layers once (every decode step pays this)."""
        return self.num_params * self.dtype_bytes

    @classmethod
    def from_hf_config(
        cls,
        cfg: Any,
        name: Optional[str] = None,
        *,
        num_params: Optional[int] = None,
        dtype_bytes: Optional[int] = None,
    ) -> "ModelSpec":
        """Build from a Hugging Face config: a ``transformers`` config object or a config.json dict.

        Reads Llama-style names (``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ...) and GPT-2 aliases
        (``n_layer``, ``n_embd``, ``n_head``). ``num_params`` is counted from the shapes of a
        gated-MLP (Llama/Qwen) decoder unless given; ``dtype_bytes`` comes from
        ``dtype``/``torch_dtype`` (default 2).
        """

        def get(*keys, default=None):
            for k in keys:
                v = cfg.get(k) if isinstance(cfg, Mapping) else getattr(cfg, k, None)
                if v is not None:
                    return v
            return default

        layers = get("num_hidden_layers", "n_layer", "num_layers")
        hidden = get("hidden_size", "n_embd", "d_model")
        heads = get("num_attention_heads", "n_head", "num_heads")
        if layers is None or hidden is None or heads is None:
            raise ValueError(
                "config lacks num_hidden_layers / hidden_size / num_attention_heads "
                f"(got {layers!r}, {hidden!r}, {heads!r})"
            )
        kv_heads = get("num_key_value_heads", "num_kv_heads", default=heads)
        head_dim = get("head_dim", default=hidden // heads)
        vocab = get("vocab_size", default=32000)
        inter = get("intermediate_size", "n_inner", default=4 * hidden)
        model_type = str(get("model_type", default="") or "")
        if dtype_bytes is None:
            # (config objects: read only `dtype`; transformers warns on `torch_dtype`)
            dt = (
                get("dtype", "torch_dtype", default="bfloat16")
                if isinstance(cfg, Mapping)
                else (getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype") or "bfloat16")
            )
            dtype_bytes = _DTYPE_BYTES.get(str(dt).replace("torch.", "").lower(), 2)
        if num_params is None:
            q_out, kv_out = heads * head_dim, kv_heads * head_dim
            attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden  # Wq, Wk, Wv, Wo
            family = MODEL_FAMILIES.get(model_type or "llama", MODEL_FAMILIES["llama"])  # (model/families.py)
            qkv_bias = family.qkv_bias if family.qkv_bias is not None else bool(get("attention_bias", default=False))
            if qkv_bias:
                attn += q_out + 2 * kv_out  # q/k/v biases
            if family.qk_norm:
                attn += 2 * head_dim  # q_norm, k_norm
            mlp = 3 * hidden * inter  # gate, up, down
            per_layer = attn + mlp + 2 * hidden  # two RMSNorms
            tied = bool(get("tie_word_embeddings", default=False))
            num_params = layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)
        if name is None:
            name = str(get("_name_or_path", "name_or_path", default="") or model_type or "hf-model")
        return cls(
            name=name,
            num_params=int(num_params),
            num_layers=int(layers),
            hidden_size=int(hidden),
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            dtype_bytes=int(dtype_bytes),
            vocab_size=int(vocab),
            intermediate_size=int(inter),
        )


# The presets are built from the shapes in each model's config.json on the Hugging Face Hub,
# so their parameter counts are derived, not typed in (tests check them by hand).
_HF_CONFIGS: dict[str, dict] = {
    "llama-2-7b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        tie_word_embeddings=False,
        model_type="llama",
    ),
    "llama-2-13b": dict(
        num_hidden_layers=40,
        hidden_size=5120,
        num_attention_heads=40,
        num_key_value_heads=40,
        intermediate_size=13824,
        vocab_size=32000,
        tie_word_embeddings=False,
        model_type="llama",
    ),
    # Llama-2-70B uses grouped-query attention: 64 query heads share 8 KV heads.
    "llama-2-70b": dict(
        num_hidden_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
        tie_word_embeddings=False,
        model_type="llama",
    ),
    "llama-3-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        model_type="llama",
    ),
    # Qwen3-0.6B: head_dim 128 although hidden/heads = 64; tied embeddings; q/k RMSNorm.
    "qwen3-0.6b": dict(
        num_hidden_layers=28,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        model_type="qwen3",
    ),
}
MODELS: dict[str, ModelSpec] = {
    name: ModelSpec.from_hf_config(cfg, name=name, dtype_bytes=2) for name, cfg in _HF_CONFIGS.items()
}


def get_model_spec(model: Union[str, ModelSpec, Mapping, Any]) -> ModelSpec:
    """A ``ModelSpec`` from itself, a preset name in ``MODELS``, or a Hugging Face config."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return _lookup(MODELS, model, "model preset")
    return ModelSpec.from_hf_config(model)


# =====================================================================================
# The interface the engine calls
# =====================================================================================


class CostModel:
    """What the modeled clock asks. Subclasses override ``step_time`` at least.

    ``step_time(num_new_tokens, context_lens)``: one forward over a batch, where request i
    processes ``num_new_tokens[i]`` tokens and holds ``context_lens[i]`` positions of KV
    *after* the step (so ``context_lens[i] >= num_new_tokens[i]``).

    Only cost models that know a memory size (``RooflineCostModel``) have
    ``kv_capacity_tokens(memory_fraction)``; test for it with ``hasattr``.
    """

    name: str = "cost-model"
    kv_bytes_per_token: int = 0  # M_KV per position (0 if the model is unknown)

    def step_time(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        raise NotImplementedError

    def swap_time(self, num_bytes: int) -> float:
        return 0.0

    def schedule_time(self, num_running: int, num_waiting: int) -> float:
        return 0.0

    def after_idle_time(self) -> float:
        """Extra seconds of a step that starts after the engine sat idle, waiting for an arrival (a
        process woken from sleep, caches gone cold); 0 unless a calibration measured it."""
        return 0.0

    def prefill_tokens_per_s(self, context_len: int = 1024) -> float:
        """S_prefill: tokens/s of one prompt of ``context_len`` tokens prefilled in one step."""
        t = self.step_time([context_len], [context_len])
        return math.inf if t <= 0 else context_len / t

    def preemption_mode(self, num_tokens: int) -> str:
        """The preemption cost rule for a victim holding ``num_tokens`` positions: "swap" or "recompute"."""
        kv = num_tokens * self.kv_bytes_per_token
        swap = self.swap_time(kv)
        recompute = num_tokens / self.prefill_tokens_per_s()
        return "swap" if swap < recompute else "recompute"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    @staticmethod
    def from_profile(path) -> "LinearStepCost":
        """The cost model a calibration on some machine saved (``python -m minillm.bench calibrate``)."""
        return LinearStepCost.from_profile(path)


def _check_batch(num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> None:
    if len(num_new_tokens) != len(context_lens):
        raise ValueError(f"step_time: {len(num_new_tokens)} num_new_tokens but {len(context_lens)} context_lens")
    for q, c in zip(num_new_tokens, context_lens):
        if q < 0 or c < q:
            raise ValueError(
                f"step_time: need 0 <= num_new_tokens <= context_len (KV after the "
                f"step), got num_new_tokens={q}, context_len={c}"
            )


class ConstantStepTime(CostModel):
    """Every step costs ``seconds``, whatever the batch: the worked examples' 10 ms per step.

    ``swap_bandwidth`` (bytes/s) makes swaps cost ``bytes / swap_bandwidth``; ``None`` = free.
    ``kv_bytes_per_token`` lets ``preemption_mode`` price a swap; 0 (default) means unknown.
    """

    def __init__(
        self,
        seconds: float = 0.010,
        schedule_overhead: float = 0.0,
        *,
        swap_bandwidth: Optional[float] = None,
        kv_bytes_per_token: int = 0,
        name: Optional[str] = None,
    ):
        if seconds < 0 or schedule_overhead < 0:
            raise ValueError(
                f"ConstantStepTime: seconds={seconds!r} and schedule_overhead={schedule_overhead!r} must be >= 0"
            )
        if swap_bandwidth is not None and swap_bandwidth <= 0:
            raise ValueError(f"ConstantStepTime.swap_bandwidth={swap_bandwidth!r}: must be > 0 or None")
        self.seconds = float(seconds)
        self.schedule_overhead = float(schedule_overhead)
        self.swap_bandwidth = swap_bandwidth
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.name = name or f"constant({self.seconds * 1e3:g} ms/step)"

    def step_time(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        _check_batch(num_new_tokens, context_lens)
        return self.seconds

    def swap_time(self, num_bytes: int) -> float:
        return 0.0 if self.swap_bandwidth is None else num_bytes / self.swap_bandwidth

    def schedule_time(self, num_running: int, num_waiting: int) -> float:
        return self.schedule_overhead


BATCH_TERMS = ("fixed", "multi_token", "new_tokens", "sequences", "context_tokens", "attention_pairs")
STEP_TERMS = BATCH_TERMS + ("after_idle",)
OPTIONAL_TERMS = ("multi_token", "after_idle")  # a profile without one: 0 (saved before the term existed)


def batch_terms(num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> tuple[int, int, int, int, int, int]:
    """What a step's time is made of, counted for one batch (``LinearStepCost``'s batch terms, in
    ``BATCH_TERMS``' order): 1 (the fixed part), 1 if the step has more than one new token
    (``multi_token``: every weight matrix multiplies a matrix of token vectors instead of one
    vector, a slower kernel to start on a CPU), new tokens (every linear layer runs once per new
    token), sequences (sampling and bookkeeping per request), context tokens (the KV each request
    reads) and attention pairs (query-key products: new token j of a request with ``c`` positions
    after the step and ``q`` new ones attends to ``c - q + j + 1`` keys)."""
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(num_new_tokens, context_lens))
    new_tokens = sum(num_new_tokens)
    return 1, int(new_tokens > 1), new_tokens, len(num_new_tokens), sum(context_lens), pairs


class LinearStepCost(CostModel):
    """A step's time as a sum of per-unit costs, fitted to measured steps of the real engine.

    ``seconds``: one number per term of ``STEP_TERMS`` (seconds per step, per step of more than one
    new token, per new token, per sequence, per context token, per attention pair: ``BATCH_TERMS``;
    and ``after_idle``, added to a step that follows a wait for an arrival, ``after_idle_time``;
    ``multi_token`` and ``after_idle`` are optional, 0 when left out);
    ``stderr``: each one's standard error from the fit; ``info``: where it was measured (machine,
    model, threads, ...). A profile is this as JSON (``to_profile`` / ``from_profile``).
    """

    PROFILE_FORMAT = "minillm-step-cost/1"

    def __init__(
        self,
        seconds: Mapping[str, float],
        stderr: Optional[Mapping[str, float]] = None,
        *,
        info: Optional[Mapping[str, Any]] = None,
        name: Optional[str] = None,
    ):
        self.seconds = {t: _profile_number("terms", t, seconds) for t in STEP_TERMS}
        self.stderr = {t: _profile_number("stderr", t, stderr) for t in STEP_TERMS} if stderr else {}
        unknown = sorted(set(seconds) - set(STEP_TERMS))
        if unknown:
            raise ValueError(f"profile field terms: unknown term(s) {unknown}; the terms are {list(STEP_TERMS)}")
        self.info = dict(info or {})
        self.name = name or f"calibrated({self.info.get('machine', 'this machine')})"
        self._weights = [self.seconds[t] for t in BATCH_TERMS]

    def step_time(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        _check_batch(num_new_tokens, context_lens)
        if not num_new_tokens:
            return 0.0
        return sum(w * x for w, x in zip(self._weights, batch_terms(num_new_tokens, context_lens)))

    def after_idle_time(self) -> float:
        return self.seconds["after_idle"]

    def to_profile(self) -> dict:
        return {
            "format": self.PROFILE_FORMAT,
            "terms": dict(self.seconds),
            "stderr": dict(self.stderr),
            **{k: v for k, v in self.info.items() if k not in ("format", "terms", "stderr")},
        }

    def save(self, path) -> None:
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(self.to_profile(), indent=2) + "\n")

    @classmethod
    def from_profile(cls, path) -> "LinearStepCost":
        """Load a profile saved by ``save``; a malformed one is refused naming the field."""
        import json
        from pathlib import Path

        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"profile {path}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != cls.PROFILE_FORMAT:
            raise ValueError(f"profile field format={data.get('format')!r}: expected {cls.PROFILE_FORMAT!r}")
        terms = data.get("terms")
        if not isinstance(terms, dict):
            raise ValueError(f"profile field terms={terms!r}: expected an object with {list(STEP_TERMS)}")
        stderr = data.get("stderr") or None
        if stderr is not None and not isinstance(stderr, dict):
            raise ValueError(f"profile field stderr={stderr!r}: expected an object")
        info = {k: v for k, v in data.items() if k not in ("format", "terms", "stderr")}
        return cls(terms, stderr, info=info)


def _profile_number(group: str, term: str, values: Mapping[str, Any]) -> float:
    if term not in values:
        if term in OPTIONAL_TERMS:
            return 0.0
        raise ValueError(f"profile field {group}.{term} is missing")
    v = values[term]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"profile field {group}.{term}={v!r}: must be a finite number >= 0 (seconds)")
    return float(v)


class RooflineCostModel(CostModel):
    """max(compute time, memory time) + fixed overhead, for one model on one accelerator.

    Efficiency knobs: kernels never reach datasheet peaks. ``flops_efficiency`` (default 0.7)
    is the fraction of dense peak FLOP/s a good GEMM sustains; ``bandwidth_efficiency``
    (default 0.8) the fraction of HBM bandwidth a streaming read sustains;
    ``pcie_efficiency`` (default 1.0) the same for host copies. ``step_overhead`` overrides
    the hardware's fixed per-step cost. ``kv_cache_dtype`` ("int8" | "fp8" | ...) stores the KV
    in that type: KV read and written per step and KV capacity follow it, weights do not.
    """

    def __init__(
        self,
        hardware: Union[str, HardwareSpec] = "H100-SXM",
        model: Union[str, ModelSpec, Mapping, Any] = "llama-2-7b",
        *,
        flops_efficiency: float = 0.7,
        bandwidth_efficiency: float = 0.8,
        pcie_efficiency: float = 1.0,
        step_overhead: Optional[float] = None,
        kv_cache_dtype: Optional[str] = None,
    ):
        for k, v in (
            ("flops_efficiency", flops_efficiency),
            ("bandwidth_efficiency", bandwidth_efficiency),
            ("pcie_efficiency", pcie_efficiency),
        ):
            if not 0 < v <= 1:
                raise ValueError(f"RooflineCostModel.{k}={v!r}: must be in (0, 1]")
        self.hardware = get_hardware(hardware)
        self.model = get_model_spec(model)
        if kv_cache_dtype not in (None, "auto"):
            self.model = self.model.with_kv_cache_dtype(kv_cache_dtype)
        if step_overhead is not None:
            if step_overhead < 0:
                raise ValueError(f"RooflineCostModel.step_overhead={step_overhead!r}: must be >= 0")
            self.hardware = replace(self.hardware, step_overhead=float(step_overhead))
        self.flops_efficiency = flops_efficiency
        self.bandwidth_efficiency = bandwidth_efficiency
        self.pcie_efficiency = pcie_efficiency
        self.kv_bytes_per_token = self.model.kv_bytes_per_token
        self.name = f"roofline({self.hardware.name}, {self.model.name})"

    # --- the pieces, exposed so a notebook can show them ---------------------------------
    @property
    def flops_per_s(self) -> float:
        return self.hardware.peak_flops * self.flops_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.hardware.hbm_bandwidth * self.bandwidth_efficiency

    def step_flops(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        """2 * params per new token + 4 * layers * heads * head_dim per (query, key) pair.

        Causal: the j-th of q new tokens (positions c-q .. c-1) attends to c-q+j+1 keys,
        so a request has q*(c-q) + q*(q+1)/2 pairs.
        """
        m = self.model
        tokens = sum(num_new_tokens)
        pairs = sum(q * (c - q) + q * (q + 1) / 2 for q, c in zip(num_new_tokens, context_lens))
        return 2.0 * m.num_params * tokens + 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs

    def step_bytes(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        """Weights once (shared by the batch) + KV read (each context) + KV written (new tokens)."""
        if sum(num_new_tokens) == 0:
            return 0.0
        kv = self.model.kv_bytes_per_token
        return float(self.model.weight_bytes + kv * sum(context_lens) + kv * sum(num_new_tokens))

    def breakdown(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> dict:
        """Everything ``step_time`` computes, as a dict (for tables and plots)."""
        _check_batch(num_new_tokens, context_lens)
        flops = self.step_flops(num_new_tokens, context_lens)
        nbytes = self.step_bytes(num_new_tokens, context_lens)
        compute, memory = flops / self.flops_per_s, nbytes / self.bytes_per_s
        empty = sum(num_new_tokens) == 0
        comm = 0.0 if empty else self.allreduce_time(sum(num_new_tokens))
        return {
            "flops": flops,
            "bytes": nbytes,
            "compute_time": compute,
            "memory_time": memory,
            "overhead": 0.0 if empty else self.hardware.step_overhead,
            "bound": "idle" if empty else ("compute" if compute > memory else "memory"),
            "arithmetic_intensity": flops / nbytes if nbytes else 0.0,
            "allreduce_time": comm,
            "time": 0.0 if empty else max(compute, memory) + comm + self.hardware.step_overhead,
        }

    def allreduce_time(self, num_tokens: int) -> float:
        """Tensor parallelism's communication in one step of ``num_tokens`` new tokens: two
        all-reduces per layer (after attention's output projection, after the MLP's down
        projection), each of the activations, ``num_tokens x hidden x dtype_bytes``, over the
        hardware's ``link``. 0 on one GPU or with ``link=None`` (ideal TP). Not overlapped
        with compute: it adds to the step."""
        hw = self.hardware
        if hw.link is None or hw.tp_size <= 1 or num_tokens <= 0:
            return 0.0
        m = self.model
        act = num_tokens * m.hidden_size * m.dtype_bytes
        return 2 * m.num_layers * hw.link.allreduce_time(act, hw.tp_size)

    # --- the interface -----------------------------------------------------------------
    def step_time(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        """Seconds for one forward over the batch; 0 for an empty batch (nothing runs).

        ``breakdown``'s ``"time"``, the same arithmetic as a few sums over the batch (the
        simulator asks this every step)."""
        # The attention pairs, sum of q (c - q) + q (q + 1) / 2, as sum(q c) - (sum(q^2) - sum(q)) / 2:
        # sums the interpreter's built-ins run (exact: integers).
        n = len(num_new_tokens)
        if n and countOf(num_new_tokens, 1) == n:  # decodes only (most steps): every q is 1
            if n != len(context_lens) or min(context_lens) < 1:
                _check_batch(num_new_tokens, context_lens)  # raises, naming the pair
            context = sum(context_lens)
            return self.batch_time(n, context, context)  # pairs: sum(c) - (n - n) / 2
        if (
            n != len(context_lens)
            or min(num_new_tokens, default=0) < 0
            or any(map(operator.lt, context_lens, num_new_tokens))
        ):
            _check_batch(num_new_tokens, context_lens)
        tokens = sum(num_new_tokens)
        if tokens == 0:
            return 0.0
        pairs = (
            sum(map(operator.mul, num_new_tokens, context_lens))
            - (sum(map(operator.mul, num_new_tokens, num_new_tokens)) - tokens) / 2
        )
        return self.batch_time(tokens, sum(context_lens), pairs)

    def decode_step_time(self, num_decodes: int, total_context: int) -> Optional[float]:
        """``step_time`` of a batch of decodes alone, from two totals: ``num_decodes`` requests, one new
        token each, holding ``total_context`` positions of KV in all after the step. Each new token
        attends to its request's whole context, so the attention pairs are ``total_context`` too: a
        decode step's price depends on the batch size and the total context, not on how the context
        is spread. (The simulator prices most steps this way, without a list per request.) None from a
        subclass that prices steps its own way (it overrides ``step_time``): ask that."""
        if type(self).step_time is not RooflineCostModel.step_time:
            return None
        if num_decodes < 0 or total_context < num_decodes:
            raise ValueError(
                f"decode_step_time: need 0 <= num_decodes <= total_context, got "
                f"num_decodes={num_decodes}, total_context={total_context}"
            )
        return self.batch_time(num_decodes, total_context, total_context) if num_decodes else 0.0

    def batch_time(self, tokens: int, context: int, pairs: float) -> float:
        """The roofline of a batch given its totals: new tokens, KV positions after the step, attention pairs
        (``step_time`` and ``decode_step_time`` work the totals out; the simulator's fast path keeps them)."""
        m = self.model
        flops = 2.0 * m.num_params * tokens + 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        nbytes = float(m.weight_bytes + m.kv_bytes_per_token * context + m.kv_bytes_per_token * tokens)
        compute, memory = flops / self.flops_per_s, nbytes / self.bytes_per_s
        return max(compute, memory) + self.allreduce_time(tokens) + self.hardware.step_overhead

    def swap_time(self, num_bytes: int) -> float:
        """Copy ``num_bytes`` of KV over PCIe: M_KV / B_PCIe."""
        return num_bytes / (self.hardware.pcie_bandwidth * self.pcie_efficiency)

    def schedule_time(self, num_running: int, num_waiting: int) -> float:
        """One scheduling pass: a fixed part plus a part linear in the requests it looks at."""
        hw = self.hardware
        return (
            hw.schedule_overhead_base
            + hw.schedule_overhead_per_request * num_running
            + hw.schedule_overhead_per_waiting * num_waiting
        )

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """(HBM * memory_fraction - weights) / KV bytes per position, at least 0."""
        return max_kv_tokens(self.hardware, self.model, memory_fraction)


def get_cost_model(
    spec: Any, model_spec: Union[str, ModelSpec, None] = None, kv_cache_dtype: Optional[str] = None
) -> Optional[CostModel]:
    """Resolve ``EngineConfig.cost_model``.

    * a ``CostModel`` (anything with ``step_time``): returned as is;
    * a hardware preset name (``"H100-SXM"``) or a ``HardwareSpec``: a ``RooflineCostModel``
      for ``model_spec`` (a name in ``MODELS``, a ``ModelSpec``; default "llama-2-7b"), its KV
      stored as ``kv_cache_dtype`` (``EngineConfig.kv_cache_dtype``; None = the model's dtype);
    * a number: ``ConstantStepTime(seconds)``;
    * ``None``: ``None`` (the engine has no modeled clock).
    """
    if spec is None:
        return None
    if isinstance(spec, CostModel) or (callable(getattr(spec, "step_time", None)) and not isinstance(spec, type)):
        return spec
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return ConstantStepTime(float(spec))
    if isinstance(spec, (str, HardwareSpec)):
        if isinstance(spec, str) and not any(k.lower() == spec.lower() for k in HARDWARE):
            raise ValueError(
                f"cost_model={spec!r}: unknown hardware preset; choose one of "
                f"{sorted(HARDWARE)}, a CostModel object, a number of seconds per "
                f"step, or None"
            )
        return RooflineCostModel(
            spec, model_spec if model_spec is not None else "llama-2-7b", kv_cache_dtype=kv_cache_dtype
        )
    raise ValueError(
        f"cost_model={spec!r}: expected a CostModel, a hardware preset name "
        f"({sorted(HARDWARE)}), a number of seconds per step, or None"
    )


def engine_cost_model(config, model_spec: ModelSpec) -> Optional[CostModel]:
    """The engine's cost model: ``EngineConfig.cost_model`` for ``model_spec``, an H100 roofline when
    the clock is modeled or ``preemption_mode="auto"`` needs one without it, else None."""
    if config.cost_model is None and config.clock != "modeled" and config.preemption_mode != "auto":
        return None
    spec = config.cost_model if config.cost_model is not None else "H100-SXM"
    return get_cost_model(spec, model_spec, kv_cache_dtype=config.kv_cache_dtype)


_num_new_tokens, _num_computed_before = attrgetter("num_new_tokens"), attrgetter("num_computed_before")


def modeled_step_time(
    cm, out, num_running: int, num_waiting: int, swap_bytes: int, after_idle: bool = False
) -> tuple[float, float, float]:
    """(duration, schedule time, swap time) of one engine step under cost model ``cm``: the forward of
    ``out``'s grants (a ``SchedulerOutput``; ``after_idle``: the engine waited for an arrival before
    it, ``cm.after_idle_time()`` more), the pass that formed it (when it re-formed the batch, over
    ``num_running`` and ``num_waiting`` requests) and the KV copied to or from host memory."""
    grants = out.scheduled
    n = len(grants)
    num_new = list(map(_num_new_tokens, grants))  # each grant's new tokens (map: the reads run in C)
    step, decode_step_time = None, getattr(cm, "decode_step_time", None)
    if decode_step_time is not None and n and countOf(num_new, 1) == n:
        step = decode_step_time(n, sum(map(_num_computed_before, grants)) + n)  # decodes only: two totals
    if step is None:  # and each one's KV length after the step
        step = cm.step_time(num_new, list(map(add, map(_num_computed_before, grants), num_new))) if n else 0.0
    if after_idle and n:
        step += cm.after_idle_time()
    sched = cm.schedule_time(num_running, num_waiting) if out.reformed else 0.0
    swap = cm.swap_time(swap_bytes) if swap_bytes else 0.0
    return step + sched + swap, sched, swap


# =====================================================================================
# The batching-math formulas
# =====================================================================================


def kv_cache_bytes(model: Union[str, ModelSpec], num_tokens: int, batch: int = 1) -> int:
    """M_KV = 2 x n_layer x d_head x n_kv_head x n_max x b x sizeof(dtype)."""
    m = get_model_spec(model)
    return m.kv_bytes_per_token * int(num_tokens) * int(batch)


def max_kv_tokens(
    hardware: Union[str, HardwareSpec], model: Union[str, ModelSpec], memory_fraction: float = 0.9, num_gpus: int = 1
) -> int:
    """KV positions that fit beside the weights: (HBM x fraction - weights) / M_KV per token."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction!r}: must be in (0, 1]")
    hw, m = get_hardware(hardware), get_model_spec(model)
    free = hw.hbm_bytes * num_gpus * memory_fraction - m.weight_bytes
    return max(0, int(free // m.kv_bytes_per_token))


def max_batch_size(
    hardware: Union[str, HardwareSpec],
    model: Union[str, ModelSpec],
    max_len: int,
    memory_fraction: float = 0.9,
    num_gpus: int = 1,
) -> int:
    """How many requests of ``max_len`` positions each fit at once (reserving the full length).

    0 means the weights alone do not fit (Llama-2-70B in bf16 on one 80 GB GPU).
    """
    if max_len < 1:
        raise ValueError(f"max_len={max_len!r}: must be >= 1")
    return max_kv_tokens(hardware, model, memory_fraction, num_gpus) // int(max_len)


def bytes_per_generated_token(model: Union[str, ModelSpec], batch: int, context_len: int = 0) -> float:
    """Memory traffic per generated token in a decode step of ``batch`` requests.

    The weights are read once and shared: weight_bytes / batch (full model / 8 at
    batch 8, full model / 32 at batch 32); each request also reads its own
    ``context_len`` positions of KV, which batching does not share.
    """
    if batch < 1:
        raise ValueError(f"batch={batch!r}: must be >= 1")
    m = get_model_spec(model)
    return m.weight_bytes / batch + m.kv_bytes_per_token * context_len


def decode_step_time_vs_batch(
    cost_model: CostModel, batch_sizes: Sequence[int], context_len: int = 512
) -> tuple[np.ndarray, np.ndarray]:
    """Per-step latency (s) and throughput (generated tokens/s) of decode at each batch size.

    Every request decodes one token with ``context_len`` positions of KV after the step.
    """
    lat = np.array([cost_model.step_time([1] * int(b), [int(context_len)] * int(b)) for b in batch_sizes], dtype=float)
    thr = np.array(batch_sizes, dtype=float) / lat
    return lat, thr


def swap_or_recompute(kv_bytes: float, num_tokens: int, pcie_bandwidth: float, prefill_tokens_per_s: float) -> str:
    """The preemption cost rule: swap when M_KV / B_PCIe < (n_input + n_generated) / S_prefill.

    ``num_tokens`` is n_input + n_generated, what a recompute must prefill again.
    Ties go to "recompute" (it needs no host memory).
    """
    if pcie_bandwidth <= 0 or prefill_tokens_per_s <= 0:
        raise ValueError("pcie_bandwidth and prefill_tokens_per_s must be > 0")
    return "swap" if kv_bytes / pcie_bandwidth < num_tokens / prefill_tokens_per_s else "recompute"
