"""Exercises of notebook 05, "Preemption": the recompute-or-swap decision and the choice of victim.

Let M_KV be a preempted request's KV size, n_input its prompt length, n_generated the tokens
it has generated, S_prefill the prefill speed (tokens/s) and B_PCIe the host link's bandwidth.
Bringing it back after a swap takes M_KV / B_PCIe; after a recompute, (n_input + n_generated) /
S_prefill (notebook 05, section 2).

* ``swap_time``, ``recompute_time``, ``swap_or_recompute``: that rule. ``YourCostModel`` (given)
  makes the engine ask *your* rule whenever it preempts with ``preemption_mode="auto"``.
* ``LeastProgressVictim``: which running request gives up its memory when one needs a block.
* ``PriorityPreemption``: priority classes that push a lower class out (the fix for head-of-line
  blocking across priority classes).
* ``headroom_blocks``: the free blocks a running batch grows into over the next steps, the
  headroom that keeps admission from forcing a preemption (thrashing, section 4).
* ``swap_recompute_crossover`` (a judgement question): on a given host link, the shortest victim
  your rule sends to recompute, read off the engine's cost model (section 2's figure).

The policies plug in like any other (``LLM(policy=ex.LeastProgressVictim())``). Each docstring
states the contract; notebook 05's exercise cells have optional hints. The rule is graded with
``minillm.sim.costmodel``'s own version switched off: write it, do not call it. Check your work with

    make grade EX=05            # or: MINILLM_IMPL=exercises pytest -m ex05 tests/test_exercises.py
"""

from __future__ import annotations

from typing import Optional, Sequence

from minillm.sim.costmodel import CostModel, RooflineCostModel
from minillm.core.policies import Policy
from minillm.core.request import Request

__all__ = ["swap_time", "recompute_time", "swap_or_recompute", "YourCostModel", "LeastProgressVictim",
           "PriorityPreemption", "headroom_blocks", "swap_recompute_crossover"]


# =====================================================================================
# Exercise 1: recompute or swap
# =====================================================================================

def swap_time(kv_bytes: float, pcie_bandwidth: float) -> float:
    """Seconds to bring a swapped-out request back: its KV (``kv_bytes``) copied over the
    host link at ``pcie_bandwidth`` bytes/s (M_KV / B_PCIe).

    >>> round(swap_time(1e9, 32e9) * 1e3, 2)     # 1 GB over PCIe 4.0 x16 (32 GB/s), in ms
    31.25
    """
    ### BEGIN SOLUTION
    return kv_bytes / pcie_bandwidth
    ### END SOLUTION


def recompute_time(num_tokens: int, prefill_tokens_per_s: float) -> float:
    """Seconds to rebuild a dropped request's KV: prefill all ``num_tokens`` positions again
    (prompt + tokens generated so far) at ``prefill_tokens_per_s``
    ((n_input + n_generated) / S_prefill).

    >>> recompute_time(2000, 4000.0)             # a 2000-token prefill at 4000 tokens/s, in s
    0.5
    """
    ### BEGIN SOLUTION
    return num_tokens / prefill_tokens_per_s
    ### END SOLUTION


def swap_or_recompute(kv_bytes: float, num_tokens: int, pcie_bandwidth: float,
                      prefill_tokens_per_s: float) -> str:
    """The cost rule: ``"swap"`` when bringing the request back by copying its KV
    (``swap_time``) is strictly faster than prefilling its ``num_tokens`` again
    (``recompute_time``), else ``"recompute"``. A tie goes to recompute: it needs no host
    memory and no copy.

    >>> swap_or_recompute(1e9, 2000, 32e9, 4000.0)    # 31 ms to copy vs 500 ms to prefill
    'swap'
    """
    ### BEGIN SOLUTION
    swap = swap_time(kv_bytes, pcie_bandwidth)
    recompute = recompute_time(num_tokens, prefill_tokens_per_s)
    return "swap" if swap < recompute else "recompute"
    ### END SOLUTION


class YourCostModel(RooflineCostModel):
    """(Given.) The engine's roofline cost model, asking *your* rule when the scheduler preempts
    with ``preemption_mode="auto"``: the victim holds ``num_tokens`` positions of KV, of
    ``kv_bytes_per_token`` bytes each; the host link runs at the hardware's PCIe bandwidth; the
    prefill speed is the roofline's (``prefill_tokens_per_s()``)::

        LLM(model="llama-2-7b", executor="simulated", clock="modeled", preemption_mode="auto",
            num_swap_blocks=..., cost_model=YourCostModel("H100-SXM", "llama-2-7b"))
    """

    def preemption_mode(self, num_tokens: int) -> str:
        return swap_or_recompute(num_tokens * self.kv_bytes_per_token, num_tokens,
                                 self.hardware.pcie_bandwidth * self.pcie_efficiency, self.prefill_tokens_per_s())


