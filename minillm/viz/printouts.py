"""The notebooks' printed tables: a few lines of text each, from a run's records and summaries.

A notebook cell runs the engine (or the simulator, or the cost model) and hands what came back to one
of these, so the code a reader sees is the engine call, and the formatting lives here. Each function
prints, and reads only what it is given (``StepRecord``s, ``RequestOutput``s, the dicts of
``metrics.summarize`` and of the benchmarks); none runs anything.

By notebook: 00 ``outputs``, ``step_record``, ``client_vs_engine_ttft``; 01 ``decode_timings``,
``roofline_shares``, ``kv_per_position``, ``batching_summaries``; 02 ``kv_of_request``, ``step_batches``,
``kv_manager_summaries``, ``block_size_sweep``, ``kv_dtype_capacity``, ``kv_quant_quality``;
04 ``prefix_cache_summaries``, ``multi_turn_summaries``, ``block_owners``, ``sampling_summaries``,
``fork_sharing``; 05 ``return_after_preemption``, ``preemption_summaries``, ``watermark_summaries``;
06 ``speculation_by_k``, ``verification_costs``, ``acceptance_by_proposer``; 07 ``tp_ranks``,
``goodput_table``, ``router_summaries``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ..step_record import StepRecord

__all__ = [
    "outputs",
    "step_record",
    "client_vs_engine_ttft",
    "decode_timings",
    "roofline_shares",
    "kv_per_position",
    "batching_summaries",
    "kv_of_request",
    "step_batches",
    "kv_manager_summaries",
    "kv_dtype_capacity",
    "kv_quant_quality",
    "prefix_cache_summaries",
    "block_owners",
    "sampling_summaries",
    "fork_sharing",
    "return_after_preemption",
    "preemption_summaries",
    "watermark_summaries",
    "verification_costs",
    "acceptance_by_proposer",
    "tp_ranks",
    "goodput_table",
    "router_summaries",
    "block_size_sweep",
    "multi_turn_summaries",
    "speculation_by_k",
]


# --- 00: the tour ---------------------------------------------------------------------------------------


def outputs(request_outputs: Iterable) -> None:
    """Each finished request of ``LLM.generate``: prompt -> text, then its tokens, TTFT and TPOT."""
    for out in request_outputs:
        m = out.metrics
        print(f"{out.prompt or out.prompt_token_ids!r} -> {out.text if out.text is not None else out.token_ids!r}")
        print(
            f"    {len(out.token_ids)} tokens ({out.finish_reason}), first after {m.ttft * 1e3:.1f} ms, "
            f"then {m.tpot * 1e3:.1f} ms per token\n"
        )


def step_record(rec: StepRecord) -> None:
    """One step, field by field: the budget used, each batch entry, who waits and why, the KV after it."""
    print(
        f"step {rec.step}: {rec.num_batched_tokens} of {rec.token_budget} budget tokens, "
        f"took {rec.duration * 1e3:.1f} ms ({rec.clock} clock)"
    )
    for e in rec.batch:
        print(
            f"  {e.request_id}: {e.phase:<7} +{e.num_new_tokens:>2} tokens   KV {e.num_computed_before:>2} -> "
            f"{e.context_len:>2} positions   {e.num_output_tokens} token(s) out"
        )
    for w in rec.waiting:
        print(f"  {w.request_id} waits: {w.reason}")
    kv = rec.kv
    print(
        f"  KV: {kv.used} of {kv.total} positions hold KV, in {kv.blocks_used} of {kv.blocks_total} blocks "
        f"of {kv.block_size} ({kv.partial_waste} positions empty in partly filled last blocks)"
    )


def client_vs_engine_ttft(c: Mapping[str, Any]) -> None:
    """``load_generator.compare``'s result: the TTFT the clients measured against the engine's own."""
    print(f"TTFT p50: client {c['ttft_p50_client'] * 1e3:6.0f} ms, engine {c['ttft_p50_engine'] * 1e3:6.0f} ms")
    print(f"TTFT p90: client {c['ttft_p90_client'] * 1e3:6.0f} ms, engine {c['ttft_p90_engine'] * 1e3:6.0f} ms")
    print(
        f"outside the engine, per request: min {c['overhead_ttft_min'] * 1e3:.0f} ms, "
        f"p50 {c['overhead_ttft_p50'] * 1e3:.0f} ms, max {c['overhead_ttft_max'] * 1e3:.0f} ms "
        f"({c['num_paired']} requests paired by id)"
    )
    print(f"the engine's part of the client's median TTFT: {c['ttft_p50_engine'] / c['ttft_p50_client']:.0%}")


# --- 01: batching math ----------------------------------------------------------------------------------


def decode_timings(timings, batches: Sequence[int], noisy_spread: float) -> None:
    """``decode_timing.measure``'s result: a line per batch size, the batch 1 -> 32 ratios, and whether
    the repeats agree well enough to trust them (``noisy_spread``: the largest spread that does)."""
    for b, t, spread in zip(batches, timings.step_time, timings.spread):
        print(f"batch {b:>2}: {t * 1e3:7.2f} ms per step, {b / t:9.0f} tokens/s   (repeats within x{spread:.2f})")
    gain, growth = timings.ratio(1, 32)
    print(f"\nhere ({timings.clock}), batch 1 -> 32: throughput x{gain:.1f}, latency x{growth:.2f}")
    if timings.noisy:
        print(
            f"Too noisy to trust: some batch size's repeats differ by x{max(timings.spread):.1f} "
            f"(more than x{noisy_spread}). Other work is running on this machine; re-run the cell when it is quiet."
        )
    else:
        print(f"The repeats agree within x{max(timings.spread):.2f}: background load did not decide these ratios.")


def roofline_shares(breakdowns: Mapping[int, Mapping[str, Any]], ridge: float) -> None:
    """Per batch size, a ``RooflineCostModel.breakdown`` of a decode step: its arithmetic intensity against
    the ridge point, and the share of the step the arithmetic needs."""
    for b, d in breakdowns.items():
        print(
            f"batch {b:>4}: {d['arithmetic_intensity']:5.1f} FLOP/byte (ridge {ridge:.0f}); the arithmetic needs "
            f"{d['compute_time'] / d['time']:5.1%} of the step: {d['bound']} bound"
        )


def kv_per_position(specs: Iterable, num_tokens: int, request_bytes) -> None:
    """Per model: the KV of one position, and ``request_bytes(spec, num_tokens)`` for one request."""
    for spec in specs:
        print(
            f"{spec.name:<28} {spec.kv_bytes_per_token / 2**10:8.1f} KiB per position, "
            f"{request_bytes(spec, num_tokens) / 2**30:7.3f} GiB for one request of {num_tokens} positions"
        )


def batching_summaries(summaries: Mapping[str, Mapping[str, Any]]) -> None:
    """Per batching mode, ``metrics.summarize``: throughput, mean batch, occupancy, TTFT and end-to-end."""
    for batching, s in summaries.items():
        print(
            f"{batching:>10}: {s['output_throughput']:7.0f} tokens/s, mean batch {s['batch_size_mean']:5.1f} "
            f"(occupancy {s['batch_occupancy']:4.0%}), "
            f"TTFT p50 {s['ttft_p50']:6.2f} s, end-to-end p50 {s['e2e_p50']:6.2f} s / p99 {s['e2e_p99']:6.2f} s"
        )


# --- 02: reservation vs paging --------------------------------------------------------------------------


def kv_of_request(records: Mapping[str, StepRecord], request_id: str) -> None:
    """Per engine (name -> its last record): what ``request_id`` holds, and what is free for anyone else."""
    for name, rec in records.items():
        kv = rec.kv
        r = kv.per_request[request_id]
        print(
            f"{name:<36} {request_id}: {r.used} positions of KV, {r.reserved_unused} reserved but unused; "
            f"{kv.free} of {kv.total} positions free for anyone else"
        )


def step_batches(records: Mapping[str, StepRecord]) -> None:
    """Per engine (name -> a record): who ran with how many tokens, the KV held, who waits and why."""
    for name, rec in records.items():
        ran = ", ".join(f"{e.request_id} {e.phase} +{e.num_new_tokens}" for e in rec.batch)
        waits = "; ".join(f"{w.request_id} waits: {w.reason}" for w in rec.waiting) or "nobody waits"
        print(
            f"{name}\n    ran: {ran} ({rec.num_batched_tokens}/{rec.token_budget} tokens); KV {rec.kv.used} of "
            f"{rec.kv.total} positions hold KV\n    {waits}"
        )


def kv_manager_summaries(summaries: Mapping[str, Mapping[str, Any]]) -> None:
    """Per KV manager, ``metrics.summarize``: throughput, mean batch, queue wait, TTFT p99, preemptions."""
    for name, s in summaries.items():
        print(
            f"{name:<22} {s['output_throughput']:6.0f} tokens/s, mean batch {s['batch_size_mean']:5.1f}, "
            f"queue wait p50 {s['queue_wait_p50']:5.2f} s / p99 {s['queue_wait_p99']:5.2f} s, "
            f"TTFT p99 {s['ttft_p99']:5.2f} s, preemptions {s['num_preemptions']}"
        )


def block_size_sweep(rows: Iterable[tuple[int, float, Mapping[str, Any], float]]) -> None:
    """Rows of (block size, last-block tail as a fraction of the cache, ``metrics.summarize``, block-table
    entries per finished request)."""
    for bs, tail, s, entries in rows:
        print(
            f"block_size {bs:>3}: last-block tail {tail:6.1%} of the cache, {s['output_throughput']:6.0f} tokens/s, "
            f"preemptions {s['num_preemptions']:>3}, ~{entries:5.1f} block-table entries per finished request"
        )


def kv_dtype_capacity(kinds: Iterable[str], capacity: Mapping[str, Mapping], modeled: Mapping[str, Mapping]) -> None:
    """``kv_quant.capacity`` for the shipped model's shape, then ``kv_quant.modeled`` for Llama-2-7B."""
    for name in kinds:
        c = capacity[name]
        print(
            f"shipped model, {name:>7} KV: {c['bytes_per_block']:>6,} bytes per block of 16 positions -> "
            f"{c['blocks']:>6,} blocks in 0.25 GiB ({c['vs_float16']:.2f}x float16)"
        )
    for name, m in modeled.items():
        print(
            f"Llama-2-7B on H100, {name:>8} KV: {m['kv_bytes_per_token']:>7,} bytes per position, largest batch of "
            f"4096-token requests {m['max_batch']:>3}, modeled decode {m['tokens_per_s']:>6,.0f} tokens/s"
        )


