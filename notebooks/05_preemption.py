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
# # 05 · Preemption
#
# Paging admits a request as soon as its prompt fits, without knowing how long its answer will be
# (notebook 02). So the cache can fill up while everyone is still generating, and then a running request
# needs a block that does not exist. Under high load, even with prefix caching, GPU memory may not hold
# the KV of every active request, and the engine must pause some requests to free memory for others.
#
# Two ways to pause one (both in vLLM, Kwon et al., SOSP 2023, section 4.5):
#
# - **Swap**: move its KV cache to slower (host) memory and restore it later. Keeps the work, costs
#   bandwidth.
# - **Recompute**: discard its KV cache and run the prefill again on resume. Frees memory at once, wastes
#   the work done.
#
# Either way the decision happens between steps: after each step the scheduler checks whether it must
# preempt; a step in flight is never interrupted. This notebook:
#
# 1. memory pressure and the victim, stepped live: recompute and swap side by side;
# 2. recompute or swap: a cost rule, and a map of which one wins;
# 3. at scale: recompute, swap, and the rule choosing per victim;
# 4. thrashing, and how headroom damps it;
# 5. priority preemption: pushing a lower class out of memory;
# 6. exercises: the recompute-or-swap decision, the choice of victim, and the headroom a batch needs.

# %% [markdown]
# **After this notebook you can:**
#
# - say which request the engine gives up when a block runs out, and what recompute and swap each do with its KV;
# - compute a victim's recovery time both ways, M_KV / B_PCIe against (n_input + n_generated) / S_prefill, and
#   decide which is cheaper on a given link;
# - explain why recompute often costs no more than swap inside a running engine, although it redoes work;
# - size the headroom a batch needs to decode k steps without a preemption, and recognise thrashing by its
#   preemption rate;
# - bound how long an urgent request waits for the step in flight, and let a priority class push a lower one out.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels

import numpy as np
import plotly.graph_objects as go

from minillm import LLM, SamplingParams, impl
from minillm.viz import figures, printouts
from minillm.analysis import workloads
from minillm.viz import LockstepStepper

# %%
from dataclasses import replace

from plotly.subplots import make_subplots

from minillm.sim.costmodel import HARDWARE, RooflineCostModel, swap_or_recompute
from minillm.core.policies import Priority
from minillm.analysis.workloads import TraceRequest, Uniform
from minillm.sim.replay import replay

ex = impl.load("ex05_preemption")    # your exercises/ex05_preemption.py (MINILLM_IMPL=solutions: the answers);
                                     # re-run this cell after editing the file: impl.load reads it again
H100 = RooflineCostModel("H100-SXM", "llama-2-7b")

def serve(trace, cost_model=H100, **config):
    """The simulated executor (the real scheduler and KV manager, no forward pass) serving Llama-2-7B on the
    modeled clock of `cost_model`. Returns the engine, its requests' metrics, and metrics.summarize's dict."""
    config.setdefault("num_kv_blocks", 1024)             # 16,384 positions of KV (8 GiB), as in notebook 02
    config.setdefault("max_num_seqs", 256)
    return replay(trace, model="llama-2-7b", cost_model=cost_model, max_model_len=8192, max_num_batched_tokens=8192,
                  **config)


# %% [markdown]
# ## 1. Memory pressure, and the victim
#
# A cache of 8 blocks of 4 positions (32 positions) and three requests, A, B and C, with prompts of 7, 6
# and 5 tokens and answers of 7, 7 and 6 tokens. All three prompts fit (18 positions), so all three are
# admitted at once; together they will need 35. Left: `preemption_mode="recompute"`. Right:
# `preemption_mode="swap"` with a host pool of 12 blocks (`num_swap_blocks`). Each Step runs the Triton
# attention kernel. On the right, blocks that move to or from the host are copied with plain torch
# copies (`minillm_kernels.ops.swap_blocks`): a host-device transfer is the work of the GPU's copy engines (DMA), not
# of a kernel.

