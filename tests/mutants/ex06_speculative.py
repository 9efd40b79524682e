"""Plausible wrong answers to notebook 06's exercises; each must fail tests/graders/ex06_speculative.py.

Each entry: (what the mistake is, old text of solutions/ex06_speculative.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # accept_greedy
    (
        "greedy: no bonus token when every guess is accepted",
        "    return list(draft[:a]) + [int(target[a])]\n",
        "    return list(draft[:a]) + ([int(target[a])] if a < k else [])\n",
    ),
    (
        "greedy: no correction at a mismatch",
        "    return list(draft[:a]) + [int(target[a])]\n",
        "    return list(draft[:a]) + ([int(target[a])] if a == k else [])\n",
    ),
    (
        "greedy: the correction is the rejected guess itself",
        "    return list(draft[:a]) + [int(target[a])]\n",
        "    return list(draft[:a]) + [int(draft[a]) if a < k else int(target[a])]\n",
    ),
    (
        "greedy: keeps every guess that matches, past the first mismatch",
        "    return list(draft[:a]) + [int(target[a])]\n",
        "    kept = [d for d, t in zip(draft, target) if d == t]\n    return kept + [int(target[len(kept)])]\n",
    ),
    # accept_sampled
    (
        "sampled: acceptance test the wrong way round (u * px < qx)",
        "if float(torch.rand((), generator=generator)) * qx < px:",
        "if float(torch.rand((), generator=generator)) * px < qx:",
    ),
    (
        "sampled: the correction drawn from p, not from the residual",
        "            residual = (p[j] - q[j]).clamp_min(0.0)",
        "            residual = p[j].clone()",
    ),
    (
        "sampled: with q None the rejected guess keeps its mass",
        "            residual = p[j].clone()\n            residual[x] = 0.0",
        "            residual = p[j].clone()",
    ),
    (
        "sampled: the bonus token drawn from the last guess's row",
        "return list(draft) + [int(torch.multinomial(p[k], 1, generator=generator))]",
        "return list(draft) + [int(torch.multinomial(p[k - 1], 1, generator=generator))]",
    ),
    (
        "sampled: the correction is the residual's argmax (no draw)",
        "        tok = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))",
        "        tok = int(residual.argmax())",
    ),
    (
        "sampled: one random number drawn for all guesses",
        [
            (
                "    k = len(draft)\n    for j, x in enumerate(draft):\n        px = float(p[j, x])",
                "    k = len(draft)\n    u = float(torch.rand((), generator=generator))\n    for j, x in enumerate(draft):\n        px = float(p[j, x])",
            ),
            ("if float(torch.rand((), generator=generator)) * qx < px:", "if u * qx < px:"),
        ],
    ),
    (
        "sampled: q used even when a row's guess is certain (q None read as uniform)",
        "qx = 1.0 if q is None else float(q[j, x])",
        "qx = 1.0 / p.shape[1] if q is None else float(q[j, x])",
    ),
    (
        "sampled: the rejected guess is emitted too",
        "        return list(draft[:j]) + [tok]",
        "        return list(draft[:j + 1]) + [tok]",
    ),
    # tokens_per_step
    (
        "tokens: alpha^k in place of alpha^(k+1) (forgets the target's own token)",
        "    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)\n",
        "    return (1.0 - alpha ** k) / (1.0 - alpha)\n",
    ),
    (
        "tokens: counts only the accepted guesses",
        "    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)\n",
        "    return alpha * (1.0 - alpha ** k) / (1.0 - alpha)\n",
    ),
    ("tokens: alpha = 1 divides by zero", "    if alpha == 1.0:\n        return float(k + 1)\n", ""),
    (
        "tokens: alpha = 1 gives k (the bonus token forgotten)",
        "    if alpha == 1.0:\n        return float(k + 1)\n",
        "    if alpha == 1.0:\n        return float(k)\n",
    ),
    (
        "tokens: delegated to the engine's expected_tokens_per_step",
        "    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)\n",
        "    from minillm.spec.speculative import expected_tokens_per_step\n    return expected_tokens_per_step(alpha, k)\n",
    ),
    # speculative_speedup
    (
        "speed-up: the target's forward left out of the cost",
        "    return tokens_per_step(alpha, k) / (k * draft_cost_ratio + 1.0)\n",
        "    return tokens_per_step(alpha, k) / (k * draft_cost_ratio)\n",
    ),
    (
        "speed-up: one draft forward per step, not per guess",
        "    return tokens_per_step(alpha, k) / (k * draft_cost_ratio + 1.0)\n",
        "    return tokens_per_step(alpha, k) / (draft_cost_ratio + 1.0)\n",
    ),
    (
        "speed-up: the draft's cost ignored",
        "    return tokens_per_step(alpha, k) / (k * draft_cost_ratio + 1.0)\n",
        "    return tokens_per_step(alpha, k)\n",
    ),
    (
        "speed-up: k + 1 draft forwards",
        "    return tokens_per_step(alpha, k) / (k * draft_cost_ratio + 1.0)\n",
        "    return tokens_per_step(alpha, k) / ((k + 1) * draft_cost_ratio + 1.0)\n",
    ),
    (
        "speed-up: delegated to the engine's expected_speedup",
        "    return tokens_per_step(alpha, k) / (k * draft_cost_ratio + 1.0)\n",
        "    from minillm.spec import speculative\n    return speculative.expected_speedup(alpha, k, draft_cost_ratio)\n",
    ),
    # first_losing_k (judgement)
    (
        "losing k: one too large",
        "            return k\n    return None\n",
        "            return k + 1\n    return None\n",
    ),
    (
        "losing k: the last k that pays",
        "            return k\n    return None\n",
        "            return k - 1\n    return None\n",
    ),
    (
        "losing k: a speed-up of exactly 1 counted as paying",
        "        if speedup_at(k) <= 1.0:",
        "        if speedup_at(k) < 1.0:",
    ),
    (
        "losing k: where the gain peaks, not where it ends",
        "        if speedup_at(k) <= 1.0:",
        "        if k > 1 and speedup_at(k) <= speedup_at(k - 1):",
    ),
    (
        "losing k: max_k when every k pays",
        "            return k\n    return None\n",
        "            return k\n    return max_k\n",
    ),
    (
        "losing k: k = 0 tried first",
        "    for k in range(1, max_k + 1):\n        if speedup_at",
        "    for k in range(0, max_k + 1):\n        if speedup_at",
    ),
    (
        "losing k: the best k",
        "    for k in range(1, max_k + 1):\n        if speedup_at",
        "    return max(range(1, max_k + 1), key=speedup_at)\n    for k in range(1, max_k + 1):\n        if speedup_at",
    ),
]
