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
# # 03 · Scheduling policies
#
# Continuous batching decides *when* requests join and leave the batch; it does not decide *which*
# waiting request goes next when there is room for only some. The scheduler's inputs are the waiting
# queue, the running set and the resource state (free slots, free KV memory); its objective is a balance
# among latency (short queueing and execution times), throughput (tokens per unit time) and fairness (no
# request postponed indefinitely).
#
# | Policy | Behavior | Good for | Weakness |
# |---|---|---|---|
# | FCFS | First come, first served | Fairness, simplicity | Head-of-line blocking on long requests |
# | Shortest-first | Prioritize short requests | Average latency | Long requests can starve |
# | Priority classes | Tiered service levels | Mixed workloads | Needs careful class definition |
# | Fair queuing | Equal share per user | Multi-tenant systems | More bookkeeping |
#
# That table is the plan of this notebook, with MLFQ, the classic compromise from operating systems,
# and two questions about the scheduler itself:
#
# 1. FCFS and head-of-line blocking, stepped live: FCFS and SJF side by side;
# 2. shortest job first: with an oracle, with a predictor, its starvation, and aging;
# 3. priority classes and priority inversion;
# 4. MLFQ: token quanta, demotion, boosting;
# 5. fair queuing when one tenant floods;
# 6. prefill against decode: prefill-priority, decode-priority, chunked prefill;
# 7. scheduling every N steps (a worked example);
# 8. at scale: goodput under SLOs, load shedding, and the tail as load rises;
# 9. is the simulator right? Calibrate it on your machine, and check it against the real engine;
# 10. exercises: SJF with aging, MLFQ and fair queuing, written as policies and run inside the engine;
#    the arithmetic of sections 6 to 8.
#
# A policy is an object the scheduler asks every step (`minillm/core/policies.py`): in what order to
# consider the waiting requests (`order_waiting`), and, for the preemptive ones, whom to push out
# (`preempt_for`, `pick_victim`). Built-in ones have names (`LLM(policy="fcfs")`); yours plugs in the
# same way (`LLM(policy=MyPolicy())`).

# %% [markdown]
# **After this notebook you can:**
#
# - point to head-of-line blocking in a step record's waiting reasons, and say which policy removes it;
# - compare FCFS and shortest-first on mean and worst completion time, and say what a length predictor and
#   aging change (starvation);
# - choose between priority classes, MLFQ and fair queuing for a workload, and write each as a policy the
#   scheduler calls every step;
# - compare the worst decode stall and the prompt's TTFT under prefill priority, decode priority and chunked prefill;
# - read goodput and the TTFT tail off a load sweep, and find the largest queue cap that keeps a 2 s TTFT.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels

import numpy as np
import plotly.graph_objects as go

from minillm import LLM, SamplingParams, impl
from minillm.viz import figures
from minillm.analysis import workloads
from minillm.viz import LockstepStepper

# %%
from types import SimpleNamespace

from plotly.subplots import make_subplots

from minillm.sim.costmodel import ConstantStepTime
from minillm.core.policies import MLFQ, SJF, Fair, Priority, PromptPredictor
from minillm.bench.sched_overhead import time_pass
from minillm.sim.simulated import simulate
from minillm.sim.replay import replay
from minillm.analysis.workloads import LogNormal, TraceRequest, Uniform

ex = impl.load("ex03_policies")    # your exercises/ex03_policies.py (MINILLM_IMPL=solutions: the answers);
                                   # re-run this cell after editing the file: impl.load reads it again
TEN_MS = ConstantStepTime(0.010)   # the worked examples' assumption: every step takes 10 ms, whatever the batch

def served(trace, policy="fcfs", cost_model=TEN_MS, **config):
    """Replay a trace on the simulated executor (the real scheduler and KV manager, no forward pass) on the
    modeled clock (`replay`). Returns the engine, its requests' metrics by id, and metrics.summarize's dict."""
    return replay(trace, model="random", cost_model=cost_model, policy=policy, **config)

def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)


# %% [markdown]
# ## 1. FCFS and head-of-line blocking
#
# First come, first served (FCFS) orders requests by arrival time. It is fair by construction and nobody
# starves, but it ignores how long each request will take. Here is the smallest case where that matters.
# At most 3 requests run at once and a step may process 16 tokens. A and B are decoding long answers.
# Then L arrives, with a 24-token prompt and a 10-token answer, and right behind it three short requests
# s1, s2, s3 (4-token prompts, 2-token answers).
#
# Left, FCFS: the one free slot goes to L. Its prompt does not fit one step's budget, so its prefill
# is split over two steps, and then it decodes for ten more; s1, s2 and s3 wait behind it, though
# each would be done in two steps. Right, SJF (shortest job first) with the true answer lengths: the
# free slot serves the three short requests first. Both engines run the real model with
# `attention_backend="triton"` (the tiny random Llama: only the token counts matter here), and every
# **Step** executes the Triton attention kernel in both.

# %%
def hol_engine(policy):
    llm = LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton", policy=policy,
              block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=3,
              clock="modeled", cost_model=0.010)
    greedy = dict(ignore_eos=True, temperature=0.0)
    for rid, arrival, prompt_len, out_len in (("A", 0.0, 6, 9), ("B", 0.0, 5, 12), ("L", 0.015, 24, 10),
                                              ("s1", 0.016, 4, 2), ("s2", 0.017, 4, 2), ("s3", 0.018, 4, 2)):
        llm.engine.add_request(list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=out_len, **greedy),
                               request_id=rid, arrival_time=arrival)
    return llm

hol = LockstepStepper(lambda: hol_engine("fcfs"), lambda: hol_engine(SJF(predictor="oracle", aging=0.0)),
                      names=["FCFS", "SJF (true lengths)"],
                      title="one free slot: a long request L, then three short ones")
hol

# %% [markdown]
# Step 0 prefills A and B and step 1 decodes them; L and the short requests arrive during step 1.
# Step 2 is where the policies part. Four steps, in code (the same as four clicks on **Step**):

# %% [markdown]
# **Predict, then run.** At step 2 one of the three slots is free, and L, s1, s2 and s3 are waiting (L arrived
# first). Which request takes the slot under FCFS, and which under SJF with the true lengths?

# %%
for _ in range(4):
    hol.step()
for name, s in zip(hol.names, hol.steppers):
    print(f"{name}:")
    for rec in s.records[2:]:
        ran = ", ".join(f"{e.request_id} {e.phase} +{e.num_new_tokens}" for e in rec.batch)
        waits = "; ".join(f"{w.request_id}: {w.reason}" for w in rec.waiting[:2])
        print(f"  step {rec.step}: ran {ran}" + (f"  | waiting {waits}" if waits else ""))

# %% [markdown]
# <details><summary>Answer</summary>
#
# FCFS gives it to L, the oldest, whose 24-token prompt then takes two steps of the 16-token budget while the
# short ones wait ("queued behind"). SJF gives it to a short request (s1, the earliest of the three), which
# is done two steps later, and the next short one follows.
#
# </details>

# %% [markdown]
# Under FCFS the short requests sit in the queue with the reason "max_num_seqs=3 requests already
# running" (s2 and s3 "queued behind s1"): that is **head-of-line blocking**. The queue is served in
# order, so the work at its head decides everyone's wait. The kernel, checked against its torch
# reference on the FCFS engine's cache:

# %%
print(check_paged_attention(hol.steppers[0].engine))   # the Triton kernel against its torch reference

# %% [markdown]
# The same six requests to the end, on the simulated executor (the same scheduler and memory
# manager, no forward pass, the same 10 ms per step): when each one waits and runs.

# %%
hol_trace = [TraceRequest(rid, t, p, n) for rid, t, p, n in (("A", 0.0, 6, 9), ("B", 0.0, 5, 12), ("L", 0.015, 24, 10),
             ("s1", 0.016, 4, 2), ("s2", 0.017, 4, 2), ("s3", 0.018, 4, 2))]