# %%
def pressure_engine(mode):
    llm = LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton", block_size=4, num_kv_blocks=8,
              max_num_batched_tokens=32, max_num_seqs=4, preemption_mode=mode, num_swap_blocks=12 if mode == "swap" else 0,
              clock="modeled", cost_model=0.010)
    for rid, prompt_len, out_len in (("A", 7, 7), ("B", 6, 7), ("C", 5, 6)):
        llm.engine.add_request(list(range(100, 100 + prompt_len)),
                               SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0),
                               request_id=rid, arrival_time=0.0)
    return llm

pressure = LockstepStepper(lambda: pressure_engine("recompute"), lambda: pressure_engine("swap"),
                           names=["recompute", "swap (host pool of 12 blocks)"],
                           title="8 blocks of 4 positions; A, B, C admitted together")
pressure

# %% [markdown]
# Five steps: the prefills, then three decodes that fill the last free block, and then C's next
# position needs a new block, and none is free. The cells below step their own copies of the two
# engines (`pressure_runs`), so the widget above stays where you left it, ready to step.

# %% [markdown]
# **Predict, then run.** After five steps C needs a new block and none of the 8 is free. Which request does
# each engine give up, and where does its KV go: on the left (recompute), on the right (swap)?

# %%
pressure_runs = [pressure_engine("recompute"), pressure_engine("swap")]   # the widget above stays yours
for _ in range(5):
    recs = [llm.engine.step() for llm in pressure_runs]
for name, rec in zip(pressure.names, recs):
    print(f"{name}: {rec.summary()}\n")
figures.compare_kv_figure(dict(zip(pressure.names, recs)), colors=pressure.colors, width=560)

# %% [markdown]
# <details><summary>Answer</summary>
#
# Both give up C, the most recently admitted request (here the very one that needed the block). Recompute
# drops C's KV, so its blocks return to the free pool and C goes back to the front of the queue; swap copies
# C's blocks into the host pool, and C waits in the swapped list. The next cell says why the default picks C.
#
# </details>

# %% [markdown]
# The scheduler serves running requests first, in admission order; when one cannot get its block it asks
# the policy for a *victim* (`Policy.pick_victim`). minillm's default gives up the **most recently
# admitted** request: it has done the least work (least to recompute, least to copy), and under FCFS the
# newest should yield to the oldest. Here that is C, the very request that needed the block. With
# recompute (the widget's left half, the upper map) C's KV is dropped and C goes back to the front of
# the queue; with swap (the right half, the lower map) C's 3 blocks are copied to host memory and C
# waits in the swapped list. A and B keep decoding; the kernel, checked against its torch reference on
# both caches:

# %%
print(check_paged_attention(pressure_runs[0].engine))   # the Triton kernel against its torch reference
print(check_paged_attention(pressure_runs[1].engine))   # the Triton kernel against its torch reference

# %% [markdown]
# Run both to the end:

# %%
for llm in pressure_runs:
    llm.engine.run()
printouts.return_after_preemption({name: llm.engine.step_records for name, llm in zip(pressure.names, pressure_runs)},
                                  "C", after_step=5)     # C's first step back after its preemption

# %% [markdown]
# With recompute C's return is a prefill of its 5 prompt tokens *and* the 4 it had generated, so its
# recovery takes (n_input + n_generated) / S_prefill at a prefill speed of S_prefill tokens/s. With swap
# its blocks are copied back and it simply decodes its next token: recovery takes M_KV / B_PCIe, its KV
# bytes over the host link's bandwidth. Both
# give the same tokens (greedy decoding here); only the cost differs.
#
# ## 2. Recompute or swap: the cost rule
#
# Which is cheaper depends on how much KV the victim holds against how many tokens it would prefill
# again: swap when M_KV / B_PCIe < (n_input + n_generated) / S_prefill, recompute otherwise. Typical
# numbers: PCIe 4.0 x16 moves about 32 GB/s and PCIe 5.0 x16 about 64 GB/s, so 1 GB of KV crosses in
# about 31 ms (16 ms on PCIe 5.0), while a 2000-token prompt prefilled at 4000 tokens per second (a
# large model, or a modest GPU) takes 500 ms. The prefill speed varies more than the link: the modeled
# H100 prefills Llama-2-7B's 2000 tokens an order of magnitude faster (the second line below), which
# moves the balance toward recompute. minillm's `costmodel.swap_or_recompute` is that rule:

# %%
print("1 GB over PCIe 4.0 vs 2000 tokens at 4000 tokens/s:",
      swap_or_recompute(1e9, 2000, 32e9, 2000 / 0.5))
