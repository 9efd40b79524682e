"""Exercises of notebook 01, "Batching math": memory, the roofline, static vs continuous batching,
and how the scheduler forms one step's batch.

Each docstring states a contract: what the function is given, what it returns, the rules an
answer must honour, and one worked example. How to get there is yours to work out; notebook
01's exercise cells have optional hints. Write the parts marked ``raise NotImplementedError`` in
``exercises/ex01_batching.py`` and check them with

    make grade EX=01            # or: MINILLM_IMPL=exercises pytest -m ex01 tests/test_exercises.py

The graders hold your answers against the engine itself: the cost model's numbers, and what
the real scheduler does on the same requests. They also use made-up models and hardware, and
switch ``minillm.sim.costmodel``'s own formulas off: calling them is not an answer.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from minillm.sim.costmodel import HardwareSpec, ModelSpec

__all__ = ["kv_cache_bytes", "max_batch_size", "decode_step_time", "completion_times", "plan_step"]


# =====================================================================================
# Exercise 1: the KV-cache memory formula
# =====================================================================================

def kv_cache_bytes(model: ModelSpec, num_tokens: int, batch: int = 1) -> int:
    """Bytes of KV cache that ``batch`` requests of ``num_tokens`` positions each occupy: M_KV,
    the formula of notebook 01, section 3.

    ``model``: only ``model.num_layers``, ``model.head_dim``, ``model.num_kv_heads`` and
    ``model.dtype_bytes`` (bytes per element) count. A ``ModelSpec`` or any object with those
    attributes (the graders also pass made-up shapes). Returns an ``int``.

    Rules: every position of every request keeps, in every layer, one K and one V vector of
    ``head_dim`` elements per *KV* head. Under grouped-query attention several query heads
    share a KV head and only the KV heads are stored (Llama-2-70B: 64 query heads, 8 KV heads).

    >>> from minillm.sim.costmodel import MODELS
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
    """How many requests of ``max_len`` positions fit in the KV cache at once, each given room
    for all ``max_len`` positions up front (no paging yet). ("In practice, the batch size is
    rarely limited by how many compute units can be filled; its upper bound is typically
    constrained by GPU memory.")

    ``hardware.hbm_bytes``: the GPU's memory; ``memory_fraction``: the share of it the engine
    may use. ``model``: its ``weight_bytes`` and its KV shape (as in ``kv_cache_bytes``). Plain
    objects with these attributes will do. Returns an ``int``.

    Rules: the weights come out of the usable memory first and the rest holds KV; only whole
    requests count, each with all ``max_len`` of its positions (round down, never up); 0 when
    the weights alone do not fit, never a negative number.

    >>> from minillm.sim.costmodel import HARDWARE, MODELS
    >>> max_batch_size(HARDWARE["H100-SXM"], MODELS["llama-2-7b"], 2048)   # 72 GB usable, 13.5 GB of weights
    54
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
    """Seconds for one decode step on the roofline: ``batch`` requests each generate one token
    and hold ``context_len`` positions of KV *after* the step (the new token's included).

    ``model``: ``num_params``, ``weight_bytes``, ``num_layers``, ``num_heads``, ``head_dim`` and
    the KV shape of ``kv_cache_bytes``. ``hardware``: ``peak_flops`` (FLOP/s), ``hbm_bandwidth``
    (bytes/s), ``step_overhead`` (s). The efficiencies are the fractions of those peaks a real
    kernel reaches. Plain objects with these attributes will do. Returns seconds (a float).

    Rules (the engine's roofline cost model, which the graders compare with):

    * a step lasts as long as the slower of its arithmetic and its memory traffic, each at its
      *achieved* rate, plus the fixed ``hardware.step_overhead``;
    * arithmetic: 2 FLOPs per weight per generated token, plus attention: each query head
      (``num_heads`` per layer) takes a ``head_dim``-long dot product with each of the
      ``context_len`` keys and a weighted sum of as many values (2 FLOPs per multiply-add);
    * memory: the weights are read once per step, shared by the whole batch; each request
      reads its own ``context_len`` positions of KV and writes its new position's KV.

    At small batches the weight read dominates and does not grow with the batch: that is why
    batching decode is nearly free.

    >>> from minillm.sim.costmodel import HARDWARE, MODELS
    >>> round(decode_step_time(MODELS["llama-2-7b"], HARDWARE["H100-SXM"], 1, 512) * 1e3, 3)   # ms
    5.429
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
# Exercise 4: static vs continuous batching, a worked example
# =====================================================================================

def completion_times(output_lens: Sequence[int], max_num_seqs: int, step_time: float = 0.010,
                     batching: str = "continuous") -> list[float]:
    """When each request is returned, in seconds, under ``batching`` ("static" or "continuous").

    The worked example of notebook 01: 10 requests arrive together, 8 generate 100 tokens and 2
    generate 1000, each step takes 10 ms whatever the batch. Assume, as there:

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
    """Which requests run in the next step, and how many new tokens each processes:
    Figure 2 of notebook 01 (how the scheduler forms a batch) with Figure 3's two checks, tokens processed
    in this execution (the *execution-token budget*) and KV retained after it.

    * ``running``: ``(request_id, num_tokens, num_computed_tokens)`` for each running request,
      in running order. ``num_tokens`` is prompt + generated so far; ``num_computed_tokens``
      how many of those already have KV. A decoding request has exactly one token without KV
      (the one it sampled last step); a request whose long prompt was split has more.
    * ``waiting``: ``(request_id, num_tokens)`` for each waiting request, in FCFS order; none
      of its tokens has KV yet.
    * ``token_budget``: the most new tokens this step may process, all requests together.
    * ``free_kv_positions``: KV positions free *before* this step. A paged cache of block
      size 1: every token any request processes this step takes one of them.
    * ``max_num_seqs``: the most requests running at once.

    Returns ``{request_id: num_new_tokens}`` for every request in the step (none with 0).

    Rules (one rule for prefill and decode alike):

    * Running requests come first, in their order, and each processes as many of its tokens
      without KV as the budget still allows (a decode: 1; a split prompt: its next chunk).
    * Every running request holds its slot under ``max_num_seqs``, including one that gets no
      tokens this step.
    * Then waiting requests, in FCFS order. One is admitted only if a slot is free, budget is
      left and the free KV positions still cover the tokens it processes now; it processes
      as many of its tokens as the budget allows (a prompt longer than that is split:
      *chunked prefill*). The first that cannot be admitted stops admission: those behind it
      wait too, even one that would fit.
    * All requests together never exceed the budget nor the free KV positions.

    The graders only ask about steps in which the running requests' tokens fit the free KV
    (when they do not, the engine preempts someone: notebook 05).

    Figure 3: B decodes (1 token) and C prefills (6), 7 tokens of the 8; D finds no free slot.

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
