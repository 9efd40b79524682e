"""Plausible wrong answers to notebook 05's exercises; each must fail tests/graders/ex05_preemption.py.

Each entry: (what the mistake is, old text of solutions/ex05_preemption.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # swap_time / recompute_time
    ("swap_time: bytes times bandwidth", "return kv_bytes / pcie_bandwidth", "return kv_bytes * pcie_bandwidth / 1e18"),
    (
        "swap_time: bandwidth taken as GB/s",
        "return kv_bytes / pcie_bandwidth",
        "return kv_bytes / (pcie_bandwidth * 1e9)",
    ),
    (
        "recompute_time: speed over tokens",
        "return num_tokens / prefill_tokens_per_s",
        "return prefill_tokens_per_s / num_tokens",
    ),
    (
        "recompute_time: one token fewer (the last one is not recomputed)",
        "return num_tokens / prefill_tokens_per_s",
        "return (num_tokens - 1) / prefill_tokens_per_s",
    ),
    # swap_or_recompute
    (
        "rule: a tie goes to swap",
        'return "swap" if swap < recompute else "recompute"',
        'return "swap" if swap <= recompute else "recompute"',
    ),
    (
        "rule: the comparison the wrong way round",
        'return "swap" if swap < recompute else "recompute"',
        'return "swap" if swap > recompute else "recompute"',
    ),
    (
        "rule: delegated to the engine's swap_or_recompute",
        "    swap = swap_time(kv_bytes, pcie_bandwidth)\n",
        "    from minillm.sim.costmodel import swap_or_recompute as engine_rule\n"
        "    return engine_rule(kv_bytes, num_tokens, pcie_bandwidth, prefill_tokens_per_s)\n",
    ),
    (
        "rule: delegated to the engine's cost model",
        "    swap = swap_time(kv_bytes, pcie_bandwidth)\n",
        "    from minillm.sim import costmodel\n"
        "    return costmodel.swap_or_recompute(kv_bytes, num_tokens, pcie_bandwidth, prefill_tokens_per_s)\n",
    ),
    ("rule: always recompute", 'return "swap" if swap < recompute else "recompute"', 'return "recompute"'),
    # LeastProgressVictim.pick_victim
    (
        "least-progress: the most progress",
        "return min(candidates, key=lambda r: (r.num_computed_tokens, -r.admit_seq))",
        "return max(candidates, key=lambda r: (r.num_computed_tokens, r.admit_seq))",
    ),
    (
        "least-progress: ties to the earliest admitted",
        "return min(candidates, key=lambda r: (r.num_computed_tokens, -r.admit_seq))",
        "return min(candidates, key=lambda r: (r.num_computed_tokens, r.admit_seq))",
    ),
    (
        "least-progress: progress measured in generated tokens",
        "return min(candidates, key=lambda r: (r.num_computed_tokens, -r.admit_seq))",
        "return min(candidates, key=lambda r: (r.num_output_tokens, -r.admit_seq))",
    ),
    # PriorityPreemption
    (
        "priority: delegated to the engine's Priority policy",
        [
            (
                "        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))\n",
                "        from minillm.core.policies import Priority\n        return Priority().order_waiting(waiting, now)\n",
            ),
            (
                "        return max(candidates, key=lambda r: (r.priority, r.admit_seq))\n",
                "        from minillm.core.policies import Priority\n        return Priority().pick_victim(candidates, now)\n",
            ),
            (
                "        lower = [r for r in running if r.priority > request.priority]\n"
                "        return self.pick_victim(lower, now) if lower else None\n",
                "        from minillm.core.policies import Priority\n        return Priority(preempt=True).preempt_for(request, running, now)\n",
            ),
        ],
    ),
    (
        "priority: arrival order only",
        "return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))",
        "return sorted(waiting, key=lambda r: r.arrival_time)",
    ),
    (
        "priority: the largest priority value first",
        "return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))",
        "return sorted(waiting, key=lambda r: (-r.priority, r.arrival_time))",
    ),
    (
        "priority: the victim is the most urgent",
        "return max(candidates, key=lambda r: (r.priority, r.admit_seq))",
        "return min(candidates, key=lambda r: (r.priority, -r.admit_seq))",
    ),
    (
        "priority: victim ties to the earliest admitted",
        "return max(candidates, key=lambda r: (r.priority, r.admit_seq))",
        "return max(candidates, key=lambda r: (r.priority, -r.admit_seq))",
    ),
    (
        "priority: a request of the same class may be pushed out",
        "lower = [r for r in running if r.priority > request.priority]",
        "lower = [r for r in running if r.priority >= request.priority]",
    ),
    (
        "priority: never preempts",
        "return self.pick_victim(lower, now) if lower else None\n        ### END SOLUTION\n",
        "return None\n        ### END SOLUTION\n",
    ),
    # headroom_blocks
    (
        "headroom: the blocks of num_steps positions, the partly filled last block ignored",
        "        need += after - held\n",
        "        need += -(-num_steps // block_size)\n",
    ),
    (
        "headroom: floor in place of ceiling",
        "        held = -(-c // block_size)                          # ceil(c / block_size)\n"
        "        after = -(-(c + num_steps) // block_size)           # the blocks it holds num_steps later\n",
        "        held = c // block_size\n        after = (c + num_steps) // block_size\n",
    ),
    (
        "headroom: one step more (the token sampled last counted twice)",
        "        after = -(-(c + num_steps) // block_size)",
        "        after = -(-(c + num_steps + 1) // block_size)",
    ),
    ("headroom: positions, not blocks", "        need += after - held\n", "        need += num_steps\n"),
    (
        "headroom: the largest request's need, not the batch's",
        "        need += after - held\n",
        "        need = max(need, after - held)\n",
    ),
    # swap_recompute_crossover (judgement)
    (
        "crossover: the answer in blocks, not positions",
        "            return n\n    return None\n",
        "            return n // block_size\n    return None\n",
    ),
    (
        "crossover: the wrong side (the longest victim that still swaps)",
        "            return n\n    return None\n",
        "            return n - block_size\n    return None\n",
    ),
    (
        "crossover: a block's KV bytes for every position",
        "if swap_or_recompute(n * cost_model.kv_bytes_per_token, n,",
        "if swap_or_recompute(n * cost_model.kv_bytes_per_token * block_size, n,",
    ),
    (
        "crossover: the prefill speed of a 1024-token prompt at every length",
        "prefill = n / cost_model.step_time([n], [n])",
        "prefill = cost_model.prefill_tokens_per_s()",
    ),
    (
        "crossover: every position tried, not whole blocks",
        "for n in range(block_size, max_tokens + 1, block_size):",
        "for n in range(1, max_tokens + 1):",
    ),
    (
        "crossover: the first victim that swaps",
        'n, pcie_bandwidth, prefill) == "recompute":',
        'n, pcie_bandwidth, prefill) == "swap":',
    ),
    (
        "crossover: max_tokens when swap always wins",
        "            return n\n    return None\n",
        "            return n\n    return max_tokens\n",
    ),
    (
        "crossover: the engine's rule, not yours",
        "        if swap_or_recompute(n * cost_model.kv_bytes_per_token,",
        "        from minillm.sim.costmodel import swap_or_recompute as engine_rule\n"
        "        if engine_rule(n * cost_model.kv_bytes_per_token,",
    ),
]