print(f"Llama-2-7B on a modeled H100: {H100.model.kv_bytes_per_token / 2**10:.0f} KiB of KV per position; a 2000-token "
      f"prefill takes {H100.step_time([2000], [2000]) * 1e3:.0f} ms; its {2000 * H100.model.kv_bytes_per_token / 1e9:.2f} GB "
      f"cross PCIe 5.0 in {H100.swap_time(2000 * H100.model.kv_bytes_per_token) * 1e3:.0f} ms")

# %% [markdown]
# Which one wins, over every prompt length and every KV size. Each cell applies the rule with the
# H100's prefill speed at that length (from the roofline: longer prompts cost more per token, because
# attention grows with the square of the length). The solid line is the boundary over a PCIe 5.0 link
# of its own (64 GB/s); the dashed one over a link four GPUs share (16 GB/s each, a common server
# layout). A real model's requests lie on a line through the origin, M_KV = n x (KV bytes per position):

# %%
n_grid = np.linspace(64, 8192, 64).astype(int)                  # tokens to recompute (prompt + generated)
kv_grid = np.linspace(0.03e9, 4.5e9, 60)                        # bytes of KV to copy
prefill_s = np.array([H100.step_time([int(n)], [int(n)]) for n in n_grid])
wins = np.array([[1.0 if swap_or_recompute(kv, int(n), 64e9, n / t) == "swap" else 0.0
                  for n, t in zip(n_grid, prefill_s)] for kv in kv_grid])
fig = go.Figure(go.Heatmap(x=n_grid, y=kv_grid / 1e9, z=wins, showscale=False, hoverinfo="skip",
                           colorscale=[[0, "#f4c7a1"], [1, "#a9d3ee"]]))
for bw, dash, name in ((64e9, "solid", "boundary, PCIe 5.0 x16 (64 GB/s)"), (16e9, "dash", "boundary, 16 GB/s (a shared link)")):
    fig.add_trace(go.Scatter(x=n_grid, y=bw * prefill_s / 1e9, mode="lines", name=name, line=dict(color="black", dash=dash)))
for model, color in (("llama-2-7b", "#c0392b"), ("llama-3-8b", "#6c3483")):
    per = RooflineCostModel("H100-SXM", model).model.kv_bytes_per_token
    fig.add_trace(go.Scatter(x=n_grid, y=n_grid * per / 1e9, mode="lines", line=dict(color=color, width=3),
                             name=f"{model} requests ({per / 2**10:.0f} KiB per position)"))
fig.add_trace(go.Scatter(x=[2000], y=[1.0], mode="markers+text", text=["1 GB vs 2000 tokens"], textposition="top center",
                         marker=dict(size=12, color="black", symbol="star"), showlegend=False))
fig.add_annotation(x=1200, y=4.0, text="recompute wins", showarrow=False, font=dict(size=14))
fig.add_annotation(x=6500, y=0.5, text="swap wins", showarrow=False, font=dict(size=14))
fig.update_layout(title="recompute or swap, on a modeled H100 (Llama-2-7B's prefill speed)",
                  xaxis_title="tokens to recompute (n_input + n_generated)", yaxis_title="KV to copy, M_KV (GB)",
                  yaxis_range=[0, 4.5], height=440, legend=dict(orientation="h", y=-0.2), plot_bgcolor="white")
fig

# %% [markdown]
# On its own PCIe 5.0 link, swapping Llama-2-7B's KV (half a megabyte per position: full multi-head
# attention, 32 layers) beats recomputing it at every length, and grouped-query attention (Llama-3-8B,
# a quarter of that) makes swapping cheaper still. Share the link four ways and Llama-2-7B's line
# crosses into recompute territory. The rule is simple; its inputs are not. And it leaves things out:
# recomputation is often cheaper than it sounds, because prefill is compute bound and efficient, while
# swapping takes bandwidth decode needs, and host memory. Hence a common rule of thumb: under pressure,
# prefer recompute to swap unless measurement says otherwise.
#
# ## 3. At scale: recompute, swap, and the rule
#
# 150 requests with long prompts (500 to 1500 tokens) and answers (200 to 600) arrive at 40 per second on
# the modeled H100 with 8 GiB of KV (as in notebook 02, a deliberate restriction well below the 58 GB or so
# left after the weights, to create memory pressure): far more than fits, so the engine preempts all the time. minillm's
# `preemption_mode="auto"` applies the rule to each victim (`CostModel.preemption_mode`), with the cost
# model's PCIe bandwidth and prefill speed.

