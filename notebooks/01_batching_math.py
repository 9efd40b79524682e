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
# # 01 · The batching math
#
# Decode reads the full weight set to produce one token, and that read costs the same whether one request
# or thirty-two are in flight. That is the whole case for batching, and this notebook works it out in
# numbers:
#
# 1. **bytes read per generated token** against the batch size, and the **roofline**: why decode is
#    memory bound and batching amortises the weight read;
# 2. **throughput and step latency vs batch size**, measured on this machine with the real engine, next
#    to the modeled H100 curve (about 20x the throughput for about 1.5x the latency from batch 1 to 32);
# 3. the **KV-cache memory formula**, and what it does to the largest batch that fits;
# 4. **static vs continuous batching**, on a worked example and on a long-tail trace;
# 5. inside one step: the **execution-token budget** and the **KV retained** (Figures 2 and 3, drawn
#    live by the step-through widget);
# 6. exercises.

# %% [markdown]
# **After this notebook you can:**
#
# - compute the bytes a decode step reads per generated token, and place a step on the roofline (memory or compute bound);
# - compute the KV-cache bytes of a request and the largest batch of a given length that fits beside the weights;
# - predict a decode step's time from the batch size and the context on a modeled GPU;
# - compute when each request finishes under static and continuous batching, and why continuous batching leaves no slot held by a finished request;
# - plan one step under the execution-token budget: which running and waiting requests get how many tokens.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels
GPU = DEVICE == "cuda"

import numpy as np
import plotly.graph_objects as go

from minillm import LLM, SamplingParams, impl
from minillm.viz import figures, printouts
from minillm.analysis import metrics, workloads
from minillm.bench import decode_timing
from minillm.viz import Stepper

# %%
from dataclasses import replace

from minillm.sim.costmodel import (
    HARDWARE, MODELS, ConstantStepTime, RooflineCostModel, bytes_per_generated_token, decode_step_time_vs_batch,
    kv_cache_bytes, max_batch_size,
)

ex = impl.load("ex01_batching")   # your exercises/ex01_batching.py (MINILLM_IMPL=solutions: the answers);
                                  # re-run this cell after editing the file: impl.load reads it again

# %% [markdown]
# ## 1. Decode reads every weight to make one token
#
# A decode step of one request multiplies a single vector (the newest token's hidden state) by every
# weight matrix of the model: a `(1 x d) @ (d x n)` product per layer. Each weight is fetched from memory,
# used for one multiply-add, and dropped. With `b` requests decoding together the same fetch serves `b`
# rows: a `(b x d) @ (d x n)` product, so the weight bytes **per generated token** fall as `1 / b`. What
# batching does *not* share is each request's own KV cache, which its attention must read every step.
# Per generated token, for Llama-2-7B (13.5 GB of bf16 weights) with 512 positions of context:

# %%
m = MODELS["llama-2-7b"]
ctx = 512
batches = [1, 2, 4, 8, 16, 32, 64, 128]
weights_per_tok = [m.weight_bytes / b / 1e9 for b in batches]
kv_per_tok = [(bytes_per_generated_token(m, b, ctx) - m.weight_bytes / b) / 1e9 for b in batches]
for b, w, k in zip(batches, weights_per_tok, kv_per_tok):
    if b in (1, 8, 32):
        print(f"batch {b:>3}: {w + k:6.3f} GB read per generated token = weights / {b} ({w:.3f}) + its own KV ({k:.3f})")

fig = go.Figure([go.Bar(name="weights (shared by the batch)", x=[str(b) for b in batches], y=weights_per_tok),
                 go.Bar(name=f"own KV ({ctx} positions)", x=[str(b) for b in batches], y=kv_per_tok)])
fig.update_layout(barmode="stack", title="bytes read per generated token, Llama-2-7B", xaxis_title="batch size",
                  yaxis_title="GB per generated token", height=360, plot_bgcolor="white")
fig

