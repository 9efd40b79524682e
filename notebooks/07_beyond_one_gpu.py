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
# # 07 · Beyond one GPU
#
# Notebooks 00-06 served one model copy on one device. Three questions come next:
#
# 1. **The model does not fit one GPU** (Llama-2-70B's bf16 weights are 138 GB; an H100 has 80 GB).
#    Tensor parallelism splits every layer across N GPUs (Megatron-LM, Shoeybi et al. 2019).
#    What does each GPU hold, what do they exchange, and when does adding GPUs stop paying?
# 2. **Prefill and decode interfere.** A long prefill in the batch stalls every decode beside it.
#    Disaggregation gives each phase its own GPUs and moves the KV cache between them (DistServe,
#    Zhong et al., OSDI 2024; Splitwise, Patel et al., ISCA 2024). When does that beat colocating
#    both phases with chunked prefill?
# 3. **A fleet of replicas.** N copies of the model behind a router. Which replica should a request go
#    to, when each replica's prefix cache (notebook 04) only helps requests that reach it?
#
# Part 1 runs for real: two CPU processes split the random model's layers over `torch.distributed`.
# Parts 2 and 3 are simulated: every instance is an `LLMEngine` with `executor="simulated"` and
# `clock="modeled"` (the engine's own scheduler and paged KV, a roofline clock), and
# `minillm/sim/cluster.py` only decides which instance gets a request, and when.

# %% [markdown]
# **After this notebook you can:**
#
# - say what each rank holds under tensor parallelism and what the two all-reduces per layer exchange;
# - predict from the link's bandwidth and latency when adding GPUs stops paying, for decode and for prefill;
# - compare disaggregated prefill/decode with chunked colocation under TTFT and TPOT SLOs;
# - compare routers by prefix-cache hit rate and TTFT, and route a prefix with consistent hashing.

# %%
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from minillm import LLM, SamplingParams, impl
from minillm.viz import figures, printouts
from minillm.sim import cluster
from minillm.analysis import metrics
from minillm.sim.costmodel import LINKS, MODELS
from minillm.sim.simulated import tp_step_times
from minillm.analysis.workloads import LogNormal, synthetic_trace

ex = impl.load("ex07_router")   # your exercises/ex07_router.py (MINILLM_IMPL=solutions: the answer);
                                # re-run this cell after editing the file: impl.load reads it again

# %% [markdown]
# ## 1. Tensor parallelism, stepped live
#
# Megatron-style sharding of one decoder layer over N ranks:
#
# * `q_proj`, `k_proj`, `v_proj` are split **by output** (column-parallel) on whole heads: rank r computes
#   `num_heads / N` query heads and `num_kv_heads / N` KV heads, and stores only those KV heads in its
#   slice of every KV block. Attention needs nothing from the other ranks.
# * `o_proj` is split **by input** (row-parallel): each rank multiplies its heads' outputs by its
#   columns of `W_o`, which gives a *partial sum* of the full output; an **all-reduce** adds the N partial
#   sums so every rank holds the whole result.
# * The MLP likewise: `gate_proj`/`up_proj` column-parallel, `down_proj` row-parallel, one more all-reduce.
#
# So: **two all-reduces per layer**, each of the activations (`tokens x hidden x dtype bytes`). The
# scheduler and the block tables stay in the driver process; one step is one broadcast of the
# scheduler's decision and one forward on every rank (`minillm/worker/tp_executor.py`,
# `minillm/model/parallel.py`). Below: the random model on 2 CPU ranks (gloo), float32, greedy.

# %% [markdown]
# **Predict, then run.** Two ranks each compute half the heads and half the MLP, and add their partial sums with an all-reduce. Greedy, float32: will the tokens equal those of one process?

# %%
PROMPTS = [[11, 12, 13, 14, 15, 16], [40, 41, 42]]
greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
with LLM("random", tensor_parallel_size=2, dtype="float32") as tp2:
    out_tp = tp2.generate(PROMPTS, greedy)
    ranks = tp2.engine.executor.describe()
out_one = LLM("random", dtype="float32").generate(PROMPTS, greedy)
printouts.tp_ranks(ranks)     # each rank's heads, its shard of three weight matrices, its KV cache
same = [a.token_ids == b.token_ids for a, b in zip(out_tp, out_one)]
print("greedy tokens, 2 ranks vs 1 process, identical:", same)
assert all(same)