# %% [markdown]
# **Predict, then run.** Section 2's figure says that on its own PCIe 5.0 link swapping Llama-2-7B's KV beats
# recomputing it at every length. On the burst below, will `"swap"` finish with clearly more tokens per second
# than `"recompute"`, about the same, or fewer?

# %%
burst = workloads.synthetic_trace(150, rate=40, prompt_len=Uniform(500, 1500), output_len=Uniform(200, 600), seed=0)
shared_link = RooflineCostModel(replace(HARDWARE["H100-SXM"], name="H100, shared 16 GB/s link", pcie_bandwidth=16e9),
                                "llama-2-7b")
modes = {"recompute": dict(preemption_mode="recompute"),
         "swap": dict(preemption_mode="swap", num_swap_blocks=4096),
         "auto, PCIe 5.0": dict(preemption_mode="auto", num_swap_blocks=4096),
         "auto, shared 16 GB/s link": dict(preemption_mode="auto", num_swap_blocks=4096, cost_model=shared_link)}
preempt_runs = {name: serve(burst, **cfg) for name, cfg in modes.items()}     # (engine, metrics, summary)
printouts.preemption_summaries({name: (eng.stats(), s) for name, (eng, _, s) in preempt_runs.items()})

# %% [markdown]
# <details><summary>Answer</summary>
#
# About the same, although recompute prefills tens of thousands of tokens again: compare the two
# `tokens/s` columns. The rule prices one victim at a time; the next cell says what it leaves out.
#
# </details>

# %% [markdown]
# The rule picks swap where the link is fast and recompute where it is shared. But look at the
# outcome: even on the fast link, recompute ends up as fast as swap, although it prefills tens of
# thousands of tokens again. The rule compares recovery times one victim at a time; in a running engine a
# recomputed prompt is prefilled *inside* a step that other requests' decodes share, where the extra
# tokens use arithmetic the memory-bound decode left idle, while a copy is time added to the step it
# happens in, in front of everyone's next token. (The modeled clock charges it that way; it does not
# model the host memory a swap pool takes.) That is why recomputation is often cheaper than it sounds,
# and why the rule of thumb prefers it unless measurement says otherwise. Either way the work lost is small next to the overload here: the queue, not the
# preemptions, sets the latency.
#
# ## 4. Thrashing, and headroom
#
# Under load, preemption can *thrash*. The mechanism: at 100% of the cache, every
# growing request that needs a block forces a preemption; a preempted request goes back to the front of
# the queue and is readmitted as soon as its prompt fits again, which fills the cache again, and the cycle
# repeats, redoing prefills nobody asked for. The fixes are admission control, headroom and
# hysteresis: a system at exactly 100% of its capacity has no room to absorb variance. minillm's `watermark` is
# headroom: admission keeps that fraction of the blocks free, for running requests to grow into.

# %% [markdown]
# **Predict, then run.** Admission will keep 0% to 20% of the blocks free. Which way does throughput move at 5%
# headroom, and which way at 20%? And the tokens prefilled again?

# %%
watermarks = [0.0, 0.02, 0.05, 0.1, 0.2]
wm_runs = {}
for wm in watermarks:
    eng, m, s = (preempt_runs["recompute"] if wm == 0.0 else serve(burst, preemption_mode="recompute", watermark=wm))
    wm_runs[wm] = (eng.stats()["recomputed_tokens"], s)
printouts.watermark_summaries(wm_runs)     # per watermark: preemptions, tokens prefilled again, throughput
tput = {wm: s["output_throughput"] for wm, (_, s) in wm_runs.items()}
print(f"throughput against no headroom: 5% {tput[0.05] / tput[0.0] - 1:+.1%}, 20% {tput[0.2] / tput[0.0] - 1:+.1%}")
assert abs(tput[0.05] / tput[0.0] - 1) < 0.02 and tput[0.2] < tput[0.0]    # what the text below says
useful = sum(r.prompt_len + r.output_len for r in burst)
fig = make_subplots(specs=[[{"secondary_y": True}]])
fig.add_trace(go.Bar(x=[f"{w:.0%}" for w in watermarks], y=[100 * wm_runs[w][0] / useful for w in watermarks],
                     name="work redone (% of the trace's tokens)", marker_color="#e39a5b"), secondary_y=False)
