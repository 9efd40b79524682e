"""Exercises of notebook 03b, "The scheduler under load": the arithmetic of chunked prefill, of
scheduling every N steps and of goodput, and one judgement question, each held against numbers worked
by hand and against what the engine does on the same requests.

* ``chunk_sizes`` and ``worst_decode_stall``: chunked prefill, and the longest a decoding request
  waits between two tokens while a long prompt is prefilled (section 1);
* ``schedule_every_tradeoff``: what scheduling every N steps saves and what it costs (section 2);
* ``goodput``: requests served within their latency SLOs per second, rejected ones failing (section 3);
* ``largest_queue_cap`` (a judgement question): the longest queue that still gets its first tokens
  out within the TTFT target, found by running the simulator (section 3).

Each docstring states the contract (what comes in, what goes out, an example); notebook 03b's
exercise cells have optional hints. Check your work with

    make grade EX=03b           # or: MINILLM_IMPL=exercises pytest -m ex03b tests/test_exercises.py
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

__all__ = ["chunk_sizes", "worst_decode_stall", "schedule_every_tradeoff", "goodput", "largest_queue_cap"]


# =====================================================================================
# Exercise 1: chunked prefill, the worst decode stall
# =====================================================================================

def chunk_sizes(prompt_len: int, num_decoding: int, token_budget: int) -> list[int]:
    """The chunks a prompt of ``prompt_len`` tokens is prefilled in, step by step, beside
    ``num_decoding`` requests that decode throughout (section 1, chunked prefill).

    Each step has ``token_budget`` tokens (the execution-token budget). Running requests are
    served first, one token each; the prompt gets what is left, up to what remains of it.
    Raise ``ValueError`` naming ``token_budget`` if nothing is left for the prompt.

    >>> chunk_sizes(2000, 10, 512)        # 512 - 10 = 502 tokens a step: 3 full chunks and the rest
    [502, 502, 502, 494]
    """
    ### BEGIN SOLUTION
    room = token_budget - num_decoding
    if room < 1:
        raise ValueError(f"token_budget={token_budget!r}: no room for a prompt chunk beside "
                         f"{num_decoding} decoding requests")
    full, rest = divmod(prompt_len, room)
    return [room] * full + ([rest] if rest else [])
    ### END SOLUTION


def worst_decode_stall(step_time, prompt_len: int, decode_context_lens: Sequence[int], token_budget: int) -> float:
    """The longest gap between two tokens of a decoding request while a prompt of ``prompt_len``
    tokens is prefilled in chunks beside it: the longest of the prefill's steps, in seconds.

    ``step_time(num_new_tokens, context_lens)``: a cost model's step time (e.g.
    ``RooflineCostModel(...).step_time``), one entry per request in the step: its new tokens and
    its positions with KV *after* the step. ``decode_context_lens``: the positions each decoding
    request holds before the prefill's first step; every prefill step adds one to each (they
    decode throughout). The prompt's chunks are ``chunk_sizes(prompt_len, len(decode_context_lens),
    token_budget)``; after chunk i its positions are the sum of chunks 0..i (attention over the
    earlier chunks too). Each step lists the decoding requests first, then the chunk.

    >>> toy = lambda new, ctx: sum(n * c for n, c in zip(new, ctx))   # a cost in arbitrary units
    >>> worst_decode_stall(toy, 10, [10, 20], 6)   # chunks 4, 4, 2: steps of 48, 66 and 56 units
    66
    """
    ### BEGIN SOLUTION
    d = len(decode_context_lens)
    worst, done = 0, 0
    for i, chunk in enumerate(chunk_sizes(prompt_len, d, token_budget)):
        done += chunk
        t = step_time([1] * d + [chunk], [c + i + 1 for c in decode_context_lens] + [done])
        worst = max(worst, t)
    return worst
    ### END SOLUTION


# =====================================================================================
# Exercise 2: scheduling every N steps
# =====================================================================================

def schedule_every_tradeoff(n: int, step_time: float, pass_time: float) -> dict:
    """What re-forming the batch only every ``n`` steps saves, and what it costs (section 2).

    The engine (``schedule_every=n``) runs a scheduling pass at the start of steps 0, n, 2n, ...;
    a pass adds ``pass_time`` seconds to its step, and every step's forward takes ``step_time``.
    Only a pass admits waiting requests and releases finished ones. Return a dict:

    * ``"overhead"``: time spent in passes as a fraction of forward time, pass_time / (n step_time);
    * ``"longest_hold"``: the longest a request that has produced its last token (at the end of
      some step) stays in the batch before the next pass releases it, in seconds;
    * ``"longest_admission_wait"``: the longest a newcomer waits for the pass that admits it, in
      seconds, on an engine that is busy decoding: it arrives just after a pass has started
      (the bound that arrivals approach, not reach).

    Raise ``ValueError`` naming ``n`` if it is below 1.

    >>> t = schedule_every_tradeoff(5, 0.015, 0.0005)     # 15 ms steps, a 0.5 ms pass, every 5 steps
    >>> round(t["overhead"], 5), round(t["longest_hold"], 4), round(t["longest_admission_wait"], 4)
    (0.00667, 0.06, 0.0755)
    """
    ### BEGIN SOLUTION
    if n < 1:
        raise ValueError(f"n={n!r}: schedule every n >= 1 steps")
    return dict(overhead=pass_time / (n * step_time),
                longest_hold=(n - 1) * step_time,
                longest_admission_wait=n * step_time + pass_time)
    ### END SOLUTION


# =====================================================================================
# Exercise 3: goodput under SLOs, with load shedding
# =====================================================================================

def goodput(requests: Sequence[tuple[float, Sequence[float]]], slo_ttft: float, slo_tpot: float) -> dict:
    """Goodput as the notebooks measure it (SLO-meeting throughput) of one run: how many requests
    per second were served within both latency SLOs. (DistServe, Zhong et al. 2024, calls goodput the
    highest arrival rate at which a target share of requests meets the SLOs: a sweep of such runs.)

    ``requests``: one ``(arrival_time, token_times)`` pair per request that arrived, with the
    times (seconds) at which each of its output tokens came out; an empty ``token_times`` is a
    request the engine turned away (load shedding) or never served. A request meets the SLOs if

    * its TTFT, first token time - arrival time, is at most ``slo_ttft``, and
    * its TPOT, (last token time - first token time) / (number of tokens - 1), is at most
      ``slo_tpot``; a request with a single token has no TPOT and passes this one.

    Return ``dict(goodput=..., attainment=...)``: requests meeting both SLOs per second of the
    run, from the first arrival to the last token of any request; and their share of *all*
    requests, turned-away ones counting as failures.

    >>> goodput([(0.0, [0.5, 0.6, 0.7]), (0.2, [2.8, 2.9]), (0.4, [])], slo_ttft=2.0, slo_tpot=0.1)
    {'goodput': 0.3448275862068966, 'attainment': 0.3333333333333333}
    """
    ### BEGIN SOLUTION
    good = 0
    for arrival, times in requests:
        if not times or times[0] - arrival > slo_ttft:
            continue
        if len(times) > 1 and (times[-1] - times[0]) / (len(times) - 1) > slo_tpot:
            continue
        good += 1
    start = min(arrival for arrival, _ in requests)
    end = max(times[-1] for _, times in requests if times)
    return dict(goodput=good / (end - start), attainment=good / len(requests))
    ### END SOLUTION


# =====================================================================================
# Exercise 4 (judgement): the largest queue cap for a TTFT target
# =====================================================================================

def largest_queue_cap(run: Callable[[int], Mapping[str, Any]], slo_ttft: float, max_cap: int) -> int:
    """The largest queue cap (``max_queue_len``, 1 to ``max_cap``) at which the requests the
    engine accepts still get their first token within ``slo_ttft`` seconds at the 99th
    percentile: section 3's cap, found by running the simulator rather than by a rule of thumb.

    ``run(cap)`` serves the workload with that cap and returns ``metrics.summarize``'s dict; its
    ``"ttft_p99"`` counts the accepted requests only (rejected ones get no first token). A
    longer queue never shortens the wait, so the caps that meet the target are 1 up to some
    largest one: find it by bisection, running at most ceil(log2(max_cap + 1)) caps (each run is
    a whole simulation). A TTFT p99 equal to ``slo_ttft`` meets it. Return 0 when even a cap of 1
    misses.

    >>> p99 = {1: 0.4, 2: 0.9, 3: 1.6, 4: 2.3, 5: 3.1}     # TTFT p99 (s) of the accepted requests, by cap
    >>> largest_queue_cap(lambda cap: {"ttft_p99": p99[cap]}, slo_ttft=2.0, max_cap=5)
    3
    """
    ### BEGIN SOLUTION
    lo, hi = 0, max_cap + 1             # invariant: cap lo meets the target (0: vacuously), cap hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid)["ttft_p99"] <= slo_ttft:
            lo = mid
        else:
            hi = mid
    return lo
    ### END SOLUTION