def kv_quant_quality(quality: Mapping[str, Mapping[str, Any]]) -> None:
    """``kv_quant.quality``: per KV dtype, the loss against float32's and how often the tokens agree."""
    for name, q in quality.items():
        g = q["greedy"]
        print(
            f"{name:>9} KV: {q['nats_per_char_decode']:.4f} nats/char ({100 * q['rel_change_decode']:+.3f}% vs "
            f"float32), next-token argmax = float32's {q['top1_agreement']:.1%}, greedy tokens = float32's "
            f"{g['positions_equal']:.1%} ({g['before_first_divergence']:.1%} before the first divergence)"
        )


# --- 04: prefix caching ---------------------------------------------------------------------------------


def prefix_cache_summaries(summaries: Mapping[str, tuple[int, Mapping[str, Any]]]) -> None:
    """Per run (name -> (prompt tokens prefilled, ``metrics.summarize``)): hit rate, prefill, TTFT, KV in
    use, preemptions, throughput."""
    for name, (computed, s) in summaries.items():
        print(
            f"{name:<16} hit rate {s['prefix_cache_hit_rate']:4.0%}; prompt tokens prefilled {computed:>7,} of "
            f"{s['total_input_tokens']:,}; TTFT p50 {s['ttft_p50'] * 1e3:7.1f} ms, "
            f"p99 {s['ttft_p99'] * 1e3:7.1f} ms; "
            f"KV in use {s['kv_util_mean']:4.0%} on average; {s['num_preemptions']} preemptions; "
            f"{s['output_throughput']:5.0f} tokens/s"
        )