# %% [markdown]
# ### The roofline
#
# A step takes at least as long as its arithmetic at the GPU's peak rate, and at least as long as its
# memory traffic at the GPU's bandwidth: `time = max(FLOPs / peak, bytes / bandwidth)`. The ratio
# FLOPs / bytes of a computation (its *arithmetic intensity*) says which bound applies. A decode step
# does about `2 x params x b` FLOPs for about `2 x params` bytes of bf16 weights: an intensity of about
# `b` FLOP per byte. An H100 needs about 260 FLOP per byte (989 TFLOP/s over 3.35 TB/s, at the
# efficiencies the cost model assumes) before compute becomes the limit. So a decode step of a small
# batch is **memory bound**: the GPU waits on the weight read, and adding requests adds arithmetic that
# is nearly free. A prefill of 512 tokens is far to the right: compute bound. (Batching turns a
# matrix-vector product into a matrix-matrix one, which moves decode up the roofline.) The points below
# come from minillm's cost model, `RooflineCostModel`, which is the modeled clock the engine runs on.

# %%
h100 = RooflineCostModel("H100-SXM", "llama-2-7b")
figures.roofline_figure(h100, batch_sizes=(1, 4, 16, 64, 256, 1024), context_len=512, prefill_lens=(512,))

# %% [markdown]
# ## 2. Throughput and latency vs batch size
#
# **Measured here.** The engine runs the shipped model with `b` requests decoding together, for
# `b = 1 ... 64`. A timing on a shared machine is easily fooled (another process takes the CPU for a
# few milliseconds and one batch size looks ten times slower), so `minillm.bench.decode_timing.measure`
# times 16 decode steps per run and takes their median (the prefill step is left out), runs every batch
# size 3 times, round-robin, and keeps the fastest of the 3: noise only ever adds time. The *spread*,
# slowest repeat over fastest, says how much the machine disturbed the measurement; the cell says when
# it is too large for the ratios to mean much. On a CPU, `measure` runs torch with one thread while it
# times (and restores the setting after) and times with this process's CPU time, which a busy machine
# cannot inflate by descheduling us: with one thread, CPU time is what the step costs a quiet core. On a
# GPU it times wall time, and this is the
# Triton kernel, compiled. On a CPU we time the engine's torch backend instead: Triton's interpreter
# executes one kernel instance after another in Python, so its timings measure the interpreter, not the
# hardware (the kernel itself is checked against torch in section 5).

# %%
BACKEND = "triton" if GPU else "torch"
BATCHES = [1, 2, 4, 8, 16, 32, 64]
bench = LLM(device=DEVICE, dtype="auto", attention_backend=BACKEND, block_size=16, max_num_seqs=64,
            max_num_batched_tokens=4096, max_model_len=256, record="summary")   # no per-block KV map: totals are enough here

timings = decode_timing.measure(bench.engine, BATCHES, steps=16, repeats=3, device=DEVICE)
measured = np.array(timings.step_time)
printouts.decode_timings(timings, BATCHES, noisy_spread=decode_timing.NOISY_SPREAD)

# %%
figures.throughput_latency_figure(BATCHES, latency=measured,
                                  title=f"measured on this machine ({DEVICE}, {BACKEND} attention, the shipped model)")

# %% [markdown]
# **Modeled H100.** The same curve for Llama-2-7B on an H100, from the cost model
# (`costmodel.decode_step_time_vs_batch`). From batch 1 to 32 the throughput grows about 20x while the
# step time grows only about 1.5x (the cell prints the model's exact ratios). Past that the KV reads,
# which batching does not share, take over (the next cell says when).

# %%
lat, thr = decode_step_time_vs_batch(h100, [1, 2, 4, 8, 16, 32, 64, 128], context_len=512)
print(f"modeled H100, batch 1 -> 32: throughput x{thr[5] / thr[0]:.1f}, latency x{lat[5] / lat[0]:.2f}")
figures.throughput_latency_figure([1, 2, 4, 8, 16, 32, 64, 128], latency=lat,
                                  title="modeled: Llama-2-7B on an H100 (RooflineCostModel), 512 positions of context")

# %% [markdown]
# ### Why a small batch leaves the compute units idle
#
# An H100's tensor cores can do about 260 floating-point operations for each byte that arrives from
# memory (the ridge point). A decode step of batch 1 gives them about one: each 2-byte weight fetched
# serves one multiply-add (2 operations), so the arithmetic units wait on memory for all but a fraction
# of a percent of the step. Each request added to the batch reuses the weight already fetched for one
# more multiply-add, work the idle units absorb at no extra time. Hence
# the large gain: step time grows *sublinearly* in the batch (x1.5 for x32 the requests above), so
# throughput grows almost linearly (x20), although it stays below the batch size itself.
#
# A common rule of thumb says that by batch 32 decode is approaching the compute bound. The roofline
# above says otherwise, and the cost model can say by how much: the share of the step the arithmetic
# needs, and the arithmetic intensity against the ridge point where the roofline turns.

