"""paging: max-length reservation vs paged KV, on one trace and one KV capacity.

Before paging, an engine reserved each request's *maximum* length at admission: its
prompt plus ``max_tokens``, because it cannot know when the request will stop. Here
every request asks for ``max_tokens`` = a cap, and stops earlier, at its trace length
(the simulated executor ends it there, as a model ends at end-of-sequence). Three runs, same trace,
same capacity, simulated executor on a modeled clock:

* **reserved (max_tokens cap)**: what engines did before paging;
* **reserved (exact lengths)**: reservation with an oracle that knows each output
  length (max_tokens = the true length): the best reservation can do;
* **paged**: blocks on demand.

From every ``StepRecord.kv``: KV held but holding nothing (reserved-but-unused positions,
free positions in gaps too small for the next reservation, the empty tail of each
request's last block), concurrent requests, and throughput on the modeled clock.
"""

from __future__ import annotations

import time

from .common import finish, goal, pct, pick, progress, set_threads, table

NAME = "paging"


def _sizes(size: str) -> dict:
    from ..analysis.workloads import LogNormal

    return pick(
        size,
        tiny=dict(
            n=40,
            num_kv_blocks=64,
            max_tokens=128,
            prompt_len=LogNormal(32, 0.6, lo=4, hi=256),
            output_len=LogNormal(24, 1.0, lo=2, hi=128),
        ),
        small=dict(
            n=400,
            num_kv_blocks=1024,
            max_tokens=1024,
            prompt_len=LogNormal(128, 0.8, lo=8, hi=1024),
            output_len=LogNormal(128, 1.0, lo=4, hi=1024),
        ),
        full=dict(
            n=2000,
            num_kv_blocks=2048,
            max_tokens=1024,
            prompt_len=LogNormal(128, 0.8, lo=8, hi=1024),
            output_len=LogNormal(128, 1.0, lo=4, hi=1024),
        ),
    )


def run_one(trace, P: dict, kv_allocation: str, oracle: bool) -> dict:
    from .. import LLM
    from ..sampling_params import SamplingParams

    llm = LLM(
        "llama-2-7b",
        executor="simulated",
        clock="modeled",
        cost_model="H100-SXM",
        kv_allocation=kv_allocation,
        num_kv_blocks=P["num_kv_blocks"],
        block_size=16,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        max_model_len=2048,
        record="summary",
        record_history=0,
        record_max_waiting=8,
    )  # we read KV, not the queue: skip O(queue) reasons/step
    e = llm.engine
    for r in trace:
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len if oracle else P["max_tokens"])
        e.add_request(
            list(r.prompt_token_ids),
            sp,
            request_id=r.request_id,
            arrival_time=r.arrival_time,
            expected_output_len=r.output_len,
        )
    n = dict(
        steps=0,
        dur=0.0,
        conc=0.0,
        peak=0,
        used=0.0,
        reserved_unused=0.0,
        fragmentation=0.0,
        partial=0.0,
        held=0.0,
        total=0,
    )
    bar = progress(len(trace), f"{kv_allocation}{' (exact lengths)' if oracle else ''}", "req")
    t0 = time.perf_counter()
    while e.has_unfinished_requests():
        rec = e.step()
        kv, d = rec.kv, rec.duration
        running = rec.batch_size  # requests holding KV that ran this step
        n["steps"] += 1
        n["dur"] += d
        n["conc"] += running * d  # time-weighted on the modeled clock
        n["peak"] = max(n["peak"], running)
        waste = kv.reserved_unused + kv.fragmentation + kv.partial_waste
        n["used"] += kv.used * d
        n["reserved_unused"] += kv.reserved_unused * d
        n["fragmentation"] += kv.fragmentation * d
        n["partial"] += kv.partial_waste * d
        n["held"] += (kv.used + waste) * d
        n["total"] = kv.total
        bar.update(len(rec.finished))
    wall = time.perf_counter() - t0
    bar.close()
    dur = n["dur"] or 1.0
    out_tokens = sum(e.requests[r.request_id].num_output_tokens for r in trace)
    assert out_tokens == sum(r.output_len for r in trace), "every request should stop at its trace length"
    waste = n["reserved_unused"] + n["fragmentation"] + n["partial"]
    st = e.stats()
    return dict(
        kv_allocation=kv_allocation,
        oracle_lengths=oracle,
        steps=n["steps"],
        modeled_s=e.clock.now(),
        wall_s=wall,
        mean_concurrent=n["conc"] / dur,
        peak_concurrent=n["peak"],
        waste_fraction_of_held=waste / n["held"] if n["held"] else 0.0,
        waste_fraction_of_capacity=waste / (n["total"] * dur),
        reserved_unused_mean=n["reserved_unused"] / dur,
        fragmentation_mean=n["fragmentation"] / dur,
        partial_block_mean=n["partial"] / dur,
        used_fraction_of_capacity=n["used"] / (n["total"] * dur),
        output_tokens=out_tokens,
        output_tok_per_s=out_tokens / e.clock.now(),
        preemptions=st["preemptions_recompute"] + st["preemptions_swap"],
    )