fig.add_trace(go.Scatter(x=[f"{w:.0%}" for w in watermarks], y=[wm_runs[w][1]["output_throughput"] for w in watermarks],
                         name="throughput (tokens/s)", mode="lines+markers", line=dict(color="#2d6a9f")), secondary_y=True)
fig.update_yaxes(title_text="% of tokens prefilled again", secondary_y=False, rangemode="tozero")
fig.update_yaxes(title_text="tokens / s", secondary_y=True, rangemode="tozero")
fig.update_layout(title="headroom: a little removes most of the thrashing; a lot leaves memory idle",
                  xaxis_title="watermark (fraction of blocks admission keeps free)", height=380, plot_bgcolor="white")
fig

# %% [markdown]
# <details><summary>Answer</summary>
#
# At 5% throughput hardly moves (within 2%, the cell asserts it) while most of the redone prefills
# disappear; at 20% the batch shrinks and throughput falls below no headroom at all. Headroom trades
# memory for stability; past a few percent it only costs.
#
# </details>

# %% [markdown]
# Without headroom the engine prefills a quarter as many tokens again as the trace holds. A few percent of
# headroom removes most of it while throughput hardly moves (the line printed under the table); with a
# fifth of the cache held back the batch shrinks and throughput falls. The preemption rate is the
# symptom to watch: a high rate means thrashing. On this modeled H100 a prefill is cheap, so thrashing wastes compute rather than
# collapsing throughput; where a prefill is expensive relative to a decode step (long prompts, slower
# compute), the same cycle eats the machine.
#
# **Move the slider.** The same burst in a what-if widget: each move of a control re-simulates the 150
# requests (the same scheduler and KV manager) and redraws the latency CDFs, the KV cache over the run and,
# on the line under the controls, throughput, preemptions and the tokens prefilled again, the previous
# setting dashed. It starts where the table's first row is (no headroom, recompute, 8 GiB). Try 0% against
# 5% headroom; then swap instead of recompute; then twice the memory, where headroom stops mattering.

# %%
from minillm.viz.whatif import WhatIf, WhatIfSettings

headroom = WhatIf(WhatIfSettings(max_num_batched_tokens=8192, kv_capacity_tokens=16_384),
                  controls=("watermark", "preemption", "kv"), trace=burst, model="llama-2-7b", cost_model=H100,
                  max_num_seqs=256, config=dict(max_model_len=8192), choices=dict(kv=(8_192, 16_384, 32_768, 65_536)))
assert headroom.summary["num_preemptions"] == wm_runs[0.0][1]["num_preemptions"]    # the table's first row
headroom

# %% [markdown]
# Behind admission control and headroom is one principle: **never start what you cannot finish**. A
# request admitted into memory that will not be there when it grows has bought a prefill that will be
# thrown away. Taken literally, that means admitting a request only when its whole length fits, which is
# max-length reservation (notebook 02), here even with the true output lengths, which a real engine does
# not know:

# %%
eng, m, s = serve(burst, kv_allocation="reserved")
print(f"reserve the whole length at admission: {s['num_preemptions']} preemptions | {s['output_throughput']:5.0f} "
      f"tokens/s, mean batch {s['batch_size_mean']:4.1f} (paged, 5% headroom: {wm_runs[0.05][1]['output_throughput']:5.0f} "
      f"tokens/s, mean batch {wm_runs[0.05][1]['batch_size_mean']:4.1f})")
assert s["num_preemptions"] == 0 and s["batch_size_mean"] < wm_runs[0.05][1]["batch_size_mean"]

