"""EngineConfig: every knob of the engine in one flat, validated dataclass.

The field names are a contract: notebooks, widgets, exercises and benchmarks all
configure the engine through them, e.g. ``LLM(block_size=1, num_kv_blocks=24)``.
Each field carries a comment in the notebooks' vocabulary.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from .checks import as_bool, as_int, as_real, as_seed
from .core.preemption import PREEMPTION_MODES
from .executor import EXECUTORS
from minillm_kernels.kv_formats import KV_FORMATS


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"EngineConfig.{name}={value!r}: {why}")


# vLLM's other names for the dtypes (its ``--dtype`` choices), read as minillm's.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}

# vLLM settings that mean nothing on this engine: accepted, and what that means logged once per process.
_NO_EFFECT = {
    "enforce_eager": "minillm never captures CUDA graphs, so every step already runs eagerly",
    "trust_remote_code": "minillm runs only its own model code and never a checkpoint's (a model whose config "
    "or tokenizer needs remote code is still refused)",
}
_logged: set[str] = set()


def _log_no_effect(name: str) -> None:
    if name not in _logged:
        _logged.add(name)
        logging.getLogger("minillm").warning("EngineConfig.%s=True is accepted: %s", name, _NO_EFFECT[name])


def dtype_name(value: Any) -> Any:
    """``EngineConfig.dtype`` in minillm's words: vLLM's aliases ("half", "float") and torch dtypes
    (``torch.float16``) become "float16", "float32", ...; anything else is returned as it is."""
    if isinstance(value, str):
        return DTYPE_ALIASES.get(value, value)
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).replace("torch.", "")
    return value


def _cuda_index(device: str) -> bool:
    """``"cuda:0"``, ``"cuda:1"``, ...: a CUDA device by index."""
    return re.fullmatch(r"cuda:\d+", device) is not None


KV_CACHE_MEMORY_GB = 0.25


@dataclass
class EngineConfig:
    # --- paged KV cache -------------------------------------------------------
    block_size: int = 16  # token positions per KV block (a "page")
    num_kv_blocks: Optional[int] = None  # KV capacity in blocks; None = size from memory
    kv_cache_memory_gb: float = KV_CACHE_MEMORY_GB  # memory budget used when num_kv_blocks is None
    gpu_memory_utilization: Optional[float] = None  # vLLM's: the share (0, 1] of the device's memory this
    # engine may fill; the KV cache gets what that leaves beside
    # the weights and whatever else is in use (kv_sizing.py).
    # Sizes the cache in place of kv_cache_memory_gb; None = not used
    kv_allocation: str = "paged"  # "paged" (blocks on demand) | "reserved" (max-length reservation)
    enable_prefix_caching: bool = False  # automatic prefix caching (hash of full blocks)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "int8" | "fp8": quantized KV
    # (a format of minillm_kernels.kv_formats.KV_FORMATS),
    # one scale per (block, KV head); ~2x the blocks of fp16
    kv_quantizer: Any = None  # the int8/fp8 store's arithmetic: an object with new_scale,
    # quantize and dequantize (notebook 02's exercise plugs its own
    # in here; torch backend only); None = minillm_kernels.kv_quant
    watermark: float = 0.0  # fraction of blocks admission keeps free ("headroom")
    kv_manager: Optional[Callable] = None  # factory(config, num_blocks) -> a KV manager (the exercises'
    # allocators plug in here); None = minillm.core.kv_cache.make_kv_manager
    block_pool: Optional[Callable] = None  # factory(num_blocks, enable_caching) -> the built-in paged manager's
    # block pool (exercise 04's pool plugs in here; caching still follows
    # enable_prefix_caching; a kv_manager factory may read it or not);
    # None = core.block_pool.BlockPool

    # --- the batch of one step ---------------------------------------------------
    max_num_seqs: int = 64  # most requests in one step's batch
    max_num_batched_tokens: int = 2048  # the execution-token budget of one step
    max_model_len: int = 1024  # longest prompt + output a request may reach
    enable_chunked_prefill: bool = True  # split a prompt larger than the remaining budget
    batching: str = "continuous"  # "continuous" (re-form every step) | "static"
    schedule_every: int = 1  # re-form the batch only every N steps
    interference: str = "chunked"  # "chunked" | "prefill-priority" | "decode-priority"

    # --- preemption ----------------------------------------------------------------
    preemption_mode: str = "recompute"  # a name in core/preemption.PREEMPTION_MODES, or "auto" (the cost rule)
    num_swap_blocks: int = 0  # host-memory pool for swapped-out blocks
    swap_space: Optional[float] = None  # vLLM's: that pool given in GiB instead (the engine turns it
    # into num_swap_blocks); swap is used by preemption_mode
    # "swap" or "auto"; None = num_swap_blocks decides

    # --- policy, admission control --------------------------------------------------
    policy: Any = "fcfs"  # "fcfs" | "sjf" | "priority" | "mlfq" | "fair" | a Policy object
    max_queue_len: Optional[int] = None  # load shedding: reject arrivals beyond this queue length
    max_queue_delay: Optional[float] = None  # reject requests that waited longer than this (seconds)

    # --- execution -------------------------------------------------------------------
    executor: str = "model"  # "model" (real forward) | "simulated" (placeholder tokens):
    # the kinds minillm/executor.py declares (EXECUTORS)
    device: str = "cpu"  # "cpu" | "cuda" | "auto"
    dtype: str = "float32"  # "float32" | "float16" | "bfloat16" | "auto"; vLLM's names
    # "half", "float" and torch dtypes are read as these. "auto" is
    # bfloat16 on a GPU, float32 on the CPU (vLLM's "auto" follows
    # the checkpoint: name the dtype to match a vLLM run exactly)
    attention_backend: str = "torch"  # "torch" | "triton" | "auto" (triton on CUDA; on the CPU "cpu"
    # when its kernel compiles, else torch) | "cpu" (a C kernel
    # reading the paged KV in place, fused layers; float32)
    seed: int = 0  # seeds the random model and default sampling
    tensor_parallel_size: int = 1  # ranks (processes) that split every layer's heads and MLP
    # (Megatron style, minillm/worker/tp_executor.py); 1 = one device
    enforce_eager: bool = False  # vLLM's "no CUDA graphs": minillm never captures graphs, so
    # every step runs eagerly either way (True is logged once)
    trust_remote_code: bool = False  # vLLM's "run the checkpoint's own Python code": minillm runs
    # only its own Llama code and never a checkpoint's (True is
    # logged once)

    # --- time --------------------------------------------------------------------------
    clock: str = "wall"  # "wall" (measured) | "modeled" (cost model) | "cpu" (this process's CPU time)
    cost_model: Any = None  # a CostModel object, a hardware preset name, or None

    # --- speculative decoding ------------------------------------------------------------
    speculative_model: Optional[str] = None  # checkpoint dir | "default-draft" | "ngram" | None
    num_speculative_tokens: int = 0  # k tokens proposed per step
    acceptance_rule: Optional[Callable] = None  # verify(logits, draft, q, params, sampler, request_id)
    # -> accepted tokens; None = minillm.spec.acceptance.verify

    # --- the random model used when model="random" ----------------------------------------
    random_model: dict = field(default_factory=dict)  # overrides for the tiny random Llama

    # --- what each step records (StepRecord) --------------------------------------------------
    record: str = "auto"  # "full" (with the per-block KV map the widgets draw) |
    # "summary" (KV totals and per-request KV, no block map) |
    # "totals" (KV totals only: simulate(records="summary")) |
    # "none" (no KV snapshot, no history, no running or swapped
    # ids, no reason for those queued behind the first left waiting)
    # | "auto" (full up to 256 KV blocks, else summary)
    record_history: Optional[int] = 5000  # StepRecords kept in engine.step_records (None = all)
    record_max_waiting: Optional[int] = 64  # waiting requests given a reason per record (None = all)
    phase_clock: Optional[Callable[[], float]] = None  # e.g. time.process_time: StepRecord.phase_times
    # holds each phase's host time on it; None = not timed

    def __post_init__(self) -> None:
        self._check_record_options()
        own = "EngineConfig"
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "schedule_every",
            "tensor_parallel_size",
        ):
            setattr(self, name, as_int(own, name, getattr(self, name), 1))
        self.num_kv_blocks = as_int(own, "num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        self.num_swap_blocks = as_int(own, "num_swap_blocks", self.num_swap_blocks, 0)
        self.num_speculative_tokens = as_int(own, "num_speculative_tokens", self.num_speculative_tokens, 0)
        self.max_queue_len = as_int(own, "max_queue_len", self.max_queue_len, 0, optional=True)
        self.seed = as_seed(own, "seed", self.seed)
        self.watermark = as_real(own, "watermark", self.watermark, 0.0, 1.0, high_open=True)
        self.kv_cache_memory_gb = as_real(own, "kv_cache_memory_gb", self.kv_cache_memory_gb, 0.0, low_open=True)
        self.max_queue_delay = as_real(own, "max_queue_delay", self.max_queue_delay, 0.0, optional=True)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "trust_remote_code"):
            setattr(self, name, as_bool(own, name, getattr(self, name)))
        self.dtype = dtype_name(self.dtype)
        self._check_vllm_sizes()
        choices = {
            "kv_allocation": ("paged", "reserved"),
            "batching": ("continuous", "static"),
            "interference": ("chunked", "prefill-priority", "decode-priority"),
            "preemption_mode": (*PREEMPTION_MODES, "auto"),
            "executor": tuple(EXECUTORS),
            "device": ("cpu", "cuda", "auto"),
            "dtype": ("float32", "float16", "bfloat16", "auto"),
            "kv_cache_dtype": ("auto", *KV_FORMATS),
            "attention_backend": ("torch", "triton", "auto", "cpu"),
            "clock": ("wall", "modeled", "cpu"),
        }
        for name, allowed in choices.items():
            v = getattr(self, name)
            if not isinstance(v, str) or (v not in allowed and not (name == "device" and _cuda_index(v))):
                _fail(
                    name,
                    v,
                    f"must be one of {allowed}"
                    + (" or 'cuda:N'" if name == "device" else "")
                    + (f" (or vLLM's {tuple(DTYPE_ALIASES)}, a torch dtype)" if name == "dtype" else ""),
                )
        self._check_objects()
        if self.kv_allocation == "reserved" and self.enable_prefix_caching:
            _fail(
                "enable_prefix_caching",
                True,
                "prefix caching needs kv_allocation='paged' (a reservation is not made of shareable blocks)",
            )
        if self.kv_cache_dtype != "auto" and self.kv_allocation == "reserved":
            _fail(
                "kv_cache_dtype",
                self.kv_cache_dtype,
                "a quantized KV cache needs kv_allocation='paged' (its scales are per block, and a "
                "reservation need not start on a block boundary)",
            )
        if self.kv_quantizer is not None:
            self._check_kv_quantizer()
        if self.tensor_parallel_size > 1 and not self.runs_model:
            _fail(
                "tensor_parallel_size",
                self.tensor_parallel_size,
                "runs the real model on that many processes (executor='model'); the simulator "
                "models tensor parallelism through its cost model (minillm.sim.simulated.tensor_parallel)",
            )
        if self.speculative_model is not None and not self.runs_model:
            _fail(
                "speculative_model",
                self.speculative_model,
                f"speculative decoding needs a model to propose and verify: executor={self.executor!r} has "
                "none (executor='model'; for the simulator, see minillm.spec.speculative.expected_speedup)",
            )
        if self.speculative_model is not None and self.num_speculative_tokens < 1:
            _fail("num_speculative_tokens", self.num_speculative_tokens, "must be >= 1 when speculative_model is set")
        for name in _NO_EFFECT:  # every value checked: say what a no-effect setting means
            if getattr(self, name):
                _log_no_effect(name)

    @property
    def runs_model(self) -> bool:
        """Does this engine compute logits (``EXECUTORS[executor].runs_model``)? Text, logprobs, speculative
        decoding and the KV cache's real element size need it; the simulator has the model's shape only."""
        return EXECUTORS[self.executor].runs_model

    @classmethod
    def from_fields(cls, owner: str, **fields) -> "EngineConfig":
        """``EngineConfig(**fields)``, naming any field it does not have (``owner``: who was called)."""
        unknown = set(fields) - cls.field_names()
        if unknown:
            raise TypeError(
                f"{owner}: unknown config field(s) {sorted(unknown)}; EngineConfig has {sorted(cls.field_names())}"
            )
        if (
            "gpu_memory_utilization" in fields
            and "kv_cache_memory_gb" in fields
            and fields["gpu_memory_utilization"] is not None
        ):
            _fail(
                "gpu_memory_utilization",
                fields["gpu_memory_utilization"],
                f"and kv_cache_memory_gb={fields['kv_cache_memory_gb']!r} both size the KV cache: set one",
            )
        return cls(**fields)

    def _check_vllm_sizes(self) -> None:
        """vLLM's ways of sizing the KV pools, each beside minillm's own: one of them, never both."""
        own = "EngineConfig"
        self.gpu_memory_utilization = as_real(
            own, "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True, optional=True
        )
        self.swap_space = as_real(own, "swap_space", self.swap_space, 0.0, optional=True)
        if self.gpu_memory_utilization is not None:
            if self.num_kv_blocks is not None:
                _fail(
                    "gpu_memory_utilization",
                    self.gpu_memory_utilization,
                    f"and num_kv_blocks={self.num_kv_blocks} both size the KV cache: set one",
                )
            if self.kv_cache_memory_gb != KV_CACHE_MEMORY_GB:
                _fail(
                    "gpu_memory_utilization",
                    self.gpu_memory_utilization,
                    f"and kv_cache_memory_gb={self.kv_cache_memory_gb} both size the KV cache: set one",
                )
        if self.swap_space is not None and self.num_swap_blocks:
            _fail(
                "swap_space",
                self.swap_space,
                f"and num_swap_blocks={self.num_swap_blocks} both size the swap pool: set one",
            )
        for name in _NO_EFFECT:
            if getattr(self, name):
                _log_no_effect(name)

    def _check_objects(self) -> None:
        """The fields that take a name or an object: policy, cost_model, speculative_model, random_model, and
        the component factories kv_manager, block_pool and acceptance_rule."""
        if isinstance(self.policy, str):
            from .core.policies import POLICIES

            if self.policy.lower() not in POLICIES:
                _fail("policy", self.policy, f"must be one of {sorted(POLICIES)} or a Policy object")
        elif self.policy is None or isinstance(self.policy, (numbers.Number, bytes, list, tuple, dict)):
            _fail("policy", self.policy, "must be a policy name or a Policy object")
        cm = self.cost_model
        if cm is not None:
            from .sim.costmodel import HARDWARE, CostModel, HardwareSpec

            if isinstance(cm, str):
                if not any(k.lower() == cm.lower() for k in HARDWARE):
                    _fail(
                        "cost_model",
                        cm,
                        f"unknown hardware preset; choose one of {sorted(HARDWARE)}, "
                        "a CostModel object, a number of seconds per step, or None",
                    )
            elif isinstance(cm, numbers.Real) and not isinstance(cm, bool):
                as_real("EngineConfig", "cost_model", cm, 0.0)  # seconds per step: finite, >= 0
            elif not (
                isinstance(cm, (CostModel, HardwareSpec))
                or (callable(getattr(cm, "step_time", None)) and not isinstance(cm, type))
            ):
                raise TypeError(
                    f"EngineConfig.cost_model={cm!r}: expected a CostModel, a hardware preset "
                    f"name ({sorted(HARDWARE)}), a number of seconds per step, or None"
                )
        if self.speculative_model is not None and not isinstance(self.speculative_model, (str, os.PathLike)):
            raise TypeError(
                f"EngineConfig.speculative_model={self.speculative_model!r}: must be a "
                "checkpoint directory, 'default-draft', 'ngram' or None"
            )
        for name in ("kv_manager", "block_pool", "acceptance_rule", "phase_clock"):
            v = getattr(self, name)
            if v is not None and not callable(v):
                raise TypeError(f"EngineConfig.{name}={v!r}: must be a callable (see the field's comment) or None")
        if self.block_pool is not None and self.kv_allocation != "paged":
            _fail("block_pool", self.block_pool, "is the paged KV manager's pool: needs kv_allocation='paged'")
        if not isinstance(self.random_model, Mapping):
            raise TypeError(f"EngineConfig.random_model={self.random_model!r}: must be a dict of LlamaConfig fields")
        if self.random_model:
            from .model.loader import RANDOM_MODEL_FIELDS

            unknown = sorted(set(self.random_model) - RANDOM_MODEL_FIELDS, key=str)
            if unknown:
                raise TypeError(
                    f"EngineConfig.random_model: unknown LlamaConfig field(s) {unknown}; "
                    f"it takes {sorted(RANDOM_MODEL_FIELDS)}"
                )

    def _check_kv_quantizer(self) -> None:
        """A quantizer replaces the arithmetic of the torch store (``kernels/kv_store.py``): it needs a
        quantized cache, the torch backend (the Triton kernels have the format compiled in) and one
        process (it is a Python object; tensor-parallel ranks use minillm_kernels.kv_quant's)."""
        q = self.kv_quantizer
        missing = [m for m in ("new_scale", "quantize", "dequantize") if not callable(getattr(q, m, None))]
        if missing:
            raise TypeError(
                f"EngineConfig.kv_quantizer={q!r}: needs callable {', '.join(missing)} "
                "(kernels/kv_quant.py says what each does)"
            )
        if self.kv_cache_dtype == "auto":
            _fail("kv_quantizer", q, f"quantizes a quantized cache: set kv_cache_dtype to one of {sorted(KV_FORMATS)}")
        if self.attention_backend != "torch":
            _fail(
                "kv_quantizer",
                q,
                f"runs in the torch backend's store, so attention_backend must be "
                f"'torch' (not {self.attention_backend!r})",
            )
        if self.tensor_parallel_size > 1:
            _fail("kv_quantizer", q, "needs tensor_parallel_size=1 (ranks use minillm_kernels.kv_quant's format)")

    def _check_record_options(self) -> None:
        if self.record not in ("auto", "full", "summary", "totals", "none"):
            _fail("record", self.record, "must be one of ('auto', 'full', 'summary', 'totals', 'none')")
        for name in ("record_history", "record_max_waiting"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                _fail(name, v, "must be an integer >= 0 or None")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