def multi_turn_summaries(runs: Mapping[str, tuple[Mapping[str, Any], int, Sequence[float]]]) -> None:
    """Per KV size (name -> (``metrics.summarize``, evictions, mean tokens prefilled at each turn))."""
    for name, (s, evictions, prefilled) in runs.items():
        print(
            f"prefix cache, {name:<13} hit rate {s['prefix_cache_hit_rate']:4.0%}, {evictions:>6,} evictions; "
            f"TTFT p50 {s['ttft_p50'] * 1e3:4.0f} ms; tokens prefilled per turn: "
            + ", ".join(f"{p:4.0f}" for p in prefilled)
        )


def block_owners(rec: StepRecord) -> None:
    """The KV blocks after a step (``record="full"``): who holds each, or that a free one still caches a prefix."""
    for b in rec.kv.blocks:
        if b.ref_count:
            print(f"  block {b.block_id:>2}: held by {', '.join(b.owners)} (ref_count {b.ref_count})")
        elif b.cached:
            print(f"  block {b.block_id:>2}: free, still caching a prefix")


def sampling_summaries(runs: Mapping[str, tuple[Any, Sequence[StepRecord], Mapping[str, Any]]]) -> None:
    """Per run (name -> (engine, records, ``metrics.summarize``)): when it ended, throughput, TTFT, the
    most sequences running at once, preemptions."""
    for name, (_, recs, s) in runs.items():
        print(
            f"{name:<28} done at {recs[-1].time:5.1f} s; {s['output_throughput']:6.0f} tokens/s; TTFT p50 "
            f"{s['ttft_p50']:5.2f} s, p99 {s['ttft_p99']:5.2f} s; at most {max(len(r.running) for r in recs)} "
            f"sequences running; {s['num_preemptions']} preemptions"
        )