hol_runs = {name: served(hol_trace, pol, max_num_seqs=3, max_num_batched_tokens=16, block_size=4)
            for name, pol in (("FCFS", "fcfs"), ("SJF", SJF(predictor="oracle", aging=0.0)))}
for name, (eng, m, s) in hol_runs.items():
    print(f"{name}: short requests done after {mean(m[r].e2e_latency for r in ('s1', 's2', 's3')) * 1e3:.0f} ms "
          f"on average, L after {m['L'].e2e_latency * 1e3:.0f} ms; mean over all six {s['e2e_mean'] * 1e3:.0f} ms")
eng, _, _ = hol_runs["FCFS"]
figures.gantt_figure(eng.step_records, eng.requests, title="FCFS: s1..s3 queue behind L")

# %%
eng, _, _ = hol_runs["SJF"]
figures.gantt_figure(eng.step_records, eng.requests, title="SJF: the short requests go first, L a few steps later")

# %% [markdown]
# It is the supermarket's express lane: someone buying a bottle of water does not wait behind a full
# cart. L finishes later under SJF, the three short requests far sooner, and the mean over all
# six drops. In a
# real service the blocking request is often a long *prompt*: the prefill of a 2000-token prompt can
# take hundreds of milliseconds or more, and the requests decoding in the same batch wait for it
# (section 6 measures that stall).
#
# ## 2. Shortest job first
#
# When all job lengths are known, SJF gives the smallest mean completion time (the classic
# scheduling result). Forty requests arrive at once, answers of 5 to 200 tokens, 4 slots:

# %% [markdown]
# **Predict, then run.** Forty requests at once, 4 slots, the same total work under both policies. Does SJF
# change the time the *last* request finishes? The mean completion time?

# %%
batch40 = workloads.synthetic_trace(40, rate=None, prompt_len=16, output_len=Uniform(5, 200), seed=1)
sjf_runs = {}
for name, pol in (("FCFS", "fcfs"), ("SJF, true lengths", SJF(predictor="oracle", aging=0.0))):
    eng, m, s = served(batch40, pol, max_num_seqs=4)
    sjf_runs[name] = list(m.values())
    print(f"{name:<18} mean completion {s['e2e_mean']:.2f} s, median {s['e2e_p50']:.2f} s, "
          f"longest {s['e2e_max']:.2f} s")
figures.latency_cdf_figure(sjf_runs, metrics=("e2e_latency",), unit="s",
                           title="40 requests at once, 4 slots: when each one is done")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The last finish barely moves (the slots do the same total work either way); the mean falls by about a
# quarter, because the many short requests no longer wait behind the long ones. Compare the printed
# `longest` and `mean completion` columns.
#
# </details>

# %% [markdown]
# Same total work, and the last request finishes at about the same time (<span title="from the run">10.25 s</span>
# under FCFS, <span title="from the run">10.36 s</span> under SJF); but most requests are done much sooner: the mean
# completion falls from <span title="from the run">4.97 s</span> to <span title="from the run">3.65 s</span>. The
# catch: a request's output length is unknown until it has been generated. SJF needs a **prediction**,
# from one of three sources: historical statistics (the mean output length of similar requests from the
# same API endpoint or user group), signals in the prompt ("brief answer" suggests a short output,
# "explain in detail" a long one), or a small learned model. minillm has the first two
# (`HistoryPredictor`, `PromptPredictor`):

# %%
hint = PromptPredictor(base=128)
for text in ("Give a brief answer: what is 1+1?", "Explain in detail the basic principles of quantum mechanics",
             "What is the capital of France?"):
    print(f"{hint.predict(SimpleNamespace(prompt=text)):6.0f} tokens predicted for {text!r}")

# %% [markdown]
# A history predictor on mixed traffic: tenant "chat" asks short questions (answers around 20 tokens,
# with a long tail: a few run past 200) and tenant "doc" long ones (around 150 tokens). 300 requests
# arrive at 5.5 per second on 4 slots, about as much work as the slots can do. The predictor learns
# each tenant's mean from the requests that finish: it knows the class, never the request.

# %%
mixed = workloads.synthetic_trace(300, rate=5.5, prompt_len=16, output_len=1, tenant_mix={"chat": 0.7, "doc": 0.3}, seed=2)
chat_len = LogNormal(20, 1.2, hi=600).sample(300, np.random.default_rng(0))
doc_len = LogNormal(150, 0.5, hi=800).sample(300, np.random.default_rng(1))
for i, r in enumerate(mixed):
    r.output_len = int(chat_len[i] if r.tenant == "chat" else doc_len[i])
pred_runs = {}
for name, pol in (("FCFS", "fcfs"), ("SJF, history predictor", SJF(predictor="history", aging=0.0)),
                  ("SJF, true lengths", SJF(predictor="oracle", aging=0.0))):
    eng, m, s = served(mixed, pol, max_num_seqs=4)
    pred_runs[name] = list(m.values())
    by = {t: mean(m[r.request_id].e2e_latency for r in mixed if r.tenant == t) for t in ("chat", "doc")}
    print(f"{name:<24} mean {s['e2e_mean']:5.2f} s, p99 {s['e2e_p99']:5.2f} s, worst {s['e2e_max']:5.2f} s | "
          f"chat {by['chat']:4.2f} s, doc {by['doc']:4.2f} s on average")
figures.latency_cdf_figure(pred_runs, metrics=("e2e_latency",), unit="s", title="predicted vs true lengths")

# %% [markdown]
# Both SJFs beat FCFS on the mean; the predictor gets part of the oracle's gain. Now look at the
# worst case. Even with true lengths, shortest-first makes the longest requests wait longer than FCFS
# would. With the predictor it is worse: every doc request is predicted long, whatever its true
# length, so it is passed by every chat request that arrives while it waits; and the chat answers
# that turn out long were predicted short, so they jump the queue and then hold a slot as long as a
# doc request would. Mispredictions cause the very starvation SJF was meant to avoid.
#
# **A learned predictor.** The third source, a small model trained on the served model's own answers,
# needs only data: serve many prompts, record how long each answer ran, fit. Here the shipped model
# continues 200 passages of its held-out play (128 tokens each, cut at evenly spaced points, sampled at
# temperature 0.8) until the speech ends (a blank line) or 64 tokens. `RegressionPredictor`
# (`minillm/analysis/learned_predictor.py`, a ridge regression of the log length) is fitted on half of them, once
# on the prompt length alone and once on `TokenFeatures` (how far the current speech has gone, whether a
# new one starts, the last few tokens). The other half arrive at once on 4 slots, as in the first
# example above, and SJF orders them by each predictor, against FCFS and the true lengths. (Learned
# length predictors for scheduling, with far larger models, are studied by Qiu et al., 2024, and Fu et
# al., NeurIPS 2024.)

# %%
from minillm.analysis.learned_predictor import (
    RegressionPredictor, TokenFeatures, evenly_spaced_prompts, generated_lengths, prompt_length_features,
    rank_correlation,
)
from minillm.model.loader import DEFAULT_MODEL_DIR

shipped = LLM(device=DEVICE, dtype="auto", max_num_seqs=64, max_model_len=512, record="summary")
play = shipped.tokenizer.encode((DEFAULT_MODEL_DIR / "heldout_slice.txt").read_text(encoding="utf-8"),
                                add_special_tokens=False, verbose=False)
passages = evenly_spaced_prompts(play, count=200, max_len=128)
answer_len = generated_lengths(shipped.engine, passages, SamplingParams(max_tokens=64, temperature=0.8, seed=1, stop=["\n\n"]))
train, test = slice(0, None, 2), slice(1, None, 2)
blank_line = shipped.tokenizer.encode("\n", add_special_tokens=False) * 2
predictors = {"prompt length": RegressionPredictor(prompt_length_features, l2=10.0),
              "learned": RegressionPredictor(TokenFeatures(num_buckets=16, tail=4, marker=blank_line), l2=10.0)}
for p in predictors.values():
    p.fit(passages[train], answer_len[train])
