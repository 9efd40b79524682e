#!/usr/bin/env python3
"""Build notebooks 03-06 from the cell sources below (committed without outputs).

    python scripts/build_notebooks_part2.py            # write notebooks/03_... to 06_...
    python scripts/build_notebooks_part2.py --check    # exit 1 if a notebook differs from this script

The companion of ``scripts/build_notebooks.py`` (notebooks 00-02), whose cell helpers and shared
cells (the set-up cell, the kernel check, the grading note) it reuses, so the series reads as one.
The notebooks import, configure, run, visualise and explain; every piece of engine logic lives
in ``minillm/``. Each section names the passage of the seeds (``shared/seeds``) it teaches.
Cells are plain strings here so a diff of this file is a diff of the notebooks.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def _part1():
    """scripts/build_notebooks.py, loaded as a module (its helpers and shared cells)."""
    spec = importlib.util.spec_from_file_location("minillm_build_notebooks", ROOT / "scripts" / "build_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P1 = _part1()
md, code, build, write_notebooks = P1.md, P1.code, P1.build, P1.write_notebooks
SETUP, kernel_check, grading = P1.SETUP, P1.kernel_check, P1.grading


# =====================================================================================
# 03: scheduling policies
# =====================================================================================

def nb03() -> list:
    return [
        md(r'''
# 03 · Scheduling policies

Continuous batching decides *when* requests join and leave the batch; it does not decide *which*
waiting request goes next when there is room for only some. The seeds: "Continuous batching solves
the problem of when to add and remove requests, but it does not answer the question of 'which
request to add.'" The scheduler's inputs are the waiting queue, the running set and the resource
state (free slots, free KV memory); its objective is "a balance among latency (minimizing request
queuing and execution times), throughput (maximizing token output per unit time), and fairness
(avoiding indefinite postponement of certain requests)."

| Policy | Behavior | Good for | Weakness |
|---|---|---|---|
| FCFS | First come, first served | Fairness, simplicity | Head-of-line blocking on long requests |
| Shortest-first | Prioritize short requests | Average latency | Long requests can starve |
| Priority classes | Tiered service levels | Mixed workloads | Needs careful class definition |
| Fair queuing | Equal share per user | Multi-tenant systems | More bookkeeping |

That table (the seeds') is the plan of this notebook, with MLFQ, the seeds' "classic compromise",
and two questions about the scheduler itself:

1. FCFS and head-of-line blocking, stepped live: FCFS and SJF side by side;
2. shortest job first: with an oracle, with a predictor, its starvation, and aging;
3. priority classes and priority inversion;
4. MLFQ: token quanta, demotion, boosting;
5. fair queuing when one tenant floods;
6. prefill against decode: prefill-priority, decode-priority, chunked prefill;
7. scheduling every N steps (the seeds' worked exercise);
8. at scale: goodput under SLOs, load shedding, and the tail as load rises;
9. exercises: SJF with aging, MLFQ and fair queuing, written as policies and run inside the engine.

A policy is an object the scheduler asks every step (`minillm/policies.py`): in what order to
consider the waiting requests (`order_waiting`), and, for the preemptive ones, whom to push out
(`preempt_for`, `pick_victim`). Built-in ones have names (`LLM(policy="fcfs")`); yours plugs in the
same way (`LLM(policy=MyPolicy())`).
'''),
        SETUP,
        code(r'''
from types import SimpleNamespace

from plotly.subplots import make_subplots

from minillm.costmodel import ConstantStepTime
from minillm.policies import MLFQ, SJF, Fair, Priority, PromptPredictor
from minillm.simulated import simulate
from minillm.workloads import LogNormal, TraceRequest, Uniform

ex = impl.load("ex03_policies")    # your exercises/ex03_policies.py (MINILLM_IMPL=solutions: the answers);
                                   # re-run this cell after editing the file: impl.load reads it again
TEN_MS = ConstantStepTime(0.010)   # the seeds' exercises: every step takes 10 ms, whatever the batch

def served(trace, policy="fcfs", cost_model=TEN_MS, **config):
    """Replay a trace on the simulated executor (the real scheduler and KV manager, no forward pass) on the
    modeled clock. Returns the engine, its requests' metrics by id, and metrics.summarize's dict."""
    config.setdefault("max_model_len", 2048)
    llm = LLM(model="random", executor="simulated", clock="modeled", cost_model=cost_model, policy=policy, **config, record="summary")   # no per-block KV map: totals are enough here
    workloads.submit_trace(llm.engine, trace, vocab_size=llm.engine.vocab_size)
    records = llm.engine.run()
    m = {rid: r.metrics for rid, r in llm.engine.requests.items()}
    return llm.engine, m, metrics.summarize(m, records, max_num_seqs=llm.config.max_num_seqs)

def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)
'''),
        md(r'''
## 1. FCFS and head-of-line blocking

"First Come First Served (FCFS) orders requests by arrival time ... The advantage of FCFS is
natural fairness without starvation. The disadvantage is that it completely ignores differences in
request execution time." Here is the smallest case where that matters. At most 3 requests run at
once and a step may process 16 tokens. A and B are decoding long answers. Then L arrives, with a
24-token prompt and a 10-token answer, and right behind it three short requests s1, s2, s3
(4-token prompts, 2-token answers).

Left, FCFS: the one free slot goes to L. Its prompt does not fit one step's budget, so its prefill
is split over two steps, and then it decodes for ten more; s1, s2 and s3 wait behind it, though
each would be done in two steps. Right, SJF (shortest job first) with the true answer lengths: the
free slot serves the three short requests first. Both engines run the real model with
`attention_backend="triton"` (the tiny random Llama: only the token counts matter here), and every
**Step** executes the Triton attention kernel in both.
'''),
        code(r'''
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
'''),
        md(r'''
Step 0 prefills A and B and step 1 decodes them; L and the short requests arrive during step 1.
Step 2 is where the policies part. Four steps, in code (the same as four clicks on **Step**):
'''),
        code(r'''
for _ in range(4):
    hol.step()
for name, s in zip(hol.names, hol.steppers):
    print(f"{name}:")
    for rec in s.records[2:]:
        ran = ", ".join(f"{e.request_id} {e.phase} +{e.num_tokens}" for e in rec.batch)
        waits = "; ".join(f"{w.request_id}: {w.reason}" for w in rec.waiting[:2])
        print(f"  step {rec.step}: ran {ran}" + (f"  | waiting {waits}" if waits else ""))
'''),
        md(r'''
Under FCFS the short requests sit in the queue with the reason "max_num_seqs=3 requests already
running" (s2 and s3 "queued behind s1"): that is **head-of-line blocking**. The queue is served in
order, so the work at its head decides everyone's wait. The kernel, checked against its torch
reference on the FCFS engine's cache:
'''),
        kernel_check("hol.steppers[0]"),
        md(r'''
The same six requests to the end, on the simulated executor (the same scheduler and memory
manager, no forward pass, the same 10 ms per step): when each one waits and runs.
'''),
        code(r'''
hol_trace = [TraceRequest(rid, t, p, n) for rid, t, p, n in (("A", 0.0, 6, 9), ("B", 0.0, 5, 12), ("L", 0.015, 24, 10),
             ("s1", 0.016, 4, 2), ("s2", 0.017, 4, 2), ("s3", 0.018, 4, 2))]
hol_runs = {name: served(hol_trace, pol, max_num_seqs=3, max_num_batched_tokens=16, block_size=4)
            for name, pol in (("FCFS", "fcfs"), ("SJF", SJF(predictor="oracle", aging=0.0)))}
for name, (eng, m, s) in hol_runs.items():
    print(f"{name}: short requests done after {mean(m[r].e2e_latency for r in ('s1', 's2', 's3')) * 1e3:.0f} ms "
          f"on average, L after {m['L'].e2e_latency * 1e3:.0f} ms; mean over all six {s['e2e_mean'] * 1e3:.0f} ms")
eng, _, _ = hol_runs["FCFS"]
figures.gantt_figure(eng.step_records, eng.requests, title="FCFS: s1..s3 queue behind L")
'''),
        code(r'''
eng, _, _ = hol_runs["SJF"]
figures.gantt_figure(eng.step_records, eng.requests, title="SJF: the short requests go first, L a few steps later")
'''),
        md(r'''
The seeds' supermarket: "someone buying a bottle of water does not have to wait for someone with a
full cart." L finishes later under SJF, the three short requests far sooner, and the mean over all
six drops. In a
real service the blocking request is often a long *prompt*: "a request with 2000 input tokens may
take hundreds of milliseconds or even seconds for its Prefill, during which other requests in the
batch that are decoding must wait" (section 6 measures that stall).

## 2. Shortest job first

"SJF is theoretically optimal (it gives the smallest average completion time when all job lengths
are known)." Forty requests arrive at once, answers of 5 to 200 tokens, 4 slots:
'''),
        code(r'''
batch40 = workloads.synthetic_trace(40, rate=None, prompt_len=16, output_len=Uniform(5, 200), seed=1)
sjf_runs = {}
for name, pol in (("FCFS", "fcfs"), ("SJF, true lengths", SJF(predictor="oracle", aging=0.0))):
    eng, m, s = served(batch40, pol, max_num_seqs=4)
    sjf_runs[name] = list(m.values())
    print(f"{name:<18} mean completion {s['e2e_mean']:.2f} s, median {s['e2e_p50']:.2f} s, "
          f"longest {s['e2e_max']:.2f} s")
figures.latency_cdf_figure(sjf_runs, metrics=("e2e_latency",), unit="s",
                           title="40 requests at once, 4 slots: when each one is done")
'''),
        md(r'''
Same total work, same finish for the last request; but most requests are done much sooner. The
catch: "the generation length of a request is unknowable before execution." SJF needs a
**prediction**, and the seeds list three sources: historical statistics ("the average generation
length of similar requests from the same API endpoint or user group"), signals in the prompt ("a
prompt containing 'brief answer' suggests a shorter generation, while one containing 'explain in
detail' suggests a longer one"), and a small model. minillm has the first two
(`HistoryPredictor`, `PromptPredictor`):
'''),
        code(r'''
hint = PromptPredictor(base=128)
for text in ("Give a brief answer: what is 1+1?", "Explain in detail the basic principles of quantum mechanics",
             "What is the capital of France?"):
    print(f"{hint.predict(SimpleNamespace(prompt=text)):6.0f} tokens predicted for {text!r}")
'''),
        md(r'''
A history predictor on mixed traffic: tenant "chat" asks short questions (answers around 20 tokens,
with a long tail: a few run past 200) and tenant "doc" long ones (around 150 tokens). 300 requests
arrive at 5.5 per second on 4 slots, about as much work as the slots can do. The predictor learns
each tenant's mean from the requests that finish: it knows the class, never the request.
'''),
        code(r'''
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
'''),
        md(r'''
Both SJFs beat FCFS on the mean; the predictor gets part of the oracle's gain. Now look at the
worst case. Even with true lengths, shortest-first makes the longest requests wait longer than FCFS
would. With the predictor it is worse: every doc request is predicted long, whatever its true
length, so it is passed by every chat request that arrives while it waits; and the chat answers
that turn out long were predicted short, so they jump the queue and then hold a slot as long as a
doc request would. "Mispredictions cause the starvation it was meant to avoid."

### Starvation, and aging

Give SJF a steady stream of short requests and a long one never gets its turn. One slot, one
200-token request L at time 0, and a 10-token request every 80 ms for 12 seconds (the slot is
busy 10 x 10 ms = 100 ms of every 80 ms: there is always a short request waiting). **Aging**
(`SJF(aging=a)`) forgives a waiting request `a` predicted tokens per second waited, so its rank
improves until it is served: a request predicted at P is passed only by requests that arrive in the
first (P - P_min) / a seconds of its wait.
'''),
        code(r'''
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
fig.update_layout(title="aging trades a little average latency for a bound on the longest wait",
                  xaxis=dict(title="aging (predicted tokens forgiven per second waited)", type="log"),
                  yaxis=dict(title="L's wait (s)", rangemode="tozero"),
                  yaxis2=dict(title="short requests (s)", overlaying="y", side="right", rangemode="tozero"),
                  height=380, plot_bgcolor="white")
fig
'''),
        md(r'''
Without aging L waits for the whole stream to end ("long requests can starve"). With aging its wait
is bounded, and the more aging, the sooner it runs; the short requests pay for it, and at large
aging SJF has turned back into FCFS. The seeds' verdict on the whole approach: "Since output length
is unknown in advance, 'shortest-first' requires prediction, and mispredictions cause the starvation
it was meant to avoid. Most production systems use FCFS with priority classes and explicit preemption
rather than trying to predict."

## 3. Priority classes, and priority inversion

"Paying users expect lower latency, internal services need more stable responses than external APIs,
and real-time conversation has lower latency tolerance than batch processing." `Priority` serves the
lowest `priority` value first (vLLM's convention), FCFS inside a class. But ordering the *queue* is not
enough: "If a low-priority request is already occupying the GPU (its KV Cache has been allocated),
and a high-priority request arrives but cannot immediately obtain resources, the low-priority
request must be preempted." Four low-priority requests (class 1, 300 tokens each) fill all 4 slots;
at 0.5 s two high-priority ones (class 0, 20 tokens) arrive:
'''),
        code(r'''
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
'''),
        md(r'''
Ordering the queue by class changes nothing here: nobody of either class is waiting when the slots
free up except the high-priority requests, and the slots do not free up for three seconds. The
high-priority requests wait behind the low class that got there first: priority inversion. Preemption
fixes it: the scheduler asks the policy `preempt_for(request, running)`, which names the lowest-class,
most recently admitted running request; its KV is dropped and it goes back to the queue (it will
recompute its prefix when it returns, notebook 05). The high class starts at once. The price is paid
by the class that was preempted, and by the work it redoes. "Needs careful class definition": if
most traffic is marked urgent, urgent means nothing, and a high class that never lets up starves the
low one.

## 4. MLFQ: tokens as the time slice

The multi-level feedback queue "combines the fairness of FCFS, the efficiency of SJF, and the tiered
handling of priority scheduling". New requests enter the top level; a request that generates its
level's quantum of tokens is demoted one level ("in LLM inference, a more natural metric is the
number of tokens already generated"); waiting requests go by level, and a newcomer may push out a
running request of a deeper level. "This adaptation allows MLFQ to automatically distinguish between
short and long requests without relying on generation length prediction." To prevent starvation,
every `boost_interval` seconds everyone returns to the top level.

Eight long requests (400 tokens) fill the 4 slots; a short one (20 tokens) arrives every 0.2 s:
'''),
        code(r'''
mlfq_trace = [TraceRequest(f"long{i}", 0.0, 16, 400) for i in range(8)]
mlfq_trace += [TraceRequest(f"s{j}", 0.1 + 0.2 * j, 16, 20) for j in range(30)]
short_ids = [f"s{j}" for j in range(30)]
for name, pol in (("FCFS", "fcfs"), ("MLFQ, quanta 16/64/256, boost 30 s", MLFQ()),
                  ("MLFQ without preemption", MLFQ(preempt=False))):
    eng, m, s = served(mlfq_trace, pol, max_num_seqs=4)
    print(f"{name:<36} short requests {mean(m[r].e2e_latency for r in short_ids):6.2f} s, long ones "
          f"{mean(m[f'long{i}'].e2e_latency for i in range(8)):6.2f} s; {s['num_preemptions']} preemptions")
'''),
        md(r'''
MLFQ never read a length: the long requests revealed themselves by running past 16 tokens. Without
preemption it could only reorder the queue, and the queue was not the problem (the slots were).
Below, the level of three requests step by step, with a short boost interval (2 s) so boosts show.
'''),
        code(r'''
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
'''),
        md(r'''
The seeds' advice on the knobs: "typically 3-5 levels"; quanta "set based on the request length
distribution, so that most short requests complete within the highest-priority queue"; the boost
"typically set to several tens of seconds, matching the average request lifecycle".

## 5. Fair queuing when one tenant floods

In a multi-tenant service one tenant can send sixty requests at once while the others send a few.
FCFS serves the flood first. Fair queuing gives each tenant an equal share of service: minillm's
`Fair` keeps a *virtual token counter* per tenant (prompt tokens prefilled + 2 x tokens generated,
the VTC of Sheng et al., OSDI 2024) and admits next from the tenant that has received the least.
'''),
        code(r'''
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
            total[tenant[e.request_id]] += (e.num_tokens if e.phase == "prefill" else 0) + 2 * e.num_output_tokens
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
'''),
        md(r'''
Under FCFS the polite tenants' requests wait behind the flood's sixty. Under fair queuing their
service curves climb with the flood's: while every tenant has requests waiting, their counters stay
within a bounded distance of each other (the bound in `Fair`'s docstring), and once the polite
tenants have nothing left the flood gets the whole machine. The cost is bookkeeping: a counter per
tenant, charged every step.

## 6. Prefill against decode

The seeds' example of FCFS's blocking: "Suppose there are 10 requests decoding in the batch, and the
scheduler selects a new request with an input length of 2000 tokens to join the batch ... The Prefill
of this new request takes about 500ms, during which all 10 decoding requests are paused." Three
answers, from the seeds' table:

| Approach | Idea | Tradeoff |
|---|---|---|
| Prefill priority | Run prefills first | Decode latency suffers |
| Decode priority | Never interrupt decode | Time-to-first-token suffers |
| Chunked prefill | Split a long prompt into pieces, interleave with decode | Slightly less efficient prefill, far smoother latency |

The scenario on a modeled Llama-2-70B served by four A100s (the roofline cost model: a prefill of 2000
tokens is compute bound, a decode step memory bound). minillm's `interference` setting picks the
approach; chunked prefill runs under a budget of 512 tokens per step.
'''),
        code(r'''
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
fig = go.Figure()
for name, m in interf.items():
    times = m["d0"].token_times
    fig.add_trace(go.Scatter(x=times[1:], y=[1e3 * g for g in m["d0"].inter_token_latencies], name=name, mode="lines"))
fig.update_layout(title="request d0: the gap before each of its tokens (P arrives at 1.0 s)", xaxis_title="time (s)",
                  yaxis=dict(title="ms since its previous token", type="log"), height=360, plot_bgcolor="white")
fig
'''),
        md(r'''
Prefill priority gives P its first token soonest and stalls all ten decoders for the whole prefill
step (the "latency spike unrelated to their own request"). Decode priority never interrupts a decode,
and P waits until all ten have finished. Chunked prefill splits P's prompt into budget-sized pieces
that ride along with the decodes: each decode step grows a little, no step is long, and P's first
token comes only slightly later than under prefill priority. "Chunked prefill is the standard
compromise: it bounds the worst-case stall a decode request can experience, at modest cost." It is
minillm's default (`interference="chunked"`).

## 7. Scheduling every N steps

The scheduling pass itself costs time, and continuous batching pays it every step. The seeds'
exercise: "a GPU Decode time of 15ms per step and a scheduling overhead of 0.5ms. If the scheduling
frequency is changed from every step to every 5 steps, calculate the change in scheduling overhead
ratio and the potential resource waste." The reference answer: 0.5 / 15 = 3.3% becomes
0.5 / (15 x 5) = 0.67%; "completed requests may wait up to 4 steps (about 60ms) before being removed
from the batch, and new requests may wait up to 5 steps (about 75ms) before being added", and 60 ms
is "about 0.8%" of a 500-token request's 7500 ms. With `schedule_every=N` minillm re-forms the batch
only every N steps; in between it reuses the running set, and a request that finishes is returned at
the next pass.
'''),
        code(r'''
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
'''),
        md(r'''
The seeds' numbers, from the engine's own step records: the overhead falls five-fold, a finished
request is held at most 4 steps (60 ms, 0.8% of a 7.5 s answer), a newcomer waits at most 5 steps
(75 ms, plus the pass itself). The seeds' conclusion: "For latency-sensitive scenarios, this
increase is acceptable; for throughput-priority scenarios, reducing scheduling overhead is more
valuable," though vLLM keeps per-step scheduling, because paging keeps the pass cheap.

## 8. At scale: goodput, load shedding, and the tail

The seeds' metrics: *throughput* (tokens per second), *TTFT* and *TPOT*, and **goodput**,
"throughput meeting latency SLOs ... the honest combined metric." Here 500 requests of chat-like
traffic (log-normal prompts around 512 tokens, answers around 128, both with long tails) arrive as a
Poisson process and are served by a modeled Llama-2-70B on four H100s (`simulate`'s default), at
most 64 at once, at six rising rates (3,000 requests, a couple of seconds of simulation per rate). The SLOs:
first token within 2 s, then at most 100 ms per token.
'''),
        code(r'''
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
'''),
        code(r'''
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
'''),
        md(r'''
Below capacity the median and the p99 both stay small. Near capacity the p99 leaves the median
behind ("Watch the tail. P99 latency reveals problems that averages hide entirely"). Past capacity
throughput flattens at what the hardware can do, the queue grows for as long as the overload lasts,
every newcomer waits behind all of it, and goodput *falls*: the engine is as busy as ever, serving
requests that miss their SLO. "Throughput and latency trade off directly through batch size.
Reporting either alone is misleading."

**Shedding load.** The seeds' fix for "tail latency far worse than median: unbounded queueing" is to
"cap queue depth; shed load", because "rejecting a request cleanly beats accepting it and timing out".
`max_queue_len` rejects newcomers beyond that many waiting requests. At about 10 requests served per
second and a 2 s TTFT target, a queue much longer than 20 cannot be served in time; cap it at 16:
'''),
        code(r'''
for rate in (16, 20):
    capped = simulate(chat_trace(rate), model="llama-2-70b", records="summary", max_num_seqs=64, max_queue_len=16, **SLO)[1]
    for cap, s in ((None, load[rate]), (16, capped)):
        print(f"{rate:>3} req/s, queue cap {str(cap):>4}: rejected {s['num_rejected']:3d}, TTFT p50 {s['ttft_p50']:5.2f} s, "
              f"p99 {s['ttft_p99']:5.2f} s, goodput {s['goodput_requests_per_s']:5.1f} req/s, "
              f"SLOs met by {s['slo_attainment']:.0%} of all requests (rejected ones count as missed)")
'''),
        md(r'''
With the cap, the requests that are accepted are served within their SLO, so goodput stays near the
machine's capacity instead of collapsing; the rejected ones get an immediate, explicit "no" they can
retry elsewhere. The seeds' rules of thumb this section illustrates: "Measure goodput", "Watch the
tail", and "Shed load explicitly."
'''),
        md(r'''
## Exercises

Three policies in `exercises/ex03_policies.py`, each a `Policy` subclass that the engine asks every
step, exactly like the built-in ones. The cells below run *your* classes inside the engine.

**Exercise 1, `SJFWithAging`**: `remaining`, `key` and `order_waiting` (section 2). The stream of
section 2, with and without aging:
'''),
        md(r'''
<details><summary>Hint 1</summary>

`remaining`: the prediction minus `num_output_tokens`, clamped at 0. `key`: `remaining` minus `aging` times the seconds waited (`now - arrival_time`, clamped at 0).

</details>
<details><summary>Hint 2</summary>

`order_waiting`: `sorted` (a new list) with a tuple key, `(self.key(r, now), r.arrival_time)`.

</details>
'''),
        code(r'''
with impl.attempt("ex03.SJFWithAging"):
    for a in (0.0, 100.0):
        eng, m, s = served(stream, ex.SJFWithAging(aging=a), max_num_seqs=1)
        print(f"your SJF, aging {a:>5}: L waits {m['L'].queue_wait:6.2f} s")
'''),
        md(r'''
**Exercise 2, `MLFQPolicy`**: `order_waiting`, `pick_victim`, `preempt_for` and `on_step` (demotion
per quantum, the boost; section 4):
'''),
        md(r'''
<details><summary>Hint 1</summary>

`order_waiting`, `pick_victim`: one `sorted` / `max` each, on tuples: `(level, arrival_time)` for the order; `(level, admit_seq)` for the victim, largest wins. `preempt_for`: keep the running requests whose level is strictly deeper than the waiting one's and ask `pick_victim`.

</details>
<details><summary>Hint 2</summary>

`on_step`: `st = self.state(req)`; `st[1] += self.new_output_tokens(req)`; then *while* the request is not at the last level and `st[1] >= quanta[st[0]]`: `st[1] -= quanta[st[0]]`, `st[0] += 1` (a `while`, not an `if`: one step may cross several quanta). Boost: if `last_boost` is None, set it to `now`; else, when `now - last_boost >= boost_interval`, bump `epoch` and `num_boosts` and set `last_boost = now`.

</details>
'''),
        code(r'''
with impl.attempt("ex03.MLFQPolicy"):
    eng, m, s = served(mlfq_trace, ex.MLFQPolicy(), max_num_seqs=4)
    print(f"your MLFQ: short requests {mean(m[r].e2e_latency for r in short_ids):.2f} s, long ones "
          f"{mean(m[f'long{i}'].e2e_latency for i in range(8)):.2f} s on average; {s['num_preemptions']} preemptions")
'''),
        md(r'''
**Exercise 3, `FairPolicy`**: `order_waiting` (interleave the tenants by their counters) and
`on_step` (charge what ran; section 5):
'''),
        md(r'''
<details><summary>Hint 1</summary>

`order_waiting`: sort by arrival, then group by tenant into a dict of lists (its insertion order ranks the tenants by their oldest request). A heap of `(counter, rank, tenant)`, on copies of the counters, picks the next tenant.

</details>
<details><summary>Hint 2</summary>

Pop the smallest, append the head of that tenant's queue; if the tenant has more waiting, push it back with `counter + input_weight * (num_tokens - num_computed_tokens)` of the request just placed. `on_step`: `output_weight * new_output_tokens(req)`, plus `input_weight * s.num_new_tokens` when `s.phase == "prefill"`.

</details>
'''),
        code(r'''
with impl.attempt("ex03.FairPolicy"):
    eng, m, s = served(flood, ex.FairPolicy(), max_num_seqs=4)
    print("your fair queuing, mean latency: " + ", ".join(
        f"tenant {t} {mean(mm.e2e_latency for rid, mm in m.items() if rid.startswith(t + '-')):.2f} s"
        for t in ("flood", "a", "b")))
'''),
        grading("03", "ex03_policies", "mlfq"),
    ]


# =====================================================================================
# 04: prefix caching
# =====================================================================================

def nb04() -> list:
    return [
        md(r'''
# 04 · Prefix caching

"Many inference requests share the same prefix, with the most typical example being system prompts.
... Without optimization, each request independently computes and caches KV Cache for these
identical prefixes, resulting in massive redundant computation and GPU memory waste." Prefix caching
computes the KV of a shared prefix once and lets every later request reuse it, which, in the seeds'
words, cuts "Prefill computation (saving GPU compute)", "KV Cache memory usage (saving GPU memory)",
and "time-to-first-token (TTFT) because the shared prefix Prefill is skipped".

Paging makes it natural: "Prefix caching simply requires requests sharing the same prefix to point to
the same set of physical blocks." This notebook builds it up from the pieces:

1. the block hash, a chain: how a request finds the blocks it can reuse;
2. reference counts and LRU eviction, stepped live on the real engine;
3. a shared system prompt at scale: hit rate, prefill saved, TTFT, memory;
4. multi-turn chat: each turn prefills only its new tokens;
5. what invalidates the cache: editing an early part of the prefix;
6. what it is worth: the seeds' cache-hit pricing;
7. exercises: the block hash, the longest-prefix match, and eviction.

minillm's prefix cache is *automatic* (vLLM's APC): nobody marks a prefix as shareable; every full
block is hashed, and kept after its request finishes until its memory is needed.
'''),
        SETUP,
        code(r'''
from minillm.block_pool import hash_block
from minillm.workloads import LogNormal

ex = impl.load("ex04_prefix_cache")   # your exercises/ex04_prefix_cache.py (MINILLM_IMPL=solutions: the answers);
                                      # re-run this cell after editing the file: impl.load reads it again

def serve(trace, **config):
    """A modeled H100 serving Llama-2-7B with 8 GiB of KV cache, as in notebook 02 (the simulated executor: the
    real scheduler and block pool, no forward pass). Returns the engine, its requests' metrics, the summary."""
    config.setdefault("num_kv_blocks", 1024)                 # blocks of 16: 16,384 positions, 8 GiB of Llama-2-7B KV
    llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM", max_model_len=8192,
              max_num_seqs=64, max_num_batched_tokens=2048, **config, record="summary")   # no per-block KV map: totals are enough here
    workloads.submit_trace(llm.engine, trace)
    records = llm.engine.run()
    m = {rid: r.metrics for rid, r in llm.engine.requests.items()}
    stats = llm.engine.kv.stats() if llm.config.enable_prefix_caching else None
    return llm.engine, m, metrics.summarize(m, records, max_num_seqs=64, prefix_cache_stats=stats)

