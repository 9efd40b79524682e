"""Exercises of notebook 01, "Batching math": memory, the roofline, static vs continuous batching,
and how the scheduler forms one step's batch.

Each function says which passage of the seeds it implements. Write the part marked
``raise NotImplementedError`` in ``exercises/ex01_batching.py`` and check it with

    make grade EX=01            # or: MINILLM_IMPL=exercises pytest -m ex01 tests/test_exercises.py

The graders hold your answers against the engine itself: the cost model's numbers, and what
the real scheduler does on the same requests.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from minillm.costmodel import HardwareSpec, ModelSpec

__all__ = ["kv_cache_bytes", "max_batch_size", "decode_step_time", "completion_times", "plan_step"]


# =====================================================================================
# Exercise 1: the KV-cache memory formula
# =====================================================================================

def kv_cache_bytes(model: ModelSpec, num_tokens: int, batch: int = 1) -> int:
    """Bytes of KV cache that ``batch`` requests of ``num_tokens`` positions each occupy.

    The seeds' formula (Request Scheduling and Batching, "Memory Constraints"):

        M_KV = 2 x n_layer x d_head x n_head x n_max x b x sizeof(dtype)

    The 2 is one K and one V vector. Under grouped-query attention only the *KV* heads are
    stored, so n_head is ``model.num_kv_heads``. Use ``model.num_layers``, ``model.head_dim``,
    ``model.num_kv_heads`` and ``model.dtype_bytes``.

    >>> from minillm.costmodel import MODELS
    >>> kv_cache_bytes(MODELS["llama-2-7b"], 4096)      # 32 layers, 32 KV heads of 128, bf16
    2147483648
    """
    ### BEGIN SOLUTION
    per_token = 2 * model.num_layers * model.head_dim * model.num_kv_heads * model.dtype_bytes
    return per_token * int(num_tokens) * int(batch)
    ### END SOLUTION


# =====================================================================================
# Exercise 2: what that does to the maximum batch
# =====================================================================================

def max_batch_size(hardware: HardwareSpec, model: ModelSpec, max_len: int,
                   memory_fraction: float = 0.9) -> int:
    """How many requests of ``max_len`` positions fit in the KV cache at once.

    The engine may use ``memory_fraction`` of the GPU's memory (``hardware.hbm_bytes``); the
    weights (``model.weight_bytes``) come out of that first, and the rest holds KV. Each
    request is given room for all ``max_len`` positions (no paging yet). Return 0 when the
    weights alone do not fit. ("In practice, the batch size is rarely limited by how many
    compute units can be filled; its upper bound is typically constrained by GPU memory.")

    Use integer arithmetic on whole KV positions: first how many positions fit
    (rounded down), then how many requests of ``max_len`` positions (rounded down).
    """
    ### BEGIN SOLUTION
    free = hardware.hbm_bytes * memory_fraction - model.weight_bytes
    per_token = kv_cache_bytes(model, 1)
    positions = max(0, int(free // per_token))
    return positions // int(max_len)
    ### END SOLUTION


# =====================================================================================
# Exercise 3: one decode step on the roofline
# =====================================================================================

def decode_step_time(model: ModelSpec, hardware: HardwareSpec, batch: int, context_len: int, *,
                     flops_efficiency: float = 0.7, bandwidth_efficiency: float = 0.8) -> float:
    """Seconds for one decode step: ``batch`` requests each generate one token and hold
    ``context_len`` positions of KV *after* the step (the new token's included).

    A step takes as long as the slower of its arithmetic and its memory traffic, plus a fixed
    overhead (the roofline):

        time  = max(flops / (hardware.peak_flops * flops_efficiency),
                    bytes / (hardware.hbm_bandwidth * bandwidth_efficiency))
                + hardware.step_overhead
        flops = 2 * model.num_params * batch                              # every weight, once per token
              + 4 * model.num_layers * model.num_heads * model.head_dim * batch * context_len
                                                                          # QK^T and PV over the context
        bytes = model.weight_bytes                                        # read once, shared by the batch
              + kv_bytes_per_token * batch * context_len                  # each request reads its own KV
              + kv_bytes_per_token * batch                                # and writes its new token's

    (``kv_bytes_per_token`` is ``kv_cache_bytes(model, 1)``.) At small batches the weight read
    dominates and does not grow with the batch: that is why batching decode is nearly free.
    """
    ### BEGIN SOLUTION
    b, c = int(batch), int(context_len)
    kv = kv_cache_bytes(model, 1)
    flops = 2.0 * model.num_params * b + 4.0 * model.num_layers * model.num_heads * model.head_dim * b * c
    nbytes = float(model.weight_bytes + kv * b * c + kv * b)
    compute = flops / (hardware.peak_flops * flops_efficiency)
    memory = nbytes / (hardware.hbm_bandwidth * bandwidth_efficiency)
    return max(compute, memory) + hardware.step_overhead
    ### END SOLUTION


# =====================================================================================
# Exercise 4: static vs continuous batching, the seeds' worked exercise
# =====================================================================================

def completion_times(output_lens: Sequence[int], max_num_seqs: int, step_time: float = 0.010,
                     batching: str = "continuous") -> list[float]:
    """When each request is returned, in seconds, under ``batching`` ("static" or "continuous").

    The seeds' exercise: 10 requests arrive together, 8 generate 100 tokens and 2 generate
    1000, each step takes 10 ms whatever the batch. Assume, as there:

    * every request arrives at t = 0, in list order, and is served first come, first served;
    * at most ``max_num_seqs`` requests run in one step; the token budget and the KV cache
      never stop an admission;
    * a request that generates n tokens runs for exactly n steps (its first step is its
      prefill, which already produces its first token), one token per step;
    * every step takes ``step_time`` seconds.

    **Continuous**: a request that finishes at the end of a step frees its slot, and the next
    waiting request runs from the very next step. It is returned when it finishes.
    **Static**: the first ``max_num_seqs`` requests form a batch that runs until its longest
    member finishes; every member is returned then, together; only then does the next batch
    (the next ``max_num_seqs`` requests) start.

    Returns one time per request, in the order of ``output_lens``.

    >>> completion_times([100] * 8 + [1000] * 2, max_num_seqs=10, batching="static")[0]
    10.0
    """
    if batching not in ("static", "continuous"):
        raise ValueError(f"batching={batching!r}: must be 'static' or 'continuous'")
    ### BEGIN SOLUTION
    n = [int(x) for x in output_lens]
    steps = [0] * len(n)
    if batching == "static":
        start = 0
        for g in range(0, len(n), max_num_seqs):
            group = range(g, min(g + max_num_seqs, len(n)))
            end = start + max(n[i] for i in group)
            for i in group:
                steps[i] = end
            start = end
    else:
        free_at = [0] * min(max_num_seqs, len(n))      # the step from which each slot is free
        heapq.heapify(free_at)
        for i, length in enumerate(n):
            start = heapq.heappop(free_at)
            steps[i] = start + length
            heapq.heappush(free_at, steps[i])
    return [s * step_time for s in steps]
    ### END SOLUTION


# =====================================================================================
# Exercise 5: forming one step's batch (Figures 2 and 3)
# =====================================================================================

def plan_step(running: Sequence[tuple[str, int, int]], waiting: Sequence[tuple[str, int]],
              token_budget: int, free_kv_positions: int, max_num_seqs: int) -> dict[str, int]:
    """Which requests run in the next step, and how many new tokens each processes.

    The seeds' Figure 2 ("How the scheduler forms a batch") with Figure 3's two checks:
    tokens processed in this execution (the *execution-token budget*) and KV retained after it.

    * ``running``: ``(request_id, num_tokens, num_computed_tokens)`` for each running request,
      in running order. ``num_tokens`` is prompt + generated so far; ``num_computed_tokens``
      how many of those already have KV. A decoding request has exactly one token without KV
      (the one it sampled last step); a request whose long prompt was split has more.
    * ``waiting``: ``(request_id, num_tokens)`` for each waiting request, in FCFS order; none
      of its tokens has KV yet.
    * ``token_budget``: the most new tokens this step may process, all requests together.
    * ``free_kv_positions``: free KV positions (a paged cache of block size 1: a request that
      processes n new tokens needs n more positions).
    * ``max_num_seqs``: the most requests running at once.

    The rule (one rule for prefill and decode alike):

    1. Running requests first, in order: each gets ``min(tokens without KV, budget left)``
       new tokens (a decode gets 1; a split prompt gets its next chunk). One that would get
       0 tokens (budget spent) is left out of this step. Assume their KV positions are
       available (the graders avoid steps where they are not).
    2. Then waiting requests, in FCFS order. Stop at the first one that cannot be admitted
       (later ones wait behind it). One is admitted if there is a free slot
       (``max_num_seqs``), budget left, and KV room for what it processes now; it processes
       ``min(num_tokens, budget left)`` (a prefill that does not fit the budget is split:
       *chunked prefill*).

    Returns ``{request_id: num_new_tokens}`` for every request in the step.

    >>> plan_step([("B", 7, 6)], [("C", 6), ("D", 3)], token_budget=8, free_kv_positions=18,
    ...           max_num_seqs=2)
    {'B': 1, 'C': 6}
    """
    ### BEGIN SOLUTION
    plan: dict[str, int] = {}
    budget, free = int(token_budget), int(free_kv_positions)
    for rid, num_tokens, computed in running:
        n = min(num_tokens - computed, budget)
        if n <= 0:
            continue
        plan[rid] = n
        budget -= n
        free -= n
    num_running = len(running)
    for rid, num_tokens in waiting:
        if num_running >= max_num_seqs or budget <= 0:
            break
        n = min(num_tokens, budget)
        if n > free:
            break
        plan[rid] = n
        budget -= n
        free -= n
        num_running += 1
    return plan
    ### END SOLUTION
