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
# # 00 · A tour of minillm
#
# minillm is a small LLM serving engine built to be read and stepped through. Its subject is
# **batching and scheduling**: scheduling decides which requests run, when, and together with which
# others; batching is the mechanism that makes memory-bound decode efficient. Everything in this
# series is the real engine running: a Llama-style model, a paged KV cache, a scheduler that re-forms
# the batch every step, and attention computed by a Triton kernel.
#
# In this tour:
#
# 1. generate text with the model that ships in the repository;
# 2. look at one engine step as plain data (a `StepRecord`);
# 3. step the engine yourself with a widget;
# 4. check the Triton attention kernel against its torch reference, on the engine's own KV cache;
# 5. serve it over HTTP, send it requests with the `openai` client and watch the engine take a burst;
# 6. the map of the series;
# 7. the words the series uses (KV cache, prefill and decode, SLO, p99, CDF, ...): if any of them is new
#    to you, read section 7 first.
#
# You need basic PyTorch. Everything runs offline. On a GPU the Triton kernels are compiled. On a laptop
# CPU they run in Triton's *interpreter* (slow, but exactly the same kernels) wherever a notebook steps
# the engine by hand and in each notebook's kernel check; the large runs (hundreds of requests) use the
# torch attention path or the simulated executor, which runs the real scheduler without the model.

# %% [markdown]
# **After this notebook you can:**
#
# - generate text with `LLM.generate` and read each request's TTFT and TPOT;
# - read one engine step as data (a `StepRecord`): who ran, how many tokens each, who waits and why;
# - predict which requests a step admits from the token budget and `max_num_seqs`, and check it with the Stepper;
# - check the Triton attention kernel against its torch reference on the engine's own KV cache;
# - serve the engine over HTTP and tell the client's TTFT from the engine's.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels

import plotly.graph_objects as go

from minillm import LLM, SamplingParams
from minillm.analysis import workloads
from minillm.viz import Stepper, printouts

# %% [markdown]
# ## 1. Generate text
#
# `LLM` is the front door, shaped like vLLM's so what you learn here transfers: build it, call
# `generate` with prompts and `SamplingParams`. With no model named it loads the small Shakespeare
# model in `minillm/checkpoints/shakespeare` (a few million parameters, trained for this series).

# %%
llm = LLM(device=DEVICE, dtype="auto", attention_backend="auto")   # the shipped model; Triton on a GPU
params = SamplingParams(max_tokens=48, temperature=0.8, top_k=40, seed=0)
prompts = ["ROMEO:\n", "JULIET:\nO "]
if llm.tokenizer is None:      # only while the shipped checkpoint is missing: the random stand-in has no tokenizer
    prompts = [[10, 11, 12], [20, 21]]
printouts.outputs(llm.generate(prompts, params))     # each: prompt -> text; its tokens, TTFT and TPOT

# %% [markdown]
# Both prompts ran **together**: `generate` adds each prompt as a request and calls `engine.step()` until
# every request is done. Each step is one *scheduler iteration*: the scheduler picks the requests that
# run and how many tokens each processes, the model runs that batch once, and the engine appends the
# sampled tokens. The two numbers printed are the latency metrics every serving system reports: **TTFT**,
# the time to the first token, and **TPOT**, the time per output token after it.

# %% [markdown]
# ## 2. One step, as data
#
# The engine does one thing per `step()`, always in one direction: the **scheduler decides** (who runs,
# how many tokens, which KV blocks), the **runner executes** (tensors in, one forward pass, tokens out),
# the **engine applies** the results (append tokens, finish requests, free their KV) and emits a
# `StepRecord`. Everything you will see in this series (widgets, plots, metrics) is drawn from these
# records only.
#
# There is no separate "prefill phase" and "decode phase" in the data. Each request knows how many of
# its tokens already have KV in the cache (`num_computed_tokens`); a step grants it some new tokens
# under the **execution-token budget** (`max_num_batched_tokens`). A *decode* is the case of one new
# token; a *prefill* the case of many; a prompt too long for what is left of the budget gets a capped
# many (*chunked prefill*). Below: four requests, a budget of 16 tokens, at most 3 requests at once, a
# KV cache of 16 blocks of 4 positions.

# %% [markdown]
# **Predict, then run.** Four requests with prompts of 6, 9, 4 and 5 tokens, a budget of 16 tokens per step, at most 3 requests at once. Which requests run in step 0, with how many tokens each, and who waits?