def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)
'''),
        md(r'''
## 1. The block hash, a chain

"A hash is computed for the token sequence of each block, serving as an index for the KV Cache block.
When a new request arrives, the hashes of its prefix blocks are computed." One subtlety: a block's KV
depends on every token *before* it (attention saw them), so its key must stand for the whole prefix,
not only its own tokens. minillm chains it: a block's key is the hash of (its parent block's key, its
own tokens). Only full blocks get a key; the last, partly filled block is still being written.
'''),
        code(r'''
prompt = [501, 502, 503, 504, 601, 602, 603, 604, 701, 702]      # blocks of 4: two full, one partial
parent = None
for i in range(len(prompt) // 4):
    key = hash_block(parent, prompt[4 * i:4 * i + 4])
    print(f"block {i}: tokens {prompt[4 * i:4 * i + 4]}, parent key {parent}, key {key}")
    parent = key
print(f"tokens {prompt[8:]}: a partial block, no key yet")
print("\nthe same four tokens after another prefix get another key:",
      hash_block(None, [601, 602, 603, 604]) != hash_block(hash_block(None, prompt[:4]), [601, 602, 603, 604]))
'''),
        md(r'''
A new request computes the keys of its blocks in order and looks each one up; the first miss ends the
match, since every later key is chained on the missing one. The seeds' example: "If the hashes of the
first 10 blocks match, the KV Cache for these 160 tokens can be directly reused (assuming a block
size of 16 tokens), and Prefill only needs to be performed for tokens starting from the 11th block
onward." The engine, blocks of 16: a first request with a 165-token shared prefix and its own
question, then a second request with the same prefix and another question.
'''),
        code(r'''
shared = list(range(1000, 1165))                           # 165 tokens: 10 full blocks of 16, and 5 more
llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM", enable_prefix_caching=True,
          block_size=16, num_kv_blocks=64, max_model_len=512)