def fork_sharing(rec_fork: StepRecord, rec_next: StepRecord, prompt_blocks: int) -> None:
    """Parallel sampling: the blocks the fork shares, and the blocks in use after the next step against
    ``prompt_blocks`` per sequence without sharing."""
    f = rec_fork.forks[0]
    print(
        f"after the fork: {len(f.sequences)} sequences share blocks {f.shared_blocks}: {rec_fork.kv.blocks_used} "
        f"blocks in use; after the first decode: {rec_next.kv.blocks_used} (without sharing: "
        f"{len(f.sequences)} x {prompt_blocks} = {len(f.sequences) * prompt_blocks} for the prompt alone)"
    )


# --- 05: preemption -------------------------------------------------------------------------------------


def preemption_summaries(runs: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Any]]]) -> None:
    """Per preemption mode (name -> (engine stats, ``metrics.summarize``)): what was recomputed or copied,
    and what it cost."""
    for name, (st, s) in runs.items():
        print(
            f"{name:<26} {st['preemptions_recompute']:>3} recomputed, {st['preemptions_swap']:>3} swapped "
            f"({st['recomputed_tokens']:>6,} tokens prefilled again, {s['swap_time_total']:.2f} s copying) | "
            f"{s['output_throughput']:5.0f} tokens/s, TTFT p50 {s['ttft_p50']:5.1f} s, "
            f"end-to-end p99 {s['e2e_p99']:5.1f} s"
        )


def return_after_preemption(runs: Mapping[str, Sequence[StepRecord]], request_id: str, after_step: int) -> None:
    """Per run (name -> its step records): the first step after ``after_step`` that runs ``request_id``
    again, what it ran then, and how long the run took."""
    for name, records in runs.items():
        back = next(r for r in records[after_step:] if r.entry(request_id) is not None)
        e = back.entry(request_id)
        print(
            f"{name:<30} {request_id} returns at step {back.step} with a {e.phase} of {e.num_new_tokens} token(s) "
            f"({e.num_computed_before} positions already in the cache); the run takes {len(records)} steps"
        )


def watermark_summaries(runs: Mapping[float, tuple[int, Mapping[str, Any]]]) -> None:
    """Per watermark (-> (tokens prefilled again, ``metrics.summarize``)): preemptions and what they cost."""
    for wm, (recomputed, s) in runs.items():
        print(
            f"watermark {wm:4.0%}: {s['num_preemptions']:3d} preemptions ({s['preemption_rate']:4.2f} per s), "
            f"{recomputed:>6,} tokens prefilled again | {s['output_throughput']:5.0f} tokens/s, mean batch "
            f"{s['batch_size_mean']:4.1f}, KV in use {s['kv_util_mean']:4.0%}"
        )