# %% [markdown]
# **Predict, then run.** An H100 does about 260 FLOPs per byte it reads. A decode step of batch 32 at 512 positions of context: does its arithmetic fill most of the step, about half, or a small part?

# %%
ridge = h100.flops_per_s / h100.bytes_per_s
doubled = next(b for b in range(1, 4097) if decode_step_time_vs_batch(h100, [b], context_len=512)[0][0] >= 2 * lat[0])
steps = {b: h100.breakdown([1] * b, [512] * b) for b in (1, 8, 32, 256, 4096)}     # a decode step of batch b
printouts.roofline_shares(steps, ridge)
assert all(d["bound"] == "memory" for d in steps.values())   # at 512 positions no decode batch is compute bound
print(f"the step time doubles (the batch stops being nearly free) at batch {doubled}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# A small part, well under a tenth: the step is memory bound, and the KV each request brings to read keeps the arithmetic intensity below the ridge however large the batch (the next cell explains).
#
# </details>

# %% [markdown]
# At batch 32 the arithmetic fills well under a tenth of the step: nowhere near the compute bound. And
# the intensity levels off below the ridge however large the batch, because each request brings its own
# KV cache to read, and with full multi-head attention (Llama-2-7B: half a megabyte per position) those
# reads grow as fast as the arithmetic. What ends the free ride is memory traffic, not compute: the step
# time doubles at the batch printed above. Only a prefill, hundreds of tokens per request against one
# weight read, is compute bound; grouped-query attention (fewer KV heads) moves the levelling-off point
# up toward the ridge.

# %% [markdown]
# Compare the ratios section 2 printed for the machine you are on. The shipped model is tiny, so a CPU
# step is dominated by fixed costs (Python, the engine's bookkeeping, many small kernel calls) rather
# than by a weight read. The batch shares those costs too, so on one quiet CPU core the curve has the
# H100's shape for a different reason: from batch 1 to 32 the throughput grows more than tenfold while
# the step time grows a few times (section 2's cell printed this machine's two ratios). If that cell
# said its repeats were too noisy, its ratios describe the other work on the machine, not the model:
# re-run it when the machine is quiet. The lesson carries over: as long as the step is
# bound by something the batch shares, more requests are nearly free.
#
# The price is latency: every request in a batch waits for the whole step. Real-time chat favours small
# batches, offline jobs large ones; the scheduler must trade one for the other.

# %% [markdown]
# ## 3. The KV cache sets the largest batch
#
# The limit is memory: every concurrent request needs its own KV cache. Each position of each request
# keeps a key and a value vector in every layer:
#
# $$M_{KV} = 2 \times n_{layer} \times d_{head} \times n_{head} \times n_{max} \times b \times sizeof(dtype)$$
#
# where, under grouped-query attention, $n_{head}$ counts the *KV* heads. For example,
# Llama-2-70B (80 layers, head size 128) holds about 10 GiB of bf16 KV for one request of 4096 positions
# if all 64 heads keep their own keys and values; the released model shares 8 KV heads among them, so
# 1.25 GiB.

# %%
mha70 = replace(MODELS["llama-2-70b"], name="llama-2-70b (64 KV heads)", num_kv_heads=64)
shipped = replace(bench.engine.model_spec, name="shipped model (this notebook)",
                  dtype_bytes=bench.engine.executor.kv_caches[0][0].element_size())
printouts.kv_per_position((mha70, MODELS["llama-2-70b"], MODELS["llama-2-7b"], MODELS["llama-3-8b"], shipped),
                          4096, kv_cache_bytes)

# %% [markdown]
# If every request is given room for its maximum length up front (the next notebook's *reservation*),
# the largest batch is the memory left after the weights divided by one request's maximum KV. Llama-2-70B
# in bf16 does not fit one 80 GB GPU at all; a 7B model does, with room for a few dozen long requests:

# %%
lens = [512, 1024, 2048, 4096, 8192]
fig = go.Figure()
for hw, model in (("H100-SXM", "llama-2-7b"), ("H100-SXM", "llama-2-13b"), ("H100-SXM", "llama-3-8b"),
                  ("A100-80GB", "llama-2-7b"), ("L4", "llama-2-7b")):
    fig.add_trace(go.Scatter(x=lens, y=[max_batch_size(hw, model, n) for n in lens], mode="lines+markers",
                             name=f"{model} on {hw}"))
fig.update_layout(title="largest batch when each request holds its maximum length (90% of memory usable)",
                  xaxis=dict(title="max length per request (positions)", type="log"),
                  yaxis=dict(title="requests at once", type="log"), height=380, plot_bgcolor="white")
fig


# %% [markdown]
# Compare with section 2: the KV cache limits the batch twice. Its reads end the nearly free ride (the
# step time doubles at the batch printed there), and its size caps how many requests fit at all: a few
# dozen long ones. The largest batch is set by cache capacity, which is why memory management and
# scheduling cannot be separated. The next notebook shows how paging recovers memory that
# reservation wastes.

# %% [markdown]
# ## 4. Static vs continuous batching
#
# *Static batching* runs a group of requests until its longest member finishes and returns everyone
# together (like a coach that leaves only when every passenger has boarded and lets everyone off together
# at the end); a request that arrives meanwhile waits for the next group. *Continuous batching* re-forms
# the batch every step (every *iteration* of the model): a finished request leaves at once, and its slot
# goes to a waiting one.
#
# **Figure 1, the classic case** (this course's numbering; the mechanism is Orca's iteration-level
# scheduling, Yu et al., OSDI 2022, section 3.1). Two slots (`max_num_seqs=2`), three requests: A generates 2 tokens,
# B 5, and C (3 tokens) arrives after the first iteration. Every step costs 10 ms whatever the batch.
# minillm runs both with its simulated executor (the real scheduler and KV manager, no model) on the
# modeled clock, `ConstantStepTime(0.010)`:

# %%
def abc(batching):
    """Figure 1's three requests on 2 slots: A (2 tokens) and B (5) at t = 0, C (3) after the first step."""
    llm = LLM(model="random", executor="simulated", clock="modeled", cost_model=ConstantStepTime(0.010),
              batching=batching, max_num_seqs=2, max_model_len=64, record="summary")
    for rid, n, arrival in (("A", 2, 0.0), ("B", 5, 0.0), ("C", 3, 0.010)):
        llm.engine.add_request([10] * 8, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid,
                               arrival_time=arrival)
    return llm.engine, llm.engine.run()

figure1 = {b: abc(b) for b in ("static", "continuous")}
for batching, (eng, recs) in figure1.items():
    done = ", ".join(f"{rid} at {r.metrics.finish_time * 1e3:.0f} ms" for rid, r in eng.requests.items())
    print(f"{batching:>10}: {len(recs)} steps; returned: {done}")

# %% [markdown]
# Static batching runs A and B for 5 steps: A is done after 2 but its slot idles, held, until B ends,
# and C, which arrived after the first step, starts only when the whole batch has left: 8 steps in all.
# Continuous batching gives A's slot to C at step 3, and all three are done after 5 steps.

# %%
eng, recs = figure1["static"]
figures.gantt_figure(recs, eng.requests, title="Figure 1a, static batching: C waits for the whole batch of A and B")

# %%
eng, recs = figure1["continuous"]
figures.gantt_figure(recs, eng.requests, title="Figure 1b, continuous batching: C takes A's slot as soon as A is done")

# %% [markdown]
# **Tail padding, in a larger batch.** Ten requests arrive together: 8 generate 100 tokens, 2 generate
# 1000, with 10 slots, on the same 10 ms clock:

# %% [markdown]
# **Predict, then run.** Ten requests arrive together, 8 generate 100 tokens and 2 generate 1000, at 10 ms a step. When does a short request get its answer under static batching, and under continuous batching?

# %%
def worked_example(batching, output_lens=[100] * 8 + [1000] * 2):
    llm = LLM(model="random", executor="simulated", clock="modeled", cost_model=ConstantStepTime(0.010),
              batching=batching, max_num_seqs=10, max_model_len=1100, record="summary")   # no per-block KV map: totals are enough here
    for i, n in enumerate(output_lens):
        llm.engine.add_request([10] * 8, SamplingParams(max_tokens=n, ignore_eos=True),
                               request_id=f"{'short' if n == min(output_lens) else 'long'}{i}", arrival_time=0.0)
    return llm.engine, llm.engine.run()

runs = {b: worked_example(b) for b in ("static", "continuous")}
for batching, (eng, recs) in runs.items():
    done = {rid: r.metrics.finish_time for rid, r in eng.requests.items()}
    short = [t for rid, t in done.items() if rid.startswith("short")]
    print(f"{batching:>10}: short requests returned after {np.mean(short):5.2f} s on average, "
          f"long ones after {max(done.values()):5.2f} s ({len(recs)} steps)")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Static: after 10 s, with the long ones, because the batch is returned when its longest member ends (1000 steps). Continuous: after 1 s (100 steps): each request leaves when it is done.
#
# </details>

# %% [markdown]
# The printed averages are the hand calculation: a short request's 100 tokens take 100 steps, 1 s, but
# static batching returns it with the long ones after 1000 steps, 10 s. The two timelines show where
# static batching's time goes: short requests finish generating after 1 s and then sit, done but held,
# until the long ones end (*tail padding*).

# %%
eng, recs = runs["static"]
figures.gantt_figure(recs, eng.requests, title="tail padding, static batching: 8 short and 2 long requests, the short ones held")

# %%
eng, recs = runs["continuous"]
figures.gantt_figure(recs, eng.requests, title="the same 10 requests, continuous batching: each leaves when it is done")

# %% [markdown]
# **One long request in ten.** The tail costs more than the short requests' wait. Take 9 requests of 50
# tokens and 1 of 500 in one static batch of 10: the batch runs 500 steps, but only 9 x 50 + 500 = 950
# of its 10 x 500 = 5000 slot-steps produce a token, and the other 81% hold a finished request. *Batch
# occupancy*, the mean number of active requests over the maximum (`batch_occupancy` in
# `metrics.summarize`, beside the mean batch), measures exactly that. Here the same ten requests are
# followed by a second, identical ten, waiting:

# %%
tail10 = [50] * 9 + [500]
for batching in ("static", "continuous"):
    eng, recs = worked_example(batching, tail10 * 2)
    s = metrics.summarize(eng.request_metrics(), recs, max_num_seqs=10)
    short = [r.metrics.finish_time for rid, r in eng.requests.items() if rid.startswith("short")]
    print(f"{batching:>10}: {len(recs)} steps, occupancy {s['batch_occupancy']:4.0%} (mean batch {s['batch_size_mean']:4.1f} "
          f"of 10), short requests returned after {np.mean(short):4.2f} s on average, all done after {s['duration']:4.2f} s")
    if batching == "static":
        assert len(recs) == 2 * 500 and abs(s["batch_occupancy"] - 950 / 5000) < 1e-9   # the hand count above
    else:
        assert len(recs) == 50 + 50 + 500       # the hand count below

# %% [markdown]
# Static batching needs two full 500-step rounds at 19% occupancy. Continuous batching hands the nine
# freed slots to the next nine waiting requests (the second group's short ones) at step 50; they are
# done at step 100, when the second long request takes a slot beside the first. The set finishes after
# 50 + 50 + 500 = 600 steps instead of 1000, and the short requests come back in well under a second.
# The tail still shows: from step 100 to 500 only the two long requests run, and then one alone.
#
# **A long-tail trace.** Real output lengths are uneven: a few very long requests drag down the
# efficiency of everyone batched with them. 120 requests arrive as a Poisson process at 30 per second,
# with log-normal prompt and output lengths (median output 100 tokens, a tail up to 1000), served by a
# modeled H100 running Llama-2-7B with at most 32 requests at once. Time now comes from the roofline cost
# model, so a larger batch costs a little more per step, as it would.

# %%
tail = workloads.synthetic_trace(120, rate=30.0, prompt_len=workloads.LogNormal(200, 0.8, hi=1500),
                                 output_len=workloads.LogNormal(100, 1.0, hi=1000), vocab_size=32000, seed=0)
served = {}
for batching in ("static", "continuous"):
    llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM",
              batching=batching, max_num_seqs=32, max_model_len=4096, record="summary")   # no per-block KV map: totals are enough here
    workloads.submit_trace(llm.engine, tail)
    recs = llm.engine.run()
    served[batching] = (llm.engine, recs, metrics.summarize(llm.engine.request_metrics(), recs, max_num_seqs=32))