first = llm.engine.add_request(shared + list(range(2000, 2035)), SamplingParams(max_tokens=4, ignore_eos=True))
llm.engine.run()
second = llm.engine.add_request(shared + list(range(3000, 3025)), SamplingParams(max_tokens=4, ignore_eos=True))
rec = llm.engine.step()
e = rec.entry(second)
print(f"second request: {len(shared) + 25} prompt tokens; KV reused for {e.num_computed_before} "
      f"({e.num_computed_before // 16} blocks); prefilled {e.num_tokens}")
'''),
        md(r'''
The 11th block holds tokens 160 to 175: 5 shared ones and 11 that differ, so its key differs, and the
prefill starts at token 160, the seeds' "from the 11th block onward".

## 2. Reference counts and LRU eviction, stepped

"vLLM's APC implementation manages prefix reuse through block-level reference counting. Each physical
block maintains a reference count recording how many requests are using that block. When a new
request's prefix block hash matches an existing block, the block is directly reused and its reference
count is incremented. When a request completes, the reference count is decremented, and blocks with a
reference count of zero are recycled."

*Recycled*, in minillm, means: back on the free list **with its KV and its key intact**, so a later
request with the same prefix can take it back. Only when a fresh block is needed and the free list
hands out a block that still carries a prefix is that prefix *evicted*. The free list is in LRU order
(least recently freed first), and a finishing request frees its blocks last block first, so a
prefix's children are evicted before its parents.

