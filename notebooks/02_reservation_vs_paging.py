# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Reservation vs paging
#
# A request's KV cache grows by one position per generated token, and nobody knows in advance when the
# output will end. The memory manager must decide *when* to give a request the memory it will need.
#
# * **Max-length reservation**: at admission, set aside one contiguous region for the most positions the
#   request may ever use (prompt + `max_tokens`). Simple: the region never needs to grow. Wasteful: a
#   request that stops early never uses the rest of its region, and while it is still generating, the
#   positions it has not filled yet sit idle, out of every other request's reach.
# * **Paging** (PagedAttention): cut the cache into fixed-size *blocks* and give a request a block only
#   when its last one is full. A *block table* lists a request's blocks, which need not be contiguous;
#   the attention kernel reads KV through it.
#
# This notebook steps **Figure 4** (the same two requests under reservation and under paging) live, side
# by side. Figure 4 is this course's numbering; the waste it shows is Figures 2 and 3 of the vLLM paper
# (Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
# SOSP 2023, arXiv:2309.06180). The notebook checks the kernel on both caches, measures the waste and
# its cost on a realistic trace, weighs the block size, and ends with a quantized KV cache: more positions in the same memory, and what
# that costs in quality.

# %% [markdown]
# **After this notebook you can:**
#
# - explain with Figure 4 why an unused reservation makes a request wait that paging would admit;
# - split a cache into holding KV, reserved but unused, fragmentation and partial-block waste, from step records;
# - compute the blocks a request needs and the waste of its partly filled last block;
# - weigh the block size: waste against block-table lookups and contiguous reads;
# - say what a quantized KV cache buys in positions and what it costs in accuracy.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels
GPU = DEVICE == "cuda"

from minillm_kernels import ops
import numpy as np
import plotly.graph_objects as go
import torch

from minillm import LLM, SamplingParams, impl
from minillm.viz import figures, printouts
from minillm.analysis import workloads
from minillm.viz import LockstepStepper
from minillm.sim.replay import replay

# %%

ex = impl.load("ex02_paging")     # your exercises/ex02_paging.py (MINILLM_IMPL=solutions: the answers);
                                  # re-run this cell after editing the file: impl.load reads it again


# %% [markdown]
# ## 1. Figure 4: an unused reservation makes C wait
#
# The setting: a KV capacity of 24 positions, an execution-token budget of 8 tokens, at most two
# requests. B has a 5-token prompt and `max_tokens=15`: under reservation it holds **20 positions** from
# the start. After two steps B has KV for 6 positions; the other 14 are *reserved but unused*. Then C
# arrives with a 6-token prompt.
#
# Both engines below get exactly these requests: `kv_allocation="reserved"` on the left,
# `kv_allocation="paged"` on the right (`block_size=1`, so each cell of the map is one position; hatched
# cells are reserved but unused). The clock is modeled at 10 ms per step and C arrives at 15 ms, during
# B's second step, so it can join from the third (a batch is formed only between steps). Every Step runs the Triton kernel in both engines (on the tiny random model,
# `model="random"`: only the number of tokens matters here, and it keeps a Step quick on a CPU).

# %%
def add_b_and_c(llm):
    """Figure 4's two requests: B (5-token prompt, max_tokens=15) at 0, C (6-token prompt) at 15 ms."""
    greedy = dict(ignore_eos=True, temperature=0.0)
    llm.engine.add_request(list(range(100, 105)), SamplingParams(max_tokens=15, **greedy), request_id="B",
                           arrival_time=0.0)
    llm.engine.add_request(list(range(200, 206)), SamplingParams(max_tokens=4, **greedy), request_id="C",
                           arrival_time=0.015)
    return llm


def figure4_engine(kv_allocation):
    return add_b_and_c(LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton",
                           kv_allocation=kv_allocation, block_size=1, num_kv_blocks=24, max_num_batched_tokens=8,
                           max_num_seqs=2, clock="modeled", cost_model=0.010))

fig4 = LockstepStepper(lambda: figure4_engine("reserved"), lambda: figure4_engine("paged"),
                       names=["reserved (max-length reservation)", "paged (blocks on demand)"],
                       title="Figure 4: B (5-token prompt, max_tokens=15), then C (6-token prompt)")
fig4