printouts.batching_summaries({batching: s for batching, (_, _, s) in served.items()})

# %%
figures.latency_cdf_figure({b: e.request_metrics() for b, (e, _, _) in served.items()},
                           metrics=("ttft", "e2e_latency"), unit="s",
                           title="long-tail trace: time to first token and end-to-end latency")


# %% [markdown]
# Continuous batching does not fill the 32 slots here: requests arrive 30 a second and most are done in
# well under a second, so it averages <span title="from the run">12.7</span> requests in flight (occupancy
# <span title="from the run">40%</span>). This trace is limited by its arrivals, not by the slots. What
# continuous batching changes is that no slot is held by a finished request and no newcomer waits for a
# group to end: static batching averages <span title="from the run">2.9</span> requests
# (<span title="from the run">9%</span>), because each group runs until its longest member is done while
# the requests that arrived meanwhile queue. So the same hardware produces more tokens per second, and a
# request no longer waits for strangers' long answers. The idea,
# *iteration-level scheduling*, comes from Orca (Yu et al., OSDI 2022), which reports 36.9x the
# throughput of NVIDIA FasterTransformer, a request-level (static) batching system, at the same latency
# on GPT-3 175B. (vLLM's often-quoted 2-4x over FasterTransformer and Orca, Kwon et al., SOSP 2023, is a
# different comparison: paged KV memory against systems that already batch per iteration or not; it is
# the subject of notebook 02.) It is the baseline of every modern engine and of
# the rest of this series: schedule per step, not per request.