The widget: a KV cache of 12 blocks of 4 positions. A, B and C share an 8-token system prompt (two
blocks) and ask different questions; later D arrives with a 36-token prompt that needs most of the
cache, and after it E asks about the system prompt again. In the map a block shared by n requests is
marked `xn`, and a free block that still holds a cached prefix is dotted grey (see the legend). Every
Step runs the Triton attention kernel on the real (tiny, random) model.
'''),
        code(r'''
SYSTEM = list(range(200, 208))              # the shared system prompt: two blocks of 4
APC_REQUESTS = (("A", 0.0, SYSTEM + [31, 32, 33], 4), ("B", 0.005, SYSTEM + [41, 42], 4),
                ("C", 0.015, SYSTEM + [51, 52, 53, 54], 3), ("D", 0.075, list(range(300, 336)), 6),
                ("E", 0.17, SYSTEM + [61, 62], 2))

def add_apc_requests(engine):
    for rid, arrival, prompt, out_len in APC_REQUESTS:
        engine.add_request(prompt, SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0),
                           request_id=rid, arrival_time=arrival)

def apc_engine():
    llm = LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton", enable_prefix_caching=True,
              block_size=4, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=3,
              clock="modeled", cost_model=0.010)
    add_apc_requests(llm.engine)
    return llm

apc = Stepper(apc_engine, title="prefix caching: 12 blocks of 4, a shared 8-token system prompt")
apc
'''),
        md(r'''
Three steps (three clicks): A prefills its 11 tokens and its two full system-prompt blocks get keys;
B arrives, finds both, and prefills only its own 2 tokens; then C the same. The cells below run the
same requests on their own copy of the engine (`apc_run`), so the widget above stays where you left
it, ready to step, however many cells have run. The blocks after three steps:
'''),
        code(r'''
apc_run = apc_engine()                      # the cells' own copy: the widget above stays yours to step

def show_blocks(rec):
    for b in rec.kv.blocks:
        if b.ref_count:
            print(f"  block {b.block_id:>2}: held by {', '.join(b.owners)} (ref_count {b.ref_count})")
        elif b.cached:
            print(f"  block {b.block_id:>2}: free, still caching a prefix")

for _ in range(3):
    rec = apc_run.engine.step()
    print(rec.summary())
print(f"after step {rec.step}:")
show_blocks(rec)
st = apc_run.engine.kv.stats()
print(f"prefix cache: {st['hit_blocks']} block hits, {st['prefill_tokens_saved']} prefill tokens saved")
figures.kv_map_figure(rec, colors=apc.colors, width=560)
'''),
        md(r'''
Blocks 0 and 1 have three owners (`x3` in the map): the KV of the system prompt exists once and
serves three requests. Two more steps and A, B, C are done: every count drops to 0, and the blocks
with keys stay cached (dotted grey in the map: "cached prefix, free").
'''),
        code(r'''
for _ in range(2):
    rec = apc_run.engine.step()
print(rec.summary())
show_blocks(rec)
print("eviction order, front of the free list first:", list(apc_run.engine.kv.pool.free_queue))
'''),
        md(r'''
The system prompt's blocks (0 and 1) are at the *back* of the free list: they were freed last, when
the last request holding them finished, child before parent. D now needs 9 blocks for its prompt, and
more as it decodes; fresh blocks come from the front of the free list, evicting the cached prefixes
there. Run until D is done, then one more step for E:
'''),
        code(r'''
while "D" not in rec.finished:
    rec = apc_run.engine.step()
print(f"after D: {apc_run.engine.kv.stats()['evictions']} cached blocks evicted; "
      f"free list {list(apc_run.engine.kv.pool.free_queue)}")
rec = apc_run.engine.step()
print(rec.summary())
e = rec.entry("E")
print(f"E: {e.num_computed_before} of its {len(SYSTEM) + 2} prompt tokens reused, {e.num_tokens} prefilled")
'''),
        md(r'''
D's growth took the last free blocks, down to one of the system prompt's: the *second* (block 1), the
child, went before its parent. E finds block 0 still cached and recomputes from the second block on.
Had the parent gone first, the surviving child would be unreachable: a lookup walks from the first
block and stops at the first miss. The kernel, checked on this engine's cache (E's block table starts
with the reused block):
'''),
        kernel_check("apc_run"),
        md(r'''
## 3. A shared system prompt at scale

400 requests share a 1024-token system prompt, each with its own question (log-normal, around 128
tokens) and answer (around 128), arriving at 12 per second, on a modeled H100 serving Llama-2-7B with
8 GiB of KV cache (16,384 positions, as in notebook 02). Without and with prefix caching:
'''),
        code(r'''
sys_trace = workloads.shared_prefix_trace(400, prefix_len=1024, suffix_len=LogNormal(128, 0.8, 4, 1024),
                                          output_len=LogNormal(128, 0.9, 4, 1024), vocab_size=32000, rate=12, seed=0)
apc_runs = {}
for name, caching in (("no prefix cache", False), ("prefix cache", True)):
    eng, m, s = serve(sys_trace, enable_prefix_caching=caching)
    apc_runs[name] = (eng, m, s)
    computed = s["total_input_tokens"] - s["prefill_tokens_saved"]
    print(f"{name:<16} hit rate {s['prefix_cache_hit_rate']:4.0%}; prompt tokens prefilled {computed:>7,} of "
          f"{s['total_input_tokens']:,}; TTFT p50 {s['ttft_p50'] * 1e3:7.1f} ms, p99 {s['ttft_p99'] * 1e3:7.1f} ms; "
          f"KV in use {s['kv_util_mean']:4.0%} on average; {s['num_preemptions']} preemptions; "
          f"{s['output_throughput']:5.0f} tokens/s")
'''),
        code(r'''
figures.kv_usage_figure({name: eng.step_records for name, (eng, _, _) in apc_runs.items()},
                        title="KV positions holding KV (a shared block counted once)")
'''),
        code(r'''
figures.latency_cdf_figure({name: list(m.values()) for name, (_, m, _) in apc_runs.items()},
                           metrics=("ttft", "e2e_latency"), unit="s", title="time to first token and end-to-end latency")
'''),
        md(r'''
All three of the seeds' savings, and here memory is the one that matters most. Without the cache
every request holds its own copy of the 1024-token prompt, so 8 GiB holds about a dozen requests; the
queue grows, the cache overflows into preemptions, and the first token takes seconds. With it the
prompt's 64 blocks exist once, each request adds only its question and answer, and every prompt after
the first prefills about a seventh of its tokens.

## 4. Multi-turn chat

"In a dialogue system, each turn's input includes the context from all previous turns (user messages
and assistant responses), and the KV Cache for this context can be directly reused. Without prefix
caching, the k-th turn requires Prefill of the entire context ... With prefix caching, only the new
user message needs Prefill ... reducing Prefill time from O(n_total) to O(n_new)."

40 conversations of 6 turns: a 512-token system prompt, user messages around 64 tokens, answers
around 128, about 8 s of "think time" between turns. (The trace scripts each answer into the next
turn's prompt, so what is reused is the previous turn's prompt; an engine that also keeps its
generated answer's blocks reuses those too.) Without a cache every turn prefills its whole context:
the grey bars. With the cache, once with the 8 GiB of section 3, once with 32 GiB:
'''),
        code(r'''
chat = workloads.multi_turn_trace(40, turns=6, system_len=512, user_len=LogNormal(64, 0.8, 4, 512),
                                  answer_len=LogNormal(128, 0.8, 4, 512), vocab_size=32000, think_time=8.0, rate=2.0, seed=0)
turns = sorted({r.turn for r in chat})
chat_runs = {}
for name, blocks in (("8 GiB of KV", 1024), ("32 GiB of KV", 4096)):
    eng, m, s = serve(chat, enable_prefix_caching=True, num_kv_blocks=blocks)
    prefilled = [mean(m[r.request_id].num_prompt_tokens - m[r.request_id].num_cached_tokens for r in chat if r.turn == k)
                 for k in turns]
    chat_runs[name] = (s, prefilled)
    print(f"prefix cache, {name:<13} hit rate {s['prefix_cache_hit_rate']:4.0%}, {eng.kv.stats()['evictions']:>6,} evictions; "
          f"TTFT p50 {s['ttft_p50'] * 1e3:4.0f} ms; tokens prefilled per turn: " + ", ".join(f"{p:4.0f}" for p in prefilled))
context = [mean(r.prompt_len for r in chat if r.turn == k) for k in turns]
fig = go.Figure([go.Bar(name="whole context = prefilled without a cache", x=turns, y=context, marker_color="#ccc")] +
                [go.Bar(name=f"prefilled, prefix cache with {name}", x=turns, y=p) for name, (_, p) in chat_runs.items()])
fig.update_layout(barmode="group", title="tokens prefilled per turn: O(n_total) without the cache, O(n_new) with it",
                  xaxis_title="turn", yaxis_title="tokens (mean over conversations)", height=360, plot_bgcolor="white")
fig
'''),
        md(r'''
With 32 GiB each turn prefills about what is new in it (the previous answer and the new message),
whatever the length of the conversation. With 8 GiB the forty conversations' contexts do not all
fit: while a user thinks, other conversations need blocks, the free list evicts the oldest prefixes,
and later turns recompute part of their history. A prefix cache is only as good as its capacity,
which is why DeepSeek V4, the seeds' industrial example, "supports on-disk KV Cache storage". On
agentic workloads, where "each turn appends only a few hundred tokens to a context that already
contains tens of thousands or even hundreds of thousands of tokens", it reports a hit rate of up to
98.7%.

## 5. What invalidates the cache

Chaining has a consequence: "If the generation result of an intermediate turn is modified — for
example, in a coding scenario where the user edits tool listings, global prompts, or other information
originally placed in the prefix cache (such as CLAUDE.md, AGENTS.md files) — the KV Cache of all
subsequent turns is invalidated and must be recomputed from scratch." An agent's context of 2048
tokens (tool list and project notes first, then the conversation) is cached; then one token is edited
at a given position and the context is sent again:
'''),
        code(r'''
agent = list(range(5000, 7048))                                       # 2048 tokens: 128 blocks of 16
llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM", enable_prefix_caching=True,
          block_size=16, num_kv_blocks=1024, max_model_len=4096, record="summary")   # no per-block KV map: totals are enough here
