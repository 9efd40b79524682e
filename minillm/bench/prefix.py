"""prefix: prefill computed and TTFT with and without automatic prefix caching.

Two traces, each run twice on the shipped model (real forward, wall clock), with
``enable_prefix_caching`` off and on:

* **shared prompt**: every request starts with the same system prompt, then its own
  question (Poisson arrivals);
* **multi-turn**: conversations whose turn k's prompt is turn k-1's prompt + an answer +
  a new user message (one shared system prompt).

"Prefill computed" sums, over every step, the tokens the model ran for requests not yet
decoding (recomputation after preemption included). The *reusable* prefix of a request
is the longest prefix (in whole KV blocks) it shares with an earlier request of the
trace: what a cache could at best serve. The first request of a shared prompt has to
compute it, so at most (n-1)/n of the shared prompt's prefill can be avoided. Requests
admitted in the *same* step cannot share either (a block is cached once its step has
computed it): in the multi-turn trace every conversation's turn 0 arrives at once, so
their common system prompt is computed once per conversation.
"""

from __future__ import annotations

import time

from .common import finish, goal, make_llm, median, pct, pick, progress, set_threads, table

NAME = "prefix"


def _sizes(size: str) -> dict:
    from ..analysis.workloads import Uniform

    return pick(
        size,
        tiny=dict(
            shared=dict(n=4, prefix_len=32, suffix_len=Uniform(4, 8), output_len=4, rate=20.0),
            turns=dict(
                num_conversations=2,
                turns=2,
                system_len=32,
                user_len=Uniform(4, 8),
                answer_len=Uniform(4, 8),
                think_time=0.2,
            ),
        ),
        small=dict(
            shared=dict(n=16, prefix_len=256, suffix_len=Uniform(16, 48), output_len=8, rate=4.0),
            turns=dict(
                num_conversations=4,
                turns=3,
                system_len=128,
                user_len=Uniform(16, 48),
                answer_len=Uniform(16, 32),
                think_time=1.0,
            ),
        ),
        full=dict(
            shared=dict(n=32, prefix_len=512, suffix_len=Uniform(16, 64), output_len=16, rate=4.0),
            turns=dict(
                num_conversations=8,
                turns=4,
                system_len=256,
                user_len=Uniform(16, 64),
                answer_len=Uniform(16, 48),
                think_time=1.5,
            ),
        ),
    )