# %% [markdown]
# No preemption at all, and a smaller batch: memory is held for tokens that do not exist yet. Headroom is
# the cheap approximation of the same principle, betting on the average growth instead of the worst case.
#
# ## 5. Priority preemption
#
# Preemption is also how priority classes get memory (notebook 03's head-of-line blocking across classes, now for KV
# memory instead of a slot): a high-priority request that must run at once. Two low-priority
# requests grow until they hold 48 of the cache's 50 blocks; at 1.8 s a high-priority request arrives
# needing 7 blocks for its prompt. Under FCFS it waits for a low one to finish; `Priority` preempts
# the lowest class, most recent first, until the new request fits.

# %%
mem_trace = [TraceRequest(f"low{i}", 0.0, 200, 200, priority=1) for i in range(2)] + [TraceRequest("high", 1.8, 100, 20, priority=0)]
prio = {}
for name, pol in (("FCFS", "fcfs"), ("priority, preempting", Priority(preempt=True))):
    eng, m, s = serve(mem_trace, cost_model=0.010, policy=pol, num_kv_blocks=50, max_num_seqs=16)
    prio[name] = eng
    events = [f"{p.request_id} ({p.mode}: {p.reason})" for r in eng.step_records for p in r.preempted]
    print(f"{name:<22} high waits {m['high'].queue_wait * 1e3:5.0f} ms; preempted: {', '.join(events) or 'nobody'}")
eng = prio["priority, preempting"]
figures.gantt_figure(eng.step_records, eng.requests, title="the high-priority request pushes low1 out of memory")

# %% [markdown]
# The victim waits, then recomputes its 200-token prompt and everything it had generated: the price of
# the high class starting at once instead of 200 ms later, paid by the low class. That trade is the point of priority classes, and
# why classes need careful definition.
#
# Preemption here is coarser than in an operating system. A CPU scheduler can take the processor from a
# process at almost any instruction: a context switch costs microseconds and a time slice lasts a few
# milliseconds, so an urgent process barely waits. An engine can act only between steps, and a step in
# flight runs to its end. The longest an urgent request waits for it is one step, and a step's length
# depends on what it holds (a modeled H100):

# %%
llama3 = RooflineCostModel("H100-SXM", "llama-3-8b")
pauses = {}
for what, cm, new_tokens, context in (
        ("Llama-2-7B, a decode step of 32 requests (512 positions each)", H100, [1] * 32, [512] * 32),
        ("Llama-2-7B, the prefill of a 2,000-token prompt", H100, [2000], [2000]),
        ("Llama-3-8B, the prefill of an 8,000-token prompt", llama3, [8000], [8000])):
    pauses[what] = cm.step_time(new_tokens, context)
    print(f"{what:<62} {pauses[what] * 1e3:7.1f} ms")
assert min(pauses.values()) > 1e-3 and max(pauses.values()) > 0.1     # milliseconds, and hundreds of them

# %% [markdown]
# Milliseconds for a decode step, tens to hundreds of milliseconds for a prefill, and more on a larger
# model or a slower GPU: thousands of times a context switch. Chunked prefill (notebook 03b, section 1)
# bounds the pause by cutting the prefill into pieces. And the preemption itself costs a recompute or a
# swap, so an engine preempts only for a reason. Memory pressure (sections 1 to 4) and priority (this section) are the common ones. A third is low utilisation: when a
# few long requests hold most of the cache while many short ones wait, the batch is small and the
# GPU's compute units idle (notebook 01, section 2); pausing one long request to admit several short
# ones raises the batch and the throughput, at the cost of the long request's latency and a recompute or
# swap. minillm preempts for memory, for a priority class (`Priority`) and for a higher MLFQ level
# (`MLFQ`, notebook 03); none of its policies uses utilisation as the trigger.

# %% [markdown]
# ## Exercises
#
# In `exercises/ex05_preemption.py`; each runs inside the engine.
#
# **Exercise 1, `swap_time`, `recompute_time`, `swap_or_recompute`**: the cost rule of section 2.
# `ex.YourCostModel` is the H100 roofline asking *your* rule whenever the engine preempts with
# `preemption_mode="auto"`. Section 3's trace, with your rule deciding:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 2's first cell prints the worked numbers (31 ms to copy 1 GB over PCIe 4.0, 500 ms to prefill 2000 tokens at 4000 tokens/s): your two times must reproduce them, in seconds. The docstring of `swap_or_recompute` says which way a tie goes.
#
# </details>

