"""Plausible wrong answers to notebook 06's exercises; each must fail tests/graders/ex06_speculative.py.

Each entry: (what the mistake is, old text of solutions/ex06_speculative.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # accept_greedy
    ("greedy: no bonus token when every guess is accepted",
     "    return list(draft[:a]) + [int(target[a])]\n", "    return list(draft[:a]) + ([int(target[a])] if a < k else [])\n"),
    ("greedy: no correction at a mismatch",
     "    return list(draft[:a]) + [int(target[a])]\n", "    return list(draft[:a]) + ([int(target[a])] if a == k else [])\n"),
    ("greedy: the correction is the rejected guess itself",
     "    return list(draft[:a]) + [int(target[a])]\n",
     "    return list(draft[:a]) + [int(draft[a]) if a < k else int(target[a])]\n"),
    ("greedy: keeps every guess that matches, past the first mismatch",
     "    return list(draft[:a]) + [int(target[a])]\n",
     "    kept = [d for d, t in zip(draft, target) if d == t]\n    return kept + [int(target[len(kept)])]\n"),
    # accept_sampled
    ("sampled: acceptance test the wrong way round (u * px < qx)",
     "if float(torch.rand((), generator=generator)) * qx < px:", "if float(torch.rand((), generator=generator)) * px < qx:"),
    ("sampled: the correction drawn from p, not from the residual",
     "            residual = (p[j] - q[j]).clamp_min(0.0)", "            residual = p[j].clone()"),
    ("sampled: with q None the rejected guess keeps its mass",
     "            residual = p[j].clone()\n            residual[x] = 0.0", "            residual = p[j].clone()"),
    ("sampled: the bonus token drawn from the last guess's row",
     "return list(draft) + [int(torch.multinomial(p[k], 1, generator=generator))]",
     "return list(draft) + [int(torch.multinomial(p[k - 1], 1, generator=generator))]"),
    ("sampled: the correction is the residual's argmax (no draw)",
     "        tok = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))",
     "        tok = int(residual.argmax())"),
    ("sampled: one random number drawn for all guesses",
     [("    k = len(draft)\n    for j, x in enumerate(draft):\n        px = float(p[j, x])",
       "    k = len(draft)\n    u = float(torch.rand((), generator=generator))\n    for j, x in enumerate(draft):\n        px = float(p[j, x])"),
      ("if float(torch.rand((), generator=generator)) * qx < px:", "if u * qx < px:")]),
    ("sampled: q used even when a row's guess is certain (q None read as uniform)",
     "qx = 1.0 if q is None else float(q[j, x])", "qx = 1.0 / p.shape[1] if q is None else float(q[j, x])"),
    ("sampled: the rejected guess is emitted too",
     "        return list(draft[:j]) + [tok]", "        return list(draft[:j + 1]) + [tok]"),
]