# =====================================================================================
# Exercise 2: the victim under memory pressure
# =====================================================================================

class LeastProgressVictim(Policy):
    """First come, first served, except for the choice of victim.

    When a running request needs its next KV block and none is free, the scheduler asks
    ``pick_victim(candidates, now)`` for a running request to preempt (the candidates include
    the one that needs the block). minillm's default gives up the most recently admitted
    request. This policy gives up the one that has made the least progress.
    """
    name = "least-progress"

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        """The candidate holding the fewest positions of KV (``num_computed_tokens``): the least
        work lost if it is recomputed, and the fewest bytes to copy if it is swapped. Ties: the
        most recently admitted (largest ``admit_seq``)."""
        ### BEGIN SOLUTION
        return min(candidates, key=lambda r: (r.num_computed_tokens, -r.admit_seq))
        ### END SOLUTION


# =====================================================================================
# Exercise 3: priority classes that preempt
# =====================================================================================

class PriorityPreemption(Policy):
    """Priority classes: higher-priority requests enter the batch first. A smaller
    ``request.priority`` is more urgent (vLLM's convention: 0 before 1).

    Priority inversion: when a low-priority request already holds the GPU (its KV is allocated)
    and a high-priority request arrives that cannot obtain resources at once, the low-priority
    request must be preempted and its resources released.
    """
    name = "priority-preemption"

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        """Waiting requests by ``(priority, arrival_time)``, smallest first (a new list)."""
        ### BEGIN SOLUTION
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))
        ### END SOLUTION

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        """The least urgent candidate (largest ``priority`` value); among those the most recently
        admitted (largest ``admit_seq``)."""
        ### BEGIN SOLUTION
        return max(candidates, key=lambda r: (r.priority, r.admit_seq))
        ### END SOLUTION

    def preempt_for(self, request: Request, running: list[Request], now: float) -> Optional[Request]:
        """``request`` is waiting and cannot be admitted (no free slot, or no KV memory). Return a
        running request of a strictly *less urgent* class (``priority`` larger than
        ``request.priority``) for the scheduler to preempt, chosen by ``pick_victim``; ``None``
        when every running request is at least as urgent. (The scheduler asks again until the
        request fits or you return None.)"""
        ### BEGIN SOLUTION
        lower = [r for r in running if r.priority > request.priority]
        return self.pick_victim(lower, now) if lower else None
        ### END SOLUTION


# =====================================================================================
# Exercise 4: headroom against thrashing
# =====================================================================================

def headroom_blocks(context_lens: Sequence[int], block_size: int, num_steps: int) -> int:
    """The free KV blocks a batch needs to decode ``num_steps`` more steps without a preemption:
    the headroom admission must leave it (section 4: a cache filled to 100% thrashes).

    ``context_lens``: the positions holding KV of each running request (its
    ``num_computed_tokens``). A request holding c positions holds ceil(c / block_size) blocks
    (the last one perhaps partly filled); each decode step adds one position to every request,
    taking a fresh block whenever the last one is full. No request finishes within the steps.

    >>> headroom_blocks([5, 16, 17], 16, 1)     # only the request with a full last block needs one
    1
    """
    ### BEGIN SOLUTION
    need = 0
    for c in context_lens:
        held = -(-c // block_size)                          # ceil(c / block_size)
        after = -(-(c + num_steps) // block_size)           # the blocks it holds num_steps later
        need += after - held
    return need
    ### END SOLUTION


# =====================================================================================
# Exercise 5 (judgement): where the rule flips on a given link
# =====================================================================================

def swap_recompute_crossover(cost_model: CostModel, pcie_bandwidth: float, block_size: int = 16,
                             max_tokens: int = 16384) -> Optional[int]:
    """The shortest victim, in positions of KV, that your ``swap_or_recompute`` sends to
    recompute on a host link of ``pcie_bandwidth`` bytes/s: where a model's line crosses the
    boundary in section 2's figure.

    A victim holds whole blocks: try n = block_size, 2 block_size, ... up to ``max_tokens``.
    For each n the victim's KV is n x ``cost_model.kv_bytes_per_token`` bytes, and the prefill
    speed is that of one prompt of n tokens on ``cost_model``, n / ``step_time([n], [n])``
    (the figure's speed at that length). Return the first such n (in positions, not blocks),
    or None when swap wins at every length tried.

    >>> from minillm.sim.costmodel import ConstantStepTime     # 10 ms per prefill, 1 MB per position
    >>> swap_recompute_crossover(ConstantStepTime(0.010, kv_bytes_per_token=10**6), 1e9, block_size=4)
    12
    """
    ### BEGIN SOLUTION
    for n in range(block_size, max_tokens + 1, block_size):
        prefill = n / cost_model.step_time([n], [n])
        if swap_or_recompute(n * cost_model.kv_bytes_per_token, n, pcie_bandwidth, prefill) == "recompute":
            return n
    return None
    ### END SOLUTION