# %% [markdown]
# ## 5. Inside one step: the token budget and the KV retained
#
# Continuous batching asks the same questions before every step: which requests finished, which
# continue, which waiting ones can join? Figure 2 (steps 0 to 2 of the widget below) walks through it
# with at most two requests:
# A finishes, B continues, C and D wait; after A is cleaned up, B's decode and C's prefill form the next
# batch while D keeps waiting. Figure 3 then counts **two different resources**:
#
# * **tokens processed in this execution**, under the *execution-token budget* of 8: B's decode is
#   1 token, C's prefill 6, so **1 + 6 = 7** tokens fit. B's 6 earlier positions are not counted again
#   (their K/V is cached), although its attention reads them;
# * **KV retained after the execution**, in a capacity of 24 positions: B grows from 6 to 7 positions,
#   C creates 6, so **7 + 6 = 13** positions.
#
# Here is that scenario on the real engine: `max_num_batched_tokens=8` (the budget), a KV cache of 24
# blocks of one position (`block_size=1`, so the map shows positions), `max_num_seqs=2`. A (2-token
# prompt, 2 output tokens) and B (5-token prompt) run first; C (6 tokens) and D (3) wait. Each Step runs
# the Triton kernel. What the tokens say does not matter here, only how many there are, so the model is
# minillm's tiny random Llama (`model="random"`, two layers): on a CPU, where the kernel runs in Triton's
# interpreter, that keeps a Step well under a second.