# %% [markdown]
# Step twice (B's prefill, then one decode) and look at B's memory in each engine:

# %% [markdown]
# **Predict, then run.** B has a 5-token prompt and `max_tokens=15`. After its prefill and one decode, how many of the 24 positions does B hold under reservation, and how many under paging (blocks of 1)?

# %%
fig4.step()
fig4.step()
printouts.kv_of_request({name: s.records[-1] for name, s in zip(fig4.names, fig4.steppers)}, "B")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Reservation: 20, its prompt plus `max_tokens`, set aside at admission, so only 4 are free. Paging: only the 6 it has filled, so 18 are free. C's prompt needs 6.
#
# </details>

# %% [markdown]
# Under reservation only 24 − 20 = **4** positions are free. C's prefill needs 6 newly allocated positions
# (there is no room for the KV of its prompt, let alone for what it will generate). Paging gave B only what it has filled, so 18 are free. One more step:

# %%
fig4.step()
printouts.step_batches({name: s.records[-1] for name, s in zip(fig4.names, fig4.steppers)})
fig4.compare_figure()

# %% [markdown]
# The paged engine runs the batch of Figure 3 (notebook 01): B's decode and C's prefill, 1 + 6 = 7
# tokens, **13 positions** of KV out of 24. The reserved engine could hold the same 13 positions, but when it decided, B held 6
# positions of KV and 14 reserved but unused (the figure's hatched cells), and only 4 were free. C waits
# because unused space is tied up in B's reservation, not because the two requests' actual KV exceeds
# the capacity. Keep stepping (the
# **Step** or **Run N** buttons) to watch C wait until B finishes.
#
# Both engines run the same attention kernel. A reservation is one contiguous run of positions, so to
# the kernel it is a block table of blocks of one position; a paged request's table lists its blocks
# wherever they are. The kernel against its torch reference, on each engine's cache:

# %%
print(check_paged_attention(fig4.steppers[0].engine))   # the Triton kernel against its torch reference
print(check_paged_attention(fig4.steppers[1].engine))   # the Triton kernel against its torch reference

# %% [markdown]
# ## 2. A realistic trace: what reservation costs
#
# Now hundreds of requests. A modeled H100 serves Llama-2-7B with **8 GiB for KV** (16,384 positions), at
# most 256 requests at once. The 8 GiB is a deliberate restriction: after the 13.5 GB of weights, the 90% of
# an H100's memory that notebook 01 counts as usable leaves about 58 GB (54 GiB) for KV. The smaller cache
# creates memory pressure, so that how the memory is managed shows in the results. 150 requests
# arrive as a Poisson process at 40 per second with log-normal prompt and output lengths. The simulated
# executor runs the real scheduler and KV managers without the model; the clock is the roofline cost
# model.
#
# A word on fairness: the trace tells each request its exact output length as `max_tokens`, so this
# reservation is the *best case*, sized exactly. A real engine does not know when the output will end
# and must reserve for `max_tokens` or `max_model_len`: its waste is larger.

# %%
KV_POSITIONS = 16384                      # 8 GiB / 512 KiB per position (Llama-2-7B, bf16)
trace = workloads.synthetic_trace(150, rate=40.0, prompt_len=workloads.LogNormal(200, 0.8, hi=1500),
                                  output_len=workloads.LogNormal(150, 1.0, hi=1500), vocab_size=32000, seed=0)

def serve(kv_allocation, block_size):
    """The trace on a modeled H100 serving Llama-2-7B (`replay`): the engine, its step records, the summary."""
    eng, _, s = replay(trace, model="llama-2-7b", cost_model="H100-SXM", kv_allocation=kv_allocation,
                       block_size=block_size, num_kv_blocks=KV_POSITIONS // block_size, max_num_seqs=256,
                       max_num_batched_tokens=2048, max_model_len=4096)
    return eng, eng.step_records, s

runs = {"reserved": serve("reserved", 1), "paged (blocks of 16)": serve("paged", 16)}
printouts.kv_manager_summaries({name: s for name, (_, _, s) in runs.items()})

# %% [markdown]
# Where the memory goes, step by step: the solid line is the fraction of the cache holding KV, the dashed
# one adds what is reserved but unused.

# %%
figures.kv_usage_figure({name: recs for name, (_, recs, _) in runs.items()},
                        title="KV cache: holds KV (solid), + reserved but unused (dashed)")


