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
# This notebook takes the table row by row, with MLFQ, the classic compromise from operating systems,
# and ends with three of these policies written by you and run inside the engine. What the scheduler does
# under load (a long prefill against running decodes, scheduling every N steps, goodput and shedding load)
# is notebook 03b.
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
#   aging change (starvation, and who pays for ending it);
# - explain head-of-line blocking across priority classes, and why preemption, not the order of the queue, ends it;
# - choose between priority classes, MLFQ and fair queuing for a workload, and write SJF with aging, MLFQ and
#   fair queuing as policies the scheduler calls every step.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels

from types import SimpleNamespace

import numpy as np

from minillm import LLM, SamplingParams, impl
from minillm.analysis import workloads
from minillm.analysis.workloads import LogNormal, TraceRequest, Uniform
from minillm.core.policies import MLFQ, SJF, Fair, Priority, PromptPredictor
from minillm.sim.costmodel import ConstantStepTime
from minillm.sim.replay import replay
from minillm.viz import LockstepStepper, figures
from minillm.viz import scheduling as show     # one line of text, or one figure, per run: step_lines, run_line, ...
from minillm.viz.scheduling import mean_of

ex = impl.load("ex03_policies")    # your exercises/ex03_policies.py (MINILLM_IMPL=solutions: the answers);
                                   # re-run this cell after editing the file: impl.load reads it again
TEN_MS = ConstantStepTime(0.010)   # the worked examples' assumption: every step takes 10 ms, whatever the batch

def served(trace, policy="fcfs", cost_model=TEN_MS, **config):
    """Replay a trace on the simulated executor (the real scheduler and KV manager, no forward pass) on the
    modeled clock (`replay`). Returns the engine, its requests' metrics by id, and metrics.summarize's dict."""
    return replay(trace, model="random", cost_model=cost_model, policy=policy, **config)


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
    print(f"{name}:\n" + show.step_lines(s.records[2:]))

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
    print(show.run_line(name, s, stats=("mean",), by={"s1..s3": mean_of(m, ("s1", "s2", "s3")), "L": m["L"].e2e_latency},
                        by_label="from arrival to finish", unit="ms", width=5))
eng, _, _ = hol_runs["FCFS"]
figures.gantt_figure(eng.step_records, eng.requests, title="FCFS: s1..s3 queue behind L")

# %%
eng, _, _ = hol_runs["SJF"]
figures.gantt_figure(eng.step_records, eng.requests, title="SJF: the short requests go first, L a few steps later")

# %% [markdown]
# It is the supermarket's express lane: someone buying a bottle of water does not wait behind a full
# cart. L finishes later under SJF, the three short requests far sooner, and the mean over all
# six drops. In a
# real service the blocking request is often a long *prompt*: the prefill of a 2000-token prompt takes
# tens of milliseconds for a 7 B model on one H100 (about 2000 × 14 GFLOP at a few hundred TFLOP/s), and
# hundreds for a 70 B model or on a smaller GPU, and the requests decoding in the same batch wait for it
# (notebook 03b measures that stall).
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
    print(show.run_line(name, s, stats=("mean", "p50", "max"), width=18))
figures.latency_cdf_figure(sjf_runs, metrics=("e2e_latency",), unit="s",
                           title="40 requests at once, 4 slots: when each one is done")

# %% [markdown]
# <details><summary>Answer</summary>
#
# The last finish barely moves (the slots do the same total work either way); the mean falls by about a
# quarter, because the many short requests no longer wait behind the long ones. Compare the printed
# `worst` and `mean` columns.
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
tenant_ids = {t: [r.request_id for r in mixed if r.tenant == t] for t in ("chat", "doc")}
pred_runs = {}
for name, pol in (("FCFS", "fcfs"), ("SJF, history predictor", SJF(predictor="history", aging=0.0)),
                  ("SJF, true lengths", SJF(predictor="oracle", aging=0.0))):
    eng, m, s = served(mixed, pol, max_num_seqs=4)
    pred_runs[name] = list(m.values())
    print(show.run_line(name, s, stats=("mean", "p99", "max"), by={t: mean_of(m, ids) for t, ids in tenant_ids.items()},
                        by_label="on average"))
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
    rho = p and rank_correlation([p.predict_ids(r.prompt_token_ids) for r in held_out], [r.output_len for r in held_out])
    print(show.run_line(name, s, stats=("mean", "p99"), width=20, note=f"rank correlation with the true lengths {rho:+.2f}" if p else ""))
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