llm.engine.add_request(agent, SamplingParams(max_tokens=1, ignore_eos=True), request_id="original")
llm.engine.run()
positions = [0, 16, 256, 512, 1024, 1536, 1900, 2040]
recomputed = []
for pos in positions:
    edited = list(agent)
    edited[pos] = 9999                                                  # one token changed
    rid = llm.engine.add_request(edited, SamplingParams(max_tokens=1, ignore_eos=True), request_id=f"edit@{pos}")
    llm.engine.run()
    recomputed.append(2048 - llm.engine.requests[rid].metrics.num_cached_tokens)
    print(f"edit at token {pos:>4}: {2048 - recomputed[-1]:>4} of 2048 tokens reused, {recomputed[-1]:>4} prefilled again")
fig = go.Figure(go.Scatter(x=positions, y=recomputed, mode="lines+markers"))
fig.update_layout(title="one edited token: everything from its block on is recomputed", height=320, plot_bgcolor="white",
                  xaxis_title="position of the edit (token)", yaxis_title="tokens prefilled again")
fig
'''),
        md(r'''
An edit in the first block (the tool list, the system prompt) costs the whole context; an edit near
the end costs almost nothing. Hence the seeds' design rule: "the prefix content should remain as
stable as possible." Put what changes (timestamps, the latest message) at the end; keep tool
definitions and instructions fixed, and first.

## 6. What it is worth

"The economic effect of cache reuse is directly reflected in API pricing. In DeepSeek V4 Flash's API
pricing, cache-hit input is \$0.0028/1M tokens, while cache-miss input is \$0.14/1M tokens — input cost
is reduced by about 50x when the cache is hit." A workload pays a blend, weighted by its hit rate:
'''),
        code(r'''
HIT, MISS = 0.0028, 0.14                    # $ per 1M input tokens, the seeds' DeepSeek V4 Flash prices
print(f"a hit costs {MISS / HIT:.0f}x less than a miss")

def price(hit_rate):
    return hit_rate * HIT + (1 - hit_rate) * MISS

points = {"no cache": 0.0, "shared system prompt (section 3)": apc_runs["prefix cache"][2]["prefix_cache_hit_rate"],
          "multi-turn chat, 32 GiB (section 4)": chat_runs["32 GiB of KV"][0]["prefix_cache_hit_rate"],
          "the seeds' agentic workload": 0.987}
for name, h in points.items():
    print(f"{name:<34} hit rate {h:6.1%}: ${price(h):.4f} per 1M input tokens, {MISS / price(h):4.1f}x less than no cache")
h = np.linspace(0, 1, 201)
fig = go.Figure(go.Scatter(x=h, y=price(h), mode="lines", name="effective price"))
for name, hr in points.items():
    fig.add_trace(go.Scatter(x=[hr], y=[price(hr)], mode="markers+text", text=[name], textposition="top left",
                             showlegend=False))
fig.update_layout(title="input price vs cache hit rate", xaxis=dict(title="cache hit rate", tickformat=".0%"),
                  yaxis=dict(title="$ per 1M input tokens", type="log"), height=380, plot_bgcolor="white")
fig
'''),
        md(r'''
The price falls slowly until the hit rate is high, then fast: even at 98.7% the 1.3% of misses make
up about two fifths of the bill. "A high cache hit rate is not just a technical metric but also a
commercial competitive advantage."
'''),
        md(r'''
## Exercises

The pieces of this notebook, in `exercises/ex04_prefix_cache.py`. They plug into the real engine:
`ex.prefix_engine(...)` builds an `LLM` whose block keys, prefix lookups and block pool are yours; the
graders run the same requests with minillm's prefix cache and with yours, step by step.

**Exercise 1, `hash_block` and `block_hashes`**: the chained key (section 1).
'''),
        md(r'''
<details><summary>Hint 1</summary>

`hash_block` is one call to Python's `hash` on a pair; a list cannot be hashed, a tuple can.

</details>
<details><summary>Hint 2</summary>

`block_hashes`: `parent = None`; for each *full* block (`len(token_ids) // block_size` of them), `parent = hash_block(parent, that block's tokens)` and keep it.

</details>
'''),
        code(r'''
with impl.attempt("ex04.hash_block / block_hashes"):
    mine = ex.block_hashes(prompt, 4)
    print(f"{len(mine)} keys for {len(prompt)} tokens in blocks of 4; the first is the engine's: "
          f"{mine[0] == hash_block(None, prompt[:4])}")
'''),
        md(r'''
**Exercise 2, `longest_prefix_match`**: the cached blocks a request can reuse (section 1).
**Exercise 3, `EvictingBlockPool`**: `evict`, `allocate`, `take` and `free` (section 2). Below,
section 2's five requests on an engine built from your three pieces (on the simulated executor:
only the block decisions matter here), next to minillm's own:
'''),
        md(r'''
<details><summary>Hint 1</summary>

`longest_prefix_match`: the loop of `block_hashes` over `(len(token_ids) - 1) // block_size` blocks, looking each key up in `cached`; `break` at the first key that is missing or whose block holds other `token_ids` or another `parent_hash`.

</details>
<details><summary>Hint 2</summary>

The pool: `take` removes a block with `ref_count == 0` from the free queue before counting it; `allocate` is `popitem(last=False)`, then `evict` if the block has a hash; `evict` deletes the index entry only if it is this very block (`self.cached.get(h) is block`); `free` walks `reversed(blocks)` and puts a block that reaches 0 into the free queue where its docstring says.

</details>
'''),
        code(r'''
cfg = dict(executor="simulated", block_size=4, num_kv_blocks=12, max_num_batched_tokens=32, max_num_seqs=3,
           clock="modeled", cost_model=0.010)
with impl.attempt("ex04.longest_prefix_match / EvictingBlockPool"):
    for name, llm in (("minillm's", LLM(model="random", enable_prefix_caching=True, **cfg)),
                      ("yours", ex.prefix_engine(model="random", **cfg))):
        add_apc_requests(llm.engine)
        llm.engine.run()
        st = llm.engine.kv.stats()
        print(f"{name:>9} prefix cache: {st['hit_blocks']} block hits, {st['evictions']} evictions; "
              f"E reused {llm.engine.requests['E'].metrics.num_cached_tokens} tokens")
'''),
        grading("04", "ex04_prefix_cache", "pool"),
    ]


# =====================================================================================
# 05: preemption
# =====================================================================================

def nb05() -> list:
    return [
        md(r'''
# 05 · Preemption

Paging admits a request as soon as its prompt fits, without knowing how long its answer will be
(notebook 02). So the cache can fill up while everyone is still generating, and then a running request
needs a block that does not exist. The seeds: "under high load, even with prefix caching, GPU memory
may still be insufficient to simultaneously accommodate the KV Cache of all active requests. At this
point, a choice must be made: pause certain requests to free memory for more important ones."

Two ways to pause one:

- **Swap**: "move its KV cache to slower memory, restore later. Preserves work, costs bandwidth."
- **Recompute**: "discard the cache, re-run prefill on resume. Frees memory immediately, wastes prior work."

Either way the decision happens between steps: "After each Decode step, the scheduler can check whether
preemption or eviction is needed without interrupting an executing Decode step." This notebook:

1. memory pressure and the victim, stepped live: recompute and swap side by side;
2. recompute or swap: the seeds' cost rule, and a map of which one wins;
3. at scale: recompute, swap, and the rule choosing per victim;
4. thrashing, and how headroom damps it;
5. priority preemption: pushing a lower class out of memory;
6. exercises: the recompute-or-swap decision and the choice of victim.
'''),
        SETUP,
        code(r'''
from dataclasses import replace

from plotly.subplots import make_subplots

from minillm.costmodel import HARDWARE, RooflineCostModel, swap_or_recompute
from minillm.policies import Priority
from minillm.workloads import LogNormal, TraceRequest, Uniform

ex = impl.load("ex05_preemption")    # your exercises/ex05_preemption.py (MINILLM_IMPL=solutions: the answers);
                                     # re-run this cell after editing the file: impl.load reads it again
H100 = RooflineCostModel("H100-SXM", "llama-2-7b")

def serve(trace, cost_model=H100, **config):
    """The simulated executor (the real scheduler and KV manager, no forward pass) serving Llama-2-7B on the
    modeled clock of `cost_model`. Returns the engine, its requests' metrics, and metrics.summarize's dict."""
    config.setdefault("num_kv_blocks", 1024)             # 16,384 positions of KV (8 GiB), as in notebook 02
    config.setdefault("max_num_seqs", 256)
    llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model=cost_model, max_model_len=8192,
              max_num_batched_tokens=8192, **config, record="summary")   # no per-block KV map: totals are enough here
    workloads.submit_trace(llm.engine, trace, vocab_size=llm.engine.vocab_size)
    records = llm.engine.run()
    m = {rid: r.metrics for rid, r in llm.engine.requests.items()}
    return llm.engine, m, metrics.summarize(m, records, max_num_seqs=llm.config.max_num_seqs)
'''),
        md(r'''
## 1. Memory pressure, and the victim

A cache of 8 blocks of 4 positions (32 positions) and three requests, A, B and C, with prompts of 7, 6
and 5 tokens and answers of 7, 7 and 6 tokens. All three prompts fit (18 positions), so all three are
admitted at once; together they will need 35. Left: `preemption_mode="recompute"`. Right:
`preemption_mode="swap"` with a host pool of 12 blocks (`num_swap_blocks`). Each Step runs the Triton
attention kernel (and, on the right, the block-copy kernel when blocks move to or from the host).
'''),
        code(r'''
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
'''),
        md(r'''
Five steps: the prefills, then three decodes that fill the last free block, and then C's next
position needs a new block, and none is free. The cells below step their own copies of the two
engines (`pressure_runs`), so the widget above stays where you left it, ready to step.
'''),
        code(r'''
pressure_runs = [pressure_engine("recompute"), pressure_engine("swap")]   # the widget above stays yours
for _ in range(5):
    recs = [llm.engine.step() for llm in pressure_runs]
for name, rec in zip(pressure.names, recs):
    print(f"{name}: {rec.summary()}\n")