# %%
with impl.attempt("ex05.swap_or_recompute"):
    print("1 GB over PCIe 4.0 vs a 2000-token prefill:", ex.swap_or_recompute(1e9, 2000, 32e9, 4000.0))
    for name, hw in (("PCIe 5.0", HARDWARE["H100-SXM"]), ("shared 16 GB/s link", shared_link.hardware)):
        eng, m, s = serve(burst, preemption_mode="auto", num_swap_blocks=4096,
                          cost_model=ex.YourCostModel(hw, "llama-2-7b"))
        st = eng.stats()
        print(f"your rule, {name:<20} {st['preemptions_recompute']:>3} recomputed, {st['preemptions_swap']:>3} swapped")

# %% [markdown]
# **Exercise 2, `LeastProgressVictim.pick_victim`**: give up the running request with the least KV
# (the least work to redo or copy) instead of the most recently admitted. Section 3's trace, recompute:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 1's victim was C, the most recently admitted. Yours is the candidate holding the fewest positions of KV (`Request.num_computed_tokens`); the docstring says which one gives way when two hold the same, and the grader checks every pick against the candidates the scheduler offered.
#
# </details>

# %%
with impl.attempt("ex05.LeastProgressVictim"):
    for name, pol in (("most recently admitted (default)", "fcfs"), ("least progress (yours)", ex.LeastProgressVictim())):
        eng, m, s = serve(burst, preemption_mode="recompute", policy=pol)
        print(f"{name:<34} {s['num_preemptions']:3d} preemptions, {eng.stats()['recomputed_tokens']:>6,} tokens prefilled "
              f"again, {s['output_throughput']:5.0f} tokens/s")

# %% [markdown]
# **Exercise 3, `PriorityPreemption`**: `order_waiting`, `pick_victim` and `preempt_for` (section 5):

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 5's Gantt chart is the behaviour to reproduce: the high class starts at once and the low request admitted last gives way. The graders compare your schedule with the engine's `Priority(preempt=True)` request by request; `minillm/core/policies.py` has the hooks' contracts.
#
# </details>

# %%
with impl.attempt("ex05.PriorityPreemption"):
    eng, m, s = serve(mem_trace, cost_model=0.010, policy=ex.PriorityPreemption(), num_kv_blocks=50, max_num_seqs=16)
    print(f"your priority policy: high waits {m['high'].queue_wait * 1e3:.0f} ms; preempted "
          f"{[p.request_id for r in eng.step_records for p in r.preempted]}")

# %% [markdown]
# **Exercise 4, `headroom_blocks`**: headroom against thrashing (section 4). Given the positions each
# running request holds, how many free blocks does the batch grow into over the next k decode steps? That
# is the headroom admission must leave it so that admitting does not force a preemption within k steps.
# Below, four requests prefilled together, then 200 decode steps, with exactly your headroom free and
# with one block less:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Draw it (section 1's KV maps draw blocks of 4): a request of 16 positions in blocks of 16 holds how many blocks, one decode step later how many, and 16 steps later? The docstring's example `[5, 16, 17]` is the case to check by hand first.
#
# </details>