# %% [markdown]
# **Predict, then run.** Without aging, when does L run? As the aging rate grows, which way do L's wait and
# the short requests' mean latency move, and where does the short requests' mean end up at a very large
# aging rate?

# %%
stream = [TraceRequest("L", 0.0, 8, 200)] + [TraceRequest(f"s{j}", round(0.08 * j, 6), 8, 10) for j in range(150)]
shorts = [f"s{j}" for j in range(150)]
agings = [0, 30, 100, 300, 1000]
wait_L, short_mean = [], []
for a in agings:
    eng, m, s = served(stream, SJF(predictor="oracle", aging=float(a)), max_num_seqs=1)
    wait_L.append(m["L"].queue_wait)
    short_mean.append(mean_of(m, shorts))
    print(f"aging {a:>4} tokens/s: L waits {wait_L[-1]:6.2f} s; the short requests take {short_mean[-1]:5.2f} s on average")
_, m_fcfs, _ = served(stream, "fcfs", max_num_seqs=1)
print(f"FCFS (for comparison): L waits {m_fcfs['L'].queue_wait:.2f} s, short requests {mean_of(m_fcfs, shorts):.2f} s on average")
show.aging_figure(agings, wait_L, short_mean)

# %% [markdown]
# <details><summary>Answer</summary>
#
# Without aging L runs only when the stream ends: a short request is always waiting. With aging L's wait
# falls as the rate grows, and the short requests' mean rises; at a very large rate the order is the arrival
# order, so the mean approaches FCFS's (the last printed line).
#
# </details>

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
# ## 3. Priority classes, and head-of-line blocking across classes
#
# Requests are not all equal: paying users expect lower latency, internal services may need steadier
# responses than external APIs, and a live conversation tolerates less delay than a batch job. `Priority`
# serves the lowest `priority` value first (vLLM's convention), FCFS inside a class. But ordering the
# *queue* is not enough: when a low-priority request already holds the GPU (its KV is allocated) and a
# high-priority request arrives that cannot get resources at once, the low-priority request must be
# preempted. Four low-priority requests (class 1, 300 tokens each) fill all 4 slots; at 0.5 s two
# high-priority ones (class 0, 20 tokens) arrive:

# %% [markdown]
# **Predict, then run.** The high-priority requests arrive while the four low-priority ones hold every slot.
# How long do they wait under FCFS, under priority ordering of the queue only, and under priority with
# preemption?

# %%
prio_trace = [TraceRequest(f"low{i}", 0.0, 16, 300, priority=1) for i in range(4)]
prio_trace += [TraceRequest(f"high{i}", 0.5, 16, 20, priority=0) for i in range(2)]
high, low = ("high0", "high1"), ("low0", "low1", "low2", "low3")
prio_runs = {}
for name, pol in (("FCFS", "fcfs"), ("priority, queue order only", Priority(preempt=False)),
                  ("priority, preempting", Priority(preempt=True))):
    eng, m, s = served(prio_trace, pol, max_num_seqs=4)
    prio_runs[name] = eng
    print(show.run_line(name, s, by={"high-priority wait": mean_of(m, high, "queue_wait"),
                                     "low-priority done after": mean_of(m, low)}, preemptions=True, width=28))
eng = prio_runs["priority, preempting"]
figures.gantt_figure(eng.step_records, eng.requests, title="priority with preemption: low3 and low2 step aside")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Under FCFS and under queue order alone they wait the same, <span title="from the run">2.50 s</span>: until
# the low-priority requests finish at 3 s and free their slots. With preemption they start at once. Compare
# the first column.
#
# </details>