# %%
def figure2_engine():
    llm = LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton", block_size=1,
              num_kv_blocks=24, max_num_batched_tokens=8, max_num_seqs=2, clock="modeled", cost_model=0.010)
    for rid, prompt_len, out_len in (("A", 2, 2), ("B", 5, 10), ("C", 6, 4), ("D", 3, 3)):
        llm.engine.add_request(list(range(100, 100 + prompt_len)),
                               SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0),
                               request_id=rid, arrival_time=0.0)
    return llm

fig23 = Stepper(figure2_engine, title="Figures 2 and 3: budget 8 tokens, KV capacity 24 positions, at most 2 requests")
fig23

# %% [markdown]
# Step 0 prefills A and B (2 + 5 = 7 tokens). Step 1 decodes both; A reaches its stopping condition and
# its KV is freed, while C and D wait (two requests already run). Step 2 is Figure 3: B's decode and C's
# prefill. The same three steps in code, on the cells' own copy of the engine (`fig23_run`), so the
# widget above stays where you left it, ready to step:

# %%
fig23_run = figure2_engine().engine      # the cells' own copy: the widget above stays yours to step
for _ in range(3):
    rec = fig23_run.step()
    print(rec.summary())
print()
print("tokens processed: " + " + ".join(str(e.num_new_tokens) for e in rec.batch)
      + f" = {rec.num_batched_tokens} of the budget of {rec.token_budget}")
print("KV retained:      " + " + ".join(str(rec.kv.per_request[e.request_id].used) for e in rec.batch)
      + f" = {rec.kv.used} of {rec.kv.total} positions")