figures.compare_kv_figure(dict(zip(pressure.names, recs)), colors=pressure.colors, width=560)
'''),
        md(r'''
The scheduler serves running requests first, in admission order; when one cannot get its block it asks
the policy for a *victim* (`Policy.pick_victim`). minillm's default gives up the **most recently
admitted** request: it has done the least work (least to recompute, least to copy), and under FCFS the
newest should yield to the oldest. Here that is C, the very request that needed the block. With
recompute (the widget's left half, the upper map) C's KV is dropped and C goes back to the front of
the queue; with swap (the right half, the lower map) C's 3 blocks are copied to host memory and C
waits in the swapped list. A and B keep decoding; the kernel, checked against its torch reference on
both caches:
'''),
        kernel_check("pressure_runs[0]"),
        kernel_check("pressure_runs[1]"),
        md(r'''
Run both to the end:
'''),
        code(r'''
for name, llm in zip(pressure.names, pressure_runs):
    llm.engine.run()
    records = llm.engine.step_records                # every step of this run, from step 0
    back = next(r for r in records[5:] if r.entry("C") is not None)
    e = back.entry("C")
    print(f"{name:<30} C returns at step {back.step} with a {e.phase} of {e.num_tokens} token(s) "
          f"({e.num_computed_before} positions already in the cache); the run takes {len(records)} steps")
'''),
        md(r'''
With recompute C's return is a prefill of its 5 prompt tokens *and* the 4 it had generated: "the
recovery time for eviction is (n_input + n_generated) / S_prefill." With swap its blocks are copied
back and it simply decodes its next token: "the recovery time for preemption is M_KV / B_PCIe." Both
give the same tokens (greedy decoding here); only the cost differs.

## 2. Recompute or swap: the cost rule

"Which strategy to choose depends on the ratio between the preempted request's KV Cache size and its
input length ... When M_KV / B_PCIe < n_input / S_prefill, preemption [swap] is superior; otherwise,
eviction [recompute] is superior." The seeds' numbers: "PCIe 4.0 x16 provides approximately 32 GB/s,
PCIe 5.0 x16 provides approximately 64 GB/s, and copying a 1 GB KV Cache takes about 20ms", while "for
a request with an input length of 2000 tokens, Prefill may take about 500ms". minillm's
`costmodel.swap_or_recompute` is that rule:
'''),
        code(r'''
print("the seeds' example, 1 GB over PCIe 4.0 vs 2000 tokens at 4000 tokens/s:",
      swap_or_recompute(1e9, 2000, 32e9, 2000 / 0.5))
print(f"Llama-2-7B on a modeled H100: {H100.model.kv_bytes_per_token / 2**10:.0f} KiB of KV per position; a 2000-token "
      f"prefill takes {H100.step_time([2000], [2000]) * 1e3:.0f} ms; its {2000 * H100.model.kv_bytes_per_token / 1e9:.2f} GB "
      f"cross PCIe 5.0 in {H100.swap_time(2000 * H100.model.kv_bytes_per_token) * 1e3:.0f} ms")
'''),
        md(r'''
Which one wins, over every prompt length and every KV size. Each cell applies the rule with the
H100's prefill speed at that length (from the roofline: longer prompts cost more per token, because
attention grows with the square of the length). The solid line is the boundary over a PCIe 5.0 link
of its own (64 GB/s); the dashed one over a link four GPUs share (16 GB/s each, a common server
layout). A real model's requests lie on a line through the origin, M_KV = n x (KV bytes per position):
'''),
        code(r'''
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
fig.add_trace(go.Scatter(x=[2000], y=[1.0], mode="markers+text", text=["the seeds' example"], textposition="top center",
                         marker=dict(size=12, color="black", symbol="star"), showlegend=False))
fig.add_annotation(x=1200, y=4.0, text="recompute wins", showarrow=False, font=dict(size=14))
fig.add_annotation(x=6500, y=0.5, text="swap wins", showarrow=False, font=dict(size=14))
fig.update_layout(title="recompute or swap, on a modeled H100 (Llama-2-7B's prefill speed)",
                  xaxis_title="tokens to recompute (n_input + n_generated)", yaxis_title="KV to copy, M_KV (GB)",
                  yaxis_range=[0, 4.5], height=440, legend=dict(orientation="h", y=-0.2), plot_bgcolor="white")
fig
'''),
        md(r'''
On its own PCIe 5.0 link, swapping Llama-2-7B's KV (half a megabyte per position: full multi-head
attention, 32 layers) beats recomputing it at every length, and grouped-query attention (Llama-3-8B,
a quarter of that) makes swapping cheaper still. Share the link four ways and Llama-2-7B's line
crosses into recompute territory. The rule is simple; its inputs are not. The seeds' other voice
adds what the rule leaves out: "Recomputation is often cheaper than it sounds, because prefill is
compute bound and efficient, while swapping consumes the bandwidth decode desperately needs", and it
needs host memory. Their rule of thumb: "Prefer recompute to swap under pressure, unless measurement
says otherwise."

## 3. At scale: recompute, swap, and the rule

150 requests with long prompts (500 to 1500 tokens) and answers (200 to 600) arrive at 40 per second on
the modeled H100 with 8 GiB of KV: far more than fits, so the engine preempts all the time. minillm's
`preemption_mode="auto"` applies the rule to each victim (`CostModel.preemption_mode`), with the cost
model's PCIe bandwidth and prefill speed.
'''),
        code(r'''
burst = workloads.synthetic_trace(150, rate=40, prompt_len=Uniform(500, 1500), output_len=Uniform(200, 600), seed=0)
shared_link = RooflineCostModel(replace(HARDWARE["H100-SXM"], name="H100, shared 16 GB/s link", pcie_bandwidth=16e9),
                                "llama-2-7b")
modes = {"recompute": dict(preemption_mode="recompute"),
         "swap": dict(preemption_mode="swap", num_swap_blocks=4096),
         "auto, PCIe 5.0": dict(preemption_mode="auto", num_swap_blocks=4096),
         "auto, shared 16 GB/s link": dict(preemption_mode="auto", num_swap_blocks=4096, cost_model=shared_link)}
preempt_runs = {}
for name, cfg in modes.items():
    eng, m, s = serve(burst, **cfg)
    st = eng.stats()
    preempt_runs[name] = (eng, m, s)
    print(f"{name:<26} {st['preemptions_recompute']:>3} recomputed, {st['preemptions_swap']:>3} swapped "
          f"({st['recomputed_tokens']:>6,} tokens prefilled again, {s['swap_time_total']:.2f} s copying) | "
          f"{s['output_throughput']:5.0f} tokens/s, TTFT p50 {s['ttft_p50']:5.1f} s, end-to-end p99 {s['e2e_p99']:5.1f} s")
'''),
        md(r'''
The rule picks swap where the link is fast and recompute where it is shared. But look at the
outcome: even on the fast link, recompute ends up as fast as swap, although it prefills tens of
thousands of tokens again. The rule compares recovery times one victim at a time; in a running engine a
recomputed prompt is prefilled *inside* a step that other requests' decodes share, where the extra
tokens use arithmetic the memory-bound decode left idle, while a copy is time added to the step it
happens in, in front of everyone's next token. (The modeled clock charges it that way; it does not
model the host memory a swap pool takes.) That is the seeds' "Recomputation is often cheaper than it
sounds, because prefill is compute bound and efficient, while swapping consumes the bandwidth decode
desperately needs", and why their rule of thumb is to prefer recompute "unless measurement says
otherwise." Either way the work lost is small next to the overload here: the queue, not the
preemptions, sets the latency.

## 4. Thrashing, and headroom

"Throughput collapses under load: preemption thrashing." The mechanism: at 100% of the cache, every
growing request that needs a block forces a preemption; a preempted request goes back to the front of
the queue and is readmitted as soon as its prompt fits again, which fills the cache again, and the cycle
repeats, redoing prefills nobody asked for. The fixes: "Admission control; headroom; hysteresis." "Keep
headroom. A system at exactly 100% capacity has no room to absorb variance." minillm's `watermark` is
headroom: admission keeps that fraction of the blocks free, for running requests to grow into.
'''),
        code(r'''
watermarks = [0.0, 0.02, 0.05, 0.1, 0.2]
wm_runs = {}
for wm in watermarks:
    eng, m, s = (preempt_runs["recompute"] if wm == 0.0 else serve(burst, preemption_mode="recompute", watermark=wm))
    wm_runs[wm] = (eng.stats()["recomputed_tokens"], s)
    print(f"watermark {wm:4.0%}: {s['num_preemptions']:3d} preemptions ({s['preemption_rate']:4.2f} per s), "
          f"{wm_runs[wm][0]:>6,} tokens prefilled again | {s['output_throughput']:5.0f} tokens/s, mean batch "
          f"{s['batch_size_mean']:4.1f}, KV in use {s['kv_util_mean']:4.0%}")
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
'''),
        md(r'''
