"""Plausible wrong answers to notebook 03b's exercises; each must fail tests/graders/ex03b_under_load.py.

Each entry: (what the mistake is, old text of solutions/ex03b_under_load.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.
"""

MUTANTS = [
    # schedule_every_tradeoff
    (
        "every-N: overhead per step, n ignored",
        "dict(overhead=pass_time / (n * step_time),",
        "dict(overhead=pass_time / step_time,",
    ),
    (
        "every-N: overhead as a share of all time, pass included",
        "dict(overhead=pass_time / (n * step_time),",
        "dict(overhead=pass_time / (n * step_time + pass_time),",
    ),
    ("every-N: a finished request held n steps", "longest_hold=(n - 1) * step_time,", "longest_hold=n * step_time,"),
    (
        "every-N: a newcomer waits n - 1 steps",
        "longest_admission_wait=n * step_time + pass_time)",
        "longest_admission_wait=(n - 1) * step_time + pass_time)",
    ),
    (
        "every-N: the pass's own time forgotten in the wait",
        "longest_admission_wait=n * step_time + pass_time)",
        "longest_admission_wait=n * step_time)",
    ),
    (
        "every-N: a pass counted in every step of the wait",
        "longest_admission_wait=n * step_time + pass_time)",
        "longest_admission_wait=n * (step_time + pass_time))",
    ),
    ("every-N: n = 0 accepted", "    if n < 1:\n        raise ValueError", "    if n < 0:\n        raise ValueError"),
    # chunk_sizes
    (
        "chunks: the whole budget for the prompt, decodes not counted",
        "    room = token_budget - num_decoding\n",
        "    room = token_budget\n",
    ),
    (
        "chunks: the last partial chunk dropped",
        "    return [room] * full + ([rest] if rest else [])\n",
        "    return [room] * full\n",
    ),
    (
        "chunks: the last chunk padded to a full one",
        "    return [room] * full + ([rest] if rest else [])\n",
        "    return [room] * (full + (1 if rest else 0))\n",
    ),
    ("chunks: a budget with no room accepted", "    if room < 1:\n", "    if room < 0:\n"),
    # worst_decode_stall
    (
        "stall: the first chunk's step only",
        "        worst = max(worst, t)\n",
        "        worst = max(worst, t)\n        break\n",
    ),
    (
        "stall: the decodes left out of the step",
        "t = step_time([1] * d + [chunk], [c + i + 1 for c in decode_context_lens] + [done])",
        "t = step_time([chunk], [done])",
    ),
    (
        "stall: a chunk attends only to itself",
        "[c + i + 1 for c in decode_context_lens] + [done])",
        "[c + i + 1 for c in decode_context_lens] + [chunk])",
    ),
    (
        "stall: the decoders' contexts do not grow",
        "[c + i + 1 for c in decode_context_lens] + [done])",
        "[c + 1 for c in decode_context_lens] + [done])",
    ),
    (
        "stall: the whole prefill's time, not its longest step",
        "        worst = max(worst, t)\n",
        "        worst = worst + t\n",
    ),
    # goodput
    (
        "goodput: turned-away requests left out of the attainment",
        "attainment=good / len(requests))",
        "attainment=good / sum(1 for _, t in requests if t))",
    ),
    (
        "goodput: a single-token request fails the TPOT SLO",
        "        if len(times) > 1 and (times[-1] - times[0]) / (len(times) - 1) > slo_tpot:",
        "        if len(times) < 2 or (times[-1] - times[0]) / (len(times) - 1) > slo_tpot:",
    ),
    (
        "goodput: TPOT over all tokens, the first included",
        "(times[-1] - times[0]) / (len(times) - 1) > slo_tpot",
        "(times[-1] - arrival) / len(times) > slo_tpot",
    ),
    (
        "goodput: an SLO met exactly counts as missed",
        "if not times or times[0] - arrival > slo_ttft:",
        "if not times or times[0] - arrival >= slo_ttft:",
    ),
    (
        "goodput: the run measured from the first token, not the first arrival",
        "    start = min(arrival for arrival, _ in requests)\n",
        "    start = min(times[0] for _, times in requests if times)\n",
    ),
    (
        "goodput: TPOT as the shortest gap between two tokens",
        "(times[-1] - times[0]) / (len(times) - 1) > slo_tpot",
        "min(b - a for a, b in zip(times, times[1:])) > slo_tpot",
    ),
    (
        "goodput: every served request counts (throughput, not goodput)",
        "        if not times or times[0] - arrival > slo_ttft:\n            continue\n",
        "        if not times:\n            continue\n",
    ),
    # largest_queue_cap (judgement)
    (
        "queue cap: the first cap that misses (the wrong side)",
        "    return lo\n    ### END SOLUTION",
        "    return hi\n    ### END SOLUTION",
    ),
    ("queue cap: the median TTFT", 'if run(mid)["ttft_p99"] <= slo_ttft:', 'if run(mid)["ttft_p50"] <= slo_ttft:'),
    ("queue cap: the p90 TTFT", 'if run(mid)["ttft_p99"] <= slo_ttft:', 'if run(mid)["ttft_p90"] <= slo_ttft:'),
    ("queue cap: the mean TTFT", 'if run(mid)["ttft_p99"] <= slo_ttft:', 'if run(mid)["ttft_mean"] <= slo_ttft:'),
    (
        "queue cap: a TTFT equal to the target misses it",
        'if run(mid)["ttft_p99"] <= slo_ttft:',
        'if run(mid)["ttft_p99"] < slo_ttft:',
    ),
    ("queue cap: max_cap never tried", "    lo, hi = 0, max_cap + 1 ", "    lo, hi = 0, max_cap "),
    (
        "queue cap: a cap of 1 assumed to meet the target",
        "    lo, hi = 0, max_cap + 1 ",
        "    lo, hi = 1, max_cap + 1 ",
    ),
    (
        "queue cap: every cap run, one after another",
        "    lo, hi = 0, max_cap + 1 ",
        '    return max((c for c in range(1, max_cap + 1) if run(c)["ttft_p99"] <= slo_ttft), default=0)\n'
        "    lo, hi = 0, max_cap + 1 ",
    ),
]