# %%
small = LLM(device=DEVICE, dtype="auto", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=3)
eng = small.engine
for rid, prompt_len in (("A", 6), ("B", 9), ("C", 4), ("D", 5)):
    eng.add_request(list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=4, ignore_eos=True),
                    request_id=rid)
rec = eng.step()
print(rec.summary())


# %% [markdown]
# <details><summary>Answer</summary>
#
# A and B prefill whole (6 + 9 = 15 tokens), C gets the one token of budget left (its prompt is split), and D waits: three requests already run. The waiting reason in the printout says so.
#
# </details>

# %% [markdown]
# The same record, field by field. `batch` has one entry per request in the step; `waiting` says, in
# words, why each waiting request is not in it; `kv` is the KV cache after the step.
# (`printouts.step_record`, in `minillm/viz/printouts.py`, prints those fields; read it to see them named.)

# %%
printouts.step_record(rec)
print("\nevery field:", ", ".join(rec.to_dict()))

# %% [markdown]
# A and B prefilled whole (6 + 9 = 15 tokens), leaving 1 token of the budget: C's 4-token prompt was
# **split**, and its first token went into this step. D waits because 3 requests are already running.
# One more step: A, B decode one token each, C continues its prompt.

# %% [markdown]
# **Predict, then run.** The next step. What does each of A, B and C process, and does D run now?

# %%
printouts.step_record(eng.step())

# %% [markdown]
# <details><summary>Answer</summary>
#
# A and B decode one token each; C continues its prompt (the 3 tokens left of it); D still waits for a slot, since A, B and C all still run.
#
# </details>

# %% [markdown]
# ## 3. Step it yourself
#
# The `Stepper` widget drives the same engine one iteration per click. **Step** runs exactly one
# `engine.step()`; **Run N** runs N; **Play** keeps stepping; **Reset** rebuilds the engine and replays
# the same requests; the slider looks back at earlier steps. It shows the waiting queue and the running
# set, the step's batch against the token budget, the KV memory map (one cell per block, coloured by the
# request that owns it) and, in words, what the scheduler decided.
#
# Here a small trace: 8 requests arriving at random (a Poisson process, about one every 10 ms) with
# prompts of 4 to 14 tokens and 3 to 10 output tokens. The engine runs the real model with `attention_backend="triton"`: every
# Step executes the Triton attention kernel (through the interpreter on a CPU: about half a second a step on a quiet machine).
# Time is *modeled*: each step counts 10 ms (a round figure of the order of one decode step of a 7B model on
# one data-centre GPU), so the arrival pattern is the same on every machine.

# %%
trace = workloads.synthetic_trace(8, rate=100.0, prompt_len=workloads.Uniform(4, 14),
                                  output_len=workloads.Uniform(3, 10), vocab_size=400, seed=2)

def tour_engine():
    return LLM(device=DEVICE, dtype="auto", attention_backend="triton",    # the Triton kernel, every step
               block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4,
               clock="modeled", cost_model=0.010)                        # 10 ms per step

stepper = Stepper(tour_engine, requests=trace)
stepper

# %% [markdown]
# Clicking **Step** is calling `stepper.step()`; a cell can click for you. Watch the *Not arrived yet*
# list drain into the waiting queue, requests join the running set as soon as there is a slot and
# budget (no one waits for the batch to finish: *continuous batching*), and each one's KV grow a
# block at a time.

# %%
for _ in range(3):
    rec = stepper.step()
    print(rec.summary())

# %% [markdown]
# ## 4. The kernel, checked on the engine's own cache
#
# The attention in every step above ran in `kernels/attention.py`: a Triton kernel that reads each
# request's keys and values through its **block table** (which blocks of the shared cache hold its
# positions, in order). Beside it sits a plain-torch reference of the same computation.
# `check_paged_attention` (in `minillm/kernel_check.py`) runs both on the KV cache the widget's engine
# has filled: it takes the requests running after the last step, builds their block tables and KV
# lengths from the step record, draws one random query per request (the shape of a decode step), and
# compares the two outputs element by element. They must agree to rounding (1e-4 in float32); a larger
# difference raises an error. The later notebooks end their live sections with the same one-line check.

# %%
print(check_paged_attention(stepper.engine))   # the Triton kernel against its torch reference