held_out = [TraceRequest(f"q{i}", 0.0, len(x), n, prompt_token_ids=x) for i, (x, n) in enumerate(zip(passages[test], answer_len[test]))]
print(f"answers: median {np.median(answer_len):.0f} tokens, {np.mean(np.array(answer_len) == 64):.0%} cut at 64")
learned_runs = {}
for name, pol in (("FCFS", "fcfs"), ("SJF, prompt length", SJF(predictor=predictors["prompt length"], aging=0.0)),
                  ("SJF, learned", SJF(predictor=predictors["learned"], aging=0.0)), ("SJF, true lengths", SJF(predictor="oracle", aging=0.0))):
    eng, m, s = served(held_out, pol, max_num_seqs=4, random_model=dict(vocab_size=shipped.engine.vocab_size))
    learned_runs[name] = s["e2e_mean"]
    p = predictors.get(name.removeprefix("SJF, "))
    order = f"rank correlation with the true lengths {rank_correlation([p.predict_ids(r.prompt_token_ids) for r in held_out], [r.output_len for r in held_out]):+.2f}" if p else ""
    print(f"{name:<20} mean {s['e2e_mean']:5.2f} s, p99 {s['e2e_p99']:5.2f} s  {order}")
assert learned_runs["SJF, prompt length"] == learned_runs["FCFS"] and learned_runs["SJF, true lengths"] < learned_runs["FCFS"]

# %% [markdown]
# SJF uses only the *order* of the predictions, so the rank correlation printed beside each one is its
# score. Every passage has the same length, so the prompt-length predictor gives one number to all and
# SJF with it is FCFS (the cell asserts it): on this traffic the question's length says nothing about
# the answer's. The learned predictor's correlation says how much it found in the passages; the oracle's
# gain over FCFS is the most any predictor could recover. A tiny model's answer lengths are mostly
# chance, so here the gap stays wide; production systems train on their own traffic, where the prompt
# says more.
#
# ### Starvation, and aging
#
# Give SJF a steady stream of short requests and a long one never gets its turn. One slot, one
# 200-token request L at time 0, and a 10-token request every 80 ms for 12 seconds (the slot is
# busy 10 x 10 ms = 100 ms of every 80 ms: there is always a short request waiting). **Aging**
# (`SJF(aging=a)`) forgives a waiting request `a` predicted tokens per second waited, so its rank
# improves until it is served: a request predicted at P is passed only by requests that arrive in the
# first (P - P_min) / a seconds of its wait.

# %%
stream = [TraceRequest("L", 0.0, 8, 200)] + [TraceRequest(f"s{j}", round(0.08 * j, 6), 8, 10) for j in range(150)]
agings = [0, 30, 100, 300, 1000]
wait_L, short_mean = [], []
for a in agings:
    eng, m, s = served(stream, SJF(predictor="oracle", aging=float(a)), max_num_seqs=1)
    wait_L.append(m["L"].queue_wait)
    short_mean.append(mean(m[f"s{j}"].e2e_latency for j in range(150)))
    print(f"aging {a:>4} tokens/s: L waits {wait_L[-1]:6.2f} s; the short requests take {short_mean[-1]:5.2f} s on average")
_, m_fcfs, _ = served(stream, "fcfs", max_num_seqs=1)
print(f"FCFS (for comparison): L waits {m_fcfs['L'].queue_wait:.2f} s, "
      f"short requests {mean(m_fcfs[f's{j}'].e2e_latency for j in range(150)):.2f} s on average")
fig = go.Figure([go.Scatter(x=agings[1:], y=wait_L[1:], name="L's wait (s)", mode="lines+markers"),
                 go.Scatter(x=agings[1:], y=short_mean[1:], name="short requests' mean latency (s)",
                            mode="lines+markers", yaxis="y2")])
fig.add_hline(y=wait_L[0], line_dash="dot", annotation_text="L's wait without aging (starved)")
fig.update_layout(title="aging bounds the longest wait; the short requests pay with their mean latency",
                  xaxis=dict(title="aging (predicted tokens forgiven per second waited)", type="log"),
                  yaxis=dict(title="L's wait (s)", rangemode="tozero"),
                  yaxis2=dict(title="short requests (s)", overlaying="y", side="right", rangemode="tozero"),
                  height=380, plot_bgcolor="white")
fig

# %% [markdown]
# Without aging L waits for the whole stream to end ("long requests can starve"). With aging its wait
# is bounded, and the more aging, the sooner it runs. The short requests pay for it, and not a little:
# their mean latency is <span title="from the run">1.59 s</span> without aging, <span title="from the run">2.52 s</span>
# (+58%) at aging 30, and <span title="from the run">3.55 s</span> (+123%) at aging 1000, where SJF has all
# but turned back into FCFS (<span title="from the run">3.59 s</span>). The bound on the longest wait is
# bought with most of what SJF had given the short requests. Since output length is unknown in advance,
# shortest-first needs a prediction, and mispredictions cause the starvation it was meant to avoid; that is why most production
# systems use FCFS with priority classes and explicit preemption rather than predicting lengths.
#
# ## 3. Priority classes, and priority inversion
#
# Requests are not all equal: paying users expect lower latency, internal services may need steadier
# responses than external APIs, and a live conversation tolerates less delay than a batch job. `Priority`
# serves the lowest `priority` value first (vLLM's convention), FCFS inside a class. But ordering the
# *queue* is not enough: when a low-priority request already holds the GPU (its KV is allocated) and a
# high-priority request arrives that cannot get resources at once, the low-priority request must be
# preempted. Four low-priority requests (class 1, 300 tokens each) fill all 4 slots; at 0.5 s two
# high-priority ones (class 0, 20 tokens) arrive:

# %%
prio_trace = [TraceRequest(f"low{i}", 0.0, 16, 300, priority=1) for i in range(4)]
prio_trace += [TraceRequest(f"high{i}", 0.5, 16, 20, priority=0) for i in range(2)]
prio_runs = {}
for name, pol in (("FCFS", "fcfs"), ("priority, queue order only", Priority(preempt=False)),
                  ("priority, preempting", Priority(preempt=True))):
    eng, m, s = served(prio_trace, pol, max_num_seqs=4)
    prio_runs[name] = eng
    print(f"{name:<28} high-priority wait {mean(m[f'high{i}'].queue_wait for i in range(2)):5.2f} s; "
          f"low-priority done after {mean(m[f'low{i}'].e2e_latency for i in range(4)):5.2f} s; "
          f"{s['num_preemptions']} preemptions")
eng = prio_runs["priority, preempting"]
figures.gantt_figure(eng.step_records, eng.requests, title="priority with preemption: low3 and low2 step aside")

# %% [markdown]
# Ordering the queue by class changes nothing here: nobody of either class is waiting when the slots
# free up except the high-priority requests, and the slots do not free up for three seconds. The
# high-priority requests wait behind the low class that got there first: priority inversion. Preemption
# fixes it: the scheduler asks the policy `preempt_for(request, running)`, which names the lowest-class,
# most recently admitted running request; its KV is dropped and it goes back to the queue (it will
# recompute its prefix when it returns, notebook 05). The high class starts at once. The price is paid
# by the class that was preempted, and by the work it redoes. Classes need careful definition: if
# most traffic is marked urgent, urgent means nothing, and a high class that never lets up starves the
# low one.
#
# ## 4. MLFQ: tokens as the time slice
#
# The multi-level feedback queue (Corbató et al., 1962) combines the fairness of FCFS, the efficiency of
# SJF and the tiers of priority scheduling. New requests enter the top level; a request that generates its
# level's quantum of tokens is demoted one level (in LLM serving the natural time slice is a number of
# tokens generated, not seconds); waiting requests go by level, and a newcomer may push out a
# running request of a deeper level. So MLFQ tells short requests from long ones by watching them,
# without predicting any length. To prevent starvation,
# every `boost_interval` seconds everyone returns to the top level.
#
# Eight long requests (400 tokens) fill the 4 slots; a short one (20 tokens) arrives every 0.2 s:

# %%
mlfq_trace = [TraceRequest(f"long{i}", 0.0, 16, 400) for i in range(8)]
mlfq_trace += [TraceRequest(f"s{j}", 0.1 + 0.2 * j, 16, 20) for j in range(30)]
short_ids = [f"s{j}" for j in range(30)]
for name, pol in (("FCFS", "fcfs"), ("MLFQ, quanta 16/64/256, boost 30 s", MLFQ()),
                  ("MLFQ without preemption", MLFQ(preempt=False))):
    eng, m, s = served(mlfq_trace, pol, max_num_seqs=4)
    print(f"{name:<36} short requests {mean(m[r].e2e_latency for r in short_ids):6.2f} s, long ones "
          f"{mean(m[f'long{i}'].e2e_latency for i in range(8)):6.2f} s; {s['num_preemptions']} preemptions")

# %% [markdown]
# MLFQ never read a length: the long requests revealed themselves by running past 16 tokens. Without
# preemption it could only reorder the queue, and the queue was not the problem (the slots were).
# Below, the level of three requests step by step, with a short boost interval (2 s) so boosts show.

# %%
mlfq = MLFQ(quanta=(16, 64, 256), boost_interval=2.0)
llm = LLM(model="random", executor="simulated", clock="modeled", cost_model=TEN_MS, policy=mlfq, max_num_seqs=4,
          max_model_len=1024, record="summary")   # no per-block KV map: totals are enough here
workloads.submit_trace(llm.engine, mlfq_trace, vocab_size=llm.engine.vocab_size)
watch = ("long0", "long6", "s3")
t, levels = [], {rid: [] for rid in watch}
while llm.engine.has_unfinished_requests():
    rec = llm.engine.step()
    t.append(rec.time)
    for rid in watch:
        req = llm.engine.requests[rid]
        levels[rid].append(mlfq.level(req) if rid in rec.running or any(w.request_id == rid for w in rec.waiting)
                           else None)
fig = go.Figure([go.Scatter(x=t, y=levels[rid], name=rid, mode="lines", line=dict(shape="hv")) for rid in watch])
fig.update_layout(title=f"MLFQ level over time ({mlfq.num_boosts} boosts, every 2 s)", xaxis_title="time (s)",
                  yaxis=dict(title="level (0 = top)", autorange="reversed", dtick=1), height=320, plot_bgcolor="white")
fig

# %% [markdown]
# Rules of thumb for the knobs: typically 3 to 5 levels; quanta set from the distribution of request
# lengths, so that most short requests complete in the top queue; a boost period of several tens of
# seconds, around a request's typical lifetime. (FastServe, Wu et al., 2023, applies MLFQ to LLM
# serving, with a "skip-join" variant that places a new request at the level its prefill time calls for.)
#
# ## 5. Fair queuing when one tenant floods
#
# In a multi-tenant service one tenant can send sixty requests at once while the others send a few.
# FCFS serves the flood first. Fair queuing gives each tenant an equal share of service: minillm's
# `Fair` keeps a *virtual token counter* per tenant (prompt tokens prefilled + 2 x tokens generated,
# the VTC of Sheng et al., OSDI 2024) and admits next from the tenant that has received the least.

# %%
flood = workloads.flood_trace("flood", num_flood=60, polite_tenants=("a", "b"), num_polite=8, polite_rate=2.0,
                              prompt_len=32, output_len=32)
fair_runs = {}
for name, pol in (("FCFS", "fcfs"), ("fair queuing (VTC)", Fair())):
    eng, m, s = served(flood, pol, max_num_seqs=4)
    fair_runs[name] = eng
    per = {t: mean(mm.e2e_latency for rid, mm in m.items() if rid.startswith(t + "-")) for t in ("flood", "a", "b")}
    print(f"{name:<20} mean latency: " + ", ".join(f"tenant {t} {v:5.2f} s" for t, v in per.items()))

def service_over_time(eng):
    """Cumulative service per tenant after each step (prefill tokens + 2 x generated), from the StepRecords."""
    tenant = {rid: r.tenant for rid, r in eng.requests.items()}
    total = {t: 0.0 for t in set(tenant.values())}
    rows = []
    for rec in eng.step_records:
        for e in rec.batch:
            total[tenant[e.request_id]] += (e.num_new_tokens if e.phase == "prefill" else 0) + 2 * e.num_output_tokens
        rows.append((rec.time, dict(total)))
    return rows

fig = make_subplots(rows=1, cols=2, subplot_titles=list(fair_runs), shared_yaxes=True)
for col, (name, eng) in enumerate(fair_runs.items(), start=1):
    rows = service_over_time(eng)
    for i, tnt in enumerate(("flood", "a", "b")):
        fig.add_trace(go.Scatter(x=[r[0] for r in rows], y=[r[1][tnt] for r in rows], name=f"tenant {tnt}",
                                 line=dict(color=figures.PALETTE[i]), showlegend=col == 1), row=1, col=col)
fig.update_xaxes(title_text="time (s)")
fig.update_yaxes(title_text="service received (weighted tokens)", col=1)
fig.update_layout(title="who gets served while one tenant floods", height=360, plot_bgcolor="white")
fig

# %% [markdown]
# Under FCFS the polite tenants' requests wait behind the flood's sixty. Under fair queuing their
# service curves climb with the flood's: while every tenant has requests waiting, their counters stay
# within a bounded distance of each other (the bound in `Fair`'s docstring), and once the polite
# tenants have nothing left the flood gets the whole machine. The cost is bookkeeping: a counter per
# tenant, charged every step.
#
# ## 6. Prefill against decode
#
# An example of FCFS's blocking: 10 requests are decoding when the scheduler admits one with a
# 2000-token prompt. At a rule-of-thumb 4000 prompt tokens per second its prefill takes 500 ms, and
# all 10 decodes pause for it. Three answers (chunked prefill with decodes piggybacked on the chunks comes
# from SARATHI, Agrawal et al., arXiv 2308.16369, 2023, and its successor Sarathi-Serve, OSDI 2024):
#
# | Approach | Idea | Tradeoff |
# |---|---|---|
# | Prefill priority | Run prefills first | Decode latency suffers |
# | Decode priority | Never interrupt decode | Time-to-first-token suffers |
# | Chunked prefill | Split a long prompt into pieces, interleave with decode | Slightly less efficient prefill, far smoother latency |
#
# The scenario on a modeled Llama-2-70B served by four A100s (the roofline cost model: a prefill of 2000
# tokens is compute bound, a decode step memory bound). minillm's `interference` setting picks the
# approach; chunked prefill runs under a budget of 512 tokens per step.

# %% [markdown]
# **Predict, then run.** Ten requests are decoding when P's 2,000-token prompt arrives. Of the three approaches
# in the table, which gives P its first token soonest, which the decoders the smallest worst stall between two
# tokens, and which makes P wait longest?

# %%
interf_trace = [TraceRequest(f"d{i}", 0.0, 200, 400) for i in range(10)] + [TraceRequest("P", 1.0, 2000, 20)]
modes = {"prefill-priority": dict(interference="prefill-priority", enable_chunked_prefill=False, max_num_batched_tokens=4096),
         "decode-priority": dict(interference="decode-priority", enable_chunked_prefill=False, max_num_batched_tokens=4096),
         "chunked prefill, 512": dict(interference="chunked", enable_chunked_prefill=True, max_num_batched_tokens=512)}
interf = {}
for name, cfg in modes.items():
    eng, s = simulate(interf_trace, model="llama-2-70b", hardware="A100-80GB", num_gpus=4, max_num_seqs=16, **cfg)
    m = {rid: r.metrics for rid, r in eng.requests.items()}
    interf[name] = m
    stall = max(max(m[f"d{i}"].inter_token_latencies) for i in range(10))
    print(f"{name:<22} P's TTFT {m['P'].ttft * 1e3:7.0f} ms | decoders' TPOT {mean(m[f'd{i}'].tpot for i in range(10)) * 1e3:5.1f} ms, "
          f"worst stall between two tokens {stall * 1e3:5.0f} ms")
