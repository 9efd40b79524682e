"""Plausible wrong answers to notebook 01's exercises; each must fail tests/graders/ex01_batching.py.

Each entry: (what the mistake is, old text of solutions/ex01_batching.py, new text), or
(what, [(old, new), ...]) for a mistake that touches several lines.

Not listed: counting free slots from the requests that get tokens (``len(plan)``) instead of all
running ones. Under plan_step's rule a running request gets 0 tokens only once the budget is
spent, and then no waiting request can be admitted either, so no input tells the two apart.
"""

MUTANTS = [
    # kv_cache_bytes
    ("kv: forgets the 2 (one K and one V)", "per_token = 2 * model.num_layers", "per_token = model.num_layers"),
    (
        "kv: counts the query heads, not the KV heads (GQA)",
        "model.head_dim * model.num_kv_heads * model.dtype_bytes",
        "model.head_dim * model.num_heads * model.dtype_bytes",
    ),
    ("kv: ignores the batch", "return per_token * int(num_tokens) * int(batch)", "return per_token * int(num_tokens)"),
    (
        "kv: delegates to the engine's kv_cache_bytes",
        "    per_token = 2 * model.num_layers * model.head_dim * model.num_kv_heads * model.dtype_bytes\n"
        "    return per_token * int(num_tokens) * int(batch)",
        "    from minillm.sim.costmodel import kv_cache_bytes as engine_kv\n"
        "    return engine_kv(model, num_tokens, batch)",
    ),
    (
        "kv: uses the engine's ModelSpec.kv_bytes_per_token",
        "    per_token = 2 * model.num_layers * model.head_dim * model.num_kv_heads * model.dtype_bytes\n",
        "    per_token = model.kv_bytes_per_token\n",
    ),
    # max_batch_size
    (
        "batch: negative when the weights do not fit (no 0)",
        "positions = max(0, int(free // per_token))",
        "positions = int(free // per_token)",
    ),
    (
        "batch: ignores memory_fraction",
        "free = hardware.hbm_bytes * memory_fraction - model.weight_bytes",
        "free = hardware.hbm_bytes - model.weight_bytes",
    ),
    (
        "batch: forgets the weights",
        "free = hardware.hbm_bytes * memory_fraction - model.weight_bytes",
        "free = hardware.hbm_bytes * memory_fraction",
    ),
    (
        "batch: delegates to the engine's max_batch_size",
        "    free = hardware.hbm_bytes * memory_fraction - model.weight_bytes\n",
        "    from minillm.sim.costmodel import max_batch_size as engine_mbs\n"
        "    return engine_mbs(hardware, model, max_len, memory_fraction)\n",
    ),
    ("batch: rounds the request count up", "return positions // int(max_len)", "return -(-positions // int(max_len))"),
    # decode_step_time
    (
        "roofline: adds compute and memory time instead of taking the max",
        "return max(compute, memory) + hardware.step_overhead",
        "return compute + memory + hardware.step_overhead",
    ),
    (
        "roofline: forgets the fixed step overhead",
        "return max(compute, memory) + hardware.step_overhead",
        "return max(compute, memory)",
    ),
    (
        "roofline: forgets the new token's KV write",
        "nbytes = float(model.weight_bytes + kv * b * c + kv * b)",
        "nbytes = float(model.weight_bytes + kv * b * c)",
    ),
    (
        "roofline: weights read once per request",
        "nbytes = float(model.weight_bytes + kv * b * c + kv * b)",
        "nbytes = float(model.weight_bytes * b + kv * b * c + kv * b)",
    ),
    (
        "roofline: attention FLOPs over the KV heads",
        "4.0 * model.num_layers * model.num_heads * model.head_dim * b * c",
        "4.0 * model.num_layers * model.num_kv_heads * model.head_dim * b * c",
    ),
    (
        "roofline: ignores the efficiency knobs",
        "compute = flops / (hardware.peak_flops * flops_efficiency)",
        "compute = flops / hardware.peak_flops",
    ),
    (
        "roofline: delegates to the engine's RooflineCostModel",
        "    b, c = int(batch), int(context_len)\n",
        "    from minillm.sim.costmodel import RooflineCostModel\n"
        "    return RooflineCostModel(hardware, model, flops_efficiency=flops_efficiency,\n"
        "                             bandwidth_efficiency=bandwidth_efficiency).step_time([1] * batch,\n"
        "                                                                                 [context_len] * batch)\n",
    ),
    # completion_times
    (
        "times: continuous frees a slot one step late",
        "heapq.heappush(free_at, steps[i])",
        "heapq.heappush(free_at, steps[i] + 1)",
    ),
    (
        "times: static returns each request when it finishes, not with its batch",
        "                steps[i] = end\n",
        "                steps[i] = start + n[i]\n",
    ),
    ("times: static starts every batch at 0", "            start = end\n", "            pass\n"),
    (
        "times: continuous ignores max_num_seqs (everyone runs at once)",
        "free_at = [0] * min(max_num_seqs, len(n))",
        "free_at = [0] * len(n)",
    ),
    # plan_step
    (
        "plan: running requests' new tokens do not take free KV",
        "        budget -= n\n        free -= n\n    num_running = len(running)",
        "        budget -= n\n    num_running = len(running)",
    ),
    (
        "plan: the waiting loop ignores the running requests' slots",
        "    num_running = len(running)\n",
        "    num_running = 0\n",
    ),
    (
        "plan: a waiting request that does not fit is skipped, later ones still admitted",
        "        if n > free:\n            break",
        "        if n > free:\n            continue",
    ),
    (
        "plan: no chunked prefill (a prompt that does not fit the budget waits)",
        "        n = min(num_tokens, budget)\n        if n > free:",
        "        n = num_tokens\n        if n > budget:\n            break\n        if n > free:",
    ),
    (
        "plan: every running request gets one token (no next prompt chunk)",
        "n = min(num_tokens - computed, budget)",
        "n = min(1, budget)",
    ),
    (
        "plan: a 0-token running request stays in the plan",
        "        if n <= 0:\n            continue\n        plan[rid] = n",
        "        plan[rid] = n",
    ),
]