# %% [markdown]
# Equal token counts do not mean equal step times: the budget counts *new* positions, but B's attention
# also reads its cached ones. And the 13 positions fit in 24 only if the memory manager can actually
# hand them out: the next notebook shows a manager (max-length reservation) that cannot.
#
# The kernel, checked on this engine's cache after Figure 3's step:

# %%
print(check_paged_attention(fig23_run))   # the Triton kernel against its torch reference

# %% [markdown]
# Deciding at every step, rather than once per batch, has three consequences an engine is built around.
# The **batch size varies** from step to step, so nothing may be sized for one batch shape. The requests
# of one step have **ragged lengths**: different numbers of new tokens (a prefill beside decodes) and
# different contexts, so the kernel takes each request's positions and block table rather than a padded
# rectangle. And the **decision must be cheap**, because it is paid before every step (notebook 03b,
# section 2, measures what it costs). The rest of this run, step by step:

# %%
fig23_run.run()
for r in fig23_run.step_records:
    print(f"step {r.step}: batch of {len(r.batch)}: " + ", ".join(
        f"{e.request_id} {e.phase} {e.num_new_tokens} new of {e.context_len}" for e in r.batch))
sizes = {len(r.batch) for r in fig23_run.step_records}
ragged = [r.step for r in fig23_run.step_records if len({e.context_len for e in r.batch}) > 1]
print(f"batch sizes seen: {sorted(sizes)}; steps whose requests have different context lengths: {ragged}")

# %% [markdown]
# ## Exercises
#
# Each exercise is a function in `exercises/ex01_batching.py`, graded against the engine. The cells call
# your version; until you write it, they print a one-line reminder instead.
#
# **Exercise 1, `kv_cache_bytes(model, num_tokens, batch)`**: the $M_{KV}$ formula of section 3. The grader
# also checks it predicts the size of the KV tensors the engine really allocates.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 3 prints the KV of one position for several models (Llama-2-7B: 512 KiB). What does one position store in every layer, and for how many heads? Then scale by positions and requests.
#
# </details>
# <details><summary>Hint 2</summary>
#
# The cell below prints the expected size for Llama-2-70B with 64 KV heads at 4096 positions (about 10.7 GB). If yours is off by an exact factor, that factor names the term you missed.
#
# </details>

# %%
with impl.attempt("ex01.kv_cache_bytes"):
    print(f"{ex.kv_cache_bytes(mha70, 4096) / 1e9:.2f} GB  (section 3: about 10 GiB, 10.7 GB)")

# %% [markdown]
# **Exercise 2, `max_batch_size(hardware, model, max_len)`**: how many requests of `max_len` positions fit
# beside the weights (section 3's plot).

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 3's plot is the answer to reproduce: the largest batch at each length. The docstring says which fraction of memory is usable and what the weights take from it.
#
# </details>
# <details><summary>Hint 2</summary>
#
# A request of `max_len` positions either fits whole or not at all, and a model too large for the GPU fits none (never a negative count). The cell below prints the cost model's answer to compare with.
#
# </details>

# %%
with impl.attempt("ex01.max_batch_size"):
    print(ex.max_batch_size(HARDWARE["H100-SXM"], MODELS["llama-2-7b"], 2048), "requests; the cost model says",
          max_batch_size("H100-SXM", "llama-2-7b", 2048))

# %% [markdown]
# **Exercise 3, `decode_step_time(model, hardware, batch, context_len)`**: one decode step on the roofline
# (section 1). Your ratios should match the modeled H100's printed in section 2 (about 20x / 1.5x).

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 1's roofline: a step takes the longer of its arithmetic time and its memory time, each at the achieved rate (the docstring's efficiencies), plus a fixed overhead.
#
# </details>
# <details><summary>Hint 2</summary>
#
# Compare term by term with `RooflineCostModel.breakdown` (section 1's figure is drawn from it) on one batch: weights, attention, KV read and KV written. The ratios the cell prints should match section 2's (about 20x / 1.5x).
#
# </details>

# %%
with impl.attempt("ex01.decode_step_time"):
    t = [ex.decode_step_time(MODELS["llama-2-7b"], HARDWARE["H100-SXM"], b, 512) for b in (1, 32)]
    print(f"batch 1 -> 32: throughput x{(32 / t[1]) / (1 / t[0]):.1f}, latency x{t[1] / t[0]:.2f}")