stalls = {name: max(max(m[f"d{i}"].inter_token_latencies) for i in range(10)) for name, m in interf.items()}
assert stalls["prefill-priority"] < 0.5                      # the modeled GPUs beat the rule of thumb's 500 ms
assert stalls["chunked prefill, 512"] < stalls["prefill-priority"] and \
    interf["chunked prefill, 512"]["P"].ttft > interf["prefill-priority"]["P"].ttft   # what chunking fixes, and what not
fig = go.Figure()
for name, m in interf.items():
    times = m["d0"].token_times
    fig.add_trace(go.Scatter(x=times[1:], y=[1e3 * g for g in m["d0"].inter_token_latencies], name=name, mode="lines"))
fig.update_layout(title="request d0: the gap before each of its tokens (P arrives at 1.0 s)", xaxis_title="time (s)",
                  yaxis=dict(title="ms since its previous token", type="log"), height=360, plot_bgcolor="white")
fig

# %% [markdown]
# <details><summary>Answer</summary>
#
# Prefill priority gives P its first token soonest; chunked prefill gives the decoders the smallest worst
# stall (the cell asserts both); decode priority makes P wait until the ten decoders have finished.
#
# </details>

# %% [markdown]
# Prefill priority gives P its first token soonest and stalls all ten decoders for the whole prefill step
# (a latency spike that has nothing to do with their own requests). The stall is shorter than the
# 500 ms of the rule of thumb: four modeled A100s prefill faster than 4000 tokens per second, and the
# stall printed is what the roofline says their prefill costs. Decode priority never interrupts a
# decode, and P waits until all ten have finished. Chunked prefill splits P's prompt into budget-sized
# pieces that ride along with the decodes: each decode step grows a little, no step is long, and P's
# first token comes only slightly later than under prefill priority. Chunked prefill (SARATHI, Agrawal
# et al., 2023, and Sarathi-Serve, Agrawal et al., OSDI 2024) is the standard compromise: it bounds the worst stall a decode can suffer,
# at modest cost. Note which spike it removes. It is sometimes said to fix TTFT spikes; here P's own
# first token comes a little *later* than under prefill priority (the cell asserts it). What it fixes
# is the spike in the *other* requests' time between tokens, which a long prefill causes. It is minillm's default (`interference="chunked"`).
#
# ## 7. Scheduling every N steps
#
# The scheduling pass itself costs time, and continuous batching pays it every step. A worked
# example: a decode step takes 15 ms and the scheduling pass 0.5 ms. Scheduling every 5 steps instead of
# every step cuts the overhead from 0.5 / 15 = 3.3% to 0.5 / (15 x 5) = 0.67%. The price: a finished
# request may stay in the batch up to 4 steps (60 ms) before it is removed, about 0.8% of a 500-token
# request's 7500 ms, and a new request may wait up to 5 steps (75 ms) before it is added. With `schedule_every=N` minillm re-forms the batch
# only every N steps; in between it reuses the running set, and a request that finishes is returned at
# the next pass.

# %%
every_trace = [TraceRequest(f"r{i}", 0.0, 8, 500 + i) for i in range(10)]         # 500..509 tokens
late_trace = [TraceRequest(f"bg{i}", 0.0, 8, 300) for i in range(4)] + \
             [TraceRequest(f"new{i}", 0.0101 + 0.0377 * i, 8, 20) for i in range(30)]   # arrivals at awkward moments
cost = ConstantStepTime(0.015, schedule_overhead=0.0005)
for n in (1, 5):
    eng, m, s = served(every_trace, "fcfs", cost_model=cost, schedule_every=n, max_num_seqs=64)
    sched = sum(r.schedule_time for r in eng.step_records)
    forward = sum(r.duration - r.schedule_time for r in eng.step_records)
    held = max(mm.finish_time - mm.token_times[-1] for mm in m.values())
    _, m2, _ = served(late_trace, "fcfs", cost_model=cost, schedule_every=n, max_num_seqs=64)
    admit = max(m2[f"new{i}"].queue_wait for i in range(30))
    print(f"schedule every {n} step(s): overhead {sched / forward:6.2%} of decode time; a finished request is held "
          f"up to {held * 1e3:3.0f} ms ({held / (500 * 0.015):.2%} of 500 x 15 ms); a new one waits up to {admit * 1e3:3.0f} ms")
    assert held <= (n - 1) * 0.0155 + 1e-9 and admit <= n * 0.0155 + 1e-9   # the hand calculation's bounds (with the pass)

# %% [markdown]
# The engine's own step records reproduce the hand calculation: the overhead falls five-fold, and a
# finished request is held at most 4 steps (60 ms, 0.8% of a 7.5 s answer). A newcomer waits at most
# 5 steps (75 ms, plus the passes; the cell asserts both bounds); the longest wait printed is shorter
# because none of these 30 arrivals lands at the very worst moment, just after a pass. Where latency
# matters most the extra wait is acceptable; where throughput matters most the saved overhead is worth
# more. vLLM nevertheless schedules every step, because paging keeps the pass cheap.
#
# The yardstick is the step the pass precedes: 1 ms of scheduling before a 10 ms step is 10% of the
# machine. The same arithmetic on the engine, and minillm's own pass measured on this machine (CPU time,
# the median of 50 passes with 64 requests running and 64 waiting):

# %%
eng, _, _ = served(every_trace, "fcfs", cost_model=ConstantStepTime(0.010, schedule_overhead=0.001), max_num_seqs=64)
share = sum(r.schedule_time for r in eng.step_records) / sum(r.duration - r.schedule_time for r in eng.step_records)
print(f"a 1 ms pass before each 10 ms step: {share:.1%} of the forward time")
assert abs(share - 0.10) < 1e-9
own = time_pass(running=64, waiting=64, passes=50)
print(f"minillm's pass here: {own['pass_s'] * 1e6:,.0f} microseconds, {own['pass_s'] / 0.010:.1%} of a 10 ms step")

# %% [markdown]
# Scheduling less often is one way to shrink the share. Others keep the per-step decision but make it
# cheaper: **batch the adds and removes** (admit several waiting requests in one pass and free finished
# ones together, rather than re-forming the batch for each change); keep the pass **incremental**
# (touch only requests whose state changed, not every running one); **predict completions** (a request
# that will stop at its `max_tokens` is known to finish at a given step, so its slot and blocks can be
# handed to a waiting request in the pass before, without a pass of its own); and **overlap** the pass
# for step k + 1 with the GPU's execution of step k, which SGLang's overlap scheduler and vLLM's
# asynchronous scheduling do, so the pass costs nothing as long as it is shorter than the step.
#
# ## 8. At scale: goodput, load shedding, and the tail
#
# The metrics: *throughput* (tokens or requests per second), *TTFT* and *TPOT*, and what this notebook and
# minillm's summaries call **goodput**: SLO-meeting throughput, the requests per second served within both
# latency SLOs (`goodput_requests_per_s`), the honest combination of the others. DistServe (Zhong et al.,
# OSDI 2024) defines goodput differently: the *maximum request rate* a deployment can serve while
# meeting an SLO attainment target (for example 90% of requests within both their TTFT and TPOT SLOs).
# Ours is measured at one arrival rate; DistServe's is read off a sweep of rates like the one below, as
# the highest rate whose SLO attainment still meets the target. Here 500 requests of chat-like
# traffic (log-normal prompts around 512 tokens, answers around 128, both with long tails) arrive as a
# Poisson process and are served by a modeled Llama-2-70B on four H100s (`simulate`'s default), at
# most 64 at once, at six rising rates (3,000 requests, a couple of seconds of simulation per rate). The SLOs:
# first token within 2 s, then at most 100 ms per token.

# %%
SLO = dict(slo_ttft=2.0, slo_tpot=0.100)
rates = [4, 8, 12, 14, 16, 20]
def chat_trace(rate, n=500):
    return workloads.synthetic_trace(n, rate=rate, prompt_len=LogNormal(512, 1.0, 4, 4096),
                                     output_len=LogNormal(128, 0.9, 4, 1024), seed=0)