# %% [markdown]
# Ordering the queue by class changes nothing here: nobody of either class is waiting when the slots
# free up except the high-priority requests, and the slots do not free up for three seconds. The
# high-priority requests wait behind the low class that got there first: head-of-line blocking across
# classes (not *priority inversion*, which names a low-priority task holding a lock a high-priority one
# needs, cured by priority inheritance). Preemption
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
short_ids, long_ids = [f"s{j}" for j in range(30)], [f"long{i}" for i in range(8)]
for name, pol in (("FCFS", "fcfs"), ("MLFQ, quanta 16/64/256, boost 30 s", MLFQ()),
                  ("MLFQ without preemption", MLFQ(preempt=False))):
    eng, m, s = served(mlfq_trace, pol, max_num_seqs=4)
    print(show.run_line(name, s, by={"short requests": mean_of(m, short_ids), "long ones": mean_of(m, long_ids)},
                        by_label="on average", preemptions=True, width=36))

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
show.levels_figure(t, levels, title=f"MLFQ level over time ({mlfq.num_boosts} boosts, every 2 s)")

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
by_tenant = {t: [r.request_id for r in flood if r.tenant == t] for t in ("flood", "a", "b")}
fair_runs = {}
for name, pol in (("FCFS", "fcfs"), ("fair queuing (VTC)", Fair())):
    eng, m, s = served(flood, pol, max_num_seqs=4)
    fair_runs[name] = eng
    print(show.run_line(name, by={f"tenant {t}": mean_of(m, ids) for t, ids in by_tenant.items()}, by_label="on average",
                        width=20))
show.service_figure(fair_runs, tenants=("flood", "a", "b"))

# %% [markdown]
# Under FCFS the polite tenants' requests wait behind the flood's sixty. Under fair queuing their
# service curves climb with the flood's: while every tenant has requests waiting, their counters stay
# within a bounded distance of each other (the bound in `Fair`'s docstring), and once the polite
# tenants have nothing left the flood gets the whole machine. The cost is bookkeeping: a counter per
# tenant, charged every step.

# %% [markdown]
# ## Exercises
#
# Three policies in `exercises/ex03_policies.py`, each a `Policy` subclass that the engine asks every
# step, exactly like the built-in ones. The cells below run *your* classes inside the engine.
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
    print(show.run_line("your MLFQ", s, by={"short requests": mean_of(m, short_ids), "long ones": mean_of(m, long_ids)},
                        by_label="on average", preemptions=True, width=10))

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
    print(show.run_line("your fair queuing", by={f"tenant {t}": mean_of(m, ids) for t, ids in by_tenant.items()},
                        by_label="on average", width=18))

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
# or what the engine's own policy did on the same requests).

# %% [markdown]
# ## Summary
#
# 1. A policy orders the waiting queue and, if it preempts, names who gives way; the scheduler asks it every step.
# 2. FCFS is fair and never starves anyone, but it blocks short requests behind long ones (head-of-line blocking).
# 3. Shortest-first cuts the mean completion; it needs predicted lengths, and starves long requests unless aging, paid for by the short ones, bounds the wait.
# 4. Ordering the queue by class does not help while low-priority requests hold the slots: preemption ends head-of-line blocking across classes.
# 5. MLFQ finds the short requests by watching them (tokens as the time slice), and fair queuing gives each tenant an equal share however much one sends.

# %% [markdown]
# ## Check your understanding
#
# 1. SJF left the last of the forty requests finishing at about the same time as FCFS. Why can no order change that?
# 2. In section 2's stream, what happens to L under SJF without aging, and who pays for the aging that fixes it?
# 3. Why did ordering the queue by priority class not help the high-priority requests of section 3?
# 4. MLFQ without preemption did not help the short requests of section 4 at all. Why, when it orders the queue exactly as MLFQ with preemption does?
# 5. Fair queuing charges a generated token twice a prompt token. Why would charging both the same favour a tenant with long answers?
#
# <details><summary>Answers</summary>
#
# 1. The slots do the same total work whatever the order, and the last finish is set by that work (and by the
#    longest request); the order only decides who waits for whom.
# 2. L starves: a short request is always waiting, so L runs only when the stream ends. Aging lowers a waiting
#    request's key with its wait, so L eventually goes first; the short requests behind it wait longer.
# 3. The policy did not preempt: the slots were held by running low-priority requests and freed only when they
#    finished, so there was nothing in the queue to reorder. A preemptive priority policy fixes it.
# 4. The eight long requests held all four slots from the start; a short request could only wait for one to
#    finish, so the order of the queue did not matter. Preemption lets a newcomer at level 0 push out a long
#    request that has been demoted.
# 5. A prompt token is prefilled together with the rest of its prompt in a step or a few, while every generated
#    token takes a step of its own; counting it as one token would undercharge the tenant whose requests hold
#    slots longest (long answers), and it would get more than its share of the machine's time.
#
# </details>