# %% [markdown]
# Averaged over the steps where someone was waiting (the moments memory decides who runs), the cache
# splits into: positions holding KV; **reserved but unused** (reservation); **fragmentation**, free
# positions in gaps too small for the next reservation (reservation); **the empty tail of each request's
# last block** (paging's only waste, `partial_waste`); and free.

# %%
def waste_breakdown(recs):
    busy = [r for r in recs if r.waiting] or recs
    total = busy[0].kv.total
    parts = {"holds KV": [r.kv.used for r in busy], "reserved but unused": [r.kv.reserved_unused for r in busy],
             "fragmentation": [r.kv.fragmentation for r in busy],
             "last-block tail": [r.kv.partial_waste for r in busy]}
    out = {k: float(np.mean(v)) / total for k, v in parts.items()}
    out["free"] = max(0.0, 1.0 - sum(out.values()))
    return out

shares = {name: waste_breakdown(recs) for name, (_, recs, _) in runs.items()}
for name, parts in shares.items():
    print(f"{name:<22} " + ", ".join(f"{part} {share:.0%}" for part, share in parts.items()))
fig = go.Figure([go.Bar(name=part, y=list(shares), x=[s[part] for s in shares.values()], orientation="h")
                 for part in next(iter(shares.values()))])
fig.update_layout(barmode="stack", title="where the KV cache goes while requests wait", height=280,
                  xaxis=dict(title="fraction of KV capacity", tickformat=".0%"), yaxis_title="allocation",
                  plot_bgcolor="white")
fig

# %%
figures.latency_cdf_figure({name: eng.request_metrics() for name, (eng, _, _) in runs.items()},
                           metrics=("queue_wait", "ttft"), unit="s", title="how long requests wait to start")

# %% [markdown]
# The reserved engine keeps a large share of its memory for tokens not generated yet, plus gaps between
# regions that no new reservation fits; the paged one fills nearly all of it. (The PagedAttention
# paper, Kwon et al., SOSP 2023, measured that earlier systems hold actual token states in only 20.4% to
# 38.2% of their KV memory, against 96.3% in vLLM.) It admits fewer requests at a time, so its batches are smaller,
# its throughput lower and its queue longer. The paged engine wastes only the unfilled tail of each
# request's last block. It pays differently: it admits requests without knowing whether their future
# tokens will fit, and when the cache fills up it must **preempt** a running request (notebook 05).

# %% [markdown]
# ## 3. The block size
#
# Paging's waste is at most `block_size − 1` positions per request, so small blocks waste less. Why not
# blocks of one position? Every block is an entry in a block table that the scheduler maintains and the
# kernel must look up, and a kernel works best on keys that sit together in memory: larger blocks mean
# fewer lookups and longer contiguous reads. The same trace, with blocks of 1 to 256 positions:

# %%
BLOCK_SIZES = [1, 16, 64, 256]
sweep = {bs: runs["paged (blocks of 16)"] if bs == 16 else serve("paged", bs) for bs in BLOCK_SIZES}
final_len = np.mean([r.prompt_len + r.output_len for r in trace])      # positions of a request when it ends
printouts.block_size_sweep((bs, waste_breakdown(recs)["last-block tail"], s, final_len / bs)
                           for bs, (_, recs, s) in sweep.items())

# %% [markdown]
# **Move the slider.** The same 150 requests in a what-if widget, re-simulated whenever the block size or
# the cache size moves (the same scheduler and KV manager). In the KV panel the solid line is what holds
# KV and the dotted one what the blocks handed out cover: the gap between them is the last-block tail.
# The previous setting is dashed. Try 16 against 256, then the same with a quarter of the memory.

# %%
from minillm.viz.whatif import WhatIf, WhatIfSettings

block_whatif = WhatIf(WhatIfSettings(kv_capacity_tokens=KV_POSITIONS), controls=("block_size", "kv"), trace=trace,
                      model="llama-2-7b", max_num_seqs=256, config=dict(max_model_len=4096),
                      choices=dict(block_size=BLOCK_SIZES, kv=(4_096, 8_192, 16_384, 32_768)))
assert block_whatif.summary["output_throughput"] == runs["paged (blocks of 16)"][2]["output_throughput"]  # the same run
block_whatif