load = {}
for rate in rates:
    eng, s = simulate(chat_trace(rate), model="llama-2-70b", records="summary", max_num_seqs=64, **SLO)
    load[rate] = s
    print(f"{rate:>3} req/s: TTFT p50 {s['ttft_p50']:6.2f} s, p99 {s['ttft_p99']:6.2f} s | throughput "
          f"{s['request_throughput']:5.1f} req/s, goodput {s['goodput_requests_per_s']:5.1f} req/s "
          f"({s['slo_attainment']:.0%} meet the SLOs) | mean batch {s['batch_size_mean']:5.1f}  [{s['wall_time']:.1f} s to simulate]")

# %%
fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "served per second"))
for q, dash in (("p50", "solid"), ("p99", "dash")):
    fig.add_trace(go.Scatter(x=rates, y=[load[r][f"ttft_{q}"] for r in rates], name=f"TTFT {q}", mode="lines+markers",
                             line=dict(dash=dash, color=figures.PALETTE[0])), row=1, col=1)
fig.add_hline(y=SLO["slo_ttft"], line_dash="dot", annotation_text="TTFT SLO", row=1, col=1)
fig.add_trace(go.Scatter(x=rates, y=[load[r]["request_throughput"] for r in rates], name="throughput",
                         mode="lines+markers", line=dict(color=figures.PALETTE[1])), row=1, col=2)
fig.add_trace(go.Scatter(x=rates, y=[load[r]["goodput_requests_per_s"] for r in rates], name="goodput",
                         mode="lines+markers", line=dict(color=figures.PALETTE[2])), row=1, col=2)
fig.update_yaxes(title_text="s", type="log", row=1, col=1)
fig.update_yaxes(title_text="requests / s", row=1, col=2)
fig.update_xaxes(title_text="arrival rate (requests / s)")
fig.update_layout(height=380, plot_bgcolor="white", title="rising load on a modeled 4 x H100 serving Llama-2-70B")
fig

# %% [markdown]
# Throughput counts finished requests over the time from the first arrival to the last finish, so it
# sits below the arrival rate even when nothing is lost: at 4 requests per second every one of the 500
# requests is served within its SLOs, yet the printed throughput is <span title="from the run">3.3 req/s</span>.
# The 500 Poisson arrivals of that trace span 137 s (about 3.6 per second in this sample), and the run then
# drains for another 12 s while the last long answers are generated.
#
# DistServe's goodput, with a 90% attainment target, is read off the same printout: the highest rate tried
# at which at least 90% of requests meet both SLOs is 14 requests per second (all of them do); at 16,
# <span title="from the run">65% meet the SLOs</span>. On this sweep it lies between 14 and 16 requests per second.
#
# Below capacity the median and the p99 both stay small. Near capacity the p99 leaves the median
# behind: watch the tail, because the p99 shows problems that averages hide. Past capacity
# throughput flattens at what the hardware can do, the queue grows for as long as the overload lasts,
# every newcomer waits behind all of it, and goodput *falls*: the engine is as busy as ever, serving
# requests that miss their SLO. Throughput and latency trade off through the batch size, so
# reporting either alone misleads.
#
# **Shedding load.** When the tail is far worse than the median because the queue is unbounded, the fix
# is to cap the queue's depth and shed load: rejecting a request cleanly beats accepting it and timing out.
# `max_queue_len` rejects newcomers beyond that many waiting requests. At about 10 requests served per
# second and a 2 s TTFT target, a queue much longer than 20 cannot be served in time; cap it at 16:

# %%
for rate in (16, 20):
    capped = simulate(chat_trace(rate), model="llama-2-70b", records="summary", max_num_seqs=64, max_queue_len=16, **SLO)[1]
    for cap, s in ((None, load[rate]), (16, capped)):
        print(f"{rate:>3} req/s, queue cap {str(cap):>4}: rejected {s['num_rejected']:3d}, TTFT p50 {s['ttft_p50']:5.2f} s, "
              f"p99 {s['ttft_p99']:5.2f} s, goodput {s['goodput_requests_per_s']:5.1f} req/s, "
              f"SLOs met by {s['slo_attainment']:.0%} of all requests (rejected ones count as missed)")

# %% [markdown]
# With the cap, the requests that are accepted are served within their SLO, so goodput stays near the
# machine's capacity instead of collapsing; the rejected ones get an immediate, explicit "no" they can
# retry elsewhere. The rules of thumb this section illustrates: measure goodput, watch the tail,
# and shed load explicitly.
#
# **Ask your own what-if.** The sweep above fixed everything but the rate. The widget below re-runs a
# 2,000-request chat trace through the same scheduler, policies and KV manager each time a control
# moves (arrival rate, policy, execution-token budget, chunked prefill, KV capacity, preemption mode)
# and redraws the TTFT and TPOT CDFs (the previous setting dashed), the KV cache in use over the run,
# and goodput under the same SLOs. Things to try: the KV capacity down to 16,000 positions at 12 requests
# per second, then FCFS against SJF (a queue forms, and SJF serves most requests' first token several
# times sooner while its slowest wait a little longer: compare the p50 and p99 in the line under the
# controls); at the default 64,000 positions hardly a queue forms below about 24 requests per second, and
# the two policies draw nearly the same curves, because a policy only chooses among waiting requests;
# at 16,000 positions, recompute against swap; chunked prefill off with a small budget (the engine
# refuses, and says why).

# %%
from minillm.viz.whatif import WhatIf

whatif = WhatIf(**SLO)
assert whatif.summary["num_finished"] == 2000
whatif

# %% [markdown]
# ## 9. Is the simulator right? Calibrate it on your machine
#
# Every at-scale answer above came from the modeled clock: the real scheduler and KV manager, with each
# step's time predicted by a cost model (here a roofline of four H100s). You have no H100 to check that
# against, but you do have this machine, and the same engine runs on it for real. So: time the real
# engine's steps here, fit the cost model's terms to them, then replay one trace twice, on the real
# engine (requests arriving in real time, the wall clock) and on the simulator (the fitted model, the
# modeled clock), and compare every request's latency. Only step times are predicted; every scheduling
# decision is the real scheduler's in both runs.
#
# The model of one step (`LinearStepCost`, `minillm/sim/costmodel.py`) is a sum of five terms, each a
# cost per unit: a fixed part (launching the step, Python, the scheduling pass), per new token (every
# linear layer), per sequence (sampling and bookkeeping), per context token (the KV each request reads)
# and per attention pair (each new token's products with the keys before it). The timing runs a grid of
# batch shapes, then replays a few short traces in real time (the batches a server really forms); the
# fit (`minillm/sim/calibration.py`, least squares) gives each term an uncertainty. About 20 seconds:

# %%
from minillm.sim import calibration

steps = calibration.measure_steps(budget_s=20)
calibrated = calibration.fit_step_cost(steps)
print(f"{len(steps)} steps timed; the fit is within {calibrated.info['fit_median_rel_err']:.1%} of a step's time "
      f"(median), {calibrated.info['fit_p90_rel_err']:.1%} (p90)")
for term, sec in calibrated.seconds.items():
    print(f"  {term:<16} {sec * 1e6:10.3f} us per unit  (+/- {calibrated.stderr[term] * 1e6:.3f})")

# %% [markdown]
# Now the check: 120 requests, Poisson arrivals at 10 per second, log-normal prompt and answer lengths
# (about 12 seconds on the real engine, a fraction of one on the simulator):

# %%
check = calibration.compare_on_trace(calibrated, calibration.validation_trace(120, rate=10.0, seed=1))
for metric, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end latency")):
    m = check[metric]
    print(f"{label:<20} measured median {m['median_measured_s'] * 1e3:7.1f} ms, modeled {m['median_modeled_s'] * 1e3:7.1f} ms;"
          f" per request off by {m['median_rel_err']:.1%} (median), {m['p90_rel_err']:.1%} (p90)")
print(f"steps with work: {check['steps']['measured']} measured, {check['steps']['modeled']} modeled")