# %% [markdown]
# ## 5. Serve it: an OpenAI-compatible server, a real client
#
# So far every request was a Python call. A deployed engine sits behind an HTTP API; the de facto standard
# is OpenAI's (`/v1/completions`, `/v1/chat/completions`, tokens streamed as server-sent events), which
# vLLM, SGLang and TGI all speak. `python -m minillm.serve` (or `make serve`) starts minillm's: a FastAPI
# app on uvicorn in front of `AsyncLLM`, which runs the engine's step loop in one background task and hands
# each request its tokens as the steps produce them (a client that disconnects is aborted in the engine).
#
# Here `BackgroundServer` starts the same server in a thread of this notebook, on a free localhost port,
# with its own engine (the shipped model again, 64 KV blocks so its KV map stays readable). The official
# `openai` Python client talks to it exactly as it would to any other OpenAI-compatible server:

# %%
import openai
from minillm.serve import BackgroundServer

server = BackgroundServer(device=DEVICE, block_size=16, num_kv_blocks=64, max_num_seqs=8, max_model_len=256).start()
client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
print(f"{server.url}: /v1/models lists {[m.id for m in client.models.list().data]}")
prompt = "ROMEO:\n" if server.llm.engine.tokenizer is not None else [10, 11, 12]   # token ids without the checkpoint
stream = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=24, temperature=0.0, stream=True)
pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
print(f"{len(pieces)} streamed chunks: {''.join(pieces)!r}")

# %% [markdown]
# Now a burst: 16 requests sent over 0.3 s by an asynchronous `openai` client (the load generator of
# `python -m minillm.bench serve`, run in a background thread), while the view below follows the server's
# engine. It is the Stepper of section 3 without its buttons: the server's loop does the stepping, and
# `EngineMonitor.follow` draws each new step as it happens (the history slider looks back afterwards).
# With `max_num_seqs=8` at most eight run at once; a request that arrives while eight are running waits
# in the engine's queue until one finishes.

# %%
from minillm.bench import serve as load_generator
from minillm.viz import EngineMonitor

monitor = EngineMonitor(server.llm.engine, read=server.engine_call, title="the server's engine, as the burst arrives")
monitor

# %%
openings = ["ROMEO:\n", "JULIET:\nO ", "KING HENRY:\n", "First Citizen:\n"]
if server.llm.engine.tokenizer is None:
    openings = [[10 + i, 11 + i, 12 + i] for i in range(4)]
burst = [load_generator.ReplayRequest(f"burst-{i}", 0.0, openings[i % 4], 32) for i in range(16)]
replay = load_generator.replay_in_background(server.url, burst, [0.02 * i for i in range(16)], show_progress=False)
monitor.follow(until=replay.done)                  # redraw the view until every client has its answer
client_side = replay.result()
engine_side = load_generator.engine_metrics(server, client_side)    # the same requests, as the engine timed them
print(f"{sum(c.error is None for c in client_side)} of {len(burst)} answered; the engine ran "
      f"{len(monitor.records)} steps since it started")

# %% [markdown]
# Each request has two TTFTs. The client's runs from sending the HTTP request to receiving the first
# streamed token; the engine's runs from `add_request` to the step that sampled that token (it includes
# the wait in the engine's queue). The client's interval contains the engine's, so the difference is
# everything outside the engine: HTTP, the server's event loop, handing the request to the step loop,
# and the streamed token's way back.

# %% [markdown]
# **Predict, then run.** For each request, which is larger: the TTFT the client measured, or the one the engine measured? Can the engine's ever be larger?

# %%
c = load_generator.compare(client_side, engine_side)
printouts.client_vs_engine_ttft(c)
pairs = sorted((m.ttft, engine_side[load_generator.engine_request_id(m.response_id)].ttft) for m in client_side
               if m.error is None)
fig = go.Figure([go.Bar(name="client (HTTP)", y=[a for a, _ in pairs]), go.Bar(name="engine", y=[b for _, b in pairs])])
fig.update_layout(barmode="group", height=300, plot_bgcolor="white", xaxis_title="request", yaxis_title="seconds",
                  title="TTFT per request (sorted): as the client saw it, as the engine did")
fig

# %% [markdown]
# <details><summary>Answer</summary>
#
# The client's, always: its interval (HTTP request sent to first streamed token received) contains the engine's (`add_request` to the step that sampled the token). The difference is everything outside the engine.
#
# </details>