# --- 06: speculative decoding ---------------------------------------------------------------------------


def speculation_by_k(rows: Iterable[tuple[int, Mapping[str, Any], float, float, float, float]]) -> None:
    """Rows of (k, speculation stats, fitted alpha, measured speed-up, draft cost c, the formula's speed-up)."""
    for k, st, alpha, measured, c, formula in rows:
        print(
            f"k = {k}: {st['tokens_per_target_step']:.2f} tokens per target step (alpha ~ {alpha:.2f}); measured "
            f"speed-up {measured:.2f}x, the formula with c = {c:.2f}: {formula:.2f}x"
        )


def verification_costs(rows: Iterable[tuple[int, Mapping[str, Any], str, str]]) -> None:
    """Rows of (batch size, ``modeled_speedup`` at k = 4, the plain step's bound, the verification's bound):
    the plain step, the verification and the drafts, and the speed-up."""
    for b, r, plain_bound, verify_bound in rows:
        print(
            f"batch {b:>3}, k = 4: plain step {r['plain_step'] * 1e3:5.1f} ms ({plain_bound} bound), verification "
            f"{r['verify_time'] * 1e3:5.1f} ms ({verify_bound} bound), drafts {r['draft_time'] * 1e3:4.1f} ms "
            f"-> {r['speedup']:.2f}x"
        )


def acceptance_by_proposer(rows: Iterable[tuple]) -> None:
    """Rows of (temperature, prompt's name, proposer, acceptance rate, tokens per target step, speed-up)."""
    for temp, name, proposer, accepted, per_step, speedup in rows:
        print(
            f"T={temp}  {name:<11} {proposer:<14} {accepted:4.0%} of guesses accepted, "
            f"{per_step:.2f} tokens per target step -> {speedup:.2f}x"
        )


# --- 07: beyond one GPU ---------------------------------------------------------------------------------


def tp_ranks(ranks: Iterable[Mapping[str, Any]]) -> None:
    """Tensor parallelism: each rank's heads, its shard of three weight matrices, and its KV cache."""
    for r in ranks:
        p = r["params"]
        print(
            f"rank {r['rank']}: {r['num_heads']} query heads, {r['num_kv_heads']} KV heads; "
            f"q_proj {p['model.layers.0.self_attn.q_proj.weight']}, "
            f"o_proj {p['model.layers.0.self_attn.o_proj.weight']}, "
            f"down_proj {p['model.layers.0.mlp.down_proj.weight']}; KV cache per layer {r['kv_cache_shape']}"
        )


def goodput_table(rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Per deployment and rate: TTFT p99, TPOT p50 / p99, and the goodput under a loose and a tight TPOT."""
    print(
        f"{'deployment':10s} {'rate':>4s} {'TTFT p99 ms':>11s} {'TPOT p50 ms':>11s} {'TPOT p99 ms':>11s} "
        f"{'goodput@100ms':>13s} {'goodput@25ms':>12s}"
    )
    for name, by_rate in rows.items():
        for r in by_rate:
            print(
                f"{name:10s} {r['rate']:4d} {r['ttft_p99'] * 1e3:11.0f} {r['tpot_p50'] * 1e3:11.1f} "
                f"{r['tpot_p99'] * 1e3:11.1f} {r['good_loose']:13.2f} {r['good_tight']:12.2f}"
            )


def router_summaries(rows: Iterable[tuple[str, str, Mapping[str, Any]]]) -> None:
    """Rows of (trace, router, ``cluster`` summary): hit rate, TTFT, goodput and the load per replica."""
    for tname, label, s in rows:
        print(
            f"{tname:13s} {label:21s} hit rate {s['prefix_cache_hit_rate']:.3f}  "
            f"TTFT p50 {s['ttft_p50'] * 1e3:6.1f} ms"
            f"  p99 {s['ttft_p99'] * 1e3:6.1f} ms  goodput {s['goodput_requests_per_s']:6.2f} req/s"
            f"  requests per replica {s['requests_per_instance']}  ({s['wall_time']:.1f} s wall)"
        )