# %%
pairs = [(v["measured"]["e2e"], v["modeled"]["e2e"]) for v in check["per_request"].values()]
ttfts = [(v["measured"]["ttft"], v["modeled"]["ttft"]) for v in check["per_request"].values()]
fig = make_subplots(rows=1, cols=2, subplot_titles=("each request's end-to-end latency", "TTFT, all requests"))
top = max(max(p) for p in pairs) * 1.05
fig.add_trace(go.Scatter(x=[a for a, _ in pairs], y=[b for _, b in pairs], mode="markers", name="one request",
                         marker=dict(color=figures.PALETTE[0], size=6, opacity=0.7)), row=1, col=1)
fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="modeled = measured",
                         line=dict(color="grey", dash="dot")), row=1, col=1)
for k, (name, color) in enumerate((("measured (real engine)", figures.PALETTE[1]), ("modeled (simulator)", figures.PALETTE[2]))):
    xs = np.sort([t[k] for t in ttfts])
    fig.add_trace(go.Scatter(x=xs, y=np.arange(1, len(xs) + 1) / len(xs), mode="lines", name=f"TTFT {name}",
                             line=dict(color=color, dash="solid" if k == 0 else "dash")), row=1, col=2)
fig.update_xaxes(title_text="measured end-to-end latency (s)", row=1, col=1)
fig.update_yaxes(title_text="modeled end-to-end latency (s)", row=1, col=1)
fig.update_xaxes(title_text="time to first token (s)", row=1, col=2)
fig.update_yaxes(title_text="fraction of requests (CDF)", row=1, col=2)
fig.update_layout(height=400, plot_bgcolor="white", title="the simulator, calibrated on this machine, against the real engine")
fig

# %% [markdown]
# Points on the diagonal are requests whose latency the simulator predicted exactly; the two CDFs
# (cumulative distribution functions: the fraction of requests whose TTFT is at most x) lie on top of
# each other when the prediction is right for the whole distribution, the tail included. For scale,
# Vidur (Agrawal et al., MLSys 2024), which profiles every operator of a model on a GPU, predicts request
# latencies within 9%. Where ours misses, look at what the five terms leave out: a busy machine (another
# program taking a core makes the real steps slower, not the modeled ones), memory allocation the first
# time a batch shape appears, and Python's garbage collector.
#
# The command `python -m minillm.bench calibrate --out DIR` does the same with a minute of timing and two
# longer traces (one where requests are preempted), and saves the profile as `DIR/step-cost-MACHINE.json`;
# `CostModel.from_profile(path)` loads it, anywhere a cost model is taken. With the profile, the what-if
# widget answers for *this* machine serving the shipped model, and you can check any of its answers by
# running the real engine:

# %%
from minillm.model.loader import resolve_model_path
from minillm.viz.whatif import WhatIf, WhatIfSettings

local_whatif = WhatIf(WhatIfSettings(rate=10.0, kv_capacity_tokens=16_384), controls=("rate", "policy", "budget", "kv"),
                      trace=lambda rate: calibration.validation_trace(300, rate=rate, seed=2),
                      model=resolve_model_path(None), cost_model=calibrated, max_num_seqs=64,
                      choices={"kv": (1_024, 2_048, 4_096, 8_192, 16_384), "rate": (2.0, 40.0, 2.0)},
                      config={"max_model_len": 1024}, slo_ttft=0.5, slo_tpot=0.05)
local_whatif

# %% [markdown]
# ## Exercises
#
# Three policies in `exercises/ex03_policies.py`, each a `Policy` subclass that the engine asks every
# step, exactly like the built-in ones. The cells below run *your* classes inside the engine. Then three
# calculations from sections 6 to 8 (chunked prefill's worst stall, scheduling every N steps, goodput),
# each shown next to the engine's own run.
#
# **Exercise 1, `SJFWithAging`**: `remaining`, `key` and `order_waiting` (section 2). The stream of
# section 2, with and without aging:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# The docstrings of `remaining` and `key` define both; check them on section 2's stream first: with aging 0, L must wait for the whole stream (the printout of the aging cell), with aging it must run sooner.
#
# </details>
# <details><summary>Hint 2</summary>
#
# `order_waiting` returns a new list, smallest key first; the docstring says how a tie is broken. The graders compare every request's schedule with the engine's `SJF` on the same trace.
#
# </details>

# %%
with impl.attempt("ex03.SJFWithAging"):
    for a in (0.0, 100.0):
        eng, m, s = served(stream, ex.SJFWithAging(aging=a), max_num_seqs=1)
        print(f"your SJF, aging {a:>5}: L waits {m['L'].queue_wait:6.2f} s")

# %% [markdown]
# **Exercise 2, `MLFQPolicy`**: `order_waiting`, `pick_victim`, `preempt_for` and `on_step` (demotion
# per quantum, the boost; section 4):

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 4's rules are the contract: a waiting request is ordered by its level, and the victim is the running request at the deepest level (the docstring breaks ties). `preempt_for` may push out only a request deeper than the one waiting.
#
# </details>
# <details><summary>Hint 2</summary>
#
# `on_step`: one step can add more output tokens than are left of a quantum (speculative decoding adds several at once): the invariant is that after `on_step` no request below the last level holds a full quantum's worth of used tokens. The boost cell in section 4 shows when a boost must happen.
#
# </details>

# %%
with impl.attempt("ex03.MLFQPolicy"):
    eng, m, s = served(mlfq_trace, ex.MLFQPolicy(), max_num_seqs=4)
    print(f"your MLFQ: short requests {mean(m[r].e2e_latency for r in short_ids):.2f} s, long ones "
          f"{mean(m[f'long{i}'].e2e_latency for i in range(8)):.2f} s on average; {s['num_preemptions']} preemptions")

# %% [markdown]
# **Exercise 3, `FairPolicy`**: `order_waiting` (interleave the tenants by their counters) and
# `on_step` (charge what ran; section 5):

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 5's service curves are the behaviour to reproduce: while every tenant has requests waiting, their counters stay close. Place one request at a time, always from the tenant whose counter (as it would be after the requests already placed) is smallest.
#
# </details>
# <details><summary>Hint 2</summary>
#
# `on_step` charges each tenant for what its requests just ran, prompt tokens and output tokens at their weights (the docstring gives them). The graders compare your order with the engine's `Fair` step by step.
#
# </details>

# %%
with impl.attempt("ex03.FairPolicy"):
    eng, m, s = served(flood, ex.FairPolicy(), max_num_seqs=4)
    print("your fair queuing, mean latency: " + ", ".join(
        f"tenant {t} {mean(mm.e2e_latency for rid, mm in m.items() if rid.startswith(t + '-')):.2f} s"
        for t in ("flood", "a", "b")))

# %% [markdown]
# **Exercise 4, `chunk_sizes` and `worst_decode_stall`**: chunked prefill (section 6). The chunks a long
# prompt is prefilled in beside requests that keep decoding, and the longest step among them: the worst
# stall a decoding request sees between two tokens. Below, yours on the modeled Llama-2-70B of section 6
# (`eng.cost_model.step_time` prices a step) next to the engine's own run, for three budgets:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 6's chunked run: in each step the decoders run first, one token each, and the prompt gets what is left of the budget. The chunks must add up to the prompt.
#
# </details>
# <details><summary>Hint 2</summary>
#
# Each step of the prefill is one batch for `step_time`: the decoders' one new token each beside one chunk. Mind the context lengths (`step_time` wants the KV held *after* the step): both the decoders' and the prompt's grow from step to step.
#
# </details>