# %% [markdown]
# <details><summary>Answer</summary>
#
# Yes, identical (the cell asserts it): the all-reduce restores exactly the sums one device computes.
#
# </details>

# %% [markdown]
# Each rank holds half the heads: `q_proj`'s output rows and `o_proj`'s input columns are halved, and
# each rank's KV cache stores only its own KV heads. The tokens are identical to the single-process run:
# the all-reduce restores exactly the sums a single device would compute (in float32 on CPU).
#
# ### Where TP stops paying
#
# The cost model prices a step on N GPUs as the roofline of N GPUs' FLOP/s and bandwidth, **plus** the
# two all-reduces per layer: a ring all-reduce moves `2 (N-1)/N x bytes` per GPU over the link, plus a
# fixed latency (`costmodel.LinkSpec.allreduce_time`). Compute and weight reads shrink as 1/N; the
# all-reduce does not shrink at all. `link=None` is the ideal TP of notebook 01 (no communication).
# Links (one direction per GPU, from the vendors' figures):

# %% [markdown]
# **Predict, then run.** Llama-2-13B on 8 H100s. Over which link does decode keep most of its ideal speed-up, and which step, decode or a 4096-token prefill, suffers more on the slow links?

# %%
for name, lk in LINKS.items():
    print(f"{name:11s} {lk.bandwidth / 1e9:6.0f} GB/s, {lk.latency * 1e6:.0f} us per all-reduce")

SIZES = (1, 2, 4, 8)
CASES = {"decode, batch 32, context 1024": dict(num_new_tokens=[1] * 32, context_lens=[1024] * 32),
         "prefill, one 4096-token prompt": dict(num_new_tokens=[4096], context_lens=[4096])}
fig = make_subplots(rows=1, cols=2, subplot_titles=list(CASES))
for col, (case, kw) in enumerate(CASES.items(), start=1):
    for i, link in enumerate((None, "NVLink", "PCIe", "InfiniBand")):    # one colour per link, in both panels
        t = tp_step_times("H100-SXM", "llama-2-13b", SIZES, link, **kw)
        speedup = [t[0] / x for x in t]
        fig.add_trace(go.Scatter(x=list(SIZES), y=speedup, mode="lines+markers", name=link or "ideal",
                                 line_color=qualitative.Plotly[i], legendgroup=link or "ideal",
                                 showlegend=col == 1), row=1, col=col)
        print(f"{case:32s} {link or 'ideal':10s} step ms " + ", ".join(f"{x * 1e3:6.2f}" for x in t)
              + "   speed-up at 8: " + f"{speedup[-1]:.2f}x")
fig.update_xaxes(title_text="GPUs (tensor parallel)", type="log", tickvals=list(SIZES))
fig.update_yaxes(title_text="speed-up over 1 GPU (times)")
fig.update_layout(title="Llama-2-13B on H100s: modeled step time speed-up by link", height=380)
fig.show()

# %% [markdown]
# <details><summary>Answer</summary>
#
# NVLink keeps most of decode's gain. On PCIe and InfiniBand the prefill suffers more: its activations are thousands of tokens wide, and the all-reduce, which does not shrink with more GPUs, dominates.
#
# </details>

# %% [markdown]
# Read the printed speed-ups at 8 GPUs. Over NVLink the all-reduce costs little against the shrinking
# weight reads, and decode keeps most of its gain. Over PCIe and InfiniBand the prefill step, whose
# activations are thousands of tokens wide, is soon dominated by the all-reduce, which does not shrink
# with N: each GPU added saves less than the one before, and the speed-up flattens far below N.
# That is why TP stays inside one NVLink domain (Megatron-LM's own scaling put TP within a DGX node:
# 8.3B parameters on 512 GPUs, 15.1 PFLOP/s, 76% scaling efficiency, with 8-way TP inside each server
# and data parallelism across them). The model leaves out compute/communication overlap and NCCL's
# algorithms other than the ring.
#
# ## 2. Disaggregated prefill/decode against chunked prefill
#
# `cluster.run_disaggregated(trace, P, D)`: P prefill instances (requests get `max_tokens=1`), whose KV
# (`prompt x M_KV` bytes; 0.8 MB per token for Llama-2-13B) then crosses an InfiniBand link to the decode
# instance with the fewest outstanding tokens. `cluster.run_colocated(trace, N)`: N instances doing both.
# Four GPUs of A100-80GB each serving Llama-2-13B, on long prompts (median 1536 tokens) and 192-token
# answers; the same trace at each rate for every deployment:
#
# * **1P3D** and **2P2D**: disaggregated;
# * **chunked**: colocated, prefill chunks of at most 512 tokens share each step with the decodes
#   (the answer of SARATHI, Agrawal et al., 2023, and Sarathi-Serve, OSDI 2024, to the same interference);
# * **unchunked**: colocated, a whole prompt per step, prefill first (vLLM before chunked prefill, one of
#   DistServe's baselines; its other, DeepSpeed-MII, runs Dynamic SplitFuse, a form of chunked prefill).
#
# Goodput here is notebook 03b's SLO-meeting throughput (not DistServe's highest rate meeting an attainment
# target): requests per second meeting TTFT <= 1 s and TPOT <= the SLO, under a loose (100 ms) and a tight
# (25 ms) TPOT.

