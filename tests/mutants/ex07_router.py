"""Plausible wrong answers to notebook 07's exercises; each must fail tests/graders/ex07_router.py.

Each entry: (what the mistake is, old text of solutions/ex07_router.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # prefix_key
    (
        "key: every full block, not the first prefix_blocks",
        "    full = min(prefix_blocks, len(prompt_token_ids) // block_size)\n",
        "    full = len(prompt_token_ids) // block_size\n",
    ),
    (
        "key: a trailing partial block included",
        "    head = list(prompt_token_ids[:full * block_size]) if full else list(prompt_token_ids)\n",
        "    head = list(prompt_token_ids[:prefix_blocks * block_size])\n",
    ),
    (
        "key: the last blocks, not the first",
        "    head = list(prompt_token_ids[:full * block_size]) if full else list(prompt_token_ids)\n",
        "    head = list(prompt_token_ids[-full * block_size:]) if full else list(prompt_token_ids)\n",
    ),
    (
        "key: prefix_blocks read as tokens",
        "    full = min(prefix_blocks, len(prompt_token_ids) // block_size)\n",
        "    full = min(prefix_blocks // block_size, len(prompt_token_ids) // block_size)\n",
    ),
    # route_on_ring
    (
        "ring: a point equal to the key is skipped (bisect_right)",
        "    start = bisect.bisect_left([p for p, _ in ring], key)\n",
        "    start = bisect.bisect_right([p for p, _ in ring], key)\n",
    ),
    (
        "ring: the walk starts at the ring's first point, whatever the key",
        "    start = bisect.bisect_left([p for p, _ in ring], key)\n",
        "    start = 0\n",
    ),
    (
        "ring: no wrap-around past the last point",
        "        replica = ring[(start + j) % len(ring)][1]\n",
        "        replica = ring[min(start + j, len(ring) - 1)][1]\n",
    ),
    ("ring: no load bound", "        if loads[replica] <= bound:\n", "        if True:\n"),
    (
        "ring: a replica exactly at the bound is passed over",
        "        if loads[replica] <= bound:\n",
        "        if loads[replica] < bound:\n",
    ),
    (
        "ring: the bound taken against the largest load, not the mean",
        "load_factor * sum(loads) / len(loads)",
        "load_factor * max(loads)",
    ),
    (
        "ring: an overloaded replica sends to the least loaded, not the next on the ring",
        "        if loads[replica] <= bound:\n            return replica\n",
        "        return replica if loads[replica] <= bound else min(range(len(loads)), key=lambda i: (loads[i], i))\n",
    ),
    (
        "ring: load_factor inf times an idle fleet's mean (0) gives nan, and nothing is within it",
        "    bound = math.inf if load_factor == math.inf else load_factor * sum(loads) / len(loads)\n",
        "    bound = load_factor * sum(loads) / len(loads)\n",
    ),
    # the KV transfer
    (
        "transfer: the latency forgotten",
        "    return latency + num_tokens * kv_bytes_per_token / bandwidth\n",
        "    return num_tokens * kv_bytes_per_token / bandwidth\n",
    ),
    (
        "transfer: bandwidth read as bits per second",
        "    return latency + num_tokens * kv_bytes_per_token / bandwidth\n",
        "    return latency + 8 * num_tokens * kv_bytes_per_token / bandwidth\n",
    ),
    (
        "break-even: the latency not taken out of the budget",
        "    if budget < latency:\n        return 0\n    n = int((budget - latency) * bandwidth // kv_bytes_per_token)\n",
        "    return int(budget * bandwidth // kv_bytes_per_token)\n    n = 0\n",
    ),
    (
        "break-even: the float quotient truncated, never checked against the definition",
        "    while kv_transfer_time(n + 1, kv_bytes_per_token, bandwidth, latency) <= budget:   # float rounding\n",
        "    while False:\n",
    ),
    (
        "break-even: rounded up (one token past the budget)",
        "    return n\n    ### END SOLUTION\n\n\n# =====",
        "    return n + 1\n    ### END SOLUTION\n\n\n# =====",
    ),
]