def run(args) -> dict:
    from ..analysis.workloads import synthetic_trace

    P = _sizes(args.size)
    set_threads(args)
    trace = synthetic_trace(
        P["n"], rate=None, prompt_len=P["prompt_len"], output_len=P["output_len"], vocab_size=32000, seed=args.seed
    )
    for r in trace:  # keep the output inside the cap
        r.output_len = min(r.output_len, P["max_tokens"])
    runs = [
        run_one(trace, P, "reserved", oracle=False),
        run_one(trace, P, "reserved", oracle=True),
        run_one(trace, P, "paged", oracle=False),
    ]
    res_cap, res_oracle, paged = runs
    labels = ["reserved (max_tokens cap)", "reserved (exact lengths)", "paged"]
    rows = [
        [
            lab,
            r["peak_concurrent"],
            r["mean_concurrent"],
            pct(r["waste_fraction_of_held"]),
            r["reserved_unused_mean"],
            r["fragmentation_mean"],
            r["partial_block_mean"],
            pct(r["used_fraction_of_capacity"]),
            r["output_tok_per_s"],
            r["output_tok_per_s"] / res_cap["output_tok_per_s"],
            r["preemptions"],
        ]
        for lab, r in zip(labels, runs)
    ]
    cap = P["num_kv_blocks"] * 16
    t = table(
        [
            "KV allocation",
            "peak concurrent",
            "mean concurrent",
            "KV waste (of held)",
            "reserved unused (pos)",
            "fragmentation (pos)",
            "last-block tails (pos)",
            "KV holding tokens",
            "output tok/s (modeled)",
            "x reserved",
            "preemptions",
        ],
        rows,
        title=f"{P['n']} requests at once, {cap:,} KV positions ({P['num_kv_blocks']} blocks of 16), "
        f"max_tokens {P['max_tokens']}, llama-2-7b on modeled H100-SXM (time-weighted means)",
    )
    conc_ratio = paged["mean_concurrent"] / res_cap["mean_concurrent"]
    peak_ratio = paged["peak_concurrent"] / res_cap["peak_concurrent"]
    summary = dict(
        paged_vs_reserved_mean_concurrent=conc_ratio,
        paged_vs_reserved_peak_concurrent=peak_ratio,
        paged_vs_reserved_throughput=paged["output_tok_per_s"] / res_cap["output_tok_per_s"],
        paged_vs_oracle_reserved_mean_concurrent=paged["mean_concurrent"] / res_oracle["mean_concurrent"],
    )
    goals = [
        goal(
            "paged KV waste (reserved-unused + fragmentation + last-block tails, of held)",
            "< 5%",
            pct(paged["waste_fraction_of_held"]),
            paged["waste_fraction_of_held"] < 0.05,
        ),
        goal("paged / reserved mean concurrent requests", ">= 2.5x", conc_ratio, conc_ratio >= 2.5),
    ]
    cfg = dict(
        n=P["n"],
        num_kv_blocks=P["num_kv_blocks"],
        block_size=16,
        kv_positions=cap,
        max_tokens_cap=P["max_tokens"],
        prompt_len=repr(P["prompt_len"]),
        output_len=repr(P["output_len"]),
        model="llama-2-7b (shape only)",
        hardware="H100-SXM (roofline, modeled clock)",
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        arrivals="all at once",
    )
    return dict(
        config=cfg,
        results=dict(reserved_cap=res_cap, reserved_exact=res_oracle, paged=paged, **summary),
        goals=goals,
        _tables=[t],
    )


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