# %%
with impl.attempt("ex05.headroom_blocks"):
    prompts, k = [500, 812, 1024, 1333], 200
    need = ex.headroom_blocks(prompts, 16, k)
    held = sum(-(-p // 16) for p in prompts)                  # the prompts' blocks after their prefill
    for free in (need, need - 1):
        llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model=H100, num_kv_blocks=held + free,
                  block_size=16, max_model_len=8192, max_num_batched_tokens=8192, record="summary")
        workloads.submit_trace(llm.engine, [TraceRequest(f"r{i}", 0.0, p, k + 2) for i, p in enumerate(prompts)],
                               vocab_size=llm.engine.vocab_size)
        llm.engine.step()                                       # the four prefills
        preempted = sum(len(llm.engine.step().preempted) for _ in range(k))
        print(f"your headroom: {need} blocks | {free} free after the prefills: {preempted} preemption(s) in {k} decode steps")

# %% [markdown]
# **Exercise 5 (judgement), `swap_recompute_crossover`**: in section 2's figure the dashed boundary (a link
# four GPUs share, 16 GB/s each) crosses Llama-2-7B's line. How long must a victim be, in positions (whole
# blocks of 16), before the rule recomputes it on that link? Read a first guess off the figure, then write the
# function that finds the exact answer on the modeled H100 with *your* `swap_or_recompute`. The cell below
# asks it for both links of the figure.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# In section 2's figure, which side of the dashed boundary is the red line at the left edge (short victims),
# and which side at 2,000 tokens? The answer is where it changes side, rounded to the blocks a victim holds.
#
# </details>
# <details><summary>Hint 2</summary>
#
# The invariant the graders hold: at your answer the rule says recompute, and one block shorter it says swap.
# Check both with `ex.swap_or_recompute` and `H100.step_time` before you trust your number.
#
# </details>

# %%
with impl.attempt("ex05.swap_recompute_crossover"):
    for name, bw in (("its own PCIe 5.0 link (64 GB/s)", 64e9), ("a shared 16 GB/s link", 16e9)):
        n = ex.swap_recompute_crossover(H100, bw)
        print(f"Llama-2-7B on {name}: " + ("swap wins at every length up to 16,384 positions" if n is None else
              f"recompute from {n} positions ({n * H100.kv_bytes_per_token / 1e9:.3f} GB of KV) on"))

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex05_preemption.py` (its stubs raise `NotImplementedError` until you fill them in;
# the docstrings say exactly what each must do). The cells above run *your* version: `impl.load` reads
# the environment variable `MINILLM_IMPL` (unset: `exercises`, yours; `solutions`: the reference answers).
# From the repository root:
#
# ```bash
# make grade EX=05                                            # every ex05 grader, against exercises/
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex05 tests/test_exercises.py -k least_progress   # one exercise
# ```
#
# A failing grader says what it expected and where the expectation came from (numbers worked by hand,
# the engine's cost model, or what the real scheduler did on the same requests).
#
# After a grade that fails an exercise you attempted (a stub left untouched is no attempt), that
# exercise's cell above offers its worked answer, folded: the reference code and why it works. Open it
# once you have tried. From a cell, `impl.grade("05")` prints the same report and offers the answers
# of the exercises it failed; `impl.show_worked_answer("ex05", 1)` opens exercise 1's.

# %% [markdown]
# ## Summary
#
# 1. When a running request needs a block and none is free, the scheduler asks the policy for a victim; by default the most recently admitted.
# 2. Swap keeps the work and pays bandwidth, M_KV / B_PCIe; recompute frees the memory at once and pays a prefill, (n_input + n_generated) / S_prefill.
# 3. The rule picks per victim, but inside a running engine a recompute shares its step with decodes, so it often costs no more than a swap.
# 4. A cache at 100% thrashes; a few percent of headroom removes most of it, and much more leaves memory idle.
# 5. Preemption happens only between steps: a step in flight bounds an urgent request's wait, and priority classes use preemption to get memory.

# %% [markdown]
# ## Check your understanding
#
# 1. The host link gets twice as fast. Which way does the boundary of section 2's figure move, and which
#    victims change from recompute to swap?
# 2. Why does a recomputed victim come back with a prefill of its prompt *and* of the tokens it had generated?
# 3. Llama-3-8B keeps a quarter of Llama-2-7B's KV per position (grouped-query attention). Does that push the
#    rule toward swap or toward recompute?
# 4. Reserving the whole length at admission gives zero preemptions. Why is it still not the better engine?
# 5. An urgent request arrives while a long prefill runs. What bounds its wait, and what in notebook 03b shortens it?
#
# <details><summary>Answers</summary>
#
# 1. The boundary is M_KV = B_PCIe x (recompute time): doubling the bandwidth doubles the KV a swap can move in
#    the same time, so the boundary rises and victims just above it (more KV per token recomputed) now swap.
# 2. Recompute discarded all of its KV; the tokens it generated are part of its context now, and every
#    position of the context needs KV before the next token can be sampled.
# 3. Toward swap: for the same tokens to recompute there are four times fewer bytes to copy.
# 4. It holds memory for tokens that do not exist yet (and that a real engine cannot even predict), so the
#    batch is smaller and throughput lower than paging with a little headroom.
# 5. The length of the step in flight (tens to hundreds of milliseconds for a prefill); chunked prefill cuts the
#    prefill into budget-sized steps.
#
# </details>