# %%
RATES = (2, 4, 6, 8)
N_REQ = 240
SLO_TTFT, TPOT_LOOSE, TPOT_TIGHT = 1.0, 0.100, 0.025
SIM = dict(model="llama-2-13b", hardware="A100-80GB", keep_metrics=True)
DEPLOY = {
    "1P3D": lambda tr: cluster.run_disaggregated(tr, 1, 3, **SIM)[2],
    "2P2D": lambda tr: cluster.run_disaggregated(tr, 2, 2, **SIM)[2],
    "chunked": lambda tr: cluster.run_colocated(tr, 4, max_num_batched_tokens=512, **SIM)[1],
    "unchunked": lambda tr: cluster.run_colocated(tr, 4, enable_chunked_prefill=False,
                                                  interference="prefill-priority", **SIM)[1],
}
rows = {name: [] for name in DEPLOY}
for rate in RATES:
    trace = synthetic_trace(N_REQ, rate=rate, prompt_len=LogNormal(1536, 0.4, 128, 4000),
                            output_len=LogNormal(192, 0.5, 8, 512), vocab_size=32000, seed=1)
    for name, run in DEPLOY.items():
        s = run(trace)
        good = {tp: metrics.summarize(s["metrics"], slo_ttft=SLO_TTFT, slo_tpot=tp)["goodput_requests_per_s"]
                for tp in (TPOT_LOOSE, TPOT_TIGHT)}
        rows[name].append(dict(rate=rate, ttft_p99=s["ttft_p99"], tpot_p50=s["tpot_p50"], tpot_p99=s["tpot_p99"],
                               good_loose=good[TPOT_LOOSE], good_tight=good[TPOT_TIGHT]))
printouts.goodput_table(rows)

# %% [markdown]
# First the latencies, one panel each (one colour per deployment in every panel):