# %% [markdown]
# vLLM's default of 16 sits where the tail is already negligible. On a GPU, the other side of the
# trade-off can be measured: the paged attention kernel on the same decode batch with different block
# sizes (on a CPU this cell says so and skips: the interpreter's timings mean nothing).

# %%
if GPU:
    from triton.testing import do_bench
    from minillm_kernels.bench import Case
    for bs in (1, 4, 16, 64, 256):
        c = Case(batch=32, ctx=2048, q_len=1, heads=32, kv_heads=8, head_dim=128, block_size=bs,
                 dtype=torch.bfloat16, dev=torch.device("cuda"))
        ms = do_bench(lambda: ops.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q,
                                                  c.context_lens, c.scale, backend="triton"))
        print(f"block_size {bs:>3}: {ms * 1e3:7.1f} us per decode step (batch 32, 2048 positions)")
else:
    print("no GPU: kernel timings skipped (Triton's interpreter runs one kernel instance at a time)")

# %% [markdown]
# ## 4. Fewer bytes per position: a quantized KV cache
#
# Paging removes the waste *around* the KV; what remains is the KV itself. One position costs
# `2 × layers × kv_heads × head_dim × bytes per value` (section 2's 512 KiB for Llama-2-7B in bf16), so at a
# fixed memory budget the positions that fit, and with them the largest batch, go as one over the bytes
# per value. `LLM(..., kv_cache_dtype="int8" | "fp8")` stores each value in one byte: a number `q` (int8,
# or fp8 in the e4m3 format of Micikevicius et al., "FP8 Formats for Deep Learning", 2022) with one
# float32 scale `s` per (block, KV head), standing for `q × s`. The store kernel quantizes as it writes
# (a block's scale grows when a larger value arrives, and its earlier rows are re-quantized); the
# attention kernel dequantizes as it reads. The scales add 4 bytes per block, head and K or V.
#
# What the same memory buys, per KV dtype: for the shipped model's shape (0.25 GiB, `EngineConfig`'s
# default `kv_cache_memory_gb`), and modeled for Llama-2-7B on an H100 (the cost model of notebook 01):

# %%
from minillm.bench import kv_quant

KV_KINDS = kv_quant.available_kv_dtypes(DEVICE)      # float32, float16, int8 and (where it runs) fp8
printouts.kv_dtype_capacity(KV_KINDS, kv_quant.capacity(memory_gb=0.25), kv_quant.modeled())

# %% [markdown]
# Live, side by side: one engine per KV dtype, each with the **same 64 KiB** of KV memory, on the tiny random
# model (its shape: 2 layers, 2 KV heads of 16 values; float32 KV fills a block of 16 positions with 8 KiB).
# Each gets the same burst of 12 requests (24-token prompts, 24 new tokens: 3 blocks each when done).
# The four engines run on the modeled clock at 10 ms a step, whatever the step holds, so the TTFT and
# TPOT under each engine count its steps (a wall-clock time would measure the order in which the four are
# stepped here, and the widget's own drawing, not the KV dtype). Step them together and watch how many requests each can run at once, and how often the small caches
# must preempt (notebook 05) to make room.

# %%
KV_BUDGET_GB = 2 ** -14          # 64 KiB
ENGINE_DTYPE = {"float32": dict(dtype="float32"), "float16": dict(dtype="float16"),     # the model's dtype
                "int8": dict(dtype="float32", kv_cache_dtype="int8"),
                "fp8": dict(dtype="float32", kv_cache_dtype="fp8")}

def burst_engine(kind):
    llm = LLM(model="random", device=DEVICE, attention_backend="auto", kv_cache_memory_gb=KV_BUDGET_GB,
              max_model_len=64, max_num_seqs=16, clock="modeled", cost_model=0.010,    # 10 ms a step: TTFT counts steps
              **ENGINE_DTYPE[kind])
    for i in range(12):
        llm.engine.add_request(list(range(10 + i, 34 + i)), SamplingParams(max_tokens=24, temperature=0.0,
                                                                           ignore_eos=True), request_id=f"r{i}")
    return llm

kv_lockstep = LockstepStepper(*[lambda kind=kind: burst_engine(kind) for kind in KV_KINDS],
                              names=[f"{kind} KV" for kind in KV_KINDS],
                              title="the same 64 KiB of KV memory, the same 12 requests")