# %%
with impl.attempt("ex03.chunk_sizes / worst_decode_stall"):
    print("P's prompt beside ten decodes, budget 512: chunks", ex.chunk_sizes(2000, 10, 512))
    for budget in (256, 512, 1024):
        eng, _ = simulate(interf_trace, model="llama-2-70b", hardware="A100-80GB", num_gpus=4, max_num_seqs=16,
                          interference="chunked", enable_chunked_prefill=True, max_num_batched_tokens=budget)
        steps = [r for r in eng.step_records if any(e.request_id == "P" and e.phase == "prefill" for e in r.batch)]
        decoding = [e.num_computed_before for e in steps[0].batch if e.phase == "decode"]
        yours = ex.worst_decode_stall(eng.cost_model.step_time, 2000, decoding, budget)
        print(f"budget {budget:>4}: your worst stall {yours * 1e3:5.1f} ms; the engine's longest step while P was "
              f"prefilled {max(r.duration for r in steps) * 1e3:5.1f} ms (with its scheduling pass)")

# %% [markdown]
# **Exercise 5, `schedule_every_tradeoff`**: the arithmetic of section 7. Given the step time, the time of
# one scheduling pass and N, return the overhead, the longest a finished request is held and the longest a
# newcomer waits for admission. Below, yours next to the engine's own run: section 7's ten requests, and
# newcomers that arrive just after a pass has started (the worst moment):

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Draw the timeline of section 7: a pass at the start of steps 0, N, 2N, ... and mark when a finished request is released and when a newcomer is admitted. The docstring's example (N = 5, 15 ms steps, a 0.5 ms pass) is the case to check.
#
# </details>
# <details><summary>Hint 2</summary>
#
# The cell below runs the engine with newcomers arriving just after a pass started (the worst moment): its printed wait is the number your third value must match.
#
# </details>

# %%
with impl.attempt("ex03.schedule_every_tradeoff"):
    for n in (1, 5):
        t = ex.schedule_every_tradeoff(n, 0.015, 0.0005)
        _, m, _ = served(every_trace, "fcfs", cost_model=cost, schedule_every=n, max_num_seqs=64)
        held = max(mm.finish_time - mm.token_times[-1] for mm in m.values())
        period = n * 0.015 + 0.0005                                   # a pass starts every `period` s while busy
        worst = [TraceRequest("bg", 0.0, 8, 100)] + [TraceRequest(f"new{k}", k * period + 1e-6, 8, 3) for k in range(1, 4)]
        _, m2, _ = served(worst, "fcfs", cost_model=cost, schedule_every=n, max_num_seqs=64)
        wait = max(m2[f"new{k}"].queue_wait for k in range(1, 4))
        print(f"every {n} step(s), yours: overhead {t['overhead']:.2%}, held up to {t['longest_hold'] * 1e3:.0f} ms, "
              f"a newcomer waits up to {t['longest_admission_wait'] * 1e3:.1f} ms | the engine: held up to "
              f"{held * 1e3:.0f} ms, a newcomer just after a pass waited {wait * 1e3:.1f} ms")

# %% [markdown]
# **Exercise 6, `goodput`**: goodput under SLOs, with load shedding (section 8). From each request's
# arrival and token times, the requests per second served within both SLOs, and their share of all
# requests (a request turned away counts as a failure). Below, yours on section 8's traffic at 20
# requests per second, without and with the queue cap, next to `minillm.analysis.metrics`:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# The docstring defines both SLOs per request; its example has three requests (one turned away) to check by hand first.
#
# </details>
# <details><summary>Hint 2</summary>
#
# The cell below compares yours with `minillm.analysis.metrics` with and without the queue cap; if only the capped run differs, look at how the turned-away requests count.
#
# </details>

# %%
with impl.attempt("ex03.goodput"):
    for cap in (None, 16):
        eng, s = simulate(chat_trace(20), model="llama-2-70b", records=False, max_num_seqs=64, max_queue_len=cap, **SLO)
        g = ex.goodput([(r.metrics.arrival_time, list(r.metrics.token_times)) for r in eng.requests.values()], **SLO)
        print(f"20 req/s, queue cap {str(cap):>4}: your goodput {g['goodput']:5.2f} req/s, {g['attainment']:.0%} "
              f"meet the SLOs | minillm.analysis.metrics: {s['goodput_requests_per_s']:5.2f} req/s, {s['slo_attainment']:.0%}")

# %% [markdown]
# **Exercise 7 (judgement), `largest_queue_cap`**: section 8 capped the queue at 16 by a rule of thumb. At 20
# requests per second, what is the *largest* cap at which the requests the engine accepts still get their
# first token within 2 s at the p99? Guess from section 8's capped printout, then write the function: it
# bisects over caps, and the cell below hands it one simulation of section 8's traffic per cap it asks for.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 8's printout under the cap: the TTFT p99 at 20 requests per second with a cap of 16. Is 16 at the
# limit already, or is there room? And without a cap?
#
# </details>
# <details><summary>Hint 2</summary>
#
# Keep an invariant while you bisect: one cap known to meet the target (0 meets it trivially: nobody waits) and
# one known to miss it (treat `max_cap + 1` as missing, without running it). The graders count the runs.
#
# </details>

# %%
with impl.attempt("ex03.largest_queue_cap"):
    cap_runs = {}
    def run_with_cap(cap):
        cap_runs[cap] = simulate(chat_trace(20), model="llama-2-70b", records=False, max_num_seqs=64,
                                 max_queue_len=cap, **SLO)[1]
        return cap_runs[cap]
    best = ex.largest_queue_cap(run_with_cap, SLO["slo_ttft"], 64)
    print(f"20 req/s: the largest queue cap for a {SLO['slo_ttft']:g} s TTFT p99 is {best}; {len(cap_runs)} simulations: "
          + ", ".join(f"cap {c}: {r['ttft_p99']:.2f} s" for c, r in sorted(cap_runs.items())))

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex03_policies.py` (its stubs raise `NotImplementedError` until you fill them in;
# the docstrings say exactly what each must do). The cells above run *your* version: `impl.load` reads
# the environment variable `MINILLM_IMPL` (unset: `exercises`, yours; `solutions`: the reference answers).
# From the repository root:
#
# ```bash
# make grade EX=03                                            # every ex03 grader, against exercises/
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex03 tests/test_exercises.py -k mlfq   # one exercise
# ```
#
# A failing grader says what it expected and where the expectation came from (numbers worked by hand,
# the engine's cost model, or what the real scheduler did on the same requests).

# %% [markdown]
# ## Summary
#
# 1. A policy orders the waiting queue and, if it preempts, names who gives way; the scheduler asks it every step.
# 2. FCFS is fair but blocks short requests behind long ones; shortest-first cuts the mean completion, needs predicted lengths, and starves long requests without aging.
# 3. Priority classes, MLFQ (tokens as the time slice) and fair queuing buy guarantees for a class, for short requests or for each tenant.
# 4. A long prefill stalls every decoder in its step; chunked prefill bounds that stall at a small cost to the prompt's own TTFT.
# 5. Past capacity throughput stays flat while goodput falls; a queue cap sheds load and keeps the accepted requests within their SLO.

# %% [markdown]
# ## Check your understanding
#
# 1. SJF left the last of the forty requests finishing at about the same time as FCFS. Why can no order change that?
# 2. In section 2's stream, what happens to L under SJF without aging, and who pays for the aging that fixes it?
# 3. Why did ordering the queue by priority class not help the high-priority requests of section 3?
# 4. Chunked prefill gives P its first token a little *later* than prefill priority. Why is it still the default?
# 5. Why does the SLO attainment count rejected requests as failures?
#
# <details><summary>Answers</summary>
#
# 1. The slots do the same total work whatever the order, and the last finish is set by that work (and by the
#    longest request); the order only decides who waits for whom.
# 2. L starves: a short request is always waiting, so L runs only when the stream ends. Aging lowers a waiting
#    request's key with its wait, so L eventually goes first; the short requests behind it wait longer.
# 3. The policy did not preempt: the slots were held by running low-priority requests and freed only when they
#    finished, so there was nothing in the queue to reorder. A preemptive priority policy fixes it.
# 4. It bounds the stall every decoding request sees, which would otherwise hit all of them at each long
#    prompt; P's own delay is small.
# 5. Otherwise shedding every request but the easy ones would look like perfect attainment: a rejected request
#    is a user who was not served.
#
# </details>