# %% [markdown]
# Where the time goes depends on the load. A request that waited for one of the eight slots inside the
# engine (the view above shows the queue step by step) has that wait in both of its TTFTs. The part
# outside the engine is the printed difference, per request. Here the client, the server, the engine and
# this view share one Python process (and its interpreter lock) on one machine, so they slow each other
# down; against a server elsewhere the network adds its round trip instead. This is why load generators
# (vLLM's `vllm bench serve`, `python -m minillm.bench serve` here) measure at the client: that is
# the latency a user gets. The server is shut down at the end of the section, so nothing keeps running
# after the notebook.

# %%
server.stop()
print(f"server running: {server.running}")

# %% [markdown]
# ## 6. The series
#
# | notebook | what it covers |
# |---|---|
# | [00 · A tour](00_tour.ipynb) | generate text, one engine step as data, the step-through widget, the Triton kernel checked on the engine's cache, an OpenAI-compatible server and a client |
# | [01 · Batching math](01_batching_math.ipynb) | why decode is memory bound, the roofline, KV memory and the maximum batch, static vs continuous batching, the execution-token budget |
# | [02 · Reservation vs paging](02_reservation_vs_paging.ipynb) | why max-length reservations make requests wait (Figure 4), paged KV blocks, waste, the block size |
# | [03 · Scheduling policies](03_scheduling_policies.ipynb) | FCFS, shortest-first, priority classes, MLFQ, fair queuing; head-of-line blocking and starvation |
# | [03b · The scheduler under load](03b_scheduling_under_load.ipynb) | prefill vs decode and chunked prefill, scheduling every N steps, goodput and load shedding, the simulator calibrated on your machine |
# | [04 · Prefix caching](04_prefix_caching.ipynb) | block hashes, reference counts, shared system prompts and multi-turn conversations |
# | [05 · Preemption](05_preemption.ipynb) | swap vs recompute and the cost rule that picks one; thrashing |
# | [06 · Speculative decoding](06_speculative_decoding.ipynb) | a draft proposes, the target verifies in one pass; acceptance rate and when it stops paying |
# | [07 · Beyond one GPU](07_beyond_one_gpu.ipynb) | tensor parallelism on two CPU ranks and where it stops paying, disaggregated prefill/decode vs chunked colocation under SLOs, routing across replicas |
#
# Each notebook runs the real engine and ends with exercises that plug into it.

# %% [markdown]
# ## 7. The words the series uses
#
# **Prefill and decode.** A request's prompt is read in one forward pass (or a few *chunks*) that
# computes all its positions at once and yields the first output token: the *prefill*, many tokens per
# request in a step, limited by arithmetic. Every later token needs a forward pass of its own, with one
# new position: *decode*, one token per request per step, limited by reading the weights from memory
# (notebook 01). In minillm both are the same thing, a number of new tokens granted to a request in a step.
#
# **KV cache.** Attention at a position reads the keys and values (K and V) of every earlier position, in
# every layer. Rather than recompute them each step, an engine keeps them: the KV cache, 2 x layers x KV
# heads x head size numbers per position. Its size limits how many requests run at once (notebook 01),
# and paging (02), prefix caching (04) and preemption (05) are ways of managing it.
#
# **TTFT and TPOT.** Time to first token (from arrival to the first output token: queueing plus prefill)
# and time per output token (the mean gap between later tokens: the decode pace a reader sees).
#
# **SLO.** A *service-level objective*: a latency target each request should meet, e.g. TTFT at most 2 s
# and TPOT at most 100 ms. Requests served within their SLOs per second is *goodput* (notebook 03b also
# gives DistServe's definition: the highest arrival rate at which, say, 90% of requests meet them).
#
# **Percentiles: p50, p99.** The p-th percentile of a set of latencies is the value that p% of them are
# at or below. p50 is the median; p99 is the value only 1 request in 100 exceeds: the *tail*, what the
# unluckiest users see.
#
# **CDF.** A cumulative distribution plot: for each latency on the x axis, the fraction of requests
# served within it (0 to 1 on the y axis). The p50 is where the curve crosses 0.5 and the p99 where it
# crosses 0.99; a curve further left is faster.
#
# **Poisson arrivals.** Requests arriving independently at a constant average rate of λ per second: the
# gaps between arrivals are random (exponential, mean 1/λ), so arrivals come in bursts and lulls, as
# independent users' requests do. The traces of the series are generated this way.
#
# **Log-normal lengths.** A length whose logarithm is normally distributed: most values near the median
# and a long tail of a few very large ones, the shape of real prompt and answer lengths.
# `workloads.LogNormal(100, 1.0)` has median 100 and a standard deviation of 1 for the natural log.
#
# **Teacher forcing.** Scoring a model on a known text: at every position it is given the true preceding
# tokens (not its own earlier predictions), and its probability for the true next token is recorded.
#
# **Nats per character.** −ln(probability of the true next token) under teacher forcing, summed over
# the text's tokens and divided by its characters (so models with different tokenizers compare); lower
# is better. A nat is a unit of information with the natural log: ln 2 ≈ 0.69 nats is one bit.
#
# **e4m3.** An 8-bit floating-point (FP8) format: 1 sign bit, 4 exponent bits, 3 mantissa bits; the
# largest value is 448 (Micikevicius et al., "FP8 Formats for Deep Learning", 2022). Notebook 02 stores
# the KV cache in it.
#
# **gloo.** PyTorch's library for collective communication (all-reduce, broadcast) between processes on
# CPUs; NCCL is its GPU counterpart. Notebook 07's tensor-parallel run uses gloo between two CPU processes.
#
# **GiB and GB.** 1 GiB = 2³⁰ bytes, 1 GB = 10⁹ bytes (1 GiB ≈ 1.07 GB). Memory sizes are written in
# GiB where the series sets them (a KV cache of 8 GiB) and in GB where they are quoted as vendors state
# them (an 80 GB GPU, 13.5 GB of weights); bandwidths are in GB/s.