kv_lockstep

# %% [markdown]
# Run them to the end (or press **Run N** above) and count:

# %% [markdown]
# **Predict, then run.** The same 64 KiB of KV memory in float32, float16, int8 and fp8. How many times the float32 engine's blocks does the int8 engine get: exactly 4, a little less, or more?

# %%
kv_lockstep.run(500)
for kind, s in zip(KV_KINDS, kv_lockstep.steppers):
    recs = s.records
    print(f"{kind:>7} KV: {s.engine.num_kv_blocks:>2} blocks, largest batch {max(len(r.running) for r in recs):>2}, "
          f"{sum(len(r.preempted) for r in recs):>2} preemptions, all 12 served in {len(recs):>3} steps")
kv_lockstep.compare_figure(index=6)

# %% [markdown]
# <details><summary>Answer</summary>
#
# A little less than 4: one byte per value instead of four, but the per-head scales take some of the memory. The batch grows with the blocks.
#
# </details>

# %% [markdown]
# One byte instead of four gives about four times the blocks (the scales take the rest), and the batch
# grows with them; the figure shows every engine after its seventh step. What does it cost? The shipped
# model reads held-out text it never trained on (the model card's held-out slice) with its KV stored each
# way, the model itself in float32 so the KV storage is the only difference: nats per character under
# teacher forcing, one token per step (every block fills token by token, so scales grow and rows are
# re-quantized: the hard case), how often the next-token argmax equals float32's, and greedy continuations
# of held-out prompts compared token by token with float32's. The last line, `int4-like`, is an
# exaggerated case: an int8 store that keeps only the 15 levels -7 ... 7 of a 4-bit format
# (`kv_quant.FewLevels(7)`, plugged in as the store's arithmetic), so the steps are 18 times coarser.

# %%
model, tokenizer, heldout_text, heldout_ids = kv_quant.shipped_heldout(520)
prompts = kv_quant.heldout_prompts(heldout_ids, 4, 24)
quality = kv_quant.quality(model, heldout_text, heldout_ids, prompts, new=24, context=256,
                           kv_dtypes=KV_KINDS + ["int4-like"], fills=("decode",))
printouts.kv_quant_quality(quality)
assert abs(quality["int8"]["rel_change_decode"]) < 0.01, "int8 KV within 1% of float32 KV (tests/test_kv_quant.py)"

# %% [markdown]
# Read the printed lines against each other. float16 rounds each value to 11 significant bits, int8 to
# one of 255 levels (254 steps) across its block's range (half a step, `s / 2`, at its block's final scale), fp8 to 3 mantissa
# bits (a relative error up to 1/16 for normal values; subnormals, below 2^-6 in e4m3, get an absolute error instead); the cell checks that int8 stays within
# 1% of float32's loss, the bar tests/test_kv_quant.py holds it to. On this 3.4 M-parameter model the
# quality cost of float16, int8 and fp8 is below the noise: the loss moves by hundredths of a percent in
# either direction (a loss slightly *below* float32's is rounding noise, not a gain), and the greedy
# continuations agree token for token. It is not zero in general. The exaggerated `int4-like` store
# shows what error does once it is large enough: the next-token argmax agrees with float32's only
# <span title="from the run">91.5%</span> of the time, and the greedy continuations part early. They
# agree until the first token where two candidates were nearly tied; after it the texts differ, as two
# samples would, so the share before the first divergence is the stricter number. Larger models, long
# contexts and channels with outlying values are where 8-bit KV errors start to show as well, which is
# why engines measure them on their own models. Set against the capacity lines above
# (one byte per value: about twice float16's blocks in the same memory), this is the trade a quantized KV
# cache offers. The engine's tests hold the kernels to their torch references on quantized caches,
# exactly, and the references to dense float64 attention on the dequantized values.

