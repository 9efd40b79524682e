"""Sizing the KV cache: the bytes of one block, how many blocks the memory holds, and whether they fit.

One formula for a block's bytes, the model's shape (``ModelSpec.kv_block_bytes``: layers x KV heads x head size
x K and V, plus a draft's KV in the same block); the engine sizes and checks its cache with it before allocating.
"""

from __future__ import annotations

import math
import os

from typing import TYPE_CHECKING, Optional

from .model.loader import host_memory_bytes

if TYPE_CHECKING:
    import torch

# (torch and the speculator's sizes are imported where a model's KV is sized: a simulation needs neither)

# Host memory the block tables take per block (Block objects, free lists), a generous bound.
BOOKKEEPING_BYTES_PER_BLOCK = 512


def bytes_per_block(config, model_spec, cost_model, dtype: Optional[torch.dtype]) -> int:
    """Bytes one block of the target's KV takes: the model's shape (``ModelSpec.kv_block_bytes``),
    or in the simulator the cost model's shape when it has one (a 70B modeled on a tiny model)."""
    cm = cost_model
    if not config.runs_model and getattr(cm, "kv_bytes_per_token", 0):
        return cm.kv_bytes_per_token * config.block_size  # the cost model's shape (70B)
    elt = 4 if config.runs_model and dtype is not None and dtype.itemsize == 4 else 2  # float32, or 16 bits
    # values (1 byte for int8/fp8) and their per-block scales
    return model_spec.kv_block_bytes(config.block_size, elt, config.kv_cache_dtype)


def available_kv_bytes(cfg, device: Optional[torch.device]) -> int:
    """``EngineConfig.gpu_memory_utilization`` u (vLLM's): of the device's memory, the share u this engine
    may fill, less what is in use already (the weights, loaded by now, and anything else on the device):
    ``u * total - (total - free)``. On the CPU the device is host memory (free = MemAvailable). Unlike
    vLLM, no forward pass is profiled first: the activations of a step are not set aside."""
    if device is not None and device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
    else:
        total, free = host_memory_bytes(), host_available_bytes()
    return int(cfg.gpu_memory_utilization * total) - (total - free)


def host_available_bytes() -> int:
    """Host memory a new allocation can take without swapping (MemAvailable in /proc/meminfo; the
    free pages where that file is missing)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return host_memory_bytes()


def num_swap_blocks_from_memory(cfg, model_spec, cost_model, dtype: Optional[torch.dtype]) -> int:
    """``EngineConfig.swap_space`` (GiB of host memory, vLLM's) as a number of swap blocks."""
    return int(cfg.swap_space * 2**30) // bytes_per_block(cfg, model_spec, cost_model, dtype)


def num_blocks_from_memory(
    cfg, model_spec, cost_model, dtype: Optional[torch.dtype], device: Optional[torch.device] = None
) -> int:
    """``EngineConfig.num_kv_blocks=None``: as many blocks as ``kv_cache_memory_gb`` holds (or, when
    ``gpu_memory_utilization`` is set, ``available_kv_bytes``; a draft's KV shares each block), never
    more than ``max_num_seqs`` requests at ``max_model_len`` need; in the simulator, what the cost model's
    GPU memory (its share ``gpu_memory_utilization``, 0.9 unless set) leaves beside the weights."""
    cm = cost_model
    if not cfg.runs_model and cm is not None and hasattr(cm, "kv_capacity_tokens"):
        share = cfg.gpu_memory_utilization
        blocks = (cm.kv_capacity_tokens() if share is None else cm.kv_capacity_tokens(share)) // cfg.block_size
        if blocks < 1:
            raise ValueError(
                f"cost_model={cm.name}: the weights leave no memory for a KV cache; "
                "model more GPUs, e.g. RooflineCostModel(minillm.sim.simulated."
                "tensor_parallel('H100-SXM', 4), ...), or set num_kv_blocks"
            )
        return blocks
    per_block = bytes_per_block(cfg, model_spec, cm, dtype)
    if cfg.runs_model:  # a draft's KV shares each block
        from .spec.speculative import draft_kv_bytes_per_block

        per_block += draft_kv_bytes_per_block(cfg, dtype)
    if cfg.gpu_memory_utilization is None:
        by_memory = int(cfg.kv_cache_memory_gb * 2**30) // per_block
    else:
        have = available_kv_bytes(cfg, device)
        by_memory = max(0, have) // per_block
        if by_memory < 1:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization={cfg.gpu_memory_utilization}: leaves "
                f"{have / 2**30:.2f} GiB of {device or 'host'} memory for the KV cache, less than one "
                f"block ({per_block:,} bytes); raise it or set num_kv_blocks"
            )
    enough = cfg.max_num_seqs * math.ceil(cfg.max_model_len / cfg.block_size) + 1
    return max(1, min(by_memory, enough))


def check_kv_fits(
    cfg, num_blocks: int, model_spec, cost_model, dtype: Optional[torch.dtype], device: Optional[torch.device]
) -> None:
    """Before anything is allocated: the KV cache (and the swap space) must fit in memory,
    else a ValueError naming the field, the bytes needed and the bytes there are."""
    field = (
        f"EngineConfig.num_kv_blocks={cfg.num_kv_blocks}"
        if cfg.num_kv_blocks is not None
        else f"EngineConfig.gpu_memory_utilization={cfg.gpu_memory_utilization}"
        if cfg.gpu_memory_utilization is not None
        else f"EngineConfig.kv_cache_memory_gb={cfg.kv_cache_memory_gb}"
    )
    host = (num_blocks + cfg.num_swap_blocks) * BOOKKEEPING_BYTES_PER_BLOCK
    on_device = 0
    if cfg.runs_model:
        from .spec.speculative import draft_kv_bytes_per_block

        per_block = bytes_per_block(cfg, model_spec, cost_model, dtype)
        on_device = num_blocks * (per_block + draft_kv_bytes_per_block(cfg, dtype))
        host += cfg.num_swap_blocks * per_block
    checks = []
    if on_device and device is not None and device.type == "cuda":
        import torch

        try:
            free = torch.cuda.mem_get_info(device)[0]
        except (RuntimeError, AssertionError):
            free = None
        if free is not None:
            checks.append((on_device, free, f"{device} (free)"))
    else:
        host += on_device
    checks.append((host, host_memory_bytes(), "host memory"))
    for need, have, where in checks:
        if need > have:
            raise ValueError(
                f"{field}: {num_blocks} KV blocks"
                f"{f' + {cfg.num_swap_blocks} swap blocks' if cfg.num_swap_blocks else ''} need "
                f"{need:,} bytes ({need / 2**30:.1f} GiB), more than the {have:,} bytes "
                f"({have / 2**30:.1f} GiB) of {where}; lower num_kv_blocks (or the swap pool: num_swap_blocks, "
                f"swap_space)"
            )