# %%
def deployment_panels(panels, title):
    """One panel per (row key, scale, axis title) of ``panels``, a line per deployment, against the rate."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[name for name, *_ in panels])
    for i, (name, rs) in enumerate(rows.items()):          # one colour per deployment, in every panel
        for col, (_, key, scale, _) in enumerate(panels, 1):
            fig.add_trace(go.Scatter(x=list(RATES), y=[r[key] * scale for r in rs], mode="lines+markers", name=name,
                                     line_color=qualitative.Plotly[i], legendgroup=name, showlegend=col == 1),
                          row=1, col=col)
    for col, (*_, unit) in enumerate(panels, 1):
        fig.update_yaxes(title_text=unit, row=1, col=col)
    fig.update_xaxes(title_text="arrival rate (req/s)")
    fig.update_layout(height=360, title=title)
    return fig

fig = deployment_panels((("TTFT p99", "ttft_p99", 1, "TTFT p99 (s)"), ("TPOT p99", "tpot_p99", 1e3, "TPOT p99 (ms)")),
                        "4 x A100, Llama-2-13B: latency tails, disaggregated vs colocated")
fig.update_yaxes(type="log", row=1, col=1, **figures.log_ticks())   # ticks written out: 0.5, 1, 2, 5, 10, 20
fig.show()

# %% [markdown]
# * **TPOT isolation** (right panel). A decode pool never runs a prefill: 1P3D's three decode GPUs keep
#   TPOT p99 nearly flat as the rate grows, while both colocated deployments' TPOT tails climb, since
#   every prefill (or prefill chunk) lengthens the decode steps it shares.
# * **The price: a fixed split** (left panel, log scale). 1P3D's single prefill GPU saturates first and
#   its TTFT tail explodes; 2P2D moves the bottleneck to decode (its two decode GPUs fill up: isolation
#   does not help a pool that is simply too small). A colocated instance gives its time to whichever
#   phase has work.
#
# Then what meets both SLOs, under the loose and the tight TPOT, with the winner at each rate:

# %%
fig = deployment_panels((("goodput, TPOT <= 100 ms", "good_loose", 1, "goodput (req/s)"),
                         ("goodput, TPOT <= 25 ms", "good_tight", 1, "goodput (req/s)")),
                        "4 x A100, Llama-2-13B: goodput (TTFT <= 1 s), disaggregated vs colocated")
fig.show()
for key, label in (("good_loose", "TPOT <= 100 ms"), ("good_tight", "TPOT <= 25 ms")):
    best = [max(rows, key=lambda n: rows[n][i][key]) for i in range(len(RATES))]
    print(f"best goodput under TTFT <= 1 s and {label}: " +
          ", ".join(f"{rate} req/s -> {b} ({rows[b][i][key]:.2f})" for i, (rate, b) in enumerate(zip(RATES, best))))

# %% [markdown]
# * **Against unchunked colocation** (DistServe's vLLM baseline): under the tight 25 ms TPOT
#   (right panel) a disaggregated deployment serves more within the SLOs at 4, 6 and 8 req/s (at 4 req/s
#   1P3D's <span title="from the run">2.39</span> req/s against <span title="from the run">0.94</span>);
#   under the loose 100 ms TPOT (left) unchunked colocation serves as much or more. This is the
#   direction of DistServe's result, whose gains are also largest under tight TPOT SLOs (it reports up
#   to 7.4x more requests, or a 12.6x tighter SLO, than vLLM and DeepSpeed-MII with over 90% of requests
#   meeting it).
# * **Against chunked colocation**: disaggregation wins one cell of the eight (4 req/s under 25 ms:
#   <span title="from the run">2.39</span> against <span title="from the run">2.32</span>); chunked
#   prefill has the best goodput in the others. It recovers most of disaggregation's TPOT isolation on
#   the same GPUs, and keeps up at rates where a fixed split has run out of one phase. DistServe beat
#   DeepSpeed-MII's chunked prefill too, with each phase's parallelism searched per workload and an OPT
#   model up to 175 B; this model fixes both (next list), which is where the two results part.

# %% [markdown]
# Where this model differs from DistServe:
#
# * DistServe searches each phase's parallelism and placement per workload; here every instance is one
#   A100, and the P:D ratio is all that varies.
# * The KV transfer is one uncontended copy at link bandwidth, after the prefill ends (Splitwise, Patel et al., ISCA 2024,
#   overlaps it layer by layer with the prefill; DistServe sends it after the prefill and places each
#   pair so the copy runs over NVLink within a node).
# * The decode pool re-admits each request through the ordinary scheduler, priced as one decode step
#   over the arrived KV (`cluster.KVArrivedCostModel`).
# * The roofline has no kernel-level interference beyond time sharing, which favours colocation.
# * Splitwise (Patel et al.) reports 1.4x the throughput at 20% lower cost, or 2.35x the throughput for
#   the same cost and power, largely by putting each phase on different hardware: a knob this model
#   could turn next (a cheaper GPU for decode).

# %% [markdown]
# ## 3. Replicas behind a router
#
# Four Llama-2-7B replicas (one H100 each), prefix caching on. Three routers see, at each arrival, the
# prompt and every replica's outstanding requests and tokens (`cluster.Load`):
#
# * **round robin**: blind to content and load;
# * **least outstanding tokens**: the least loaded replica;
# * **prefix-aware**: consistent hashing on the prompt's first 4 KV blocks (64 tokens), bounded at
#   1.25 x the mean load ("consistent hashing with bounded loads", Mirrokni, Thorup and Zadimoghaddam,
#   SODA 2018): a replica over the bound is passed over for the next one on the ring.
#
# Two traces from the `router` benchmark: 31 applications' 512-token system prompts before a
# unique question; and 5-turn conversations, each with its own system prompt (turn k's prompt extends
# turn k-1's). `python -m minillm.bench router --size full` runs the same comparison on 100,000
# requests per trace.

# %% [markdown]
# **Predict, then run.** Round robin, least outstanding tokens, prefix-aware: which has the highest prefix-cache hit rate, and on which trace is the gap largest?

# %%
from minillm.bench.router import traces

TRACES = traces(1500, rate=60.0, seed=0)
ROUTERS = {"round robin": "round-robin", "least tokens": "least-tokens", "prefix-aware": "prefix-aware",
           "prefix-aware (yours)": None}
res = {}
for tname, trace in TRACES.items():
    for label, router in ROUTERS.items():
        if router is None:
            try:
                router = ex.ExerciseRouter()
                router.route(trace[0].prompt_token_ids, [cluster.Load(0, 0)] * 4)
            except NotImplementedError:
                print("ex07 not written yet: the 'yours' row is skipped")
                continue
        _, s = cluster.run_replicas(trace, router, 4, model="llama-2-7b", hardware="H100-SXM",
                                    slo_ttft=0.5, slo_tpot=0.05)
        res[tname, label] = s
printouts.router_summaries((tname, label, s) for (tname, label), s in res.items())

# %% [markdown]
# <details><summary>Answer</summary>
#
# Prefix-aware, on both traces; the gap is largest on the conversations, where each turn's whole history is a prefix only one replica holds.
#
# </details>

# %%
ROUTER_PANELS = (("prefix_cache_hit_rate", 1, "hit rate (fraction, 0 to 1)"), ("ttft_p50", 1e3, "TTFT p50 (ms)"),
                 ("ttft_p99", 1e3, "TTFT p99 (ms)"))
fig = make_subplots(rows=1, cols=3, subplot_titles=["prefix-cache hit rate", "TTFT p50", "TTFT p99"])
for i, label in enumerate(ROUTERS):                    # one colour per router, in every panel
    xs = [t for t in TRACES if (t, label) in res]
    if not xs:
        continue
    for col, (key, scale, _) in enumerate(ROUTER_PANELS, 1):
        fig.add_trace(go.Bar(x=xs, y=[res[t, label][key] * scale for t in xs], name=label, legendgroup=label,
                             marker_color=qualitative.Plotly[i], showlegend=col == 1), row=1, col=col)
for col, (_, _, unit) in enumerate(ROUTER_PANELS, 1):
    fig.update_yaxes(title_text=unit, row=1, col=col)
fig.update_xaxes(title_text="trace")
fig.update_layout(barmode="group", height=380, title="4 replicas, 60 req/s: three routers")
fig.show()

# %% [markdown]
# Prefix-aware routing sends each system prompt (or conversation) to the replica that already cached
# it, so its hit rate leads on both traces; least-outstanding-tokens balances by load but scatters
# prefixes, and round robin does both blindly. On the conversation trace the difference is
# largest: each turn's whole history is a prefix only one replica holds. The price is balance: the
# ring gives replicas unequal shares of the key space (the requests-per-replica lists), and only the
# load bound keeps a popular prefix from burying one replica (`load_factor=math.inf` is plain
# consistent hashing, with no bound at all). The same ideas are at work in production routers, e.g. SGLang's
# cache-aware router (a prefix tree per replica with a load threshold) and llm-d's prefix-aware
# scheduling. At 60 req/s the replicas are far from full, so TTFT differences stay small; the saved
# prefill (the hit rate) is what grows into TTFT and goodput as the load rises.
#
# ## Exercise
#
# **`prefix_key`, `route_on_ring`** (consistent hashing with bounded loads) and **`kv_transfer_time`,
# `max_prompt_for_transfer`** (the KV transfer's break-even) in `exercises/ex07_router.py`.
# `ex.ExerciseRouter()` routes with your functions; the table above already ran it as
# "prefix-aware (yours)". Below: the break-even, how long a prompt's KV can be and still cross within
# one TPOT budget of 25 ms, per link, for Llama-2-13B.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `route_on_ring`: section 3's prefix-aware router: a key goes to the first point on the ring at or after it, wrapping around, and a replica over the load bound is passed over for the next one. The docstring's example is the case to check by hand.
#
# </details>
# <details><summary>Hint 2</summary>
#
# `max_prompt_for_transfer`: a prompt's KV crosses the link in a fixed latency plus its bytes over the bandwidth (notebook 05, section 2 prices a swap the same way). The invariant: your n fits the budget and n + 1 does not, checked with `kv_transfer_time` itself.
#
# </details>

# %%
M_KV = MODELS["llama-2-13b"].kv_bytes_per_token
with impl.attempt("ex07.prefix_key / route_on_ring"):
    ring = [(10, 0), (20, 1), (30, 2)]
    print("route_on_ring(15, ...):", ex.route_on_ring(15, ring, [0, 0, 0]), "(expected 1);",
          "with replica 1 overloaded:", ex.route_on_ring(15, ring, [0, 10, 2]), "(expected 2)")
with impl.attempt("ex07.kv_transfer_time / max_prompt_for_transfer"):
    for name, lk in LINKS.items():
        n = ex.max_prompt_for_transfer(0.025, M_KV, lk.bandwidth, lk.latency)
        print(f"{name:11s} a 1,536-token prompt's KV crosses in "
              f"{ex.kv_transfer_time(1536, M_KV, lk.bandwidth, lk.latency) * 1e3:6.2f} ms; "
              f"within 25 ms: prompts up to {n:,} tokens")

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex07_router.py` (its stubs raise `NotImplementedError` until you fill them in;
# the docstrings say exactly what each must do). From the repository root:
#
# ```bash
# make grade EX=07                                            # every ex07 grader, against exercises/
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex07 tests/test_exercises.py -k route_on_ring   # one exercise
# ```
#
# After a grade that fails an exercise you attempted (a stub left untouched is no attempt), that
# exercise's cell above offers its worked answer, folded: the reference code and why it works. Open it
# once you have tried. From a cell, `impl.grade("07")` prints the same report and offers the answers
# of the exercises it failed; `impl.show_worked_answer("ex07", 1)` opens exercise 1's.
#
# ## References
#
# * Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
#   Parallelism", 2019: 8.3B parameters on 512 GPUs at 15.1 PFLOP/s, 76% scaling efficiency.
# * Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language
#   Model Serving", OSDI 2024: up to 7.4x more requests or 12.6x tighter SLO, > 90% of requests within it.
# * Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024:
#   1.4x throughput at 20% lower cost, or 2.35x throughput at the same cost and power.
# * Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention"
#   (vLLM), SOSP 2023: 2-4x the throughput of FasterTransformer and Orca at the same latency.
# * Agrawal et al., "SARATHI: Efficient LLM Inference by Piggybacking Decodes with Chunked Prefills",
#   arXiv 2308.16369, 2023 (chunked prefill, decodes piggybacked on the chunks).
# * Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024
#   (chunked prefill, stall-free batching).
# * Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018.

# %% [markdown]
# ## Summary
#
# 1. Tensor parallelism splits every layer's heads and MLP across N GPUs, with two all-reduces of the activations per layer.
# 2. Compute and weight reads shrink as 1/N, the all-reduce does not: a slow link ends the gain first for wide (prefill) steps.
# 3. Disaggregation gives prefill and decode their own GPUs and moves the KV between them; chunked colocation bounds interference inside one engine.
# 4. Disaggregation isolates TPOT and wins under a tight TPOT SLO against unchunked colocation; chunked colocation
#    recovers most of that isolation and, here, the best goodput in most cases: a fixed split runs out of one phase.
# 5. A router that sends a prefix to the replica that cached it raises the hit rate; a load bound keeps one popular prefix from burying a replica.

# %% [markdown]
# ## Check your understanding
#
# 1. Why does tensor parallelism need no communication inside attention?
# 2. Why does the all-reduce's cost not shrink as GPUs are added?
# 3. What must move between a prefill instance and a decode instance, and what bounds the prompt length worth moving?
# 4. Why is plain consistent hashing not enough for routing by prefix?
#
# <details><summary>Answers</summary>
#
# 1. Heads are independent: each rank computes its own heads' attention on its own KV heads; only `o_proj`'s partial sums need adding.
# 2. Each GPU must still send and receive about 2 (N - 1) / N of the activations, plus a fixed latency per all-reduce: more GPUs, not less data.
# 3. The prompt's KV cache. The first token comes from the prefill instance; the transfer (KV bytes over the link's
#    bandwidth, plus latency) delays the second, so it must fit a TPOT budget (the exercise's 25 ms).
# 4. A popular prefix would send all its traffic to one replica; a load bound passes an overloaded replica over for the next one on the ring.
#
# </details>
