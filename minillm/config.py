"""EngineConfig: every knob of the engine in one flat, validated dataclass.

The field names are a contract: notebooks, widgets, exercises and benchmarks all
configure the engine through them, e.g. ``LLM(block_size=1, num_kv_blocks=24)``.
Each field carries a comment in the notebooks' vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional


def _fail(name: str, value: Any, why: str) -> None:
    raise ValueError(f"EngineConfig.{name}={value!r}: {why}")


@dataclass
class EngineConfig:
    # --- paged KV cache -------------------------------------------------------
    block_size: int = 16                  # token positions per KV block (a "page")
    num_kv_blocks: Optional[int] = None   # KV capacity in blocks; None = size from memory
    kv_cache_memory_gb: float = 0.25      # memory budget used when num_kv_blocks is None
    kv_allocation: str = "paged"          # "paged" (blocks on demand) | "reserved" (max-length reservation)
    enable_prefix_caching: bool = False   # automatic prefix caching (hash of full blocks)
    kv_cache_dtype: str = "auto"          # "auto" (the model's dtype) | "int8" | "fp8": quantized KV,
                                          # one scale per (block, KV head); ~2x the blocks of fp16
    watermark: float = 0.0                # fraction of blocks admission keeps free ("headroom")

    # --- the batch of one step ---------------------------------------------------
    max_num_seqs: int = 64                # most requests in one step's batch
    max_num_batched_tokens: int = 2048    # the execution-token budget of one step
    max_model_len: int = 1024             # longest prompt + output a request may reach
    enable_chunked_prefill: bool = True   # split a prompt larger than the remaining budget
    batching: str = "continuous"          # "continuous" (re-form every step) | "static"
    schedule_every: int = 1               # re-form the batch only every N steps
    interference: str = "chunked"         # "chunked" | "prefill-priority" | "decode-priority"

    # --- preemption ----------------------------------------------------------------
    preemption_mode: str = "recompute"    # "recompute" | "swap" | "auto" (the seeds' cost rule)
    num_swap_blocks: int = 0              # host-memory pool for swapped-out blocks

    # --- policy, admission control --------------------------------------------------
    policy: Any = "fcfs"                  # "fcfs" | "sjf" | "priority" | "mlfq" | "fair" | a Policy object
    max_queue_len: Optional[int] = None   # load shedding: reject arrivals beyond this queue length
    max_queue_delay: Optional[float] = None  # reject requests that waited longer than this (seconds)

    # --- execution -------------------------------------------------------------------
    executor: str = "model"               # "model" (real forward) | "simulated" (placeholder tokens)
    device: str = "cpu"                   # "cpu" | "cuda" | "auto"
    dtype: str = "float32"                # "float32" | "float16" | "bfloat16" | "auto"
    attention_backend: str = "torch"      # "torch" | "triton" | "auto" (triton on CUDA, torch on CPU)
    seed: int = 0                         # seeds the random model and default sampling

    # --- time --------------------------------------------------------------------------
    clock: str = "wall"                   # "wall" (measured) | "modeled" (cost model)
    cost_model: Any = None                # a CostModel object, a hardware preset name, or None

    # --- speculative decoding ------------------------------------------------------------
    speculative_model: Optional[str] = None   # checkpoint dir | "default-draft" | "ngram" | None
    num_speculative_tokens: int = 0           # k tokens proposed per step

    # --- the random model used when model="random" ----------------------------------------
    random_model: dict = field(default_factory=dict)  # overrides for the tiny random Llama

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "schedule_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(name, v, "must be an integer >= 1")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            _fail("num_kv_blocks", self.num_kv_blocks, "must be an integer >= 1 or None")
        if not isinstance(self.num_swap_blocks, int) or self.num_swap_blocks < 0:
            _fail("num_swap_blocks", self.num_swap_blocks, "must be an integer >= 0")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            _fail("num_speculative_tokens", self.num_speculative_tokens, "must be an integer >= 0")
        if not 0.0 <= self.watermark < 1.0:
            _fail("watermark", self.watermark, "must be in [0, 1)")
        if self.kv_cache_memory_gb <= 0:
            _fail("kv_cache_memory_gb", self.kv_cache_memory_gb, "must be > 0")
        choices = {
            "kv_allocation": ("paged", "reserved"),
            "batching": ("continuous", "static"),
            "interference": ("chunked", "prefill-priority", "decode-priority"),
            "preemption_mode": ("recompute", "swap", "auto"),
            "executor": ("model", "simulated"),
            "device": ("cpu", "cuda", "auto"),
            "dtype": ("float32", "float16", "bfloat16", "auto"),
            "kv_cache_dtype": ("auto", "int8", "fp8"),
            "attention_backend": ("torch", "triton", "auto"),
            "clock": ("wall", "modeled"),
        }
        for name, allowed in choices.items():
            v = getattr(self, name)
            if v not in allowed and not (name == "device" and str(v).startswith("cuda:")):
                _fail(name, v, f"must be one of {allowed}")
        if self.kv_allocation == "reserved" and self.enable_prefix_caching:
            _fail("enable_prefix_caching", True,
                  "prefix caching needs kv_allocation='paged' (a reservation is not made of shareable blocks)")
        if self.kv_cache_dtype != "auto" and self.kv_allocation == "reserved":
            _fail("kv_cache_dtype", self.kv_cache_dtype,
                  "a quantized KV cache needs kv_allocation='paged' (its scales are per block, and a "
                  "reservation need not start on a block boundary)")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            _fail("max_queue_len", self.max_queue_len, "must be >= 0 or None")
        if self.max_queue_delay is not None and self.max_queue_delay < 0:
            _fail("max_queue_delay", self.max_queue_delay, "must be >= 0 or None")
        if self.speculative_model is not None and self.num_speculative_tokens < 1:
            _fail("num_speculative_tokens", self.num_speculative_tokens,
                  "must be >= 1 when speculative_model is set")
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size < 1:
            _fail("num_kv_blocks", self.num_kv_blocks, "gives no KV capacity")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < 1:
            _fail("max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @property
    def kv_capacity_tokens(self) -> int:
        """KV capacity in token positions (blocks x block size); needs num_kv_blocks resolved."""
        assert self.num_kv_blocks is not None, "num_kv_blocks is resolved when the engine starts"
        return self.num_kv_blocks * self.block_size