# %% [markdown]
# ## Exercises
#
# The two allocators of this notebook, in `exercises/ex02_paging.py`. Both plug into the real engine:
# `ex.paged_engine(...)` and `ex.reserved_engine(...)` build an `LLM` whose KV memory your code hands out,
# and the graders run the same requests through minillm's managers and yours, step by step.
#
# **Exercise 1, `blocks_needed(num_tokens, block_size)`**: blocks that hold `num_tokens` positions.
# **Exercise 2, `partial_block_waste(context_lens, block_size)`**: the empty tails of last blocks (the
# engine's `partial_waste`, section 3).

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `blocks_needed`: work blocks of 16 by hand: 16 positions need how many blocks, and 17? Use integer arithmetic only (no floats, no `math.ceil` on a float).
#
# </details>
# <details><summary>Hint 2</summary>
#
# `partial_block_waste`: the docstring's example, `[5, 16, 17]` in blocks of 16, is the case to check; section 2's waste breakdown counts the same thing over a whole trace.
#
# </details>

# %%
with impl.attempt("ex02.blocks_needed / partial_block_waste"):
    print(ex.blocks_needed(17, 16), ex.partial_block_waste([5, 16, 17], 16))

# %% [markdown]
# **Exercise 3, `BlockAllocator`**: the free list of a paged cache with reference counts,
# `get_new_blocks(n)` and `free_blocks(blocks)` (vLLM's names). Below, Figure 4's paged engine with your allocator inside (it counts blocks with
# your `blocks_needed` from exercise 1, so that one must work too).

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# The class docstring says which end of the free queue hands blocks out and which end takes them back; the cell below runs Figure 4 on your allocator and counts its calls.
#
# </details>
# <details><summary>Hint 2</summary>
#
# The invariant the graders check after every call: a block is in the free queue exactly when its `ref_count` is 0, and freeing a free block is an error. The docstring says in which order a request's blocks go back.
#
# </details>

# %%
with impl.attempt("ex02.paged_engine (your blocks_needed and BlockAllocator)"):
    llm = ex.paged_engine(model="random", executor="simulated", block_size=1, num_kv_blocks=24,
                          max_num_batched_tokens=8, max_num_seqs=2, clock="modeled", cost_model=0.010)
    add_b_and_c(llm)
    for rec in llm.engine.run(max_steps=3):
        print(rec.summary())

# %% [markdown]
# **Exercise 4, `FirstFitAllocator`**: max-length reservation in one address space: `gaps()`,
# `reserve(request_id, length)` (first fit) and `release(request_id)`. Figure 4 again, on your allocator:
# C must wait.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `gaps()`: draw a reserved cache as regions with free space between them (section 1's reserved engine); the docstring's example lists the gaps to reproduce, the one after the last region included.
#
# </details>
# <details><summary>Hint 2</summary>
#
# `reserve()`: the docstring says which gap first fit takes (not the best fit, not the worst). Figure 4 on your allocator (the cell below) must make C wait exactly as the engine's reserved engine does.
#
# </details>

# %%
with impl.attempt("ex02.FirstFitAllocator"):
    llm = ex.reserved_engine(model="random", executor="simulated", block_size=1, num_kv_blocks=24,
                             max_num_batched_tokens=8, max_num_seqs=2, clock="modeled", cost_model=0.010)
    add_b_and_c(llm)
    for rec in llm.engine.run(max_steps=3):
        print(rec.summary())

# %% [markdown]
# **Exercise 5, one quantized block** (in `exercises/ex02b_kv_quant.py`, graded with `make grade EX=02b`):
# the arithmetic of section 4's int8/fp8 cache. `new_scale(old, amax, kind)`: a head's scale after a write
# whose largest `|x|` is `amax`; `quantize(x, scale, kind)`: divide, clamp to `±QMAX`, round (int8) or
# cast (fp8); `dequantize(q, scale)`: what a stored number stands for; `quantize_block(x, kind)`: one block
# written at once. `ex2b.ExerciseQuantizer()` hands your functions to the engine
# (`LLM(kv_cache_dtype="int8", kv_quantizer=...)`): the cell below writes every KV block with them.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `new_scale`: section 4's text: a scale maps the block's largest value onto the largest storable number, and a block's scale may only grow (values already written keep theirs).
#
# </details>
# <details><summary>Hint 2</summary>
#
# `quantize`: the graders feed a zero scale and values beyond the range; work both by hand first. Casting an out-of-range float to `torch.int8` does not saturate.
#
# </details>
# <details><summary>Hint 3</summary>
#
# `quantize_block`: shapes first. A block is (positions, KV heads, head_dim) with one scale per head; the cell below compares your block's error with the engine's.
#
# </details>