# %% [markdown]
# **Exercise 4, `completion_times(output_lens, max_num_seqs, step_time, batching)`**: when each request is
# returned under static and continuous batching (section 4). The grader runs the engine on random lists
# and compares.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Figure 1 draws both timelines: count in steps first and convert to seconds at the end. In Figure 1a, when does the second group start?
#
# </details>
# <details><summary>Hint 2</summary>
#
# In Figure 1b a freed slot goes to the next waiting request at once. The invariant: at most `max_num_seqs` requests run at any step, and no slot idles while a request waits.
#
# </details>

# %%
with impl.attempt("ex01.completion_times"):
    for batching in ("static", "continuous"):
        t = ex.completion_times([100] * 8 + [1000] * 2, max_num_seqs=10, step_time=0.010, batching=batching)
        print(f"{batching:>10}: short requests {np.mean(t[:8]):.2f} s, long {np.mean(t[8:]):.2f} s")

# %% [markdown]
# **Exercise 5, `plan_step(running, waiting, token_budget, free_kv_positions, max_num_seqs)`**: the batch
# the scheduler forms for the next step (section 5): running requests first, then waiting ones in arrival
# order while a slot, budget and KV room remain. The grader asks your function before every step of
# random workloads and compares with what the real scheduler ran.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 5's step 2 (Figure 3) is the case to work by hand: who runs, with how many tokens, and why the others wait (the step record's waiting reasons).
#
# </details>
# <details><summary>Hint 2</summary>
#
# The invariants the graders check on every plan: the new tokens fit the budget, the new positions fit the free KV, the requests fit `max_num_seqs`; running requests come before waiting ones, and under FCFS the first waiting request that does not fit stops admission.
#
# </details>

# %%
with impl.attempt("ex01.plan_step"):
    print(ex.plan_step([("B", 7, 6)], [("C", 6), ("D", 3)], token_budget=8, free_kv_positions=18, max_num_seqs=2))

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex01_batching.py` (its stubs raise `NotImplementedError` until you fill them in;
# the docstrings say exactly what each must do). The cells above run *your* version: `impl.load` reads
# the environment variable `MINILLM_IMPL` (unset: `exercises`, yours; `solutions`: the reference answers).
# From the repository root:
#
# ```bash
# make grade EX=01                                            # every ex01 grader, against exercises/
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex01 tests/test_exercises.py -k plan_step   # one exercise
# ```
#
# A failing grader says what it expected and where the expectation came from (numbers worked by hand,
# the engine's cost model, or what the real scheduler did on the same requests).
#
# After a grade that fails an exercise you attempted (a stub left untouched is no attempt), that
# exercise's cell above offers its worked answer, folded: the reference code and why it works. Open it
# once you have tried. From a cell, `impl.grade("01")` prints the same report and offers the answers
# of the exercises it failed; `impl.show_worked_answer("ex01", 1)` opens exercise 1's.

# %% [markdown]
# ## Summary
#
# 1. A decode step reads every weight once whatever the batch, so batching amortises that read: throughput grows far faster than the step time.
# 2. Decode stays below the roofline's ridge: memory bound, its arithmetic units mostly idle, so a larger batch is nearly free until the KV reads grow.
# 3. The KV cache costs 2 x layers x KV heads x head_dim x bytes per position, per request; memory left after the weights sets the largest batch.
# 4. Static batching holds finished requests until the longest one ends; continuous batching re-forms the batch every step.
# 5. Each step plans new tokens for running and waiting requests under the execution-token budget, the slots and the free KV.

# %% [markdown]
# ## Check your understanding
#
# 1. Why does the step time grow so little from batch 1 to 32 on the modeled H100?
# 2. Grouped-query attention keeps 8 KV heads instead of 32. What happens to the largest batch?
# 3. In the static batch of one 500-token request and nine of 50, what fraction of slot-steps produce a token?
# 4. Two steps process the same number of new tokens. Why can they take different times?
#
# <details><summary>Answers</summary>
#
# 1. The weight read dominates a small batch's step and does not grow with the batch; only the KV reads and the arithmetic grow, and both are small until the batch is large.
# 2. Each position's KV is four times smaller, so about four times as many positions, and requests, fit in the memory left after the weights.
# 3. (9 x 50 + 500) / (10 x 500) = 19%: the other 81% of slot-steps hold finished requests.
# 4. The budget counts new positions only; attention also reads every cached position, so a step of decodes over long contexts costs more than one over short ones.
#
# </details>