def reusable_tokens(trace, block_size: int) -> list[int]:
    """Per request: the longest prefix (in whole blocks, leaving the last token to compute)
    it shares with any earlier request of the trace."""
    seen: set[tuple] = set()
    out = []
    for r in sorted(trace, key=lambda r: r.arrival_time):
        ids = r.prompt_token_ids
        full = (len(ids) - 1) // block_size
        k = 0
        while k < full and tuple(ids[: (k + 1) * block_size]) in seen:
            k += 1
        out.append(k * block_size)
        for j in range(1, len(ids) // block_size + 1):
            seen.add(tuple(ids[: j * block_size]))
    return out


def run_trace(trace, caching: bool, device: str, desc: str) -> dict:
    from ..sampling_params import SamplingParams
    from ..analysis.workloads import submit_trace

    llm, label = make_llm(enable_prefix_caching=caching, device=device, max_num_seqs=64, record="summary")
    e = llm.engine
    e.add_request([11, 12, 13, 14], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    e.run()  # warm up (shorter than a block: caches nothing)
    start = e.clock.now()
    for r in trace:  # trace times are relative to now
        r.arrival_time += start
    try:
        ids = submit_trace(e, trace)
    finally:
        for r in trace:
            r.arrival_time -= start
    prefill = 0
    bar = progress(len(trace), desc, "req")
    t0 = time.perf_counter()
    while e.has_unfinished_requests():
        rec = e.step()
        prefill += rec.num_prefill_tokens
        bar.update(len(rec.finished))
    wall = time.perf_counter() - t0
    bar.close()
    ms = [e.requests[i].metrics for i in ids]
    ttft = [m.ttft for m in ms]
    return dict(
        model=label,
        prefix_caching=caching,
        prefill_tokens=prefill,
        prompt_tokens=sum(m.num_prompt_tokens for m in ms),
        cached_tokens=sum(m.num_cached_tokens for m in ms),
        ttft_mean_s=sum(ttft) / len(ttft),
        ttft_p50_s=median(ttft),
        ttft_p90_s=sorted(ttft)[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        hit_rate=e.kv.stats().get("hit_rate"),
        wall_s=wall,
    )


def compare(name: str, trace, device: str, block_size: int = 16, shared_prefix: int = 0) -> tuple[dict, list]:
    off = run_trace(trace, False, device, f"{name}, no cache")
    on = run_trace(trace, True, device, f"{name}, prefix cache")
    reusable = sum(reusable_tokens(trace, block_size))
    avoided = off["prefill_tokens"] - on["prefill_tokens"]
    r = dict(
        off=off,
        on=on,
        reusable_tokens=reusable,
        prefill_avoided=avoided,
        avoided_of_reusable=avoided / reusable if reusable else None,
        prefill_reduction=avoided / off["prefill_tokens"] if off["prefill_tokens"] else None,
        ttft_mean_speedup=off["ttft_mean_s"] / on["ttft_mean_s"] if on["ttft_mean_s"] else None,
    )
    if shared_prefix:
        full_prefix = shared_prefix // block_size * block_size
        r["avoided_of_shared_prefix"] = avoided / (len(trace) * full_prefix)
    rows = [
        [
            f"{name}: {lab}",
            x["prompt_tokens"],
            x["prefill_tokens"],
            x["cached_tokens"],
            x["ttft_mean_s"] * 1e3,
            x["ttft_p50_s"] * 1e3,
            x["ttft_p90_s"] * 1e3,
        ]
        for lab, x in (("off", off), ("on", on))
    ]
    return r, rows


def run(args) -> dict:
    from ..analysis.workloads import multi_turn_trace, shared_prefix_trace

    P = _sizes(args.size)
    threads = set_threads(args)
    s, m = P["shared"], P["turns"]
    V = make_vocab()
    shared = shared_prefix_trace(
        s["n"], s["prefix_len"], s["suffix_len"], s["output_len"], vocab_size=V, rate=s["rate"], seed=args.seed
    )
    turns = multi_turn_trace(
        m["num_conversations"],
        m["turns"],
        m["system_len"],
        m["user_len"],
        m["answer_len"],
        vocab_size=V,
        think_time=m["think_time"],
        seed=args.seed,
    )
    # A burst: every request arrives at once, so most are admitted in the same pass as the first
    # one; they find the prefix because its blocks are registered when they are granted.
    burst = shared_prefix_trace(
        min(s["n"], 16), s["prefix_len"], s["suffix_len"], s["output_len"], vocab_size=V, rate=1e9, seed=args.seed + 1
    )
    r_shared, rows1 = compare("shared prompt", shared, args.device, shared_prefix=s["prefix_len"])
    r_burst, rows3 = compare("shared prompt, burst", burst, args.device, shared_prefix=s["prefix_len"])
    rows1 += rows3
    r_turns, rows2 = compare("multi-turn", turns, args.device)
    label = r_shared["on"]["model"]
    t1 = table(
        [
            "trace: prefix caching",
            "prompt tokens",
            "prefill computed",
            "served from cache",
            "TTFT mean (ms)",
            "TTFT p50 (ms)",
            "TTFT p90 (ms)",
        ],
        rows1 + rows2,
        title=f"{label} on {args.device}, wall clock",
    )
    t2 = table(
        ["trace", "prefill avoided", "of all prefill", "of the reusable prefix", "TTFT mean, off / on"],
        [
            [
                "shared prompt",
                r_shared["prefill_avoided"],
                pct(r_shared["prefill_reduction"]),
                pct(r_shared["avoided_of_reusable"]),
                r_shared["ttft_mean_speedup"],
            ],
            [
                "shared prompt, burst",
                r_burst["prefill_avoided"],
                pct(r_burst["prefill_reduction"]),
                pct(r_burst["avoided_of_reusable"]),
                r_burst["ttft_mean_speedup"],
            ],
            [
                "multi-turn",
                r_turns["prefill_avoided"],
                pct(r_turns["prefill_reduction"]),
                pct(r_turns["avoided_of_reusable"]),
                r_turns["ttft_mean_speedup"],
            ],
        ],
        title="what the cache saved",
    )
    a = r_shared["avoided_of_shared_prefix"]
    goals = [
        goal(
            f"shared prompt's prefill avoided (all {s['n']} requests x {s['prefix_len']} tokens; "
            f"at most {(s['n'] - 1) / s['n']:.0%})",
            ">= 90%",
            pct(a),
            a >= 0.9,
        )
    ]
    cfg = dict(
        model=label,
        device=args.device,
        shared_prompt={k: repr(v) for k, v in s.items()},
        multi_turn={k: repr(v) for k, v in m.items()},
        block_size=16,
        clock="wall",
        torch_threads=threads,
    )
    return dict(
        config=cfg,
        results=dict(shared_prompt=r_shared, shared_prompt_burst=r_burst, multi_turn=r_turns),
        goals=goals,
        _tables=[t1, t2],
    )


def make_vocab() -> int:
    """The vocabulary the traces draw from: the model's (shipped or stand-in)."""
    from .common import SHIPPED_SHAPE, shipped_model_available

    if shipped_model_available():
        from transformers import AutoConfig
        from ..model.loader import DEFAULT_MODEL_DIR

        return AutoConfig.from_pretrained(DEFAULT_MODEL_DIR).vocab_size
    return SHIPPED_SHAPE["vocab_size"]


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