# %%
ex2b = impl.load("ex02b_kv_quant")     # your exercises/ex02b_kv_quant.py
with impl.attempt("ex02b.quantize_block"):
    block = torch.randn(16, 2, 16, generator=torch.Generator().manual_seed(0))
    block = block * torch.tensor([1.0, 30.0])[None, :, None]                  # two heads of different range
    q8, s8 = ex2b.quantize_block(block, "int8")
    err = (ex2b.dequantize(q8, s8[None, :, None]) - block).abs().amax(dim=(0, 2))
    print(f"scales {[round(v, 4) for v in s8.tolist()]}; largest error per head {[round(v, 4) for v in err.tolist()]} "
          f"(half a step: {[round(v / 2, 4) for v in s8.tolist()]})")
    mine = LLM(model="random", kv_cache_dtype="int8", attention_backend="torch", kv_quantizer=ex2b.ExerciseQuantizer())
    theirs = LLM(model="random", kv_cache_dtype="int8", attention_backend="torch")
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    same = [a.token_ids == b.token_ids for a, b in zip(mine.generate([[10, 11, 12, 13], [40, 41]], sp),
                                                       theirs.generate([[10, 11, 12, 13], [40, 41]], sp))]
    print(f"the engine with your quantizer: greedy tokens equal minillm's own for {sum(same)} of {len(same)} requests")

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex02_paging.py` and `exercises/ex02b_kv_quant.py` (their stubs raise
# `NotImplementedError` until you fill them in; the docstrings say exactly what each must do). The cells
# above run *your* version: `impl.load` reads the environment variable `MINILLM_IMPL` (unset: `exercises`,
# yours; `solutions`: the reference answers).
# From the repository root:
#
# ```bash
# make grade EX=02                                            # every ex02 grader, against exercises/
# make grade EX=02b                                           # exercise 5 (KV quantization)
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex02 tests/test_exercises.py -k first_fit   # one exercise
# ```
#
# A failing grader says what it expected and where the expectation came from (numbers worked by hand,
# the engine's cost model, or what the real scheduler did on the same requests).
#
# After a grade that fails an exercise you attempted (a stub left untouched is no attempt), that
# exercise's cell above offers its worked answer, folded: the reference code and why it works. Open it
# once you have tried. From a cell, `impl.grade("02")` prints the same report and offers the answers
# of the exercises it failed; `impl.show_worked_answer("ex02", 1)` opens exercise 1's.

# %% [markdown]
# ## Summary
#
# 1. Max-length reservation sets aside prompt + `max_tokens` at admission; until the request fills it, that memory serves nobody.
# 2. Paging hands out a block only when the last one is full; a block table maps a request's positions to blocks anywhere in the cache.
# 3. On a realistic trace reservation leaves a large share of memory reserved but unused, or in gaps no reservation fits; requests wait for memory that holds nothing.
# 4. Paging's waste is at most `block_size - 1` positions per request; larger blocks mean fewer lookups and longer contiguous reads.
# 5. A quantized KV cache stores more positions in the same memory, at a measured cost in accuracy.

# %% [markdown]
# ## Check your understanding
#
# 1. Why can't reservation simply reserve less, say the mean answer length?
# 2. A request of 17 positions in blocks of 16: how many blocks, and how many positions wasted?
# 3. A block of one position wastes nothing, and SGLang's radix cache runs at page size 1 by default. What does a
#    large block cost prefix caching, which (notebook 04) reuses full blocks only?
# 4. Paging removes fragmentation between requests. Where is its remaining waste?
#
# <details><summary>Answers</summary>
#
# 1. A request that outgrows its region cannot grow in place: its region is contiguous. It must be moved or stopped, so reservation must cover the maximum.
# 2. 2 blocks; 32 - 17 = 15 positions wasted in the second.
# 3. Page size 1 costs a block-table entry per position, which the scheduler maintains and the kernel looks up, and keys no longer sit together in memory (SGLang pays this for token-exact prefix matching; vLLM defaults to 16). A large block loses reuse: only full blocks are hashed, so a hit can miss up to `block_size - 1` shared tokens at the end of the shared prefix, and a prefix shorter than one block is not reused at all.
# 4. In each request's partly filled last block (at most `block_size - 1` positions).
#
# </details>