Without headroom the engine prefills a quarter as many tokens again as the trace holds. A few percent of
headroom removes most of it and throughput *rises*; with a fifth of the cache held back the batch
shrinks and throughput falls. The preemption rate is the symptom to watch ("high values indicate
thrashing"). On this modeled H100 a prefill is cheap, so thrashing wastes compute rather than
collapsing throughput; where a prefill is expensive relative to a decode step (long prompts, slower
compute), the same cycle eats the machine.

## 5. Priority preemption

Preemption is also how priority classes get memory (notebook 03's priority inversion, now for KV
memory instead of a slot): "a high-priority request requiring immediate execution". Two low-priority
requests grow until they hold 48 of the cache's 50 blocks; at 1.8 s a high-priority request arrives
needing 7 blocks for its prompt. Under FCFS it waits for a low one to finish; `Priority` preempts
the lowest class, most recent first, until the new request fits.
'''),
        code(r'''
mem_trace = [TraceRequest(f"low{i}", 0.0, 200, 200, priority=1) for i in range(2)] + [TraceRequest("high", 1.8, 100, 20, priority=0)]
prio = {}
for name, pol in (("FCFS", "fcfs"), ("priority, preempting", Priority(preempt=True))):
    eng, m, s = serve(mem_trace, cost_model=0.010, policy=pol, num_kv_blocks=50, max_num_seqs=16)
    prio[name] = eng
    events = [f"{p.request_id} ({p.mode}: {p.reason})" for r in eng.step_records for p in r.preempted]
    print(f"{name:<22} high waits {m['high'].queue_wait * 1e3:5.0f} ms; preempted: {', '.join(events) or 'nobody'}")
eng = prio["priority, preempting"]
figures.gantt_figure(eng.step_records, eng.requests, title="the high-priority request pushes low1 out of memory")
'''),
        md(r'''
The victim waits, then recomputes its 200-token prompt and everything it had generated: the price of
the high class starting at once instead of 200 ms later, paid by the low class. That trade is the point of priority classes, and
why they "need careful class definition".
'''),
        md(r'''
## Exercises

In `exercises/ex05_preemption.py`; each runs inside the engine.

**Exercise 1, `swap_time`, `recompute_time`, `swap_or_recompute`**: the seeds' rule (section 2).
`ex.YourCostModel` is the H100 roofline asking *your* rule whenever the engine preempts with
`preemption_mode="auto"`. Section 3's trace, with your rule deciding:
'''),
        md(r'''
<details><summary>Hint 1</summary>

Both times are one division: bytes over bytes/s, tokens over tokens/s. The rule compares them with a strict `<`, so a tie recomputes.

</details>
'''),
        code(r'''
with impl.attempt("ex05.swap_or_recompute"):
    print("the seeds' example:", ex.swap_or_recompute(1e9, 2000, 32e9, 4000.0))
    for name, hw in (("PCIe 5.0", HARDWARE["H100-SXM"]), ("shared 16 GB/s link", shared_link.hardware)):
        eng, m, s = serve(burst, preemption_mode="auto", num_swap_blocks=4096,
                          cost_model=ex.YourCostModel(hw, "llama-2-7b"))
        st = eng.stats()
        print(f"your rule, {name:<20} {st['preemptions_recompute']:>3} recomputed, {st['preemptions_swap']:>3} swapped")
'''),
        md(r'''
**Exercise 2, `LeastProgressVictim.pick_victim`**: give up the running request with the least KV
(the least work to redo or copy) instead of the most recently admitted. Section 3's trace, recompute:
'''),
        md(r'''
<details><summary>Hint 1</summary>

One `min` over the candidates with a tuple key: `(num_computed_tokens, -admit_seq)`.

</details>
'''),
        code(r'''
with impl.attempt("ex05.LeastProgressVictim"):
    for name, pol in (("most recently admitted (default)", "fcfs"), ("least progress (yours)", ex.LeastProgressVictim())):
        eng, m, s = serve(burst, preemption_mode="recompute", policy=pol)
        print(f"{name:<34} {s['num_preemptions']:3d} preemptions, {eng.stats()['recomputed_tokens']:>6,} tokens prefilled "
              f"again, {s['output_throughput']:5.0f} tokens/s")
'''),
        md(r'''
**Exercise 3, `PriorityPreemption`**: `order_waiting`, `pick_victim` and `preempt_for` (section 5):
'''),
        md(r'''
<details><summary>Hint 1</summary>

`order_waiting`: `sorted` by `(priority, arrival_time)`. `pick_victim`: `max` by `(priority, admit_seq)`. `preempt_for`: keep the running requests with `priority > request.priority`; `pick_victim` among them, `None` if there are none.

</details>
'''),
        code(r'''
with impl.attempt("ex05.PriorityPreemption"):
    eng, m, s = serve(mem_trace, cost_model=0.010, policy=ex.PriorityPreemption(), num_kv_blocks=50, max_num_seqs=16)
    print(f"your priority policy: high waits {m['high'].queue_wait * 1e3:.0f} ms; preempted "
          f"{[p.request_id for r in eng.step_records for p in r.preempted]}")
'''),
        grading("05", "ex05_preemption", "least_progress"),
    ]


# =====================================================================================
# 06: speculative decoding
# =====================================================================================

def nb06() -> list:
    return [
        md(r'''
# 06 · Speculative decoding

"A small draft model proposes several tokens; the target model verifies them in a single forward pass.
Accepted tokens are kept, and the first rejection resets to that point. This works because
verification of k tokens costs roughly the same as generating one — decode is bandwidth bound, so
processing a few extra positions is nearly free. It converts spare compute into latency reduction."

And the seeds' warning, in the same breath: "acceptance rate determines actual speedup, and a low
acceptance rate can make things slower rather than faster." This notebook:

1. draft and verify, stepped live on the shipped model and its shipped draft;
2. the acceptance rule: greedy, and rejection sampling (why the output does not change);
3. acceptance rate against speed-up;
4. when speculation makes things slower: low acceptance, a costly draft, a large batch;
5. the shipped draft (`speculative_model="default-draft"`) against the n-gram proposer (`"ngram"`);
6. exercise: the acceptance rule, inside the engine.

In minillm one step of a decoding request with speculation is: the proposer guesses up to k tokens;
the scheduler grants the request 1 + k new tokens (they count against the execution-token budget);
one target forward scores all of them; the engine keeps the accepted guesses plus one token of the
target's own, and rolls the KV of the rejected guesses back (`minillm/speculative.py`).
'''),
        SETUP,
        code(r'''
from minillm.costmodel import MODELS, ModelSpec, RooflineCostModel
from minillm.speculative import (alpha_from_tokens_per_step, expected_speedup, expected_tokens_per_step,
                                 modeled_speedup, spec_stats)

ex = impl.load("ex06_speculative")   # your exercises/ex06_speculative.py (MINILLM_IMPL=solutions: the answer);
                                     # re-run this cell after editing the file: impl.load reads it again
'''),
        md(r'''
## 1. Draft and verify, stepped

The target is the Shakespeare model that ships with minillm (4 layers, 3.4 M parameters); the draft is
its shipped companion (`speculative_model="default-draft"`: 1 layer, 1.25 M parameters, distilled from
the target, same tokenizer). k = 4 guesses per step, greedy decoding, and `attention_backend="triton"`:
every Step runs the Triton kernel for the draft's forwards and the target's verification (a query of
5 tokens over the paged cache). The draft keeps its own KV in the *same* block ids as the target's,
so one block table serves both models.
'''),
        code(r'''
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"

def spec_engine():
    llm = LLM(device=DEVICE, dtype="auto", attention_backend="triton", speculative_model="default-draft",
              num_speculative_tokens=4, block_size=8, num_kv_blocks=32, max_num_seqs=2, max_model_len=256,
              max_num_batched_tokens=32,      # a budget the batch bar can show: 5 tokens are a sixth of it
              clock="modeled", cost_model=0.010)
    llm.engine.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), request_id="R")
    return llm

spec = Stepper(spec_engine, title="speculative decoding: the shipped draft proposes 4, the target verifies")
spec
'''),
        md(r'''
Step 0 is the prompt's prefill (no guesses yet: speculation starts once the request decodes). From
step 1 on, each step is one verification. Five steps, in code:
'''),
        code(r'''
tok = spec.engine.tokenizer
req = spec.engine.requests["R"]
for _ in range(5):
    before = req.num_output_tokens
    rec = spec.step()
    e = rec.entry("R")
    new = req.output_token_ids[before:]
    what = (f"{e.num_spec_tokens} guessed, {e.num_spec_accepted} accepted, + 1 from the target"
            if e.num_spec_tokens else "the prompt's prefill")
    print(f"step {rec.step}: {e.num_tokens:>2} tokens through the target ({what}) -> {len(new)} new: {tok.decode(new)!r}")
'''),
        md(r'''
A step emits between 1 and k + 1 = 5 tokens: the accepted guesses, then the target's own token at the
first rejection (or a *bonus* token after all four). Where a guess was wrong, its KV (written during
verification) is rolled back: blocks left empty go back to the pool. The batch bar above shows each
step's tokens against a budget of 32: R's own token (solid), then its guesses, accepted (hatched, green
outline, ✓) or rejected (red cross-hatch, ✗); drag *view step* to see each of the five. The kernel on
this engine's cache:
'''),
        kernel_check("spec"),
        md(r'''
## 2. The acceptance rule

**Greedy**: keep a guess while it equals the target's argmax at that position. The output is then
exactly what the target alone would produce, token for token:
'''),
        code(r'''
plain = LLM(attention_backend="auto")
greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
a = plain.generate([PROMPT], greedy)[0].text
b = LLM(attention_backend="auto", speculative_model="default-draft", num_speculative_tokens=4).generate([PROMPT], greedy)[0].text
print(f"same text with and without speculation: {a == b}\n{a!r}")
'''),
        md(r'''
**Sampling** needs more care: the guesses were *drawn* from the draft's distribution q, and the output
must follow the target's p. Rejection sampling (Leviathan et al., Chen et al., 2023) accepts a guess x
with probability min(1, p(x) / q(x)); at a rejection it draws a replacement from the residual
norm(max(0, p − q)). The two paths add up to p exactly. One position, a vocabulary of 5 tokens:
'''),
        code(r'''
p = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])          # the target's next-token distribution
q = torch.tensor([0.10, 0.45, 0.20, 0.05, 0.20])          # the draft's
accepted = q * torch.clamp(p / q, max=1.0)                 # drawn from q, then kept: q(x) min(1, p(x)/q(x)) = min(q, p)
reject = 1 - accepted.sum()                                # probability that the guess is rejected
residual = torch.clamp(p - q, min=0) / torch.clamp(p - q, min=0).sum()
total = accepted + reject * residual
print(f"P(accept) = {accepted.sum():.2f}; accepted + rejected-then-resampled = {total.tolist()}; p = {p.tolist()}")
fig = go.Figure([go.Bar(name="guess kept: min(p, q)", x=list(range(5)), y=accepted.tolist()),
                 go.Bar(name="replacement after a rejection", x=list(range(5)), y=(reject * residual).tolist())])
fig.add_trace(go.Scatter(name="target p", x=list(range(5)), y=p.tolist(), mode="markers", marker=dict(size=14, symbol="line-ew-open", line=dict(width=3))))
fig.add_trace(go.Scatter(name="draft q", x=list(range(5)), y=q.tolist(), mode="markers", marker=dict(size=10, symbol="x")))
fig.update_layout(barmode="stack", title="rejection sampling: the emitted token follows p, whatever q is",
                  xaxis_title="token", yaxis_title="probability", height=340, plot_bgcolor="white")
fig
'''),
        md(r'''
The acceptance probability is the overlap of the two distributions, Σ min(p, q): a draft that puts its
mass where the target does gets its guesses kept. The exercise asks you to write both rules; the
graders check that your sampled output follows p, and that the engine, running your rule, emits the
same tokens as with its own.

## 3. Acceptance rate against speed-up

If each guess is accepted with probability α, independently, one target step emits on average
1 + α + α² + ... + α^k = (1 − α^(k+1)) / (1 − α) tokens. If a draft forward costs c target forwards
and the verification costs one (the memory-bound assumption), the speed-up is
(1 − α^(k+1)) / ((1 − α)(k c + 1)) (Leviathan et al., 2023; `speculative.expected_speedup`):
'''),
        code(r'''