# %% [markdown]
# ## Exercises
#
# How the exercises work, for the whole series: each notebook `NN` has a module `exercises/exNN_*.py` of
# functions and classes to fill in (notebook 03b's is `ex03b_under_load.py`; a notebook's second module
# takes a letter, `ex02b_kv_quant.py`). Their stubs raise `NotImplementedError` naming the task; their
# docstrings say what to compute and where the idea comes from (the paper that introduced it, where there
# is one). A notebook's last cells
# call *your* implementation (`impl.load("ex01_batching")`), and `make grade EX=NN` runs the graders:
#
# ```bash
# make grade EX=01        # from the repository root: notebook 01's graders, against exercises/
# ```
#
# The reference answers are in `solutions/`; `MINILLM_IMPL=solutions` makes the notebooks use them. Try
# before you look: once a grade fails an exercise you attempted, its cell offers the worked answer,
# folded (the reference code and why it works), and `impl.grade("01")` grades from a cell.
#
# Warm-up, no grader (answer by predicting, then check with the widget above):
#
# 1. Before clicking **Step** in section 3, predict from the trace which requests the first step admits.
#    Change `max_num_batched_tokens=16` to `8` in `tour_engine` and predict again: which prompt is split?
# 2. In section 2, D waits because `max_num_seqs=3`. Rebuild `small` with `max_num_seqs=4`: does D run in
#    step 0? (Check the budget first: 6 + 9 + 4 + 5 tokens against 16.)

# %% [markdown]
# ## Summary
#
# 1. `LLM.generate` adds each prompt as a request and calls `engine.step()` until all are done; the requests run together.
# 2. Each step the scheduler decides, the runner executes and the engine applies the results, emitting a `StepRecord`.
# 3. There are no phases in the data: a step grants each request some new tokens under one execution-token budget (one for a decode, many for a prefill, a capped many for a chunk).
# 4. The attention kernel reads KV through each request's block table, and is checked against a torch reference on the engine's own cache.
# 5. Behind an OpenAI-compatible server, the client's TTFT contains the engine's, plus everything outside it.

# %% [markdown]
# ## Check your understanding
#
# 1. Why can two prompts of different lengths run in the same step, and what limits how many do?
# 2. What does `num_computed_tokens` count, and what is a decode in terms of it?
# 3. In section 2, would a budget of 32 tokens have let D run in step 0?
# 4. Why do load generators measure latency at the client rather than read it from the engine?
#
# <details><summary>Answers</summary>
#
# 1. Each step grants every request its own number of new tokens (its prompt, or one for a decode); the execution-token budget (`max_num_batched_tokens`), the slots (`max_num_seqs`) and free KV blocks limit them.
# 2. The positions of a request that already have KV in the cache; a decode is a step that grants it one new token.
# 3. No: the budget would fit all four prompts (24 tokens), but `max_num_seqs=3` leaves D without a slot.
# 4. The user experiences the client's latency: HTTP, the server's event loop and the network add to the engine's time, and only the client sees all of it.
#
# </details>