alphas = np.linspace(0.0, 0.98, 50)
fig = go.Figure()
for k in (1, 2, 4, 8):
    fig.add_trace(go.Scatter(x=alphas, y=[expected_speedup(a, k, 0.05) for a in alphas], name=f"k = {k}, draft cost c = 0.05"))
fig.add_trace(go.Scatter(x=alphas, y=[expected_speedup(a, 4, 0.36) for a in alphas], name="k = 4, c = 0.36 (the shipped pair)",
                         line=dict(dash="dash", color="black")))
fig.add_hline(y=1.0, line_dash="dot", annotation_text="no gain")
fig.update_layout(title="expected speed-up vs acceptance rate", xaxis_title="per-token acceptance rate alpha",
                  yaxis_title="speed-up (x)", height=380, plot_bgcolor="white")
fig
'''),
        md(r'''
More guesses pay only when they are likely to be kept: at low α, k = 8 wastes seven draft forwards
for one token. Now the shipped pair, measured: the engine runs on a modeled clock where a target step
costs 10 ms whatever its size (the seeds' memory-bound assumption) and a draft forward costs the
target's 10 ms scaled by the ratio of their weights, c = 1.25 M / 3.43 M ≈ 0.36 (a small model's
weights are largely embeddings, so its draft cannot be much smaller). Greedy, k = 1 to 6:
'''),
        code(r'''
engines = {}

def timed(prompts, params, **spec_config):
    """Generate on the modeled clock (10 ms per target step); returns the modeled seconds per generated token
    of the slowest request, the speculation stats of these steps, and the LLM (one per configuration, reused)."""
    key = tuple(sorted(spec_config.items()))
    if key not in engines:
        engines[key] = LLM(attention_backend="auto", clock="modeled", cost_model=0.010, **spec_config)
    llm = engines[key]
    start, first = llm.engine.clock.now(), len(llm.engine.step_records)
    outs = llm.generate(prompts, params)
    elapsed = llm.engine.clock.now() - start
    return elapsed / max(len(o.token_ids) for o in outs), spec_stats(llm.engine.step_records[first:]), llm

base, _, _ = timed([PROMPT], greedy)
rows = []
for k in (1, 2, 4, 6):
    t, st, llm = timed([PROMPT], greedy, speculative_model="default-draft", num_speculative_tokens=k)
    ratio = llm.engine.speculator.draft_cost_model.ratio
    alpha = alpha_from_tokens_per_step(st["tokens_per_target_step"], k)
    rows.append((k, alpha, base / t, expected_speedup(alpha, k, ratio)))
    print(f"k = {k}: {st['tokens_per_target_step']:.2f} tokens per target step (alpha ~ {alpha:.2f}); measured speed-up "
          f"{base / t:.2f}x, the formula with c = {ratio:.2f}: {rows[-1][3]:.2f}x")
'''),
        md(r'''
The engine's measurements follow the formula. A draft that agrees with its target on about 60% of
greedy tokens, but costs over a third of it per forward, gains a little with one or two guesses and
loses time from four on: each rejected guess wasted a draft forward. Real drafts are 10 to 50 times
smaller than their targets (c of 0.02 to 0.1), where the same α gives a clear gain.

## 4. When speculation makes things slower

The seeds' failure table: "Speculative decoding slower — Low acceptance rate — Better draft model, or
disable it." Low acceptance is one cause (the curves above fall below 1 on the left). The other is
the assumption behind "nearly free": verification of k + 1 positions costs one plain step only while
decode is memory bound, that is, while the batch is small. In a large batch the step is already
compute bound, and k + 1 positions per request cost up to k + 1 times as much. The roofline cost
model prices it (`speculative.modeled_speedup`): Llama-3-8B on an H100 with a Llama-shaped draft of
about 125 M parameters, α = 0.8, 256 positions of context per request (and, dashed, 4096):
'''),
        code(r'''
target = RooflineCostModel("H100-SXM", "llama-3-8b")
draft = RooflineCostModel("H100-SXM", ModelSpec.from_hf_config(dict(num_hidden_layers=12, hidden_size=768,
        num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048, vocab_size=32000), name="draft"))
print(f"draft: {draft.model.num_params / 1e6:.0f} M parameters, c = {draft.model.weight_bytes / target.model.weight_bytes:.3f}")
batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
fig = go.Figure()
for k, ctx, dash in ((2, 256, "solid"), (4, 256, "solid"), (8, 256, "solid"), (4, 4096, "dash")):
    fig.add_trace(go.Scatter(x=batches, y=[modeled_speedup(target, draft, b, ctx, k, 0.8)["speedup"] for b in batches],
                             name=f"k = {k}, {ctx} positions", mode="lines+markers", line=dict(dash=dash)))
fig.add_hline(y=1.0, line_dash="dot", annotation_text="no gain")
fig.update_layout(title="speculation on a modeled H100: the gain shrinks as the batch grows", height=380,
                  xaxis=dict(title="batch size (requests decoding together)", type="log"), yaxis_title="speed-up (x)",
                  plot_bgcolor="white")
for b in (1, 64, 512):
    r = modeled_speedup(target, draft, b, 256, 4, 0.8)
    print(f"batch {b:>3}, k = 4: plain step {r['plain_step'] * 1e3:5.1f} ms, verification {r['verify_time'] * 1e3:5.1f} ms, "
          f"drafts {r['draft_time'] * 1e3:4.1f} ms -> {r['speedup']:.2f}x")
fig
'''),
        md(r'''
At batch 1 the verification costs what a plain step does, and four guesses at α = 0.8 give a large
gain. By a few hundred requests the step is compute bound, the verification of five positions per
request costs several plain steps, and the gain is gone: speculation converts *spare* compute into
latency, and a big batch has none to spare. Long contexts postpone this (dashed): each request's own
KV reads keep the step memory bound. This is the seeds' "batch size becomes variable in a new way": an
engine can speculate at low load and stop at high load.

## 5. The shipped draft against the n-gram proposer

A draft model is one way to guess. Another costs nothing: **prompt lookup** (`speculative_model="ngram"`)
finds the last few tokens earlier in the request's own context and proposes what followed them there.
It is right when text repeats: code, quotes, summaries of the prompt, and small models stuck in loops.
Two prompts, four requests each, greedy and sampled (temperature 0.8), k = 4:
'''),
        code(r'''
texts = {"Romeo": PROMPT,
         "a dialogue": "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"}
compare = []
for temp in (0.0, 0.8):
    params = SamplingParams(max_tokens=48, temperature=temp, seed=1, ignore_eos=True)
    for name, text in texts.items():
        base, _, _ = timed([text] * 4, params)
        for proposer in ("default-draft", "ngram"):
            t, st, _ = timed([text] * 4, params, speculative_model=proposer, num_speculative_tokens=4)
            compare.append((temp, name, proposer, st["acceptance_rate"] or 0.0, st["tokens_per_target_step"], base / t))
            print(f"T={temp}  {name:<11} {proposer:<14} {st['acceptance_rate'] or 0:4.0%} of guesses accepted, "
                  f"{st['tokens_per_target_step']:.2f} tokens per target step -> {base / t:.2f}x")
fig = go.Figure()
for proposer in ("default-draft", "ngram"):
    rows = [r for r in compare if r[2] == proposer]
    fig.add_trace(go.Bar(name=proposer, x=[f"{n}, {'greedy' if t == 0 else 'T=0.8'}" for t, n, *_ in rows], y=[r[5] for r in rows]))
fig.add_hline(y=1.0, line_dash="dot")
fig.update_layout(barmode="group", title="speed-up on the modeled clock (10 ms per target step)", yaxis_title="x",
                  height=360, plot_bgcolor="white")
fig
'''),
        md(r'''
Greedy, the small shipped model falls into loops (look at its text in section 2), so prompt lookup
finds its guesses in the request's own recent output, keeps many of them, and costs nothing: the
best results here, while the draft model, costing a third of a target step per guess, loses time.
Sampled at T = 0.8 the text stops repeating and prompt lookup finds almost nothing to propose, while
the draft model, which learned the target's distribution, does better than it did greedy on most
prompts (rejection sampling accepts by overlap of distributions, not by exact match). Neither is
always right: measure on your traffic ("Better draft model, or disable it").
'''),
        md(r'''
## Exercise

**`accept_greedy` and `accept_sampled`** in `exercises/ex06_speculative.py`: the acceptance rule of
section 2. `ex.speculative_engine(...)` builds an `LLM` whose verification steps run your rule; below,
the shipped pair with your rule, greedy (must equal plain decoding) and sampled:
'''),
        md(r'''
<details><summary>Hint 1</summary>

`accept_greedy`: count `a`, the length of the common prefix of `draft` and `target`; the answer is `draft[:a]` plus `target[a]`.

</details>
<details><summary>Hint 2</summary>

`accept_sampled`: follow the docstring's order of random draws exactly (one `torch.rand` per guess while accepting; one `torch.multinomial` at the first rejection or for the bonus). With `q` None the residual is `p[j].clone()` with entry `x` set to 0.

</details>
'''),
        code(r'''
with impl.attempt("ex06.accept_greedy"):
    print(ex.accept_greedy([5, 7, 9], [5, 7, 2, 4]), "(expected [5, 7, 2])")
    mine = ex.speculative_engine(None, attention_backend="auto", speculative_model="default-draft", num_speculative_tokens=4)
    print("greedy with your rule equals plain decoding:", mine.generate([PROMPT], greedy)[0].text == a)
with impl.attempt("ex06.accept_sampled"):
    sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    theirs = LLM(attention_backend="auto", speculative_model="default-draft", num_speculative_tokens=4).generate([PROMPT], sampled)
    mine = ex.speculative_engine(None, attention_backend="auto", speculative_model="default-draft", num_speculative_tokens=4)
    print("sampled with your rule equals the engine's rule (same random stream):",
          mine.generate([PROMPT], sampled)[0].token_ids == theirs[0].token_ids)
'''),
        grading("06", "ex06_speculative", "accept_sampled"),
    ]


# =====================================================================================
# Writing
# =====================================================================================

BUILDERS = {"03_scheduling_policies.ipynb": nb03, "04_prefix_caching.ipynb": nb04, "05_preemption.ipynb": nb05,
             "06_speculative_decoding.ipynb": nb06}


def main(argv=None) -> int:
    return write_notebooks(BUILDERS, "build_notebooks_part2.py", "Build notebooks 03-06 (without outputs).",
                           argv)


if __name__ == "__main__":
    sys.exit(main())
