#!/usr/bin/env python3
"""Build notebooks 00-02 from the cell sources below (committed without outputs).

    python scripts/build_notebooks.py            # write notebooks/00_tour.ipynb ... 02_...
    python scripts/build_notebooks.py --check    # exit 1 if a notebook differs from this script

The notebooks import, configure, run, visualise and explain; every piece of engine logic
lives in ``minillm/``. Each section names the passage of the seeds (``shared/seeds``) it
teaches. Cells are plain strings here so a diff of this file is a diff of the notebooks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def md(text: str):
    return ("md", text.strip("\n"))


def code(text: str):
    return ("code", text.strip("\n"))


# =====================================================================================
# Shared cells
# =====================================================================================

SETUP = code('''
import kernels
kernels.use_interpreter_if_no_cuda()   # no GPU: Triton kernels run in Triton's interpreter (say so before any model loads)

import numpy as np
import plotly.graph_objects as go
import torch

from minillm import LLM, SamplingParams, figures, impl, metrics, workloads
from minillm.widgets import LockstepStepper, Stepper

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
print(f"device: {DEVICE}; Triton kernels {'compiled for the GPU' if GPU else 'run by Triton interpreter on the CPU'}")
''')


def kernel_check(stepper: str) -> tuple:
    """The cell that holds the Triton kernel against its torch reference on an engine's own KV cache."""
    return code(f'''
eng = {stepper}.engine                         # the engine the cells above have been stepping
rec = eng.step_records[-1]
rids = rec.running                             # requests holding KV right now
k_cache, v_cache = eng.executor.caches_for_attention()[0]    # layer 0's cache, as the kernel sees it
dev = k_cache.device
tables = [eng.kv.block_table(r) for r in rids]                # where each request's positions live
width = max(len(t) for t in tables)
block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
context_lens = torch.tensor([rec.kv.per_request[r].used for r in rids], dtype=torch.int32, device=dev)
cu_seqlens_q = torch.arange(len(rids) + 1, dtype=torch.int32, device=dev)   # one query each, like a decode
heads, head_dim = eng.hf_config.num_attention_heads, k_cache.shape[-1]
q = torch.randn(len(rids), heads, head_dim, dtype=k_cache.dtype, device=dev,
                generator=torch.Generator(device=dev).manual_seed(0))
args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, head_dim ** -0.5)
out_triton = kernels.paged_attention(*args, backend="triton")
out_torch = kernels.paged_attention(*args, backend="torch")
err = (out_triton.float() - out_torch.float()).abs().max().item()
print(f"requests {{rids}}, KV lengths {{context_lens.tolist()}}: max |triton - torch| = {{err:.1e}}")
assert err < (1e-4 if k_cache.dtype == torch.float32 else 3e-2), err
''')


SERIES = [
    ("00_tour.ipynb", "A tour", "generate text, one engine step as data, the step-through widget"),
    ("01_batching_math.ipynb", "Batching math",
     "why decode is memory bound, the roofline, KV memory and the maximum batch, static vs continuous "
     "batching, the execution-token budget"),
    ("02_reservation_vs_paging.ipynb", "Reservation vs paging",
     "why max-length reservations make requests wait (Figure 4), paged KV blocks, waste, the block size"),
    ("03_scheduling_policies.ipynb", "Scheduling policies",
     "FCFS, shortest-first, priority classes, MLFQ, fair queuing; head-of-line blocking and starvation"),
    ("04_prefix_caching.ipynb", "Prefix caching",
     "block hashes, reference counts, shared system prompts and multi-turn conversations"),
    ("05_preemption.ipynb", "Preemption", "swap vs recompute and the cost rule that picks one; thrashing"),
    ("06_speculative_decoding.ipynb", "Speculative decoding",
     "a draft proposes, the target verifies in one pass; acceptance rate and when it stops paying"),
]


def grading(num: str, module: str, example: str) -> tuple:
    return md(f'''
### Grading

Your code goes in `exercises/{module}.py` (its stubs raise `NotImplementedError` until you fill them in;
the docstrings say exactly what each must do). The cells above run *your* version: `impl.load` reads
the environment variable `MINILLM_IMPL` (unset: `exercises`, yours; `solutions`: the reference answers).
From the repository root:

```bash
make grade EX={num}                                            # every ex{num} grader, against exercises/
MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex{num} tests/test_exercises.py -k {example}   # one exercise
```

A failing grader says what it expected and where the expectation came from (the seeds' worked numbers,
the engine's cost model, or what the real scheduler did on the same requests).
''')


# =====================================================================================
# 00: the tour
# =====================================================================================

def nb00() -> list:
    series = "\n".join(f"| [{name[:2]} · {title}]({name}) | {what} |" for name, title, what in SERIES)
    return [
        md('''
# 00 · A tour of minillm

minillm is a small LLM serving engine built to be read and stepped through. Its subject is the
seeds' **batching and scheduling**: "Scheduling decides which requests run, when, and together with
which others. Batching is the mechanism that makes memory-bound decode efficient." Everything in this
series is the real engine running: a Llama-style model, a paged KV cache, a scheduler that re-forms
the batch every step, and attention computed by a Triton kernel.

In this tour:

1. generate text with the model that ships in the repository;
2. look at one engine step as plain data (a `StepRecord`);
3. step the engine yourself with a widget;
4. check the Triton attention kernel against its torch reference, on the engine's own KV cache;
5. the map of the series.

You need basic PyTorch. Everything runs offline. On a laptop CPU the Triton kernels run in Triton's
*interpreter* (slow, but exactly the same kernel); on a GPU they are compiled.
'''),
        SETUP,
        md('''
## 1. Generate text

`LLM` is the front door, shaped like vLLM's so what you learn here transfers: build it, call
`generate` with prompts and `SamplingParams`. With no model named it loads the small Shakespeare
model in `minillm/checkpoints/shakespeare` (a few million parameters, trained for this series).
'''),
        code('''
llm = LLM(device=DEVICE, dtype="auto", attention_backend="auto")   # the shipped model; Triton on a GPU
params = SamplingParams(max_tokens=48, temperature=0.8, top_k=40, seed=0)
prompts = ["ROMEO:\\n", "JULIET:\\nO "]
if llm.tokenizer is None:      # only while the shipped checkpoint is missing: the random stand-in has no tokenizer
    prompts = [[10, 11, 12], [20, 21]]
for out in llm.generate(prompts, params):
    m = out.metrics
    print(f"{out.prompt or out.prompt_token_ids!r} -> {out.text if out.text is not None else out.token_ids!r}")
    print(f"    {len(out.token_ids)} tokens ({out.finish_reason}), first after {m.ttft * 1e3:.1f} ms, "
          f"then {m.tpot * 1e3:.1f} ms per token\\n")
'''),
        md('''
Both prompts ran **together**: `generate` adds each prompt as a request and calls `engine.step()`
until every request is done. Each step is one *scheduler iteration*: the scheduler picks the requests
that run and how many tokens each processes, the model runs that batch once, and the engine appends
the sampled tokens. The two numbers printed are the seeds' latency metrics: **TTFT**, the time to the
first token, and **TPOT**, the time per output token after it.
'''),
        md('''
## 2. One step, as data

The engine does one thing per `step()`, always in one direction: the **scheduler decides** (who runs,
how many tokens, which KV blocks), the **runner executes** (tensors in, one forward pass, tokens out),
the **engine applies** the results (append tokens, finish requests, free their KV) and emits a
`StepRecord`. Everything you will see in this series (widgets, plots, metrics) is drawn from these
records only.

There is no separate "prefill phase" and "decode phase" in the data. Each request knows how many of
its tokens already have KV in the cache (`num_computed_tokens`); a step grants it some new tokens
under the **execution-token budget** (`max_num_batched_tokens`). A *decode* is the case of one new
token; a *prefill* the case of many; a prompt too long for what is left of the budget gets a capped
many (*chunked prefill*). Below: four requests, a budget of 16 tokens, at most 3 requests at once, a
KV cache of 16 blocks of 4 positions.
'''),
        code('''
small = LLM(device=DEVICE, dtype="auto", block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=3)
eng = small.engine
for rid, prompt_len in (("A", 6), ("B", 9), ("C", 4), ("D", 5)):
    eng.add_request(list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=4, ignore_eos=True),
                    request_id=rid)
rec = eng.step()
print(rec.summary())
'''),
        md('''
The same record, field by field. `batch` has one entry per request in the step; `waiting` says, in
words, why each waiting request is not in it; `kv` is the KV cache after the step.
'''),
        code('''
def show(rec):
    print(f"step {rec.step}: {rec.num_batched_tokens} of {rec.token_budget} budget tokens, "
          f"took {rec.duration * 1e3:.1f} ms ({rec.clock} clock)")
    for e in rec.batch:
        print(f"  {e.request_id}: {e.phase:<7} +{e.num_tokens:>2} tokens   KV {e.num_computed_before:>2} -> "
              f"{e.context_len:>2} positions   {e.num_output_tokens} token(s) out")
    for w in rec.waiting:
        print(f"  {w.request_id} waits: {w.reason}")
    kv = rec.kv
    print(f"  KV: {kv.used} of {kv.total} positions hold KV, in {kv.blocks_used} of {kv.blocks_total} blocks "
          f"of {kv.block_size} ({kv.partial_waste} positions empty in partly filled last blocks)")

show(rec)
print("\\nevery field:", ", ".join(rec.to_dict()))
'''),
        md('''
A and B prefilled whole (6 + 9 = 15 tokens), leaving 1 token of the budget: C's 4-token prompt was
**split**, and its first token went into this step. D waits because 3 requests are already running.
One more step: A, B decode one token each, C continues its prompt.
'''),
        code('''
show(eng.step())
'''),
        md('''
## 3. Step it yourself

The `Stepper` widget drives the same engine one iteration per click. **Step** runs exactly one
`engine.step()`; **Run N** runs N; **Play** keeps stepping; **Reset** rebuilds the engine and replays
the same requests; the slider looks back at earlier steps. It shows the waiting queue and the running
set, the step's batch against the token budget, the KV memory map (one cell per block, coloured by the
request that owns it) and, in words, what the scheduler decided.

Here a small trace: 8 requests arriving at random (a Poisson process, about one every 10 ms) with
prompts of 4 to 14 tokens and 3 to 10 output tokens. The engine runs the real model with `attention_backend="triton"`: every
Step executes the Triton attention kernel (through the interpreter on a CPU, about a second a step).
Time is *modeled*: each step counts 10 ms, the seeds' assumption, so the arrival pattern is the same on
every machine.
'''),
        code('''
trace = workloads.synthetic_trace(8, rate=100.0, prompt_len=workloads.Uniform(4, 14),
                                  output_len=workloads.Uniform(3, 10), vocab_size=400, seed=2)

def tour_engine():
    return LLM(device=DEVICE, dtype="auto", attention_backend="triton",    # the Triton kernel, every step
               block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4,
               clock="modeled", cost_model=0.010)                        # 10 ms per step

stepper = Stepper(tour_engine, requests=trace)
stepper
'''),
        md('''
Clicking **Step** is calling `stepper.step()`; a cell can click for you. Watch the *Not arrived yet*
list drain into the waiting queue, requests join the running set as soon as there is a slot and
budget (no one waits for the batch to finish: *continuous batching*), and each one's KV grow a
block at a time.
'''),
        code('''
for _ in range(3):
    rec = stepper.step()
    print(rec.summary())
'''),
        md('''
## 4. The kernel, checked on the engine's own cache

The attention in every step above ran in `kernels/attention.py`: a Triton kernel that reads each
request's keys and values through its **block table** (which blocks of the shared cache hold its
positions, in order). Beside it sits a plain-torch reference of the same computation. Here both run on
the KV cache the widget's engine has filled, for the requests running now, and must agree.
'''),
        kernel_check("stepper"),
        md(f'''
## 5. The series

| notebook | what it covers |
|---|---|
{series}

Each notebook runs the real engine and ends with exercises that plug into it.
'''),
        md('''
## Exercises

How the exercises work, for the whole series: each notebook `NN` has a module `exercises/exNN_*.py` of
functions and classes to fill in. Their stubs raise `NotImplementedError` naming the task; their
docstrings say what to compute and which passage of the seeds it comes from. A notebook's last cells
call *your* implementation (`impl.load("ex01_batching")`), and `make grade EX=NN` runs the graders:

```bash
make grade EX=01        # from the repository root: notebook 01's graders, against exercises/
```

The reference answers are in `solutions/`; `MINILLM_IMPL=solutions` makes the notebooks use them.

Warm-up, no grader (answer by predicting, then check with the widget above):

1. Before clicking **Step** in section 3, predict from the trace which requests the first step admits.
   Change `max_num_batched_tokens=16` to `8` in `tour_engine` and predict again: which prompt is split?
2. In section 2, D waits because `max_num_seqs=3`. Rebuild `small` with `max_num_seqs=4`: does D run in
   step 0? (Check the budget first: 6 + 9 + 4 + 5 tokens against 16.)
'''),
    ]


# =====================================================================================
# 01: batching math
# =====================================================================================

def nb01() -> list:
    return [
        md('''
# 01 · The batching math

> Decode reads the full weight set to produce one token. That read costs the same whether one request
> or thirty-two are in flight.

That sentence from the seeds is the whole case for batching, and this notebook works it out in
numbers:

1. **bytes read per generated token** against the batch size, and the **roofline**: why decode is
   memory bound and batching amortises the weight read;
2. **throughput and step latency vs batch size**, measured on this machine with the real engine, next
   to the modeled H100 curve (the seeds: about 20x the throughput for about 1.5x the latency from
   batch 1 to 32);
3. the **KV-cache memory formula**, and what it does to the largest batch that fits;
4. **static vs continuous batching**, on the seeds' worked example and on a long-tail trace;
5. inside one step: the **execution-token budget** and the **KV retained** (the seeds' Figures 2 and 3),
   stepped with the widget;
6. exercises.
'''),
        SETUP,
        code('''
from dataclasses import replace

from minillm.costmodel import (HARDWARE, MODELS, ConstantStepTime, RooflineCostModel, bytes_per_generated_token,
                               decode_step_time_vs_batch, kv_cache_bytes, max_batch_size)

ex = impl.load("ex01_batching")   # your exercises/ex01_batching.py (MINILLM_IMPL=solutions: the answers);
                                  # re-run this cell after editing the file: impl.load reads it again
'''),
        md('''
## 1. Decode reads every weight to make one token

A decode step of one request multiplies a single vector (the newest token's hidden state) by every
weight matrix of the model: a `(1 x d) @ (d x n)` product per layer. Each weight is fetched from memory,
used for one multiply-add, and dropped. With `b` requests decoding together the same fetch serves `b`
rows: a `(b x d) @ (d x n)` product, so the weight bytes **per generated token** fall as `1 / b`. What
batching does *not* share is each request's own KV cache, which its attention must read every step.
The seeds' table, for Llama-2-7B (13.5 GB of bf16 weights) with 512 positions of context:
'''),
        code('''
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
'''),
        md('''
### The roofline

A step takes at least as long as its arithmetic at the GPU's peak rate, and at least as long as its
memory traffic at the GPU's bandwidth: `time = max(FLOPs / peak, bytes / bandwidth)`. The ratio
FLOPs / bytes of a computation (its *arithmetic intensity*) says which bound applies. A decode step
does about `2 x params x b` FLOPs for about `2 x params` bytes of bf16 weights: an intensity of about
`b` FLOP per byte. An H100 needs about 260 FLOP per byte (989 TFLOP/s over 3.35 TB/s, at the
efficiencies the cost model assumes) before compute becomes the limit. So a decode step of a small
batch is **memory bound**: the GPU waits on the weight read, and adding requests adds arithmetic that
is nearly free. A prefill of 512 tokens is far to the right: compute bound. ("Batching converts a
matrix-vector operation into a matrix-matrix one, moving decode up the roofline.") The points below
come from minillm's cost model, `RooflineCostModel`, which is the modeled clock the engine runs on.
'''),
        code('''
h100 = RooflineCostModel("H100-SXM", "llama-2-7b")
figures.roofline_figure(h100, batch_sizes=(1, 4, 16, 64, 256, 1024), context_len=512, prefill_lens=(512,))
'''),
        md('''
## 2. Throughput and latency vs batch size

**Measured here.** The engine runs the shipped model with `b` requests decoding together, for
`b = 1 ... 64`, and we take the median duration of the decode steps (wall clock; the prefill step is
left out). On a GPU this is the Triton kernel, compiled. On a CPU we time the engine's torch backend
instead: Triton's interpreter executes one kernel instance after another in Python, so its timings
measure the interpreter, not the hardware (the kernel itself is checked against torch in section 5).
'''),
        code('''
BACKEND = "triton" if GPU else "torch"
BATCHES = [1, 2, 4, 8, 16, 32, 64]
bench = LLM(device=DEVICE, dtype="auto", attention_backend=BACKEND, block_size=16, max_num_seqs=64,
            max_num_batched_tokens=4096, max_model_len=256, record="summary")   # no per-block KV map: totals are enough here

def decode_step_times(batch, steps=4, prompt_len=32):
    """Run `batch` requests together; the durations of the steps where all of them decode."""
    for _ in range(batch):
        bench.engine.add_request(list(range(10, 10 + prompt_len)),
                                 SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0))
    recs = bench.engine.run()
    return [r.duration for r in recs if len(r.batch) == batch and r.num_prefill_tokens == 0]

decode_step_times(4)                  # warm-up (on a GPU this compiles the kernels)
measured = np.array([np.median(decode_step_times(b)) for b in BATCHES])
for b, t in zip(BATCHES, measured):
    print(f"batch {b:>2}: {t * 1e3:7.2f} ms per step, {b / t:9.0f} tokens/s")
i32 = BATCHES.index(32)
print(f"\\nhere, batch 1 -> 32: throughput x{(32 / measured[i32]) / (1 / measured[0]):.1f}, "
      f"latency x{measured[i32] / measured[0]:.2f}")
'''),
        code('''
figures.throughput_latency_figure(BATCHES, latency=measured,
                                  title=f"measured on this machine ({DEVICE}, {BACKEND} attention, the shipped model)")
'''),
        md('''
**Modeled H100.** The same curve for Llama-2-7B on an H100, from the cost model
(`costmodel.decode_step_time_vs_batch`). The seeds: "when the batch size grows from 1 to 32,
throughput improves by approximately 20x, while per-step latency increases by only about 1.5x". Past
that the KV reads (which batching does not share) and, much later, the arithmetic take over.
'''),
        code('''
lat, thr = decode_step_time_vs_batch(h100, [1, 2, 4, 8, 16, 32, 64, 128], context_len=512)
print(f"modeled H100, batch 1 -> 32: throughput x{thr[5] / thr[0]:.1f}, latency x{lat[5] / lat[0]:.2f}")
figures.throughput_latency_figure([1, 2, 4, 8, 16, 32, 64, 128], latency=lat,
                                  title="modeled: Llama-2-7B on an H100 (RooflineCostModel), 512 positions of context")
'''),
        md('''
The machine you are on behaves like the model in shape, not in scale: the shipped model is tiny, so a
CPU step is dominated by fixed costs (Python, kernel launches) rather than by the weight read, and the
curve flattens for a different reason. The lesson carries over: as long as the step is bound by
something the batch shares, more requests are nearly free.

The price is latency: every request in a batch waits for the whole step. Real-time chat favours small
batches, offline jobs large ones; the scheduler must trade one for the other.
'''),
        md('''
## 3. The KV cache sets the largest batch

"The limit is memory: every concurrent request needs its own KV cache." Each position of each request
keeps a key and a value vector in every layer:

$$M_{KV} = 2 \\times n_{layer} \\times d_{head} \\times n_{head} \\times n_{max} \\times b \\times sizeof(dtype)$$

where, under grouped-query attention, $n_{head}$ counts the *KV* heads. The seeds' example:
Llama-2-70B's KV for one request is "approximately 10 GB" (that counts all 64 heads; the released model
shares 8 KV heads among them).
'''),
        code('''
mha70 = replace(MODELS["llama-2-70b"], name="llama-2-70b (64 KV heads)", num_kv_heads=64)
shipped = replace(bench.engine.model_spec, name="shipped model (this notebook)",
                  dtype_bytes=bench.engine.executor.kv_caches[0][0].element_size())
for spec in (mha70, MODELS["llama-2-70b"], MODELS["llama-2-7b"], MODELS["llama-3-8b"], shipped):
    print(f"{spec.name:<28} {spec.kv_bytes_per_token / 2**10:8.1f} KiB per position, "
          f"{kv_cache_bytes(spec, 4096) / 1e9:7.3f} GB for one request of 4096 positions")
'''),
        md('''
If every request is given room for its maximum length up front (the next notebook's *reservation*),
the largest batch is the memory left after the weights divided by one request's maximum KV. Llama-2-70B
in bf16 does not fit one 80 GB GPU at all; a 7B model does, with room for a few dozen long requests:
'''),
        code('''
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
'''),
        md('''
Compare with section 2: the batch where decode stops being nearly free is in the hundreds, but memory
caps it at a few dozen long requests. "Maximum batch size is set by cache capacity, which is why memory
management and scheduling are inseparable." The next notebook shows how paging recovers memory that
reservation wastes.
'''),
        md('''
## 4. Static vs continuous batching

**The seeds' worked exercise.** Ten requests arrive together: 8 generate 100 tokens, 2 generate 1000;
every step costs 10 ms whatever the batch. *Static batching* runs the group until its longest member
finishes and returns everyone together ("a long-distance bus that departs only after all passengers
have boarded and arrives at the destination where all passengers disembark together"). *Continuous
batching* re-forms the batch every step: a finished request leaves at once, and its slot goes to a
waiting one. minillm runs both with its simulated executor (the real scheduler and KV manager, no
model) on the modeled clock, `ConstantStepTime(0.010)`:
'''),
        code('''
def seeds_example(batching):
    llm = LLM(model="random", executor="simulated", clock="modeled", cost_model=ConstantStepTime(0.010),
              batching=batching, max_num_seqs=10, max_model_len=1100, record="summary")   # no per-block KV map: totals are enough here
    for i, n in enumerate([100] * 8 + [1000] * 2):
        llm.engine.add_request([10] * 8, SamplingParams(max_tokens=n, ignore_eos=True),
                               request_id=f"{'short' if n == 100 else 'long'}{i}", arrival_time=0.0)
    return llm.engine, llm.engine.run()

runs = {b: seeds_example(b) for b in ("static", "continuous")}
for batching, (eng, recs) in runs.items():
    done = {rid: r.metrics.finish_time for rid, r in eng.requests.items()}
    short = [t for rid, t in done.items() if rid.startswith("short")]
    print(f"{batching:>10}: short requests returned after {np.mean(short):5.2f} s on average, "
          f"long ones after {max(done.values()):5.2f} s ({len(recs)} steps)")
'''),
        md('''
The seeds' reference answer, reproduced: 10 s vs 1 s for the short requests. The timelines show where
static batching's time goes: short requests finish generating after 1 s and then sit, done but held,
until the long ones end (*tail padding*).
'''),
        code('''
eng, recs = runs["static"]
figures.gantt_figure(recs, eng.requests, title="static batching: finished short requests wait for the long ones")
'''),
        code('''
eng, recs = runs["continuous"]
figures.gantt_figure(recs, eng.requests, title="continuous batching: each request leaves when it is done")
'''),
        md('''
**A long-tail trace.** Real output lengths are uneven ("a few extremely long requests drag down overall
efficiency"). 120 requests arrive as a Poisson process at 30 per second, with log-normal prompt and
output lengths (median output 100 tokens, a tail up to 1000), served by a modeled H100 running
Llama-2-7B with at most 32 requests at once. Time now comes from the roofline cost model, so a larger
batch costs a little more per step, as it would.
'''),
        code('''
tail = workloads.synthetic_trace(120, rate=30.0, prompt_len=workloads.LogNormal(200, 0.8, hi=1500),
                                 output_len=workloads.LogNormal(100, 1.0, hi=1000), vocab_size=32000, seed=0)
served = {}
for batching in ("static", "continuous"):
    llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM",
              batching=batching, max_num_seqs=32, max_model_len=4096, record="summary")   # no per-block KV map: totals are enough here
    workloads.submit_trace(llm.engine, tail)
    recs = llm.engine.run()
    served[batching] = (llm.engine, recs, metrics.summarize(llm.engine.request_metrics(), recs, max_num_seqs=32))

for batching, (_, _, s) in served.items():
    print(f"{batching:>10}: {s['output_throughput']:7.0f} tokens/s, mean batch {s['batch_size_mean']:5.1f}, "
          f"TTFT p50 {s['ttft_p50']:6.2f} s, end-to-end p50 {s['e2e_p50']:6.2f} s / p99 {s['e2e_p99']:6.2f} s")
'''),
        code('''
figures.latency_cdf_figure({b: e.request_metrics() for b, (e, _, _) in served.items()},
                           metrics=("ttft", "e2e_latency"), unit="s",
                           title="long-tail trace: time to first token and end-to-end latency")
'''),
        md('''
Continuous batching keeps the batch full (compare the mean batch), so the same hardware produces
several times the tokens per second, and a request no longer waits for strangers' long answers
(the seeds cite vLLM's 2-4x throughput on ShareGPT). It is the baseline of every modern engine and of
the rest of this series: "Schedule per step, not per request."
'''),
        md('''
## 5. Inside one step: the token budget and the KV retained

Continuous batching asks the same questions before every step: which requests finished, which
continue, which waiting ones can join? The seeds' Figure 2 walks through it with at most two requests:
A finishes, B continues, C and D wait; after A is cleaned up, B's decode and C's prefill form the next
batch while D keeps waiting. Figure 3 then counts **two different resources**:

* **tokens processed in this execution**, under the *execution-token budget* of 8: B's decode is
  1 token, C's prefill 6, so **1 + 6 = 7** tokens fit. B's 6 earlier positions are not counted again
  (their K/V is cached), although its attention reads them;
* **KV retained after the execution**, in a capacity of 24 positions: B grows from 6 to 7 positions,
  C creates 6, so **7 + 6 = 13** positions.

Here is that scenario on the real engine: `max_num_batched_tokens=8` (the budget), a KV cache of 24
blocks of one position (`block_size=1`, so the map shows positions), `max_num_seqs=2`. A (2-token
prompt, 2 output tokens) and B (5-token prompt) run first; C (6 tokens) and D (3) wait. Each Step runs
the Triton kernel. What the tokens say does not matter here, only how many there are, so the model is
minillm's tiny random Llama (`model="random"`, two layers): on a CPU, where the kernel runs in Triton's
interpreter, that keeps a Step well under a second.
'''),
        code('''
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
'''),
        md('''
Step 0 prefills A and B (2 + 5 = 7 tokens). Step 1 decodes both; A reaches its stopping condition and
its KV is freed, while C and D wait (two requests already run). Step 2 is Figure 3: B's decode and C's
prefill. Three clicks, in code:
'''),
        code('''
for _ in range(3):
    rec = fig23.step()
    print(rec.summary())
print()
print("tokens processed: " + " + ".join(str(e.num_tokens) for e in rec.batch)
      + f" = {rec.num_batched_tokens} of the budget of {rec.token_budget}")
print("KV retained:      " + " + ".join(str(rec.kv.per_request[e.request_id].used) for e in rec.batch)
      + f" = {rec.kv.used} of {rec.kv.total} positions")
'''),
        md('''
Equal token counts do not mean equal step times: the budget counts *new* positions, but B's attention
also reads its cached ones. And the 13 positions fit in 24 only if the memory manager can actually
hand them out: the next notebook shows a manager (max-length reservation) that cannot.

The kernel, checked on this engine's cache after Figure 3's step:
'''),
        kernel_check("fig23"),
        md('''
## Exercises

Each exercise is a function in `exercises/ex01_batching.py`, graded against the engine. The cells call
your version; until you write it, they print a one-line reminder instead.

**Exercise 1, `kv_cache_bytes(model, num_tokens, batch)`**: the seeds' $M_{KV}$ formula. The grader
also checks it predicts the size of the KV tensors the engine really allocates.
'''),
        md('''
<details><summary>Hint 1</summary>

Count what one position of one request stores: in every one of the `num_layers` layers, a K vector and a V vector for each of the `num_kv_heads` KV heads, each `head_dim` elements of `dtype_bytes` bytes. Then scale by positions and requests.

</details>
<details><summary>Hint 2</summary>

Per position: `2 * num_layers * num_kv_heads * head_dim * dtype_bytes` bytes (Llama-2-7B: 2 × 32 × 32 × 128 × 2 = 524,288). Times `num_tokens`, times `batch`.

</details>
'''),
        code('''
with impl.attempt("ex01.kv_cache_bytes"):
    print(f"{ex.kv_cache_bytes(mha70, 4096) / 1e9:.2f} GB  (the seeds: approximately 10 GB)")
'''),
        md('''
**Exercise 2, `max_batch_size(hardware, model, max_len)`**: how many requests of `max_len` positions fit
beside the weights (section 3's plot).
'''),
        md('''
<details><summary>Hint 1</summary>

Usable bytes: `hbm_bytes * memory_fraction`. Take the weights out; what is left holds KV, at `kv_cache_bytes(model, 1)` bytes per position.

</details>
<details><summary>Hint 2</summary>

Whole positions first (`//`, and never below 0), then whole requests: `positions // max_len`. An H100 with Llama-2-7B: 72e9 − 13.48e9 bytes hold 111,624 positions, 54 requests of 2,048.

</details>
'''),
        code('''
with impl.attempt("ex01.max_batch_size"):
    print(ex.max_batch_size(HARDWARE["H100-SXM"], MODELS["llama-2-7b"], 2048), "requests; the cost model says",
          max_batch_size("H100-SXM", "llama-2-7b", 2048))
'''),
        md('''
**Exercise 3, `decode_step_time(model, hardware, batch, context_len)`**: one decode step on the roofline
(section 1). Your curve should reproduce the seeds' 20x / 1.5x.
'''),
        md('''
<details><summary>Hint 1</summary>

Work out the FLOPs and the bytes of the whole step, turn each into seconds at its achieved rate (`peak_flops * flops_efficiency`, `hbm_bandwidth * bandwidth_efficiency`), take the larger, add `step_overhead`.

</details>
<details><summary>Hint 2</summary>

FLOPs: `2 * num_params * batch` for the weights, plus `4 * num_layers * num_heads * head_dim * batch * context_len` for attention (QKᵀ and PV, 2 FLOPs per multiply-add each). Bytes: `weight_bytes` once, plus `kv_per_position * batch * context_len` read, plus `kv_per_position * batch` written.

</details>
'''),
        code('''
with impl.attempt("ex01.decode_step_time"):
    t = [ex.decode_step_time(MODELS["llama-2-7b"], HARDWARE["H100-SXM"], b, 512) for b in (1, 32)]
    print(f"batch 1 -> 32: throughput x{(32 / t[1]) / (1 / t[0]):.1f}, latency x{t[1] / t[0]:.2f}")
'''),
        md('''
**Exercise 4, `completion_times(output_lens, max_num_seqs, step_time, batching)`**: when each request is
returned under static and continuous batching (section 4). The grader runs the engine on random lists
and compares.
'''),
        md('''
<details><summary>Hint 1</summary>

Count in steps and multiply by `step_time` at the end. Static: consecutive groups of `max_num_seqs`; a group runs as many steps as its longest member, starting where the previous group ended.

</details>
<details><summary>Hint 2</summary>

Continuous: remember, for each of the `max_num_seqs` slots, the step from which it is free (all 0 at first). Each request, in order, takes the slot that frees earliest (a heap, `heapq`) and finishes `length` steps later; the slot is free again from then.

</details>
'''),
        code('''
with impl.attempt("ex01.completion_times"):
    for batching in ("static", "continuous"):
        t = ex.completion_times([100] * 8 + [1000] * 2, max_num_seqs=10, step_time=0.010, batching=batching)
        print(f"{batching:>10}: short requests {np.mean(t[:8]):.2f} s, long {np.mean(t[8:]):.2f} s")
'''),
        md('''
**Exercise 5, `plan_step(running, waiting, token_budget, free_kv_positions, max_num_seqs)`**: the batch
the scheduler forms for the next step (section 5): running requests first, then waiting ones in arrival
order while a slot, budget and KV room remain. The grader asks your function before every step of
random workloads and compares with what the real scheduler ran.
'''),
        md('''
<details><summary>Hint 1</summary>

Keep three counters as you go: the budget left, the free KV positions left, and the occupied slots (which start at `len(running)`: every running request holds one).

</details>
<details><summary>Hint 2</summary>

Running: `n = min(num_tokens - num_computed_tokens, budget left)`; if `n > 0`, plan it and take `n` off the budget *and* the free positions. Waiting: stop at the first request without a slot, without budget, or whose `n = min(num_tokens, budget left)` exceeds the free positions; otherwise plan it and take `n` off both counters and one slot.

</details>
'''),
        code('''
with impl.attempt("ex01.plan_step"):
    print(ex.plan_step([("B", 7, 6)], [("C", 6), ("D", 3)], token_budget=8, free_kv_positions=18, max_num_seqs=2))
'''),
        grading("01", "ex01_batching", "plan_step"),
    ]


# =====================================================================================
# 02: reservation vs paging
# =====================================================================================

def nb02() -> list:
    return [
        md('''
# 02 · Reservation vs paging

A request's KV cache grows by one position per generated token, and nobody knows in advance when the
output will end. The memory manager must decide *when* to give a request the memory it will need.

* **Max-length reservation**: at admission, set aside one contiguous region for the most positions the
  request may ever use (prompt + `max_tokens`). Simple: the region never needs to grow. Wasteful: "If
  B finishes before using all 20 positions, the remaining space will have gone unused. While generation
  is still in progress, there is also space that has not yet been filled."
* **Paging** (PagedAttention): cut the cache into fixed-size *blocks* and give a request a block only
  when its last one is full. A *block table* lists a request's blocks, which need not be contiguous;
  the attention kernel reads KV through it.

This notebook steps the seeds' Figure 4 live in both modes side by side, checks the kernel on both
caches, measures the waste and its cost on a realistic trace, and ends with the block-size trade-off.
'''),
        SETUP,
        code('''
from minillm.costmodel import ConstantStepTime

ex = impl.load("ex02_paging")     # your exercises/ex02_paging.py (MINILLM_IMPL=solutions: the answers);
                                  # re-run this cell after editing the file: impl.load reads it again
'''),
        md('''
## 1. Figure 4: an unused reservation makes C wait

The seeds' setting: a KV capacity of 24 positions, an execution-token budget of 8 tokens, at most two
requests. B has a 5-token prompt and `max_tokens=15`: under reservation it holds **20 positions** from
the start. After two steps B has KV for 6 positions; the other 14 are *reserved but unused*. Then C
arrives with a 6-token prompt.

Both engines below get exactly these requests: `kv_allocation="reserved"` on the left,
`kv_allocation="paged"` on the right (`block_size=1`, so each cell of the map is one position; hatched
cells are reserved but unused). The clock is modeled at 10 ms per step and C arrives at 15 ms, just
after B's second step. Every Step runs the Triton kernel in both engines (on the tiny random model,
`model="random"`: only the number of tokens matters here, and it keeps a Step quick on a CPU).
'''),
        code('''
def figure4_engine(kv_allocation):
    llm = LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton", kv_allocation=kv_allocation,
              block_size=1, num_kv_blocks=24, max_num_batched_tokens=8, max_num_seqs=2,
              clock="modeled", cost_model=0.010)
    greedy = dict(ignore_eos=True, temperature=0.0)
    llm.engine.add_request(list(range(100, 105)), SamplingParams(max_tokens=15, **greedy), request_id="B",
                           arrival_time=0.0)
    llm.engine.add_request(list(range(200, 206)), SamplingParams(max_tokens=4, **greedy), request_id="C",
                           arrival_time=0.015)
    return llm

fig4 = LockstepStepper(lambda: figure4_engine("reserved"), lambda: figure4_engine("paged"),
                       names=["reserved (max-length reservation)", "paged (blocks on demand)"],
                       title="Figure 4: B (5-token prompt, max_tokens=15), then C (6-token prompt)")
fig4
'''),
        md('''
Step twice (B's prefill, then one decode) and look at B's memory in each engine:
'''),
        code('''
fig4.step()
fig4.step()
for name, s in zip(fig4.names, fig4.steppers):
    kv = s.records[-1].kv
    b = kv.per_request["B"]
    print(f"{name:<36} B: {b.used} positions of KV, {b.reserved_unused} reserved but unused; "
          f"{kv.free} of {kv.total} positions free for anyone else")
'''),
        md('''
Under reservation only 24 − 20 = **4** positions are free. C's prefill needs 6 newly allocated positions
("there is insufficient space to hold the KV for its input context even before considering additional
room for its later generation"). Paging gave B only what it has filled, so 18 are free. One more step:
'''),
        code('''
fig4.step()
for name, s in zip(fig4.names, fig4.steppers):
    rec = s.records[-1]
    ran = ", ".join(f"{e.request_id} {e.phase} +{e.num_tokens}" for e in rec.batch)
    waits = "; ".join(f"{w.request_id} waits: {w.reason}" for w in rec.waiting) or "nobody waits"
    print(f"{name}\\n    ran: {ran} ({rec.num_batched_tokens}/{rec.token_budget} tokens); KV {rec.kv.used} of "
          f"{rec.kv.total} positions hold KV\\n    {waits}")
fig4.compare_figure()
'''),
        md('''
The paged engine runs Figure 3's batch: B's decode and C's prefill, 1 + 6 = 7 tokens, **13 positions**
of KV out of 24. The reserved engine could hold the same 13 positions, but when it decided, B held 6
positions of KV and 14 reserved but unused (the figure's hatched cells), and only 4 were free: "C is
waiting because unused space is tied up in B's reservation, not because the two requests' actual KV
exceeds total capacity." Keep stepping (the
**Step** or **Run N** buttons) to watch C wait until B finishes.

Both engines run the same attention kernel. A reservation is one contiguous run of positions, so to
the kernel it is a block table of blocks of one position; a paged request's table lists its blocks
wherever they are. The kernel against its torch reference, on each engine's cache:
'''),
        kernel_check("fig4.steppers[0]"),
        kernel_check("fig4.steppers[1]"),
        md('''
## 2. A realistic trace: what reservation costs

Now hundreds of requests. A modeled H100 serves Llama-2-7B with **8 GiB for KV** (16,384 positions: the
rest of its memory holds the weights and everything else), at most 256 requests at once. 150 requests
arrive as a Poisson process at 40 per second with log-normal prompt and output lengths. The simulated
executor runs the real scheduler and KV managers without the model; the clock is the roofline cost
model.

A word on fairness: the trace tells each request its exact output length as `max_tokens`, so this
reservation is the *best case*, sized exactly. A real engine does not know when the output will end
and must reserve for `max_tokens` or `max_model_len`: its waste is larger.
'''),
        code('''
KV_POSITIONS = 16384                      # 8 GiB / 512 KiB per position (Llama-2-7B, bf16)
trace = workloads.synthetic_trace(150, rate=40.0, prompt_len=workloads.LogNormal(200, 0.8, hi=1500),
                                  output_len=workloads.LogNormal(150, 1.0, hi=1500), vocab_size=32000, seed=0)

def serve(kv_allocation, block_size):
    llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM",
              kv_allocation=kv_allocation, block_size=block_size, num_kv_blocks=KV_POSITIONS // block_size,
              max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=4096, record="summary")   # no per-block KV map: totals are enough here
    workloads.submit_trace(llm.engine, trace)
    recs = llm.engine.run()
    return llm.engine, recs, metrics.summarize(llm.engine.request_metrics(), recs, max_num_seqs=256)

runs = {"reserved": serve("reserved", 1), "paged (blocks of 16)": serve("paged", 16)}
for name, (_, recs, s) in runs.items():
    print(f"{name:<22} {s['output_throughput']:6.0f} tokens/s, mean batch {s['batch_size_mean']:5.1f}, "
          f"queue wait p50 {s['queue_wait_p50']:5.2f} s / p99 {s['queue_wait_p99']:5.2f} s, "
          f"TTFT p99 {s['ttft_p99']:5.2f} s, preemptions {s['num_preemptions']}")
'''),
        md('''
Where the memory goes, step by step: the solid line is the fraction of the cache holding KV, the dashed
one adds what is reserved but unused.
'''),
        code('''
figures.kv_usage_figure({name: recs for name, (_, recs, _) in runs.items()},
                        title="KV cache: holds KV (solid), + reserved but unused (dashed)")
'''),
        md('''
Averaged over the steps where someone was waiting (the moments memory decides who runs), the cache
splits into: positions holding KV; **reserved but unused** (reservation); **fragmentation**, free
positions in gaps too small for the next reservation (reservation); **the empty tail of each request's
last block** (paging's only waste, `partial_waste`); and free.
'''),
        code('''
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
                  xaxis=dict(title="fraction of KV capacity", tickformat=".0%"), plot_bgcolor="white")
fig
'''),
        code('''
figures.latency_cdf_figure({name: eng.request_metrics() for name, (eng, _, _) in runs.items()},
                           metrics=("queue_wait", "ttft"), unit="s", title="how long requests wait to start")
'''),
        md('''
The reserved engine keeps a large share of its memory for tokens not generated yet, plus gaps between
regions that no new reservation fits; the paged one fills nearly all of it. (The seeds quote the
PagedAttention paper's measurement: memory utilisation from about 41% to nearly 100%.) It admits fewer requests at a time, so its batches are smaller,
its throughput lower and its queue longer. The paged engine wastes only the unfilled tail of each
request's last block. It pays differently: it admits requests without knowing whether their future
tokens will fit, and when the cache fills up it must **preempt** a running request (notebook 05).
'''),
        md('''
## 3. The block size

Paging's waste is at most `block_size − 1` positions per request, so small blocks waste less. Why not
blocks of one position? Every block is an entry in a block table that the scheduler maintains and the
kernel must look up, and a kernel works best on keys that sit together in memory: larger blocks mean
fewer lookups and longer contiguous reads. The same trace, with blocks of 1 to 256 positions:
'''),
        code('''
BLOCK_SIZES = [1, 16, 64, 256]
sweep = {bs: runs["paged (blocks of 16)"] if bs == 16 else serve("paged", bs) for bs in BLOCK_SIZES}
final_len = np.mean([r.prompt_len + r.output_len for r in trace])      # positions of a request when it ends
for bs, (_, recs, s) in sweep.items():
    tail = waste_breakdown(recs)["last-block tail"]
    print(f"block_size {bs:>3}: last-block tail {tail:6.1%} of the cache, {s['output_throughput']:6.0f} tokens/s, "
          f"preemptions {s['num_preemptions']:>3}, ~{final_len / bs:5.1f} block-table entries per finished request")
'''),
        md('''
vLLM's default of 16 sits where the tail is already negligible. On a GPU, the other side of the
trade-off can be measured: the paged attention kernel on the same decode batch with different block
sizes (on a CPU this cell says so and skips: the interpreter's timings mean nothing).
'''),
        code('''
if GPU:
    from triton.testing import do_bench
    from kernels.bench import Case
    for bs in (1, 4, 16, 64, 256):
        c = Case(batch=32, ctx=2048, q_len=1, heads=32, kv_heads=8, head_dim=128, block_size=bs,
                 dtype=torch.bfloat16, dev=torch.device("cuda"))
        ms = do_bench(lambda: kernels.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.cu_seqlens_q,
                                                      c.context_lens, c.scale, backend="triton"))
        print(f"block_size {bs:>3}: {ms * 1e3:7.1f} us per decode step (batch 32, 2048 positions)")
else:
    print("no GPU: kernel timings skipped (Triton's interpreter runs one kernel instance at a time)")
'''),
        md('''
## Exercises

The two allocators of this notebook, in `exercises/ex02_paging.py`. Both plug into the real engine:
`ex.paged_engine(...)` and `ex.reserved_engine(...)` build an `LLM` whose KV memory your code hands out,
and the graders run the same requests through minillm's managers and yours, step by step.

**Exercise 1, `blocks_needed(num_tokens, block_size)`**: blocks that hold `num_tokens` positions.
**Exercise 2, `partial_block_waste(context_lens, block_size)`**: the empty tails of last blocks (the
engine's `partial_waste`, section 3).
'''),
        md('''
<details><summary>Hint 1</summary>

`blocks_needed` is a division rounded *up*, in integers: `-(-n // b)` or `(n + b - 1) // b`.

</details>
<details><summary>Hint 2</summary>

`partial_block_waste`: a request of `n` positions holds `blocks_needed(n, b) * b` positions; its waste is what they hold beyond `n`. Sum over the requests.

</details>
'''),
        code('''
with impl.attempt("ex02.blocks_needed / partial_block_waste"):
    print(ex.blocks_needed(17, 16), ex.partial_block_waste([5, 16, 17], 16))
'''),
        md('''
**Exercise 3, `BlockAllocator`**: the free list of a paged cache with reference counts, `allocate()`
and `free(blocks)`. Below, Figure 4's paged engine with your allocator inside.
'''),
        md('''
<details><summary>Hint 1</summary>

`free_queue` is an `OrderedDict`: `popitem(last=False)` takes the front; `free_queue[block_id] = block` puts a block at the back.

</details>
<details><summary>Hint 2</summary>

`free`: `for block in reversed(blocks)`: refuse a block whose `ref_count` is already 0, take one off, and put the block at the back of the queue when it reaches 0.

</details>
'''),
        code('''
with impl.attempt("ex02.BlockAllocator"):
    llm = ex.paged_engine(model="random", executor="simulated", block_size=1, num_kv_blocks=24,
                          max_num_batched_tokens=8, max_num_seqs=2, clock="modeled", cost_model=0.010)
    llm.engine.add_request(list(range(100, 105)), SamplingParams(max_tokens=15, ignore_eos=True), request_id="B")
    llm.engine.add_request(list(range(200, 206)), SamplingParams(max_tokens=4, ignore_eos=True), request_id="C",
                           arrival_time=0.015)
    for rec in llm.engine.run(max_steps=3):
        print(rec.summary())
'''),
        md('''
**Exercise 4, `FirstFitAllocator`**: max-length reservation in one address space: `gaps()`,
`reserve(request_id, length)` (first fit) and `release(request_id)`. Figure 4 again, on your allocator:
C must wait.
'''),
        md('''
<details><summary>Hint 1</summary>

`gaps()`: walk the regions sorted by start with a cursor at 0. A region that starts past the cursor leaves a gap before it; the cursor then moves to the region's end. After the last region, the rest up to `capacity` is a gap too (if not empty).

</details>
<details><summary>Hint 2</summary>

`reserve()`: refuse a request that holds a region; take the *first* `(start, size)` of `gaps()` with `size >= length` (not the smallest, not the largest), record `(start, length)`, return `start`; `None` when there is none. `release()`: `dict.pop(request_id, None)`.

</details>
'''),
        code('''
with impl.attempt("ex02.FirstFitAllocator"):
    llm = ex.reserved_engine(model="random", executor="simulated", block_size=1, num_kv_blocks=24,
                             max_num_batched_tokens=8, max_num_seqs=2, clock="modeled", cost_model=0.010)
    llm.engine.add_request(list(range(100, 105)), SamplingParams(max_tokens=15, ignore_eos=True), request_id="B")
    llm.engine.add_request(list(range(200, 206)), SamplingParams(max_tokens=4, ignore_eos=True), request_id="C",
                           arrival_time=0.015)
    for rec in llm.engine.run(max_steps=3):
        print(rec.summary())
'''),
        grading("02", "ex02_paging", "first_fit"),
    ]


# =====================================================================================
# Writing
# =====================================================================================

BUILDERS = {"00_tour.ipynb": nb00, "01_batching_math.ipynb": nb01, "02_reservation_vs_paging.ipynb": nb02}


def build(cells: list) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, src) in enumerate(cells):
        cell = new_markdown_cell(src) if kind == "md" else new_code_cell(src)
        cell["id"] = f"c{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def write_notebooks(builders: dict, script: str, description: str, argv=None) -> int:
    """Build each notebook without outputs and write it (or, with --check, report drift)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="exit 1 if a notebook on disk differs")
    args = ap.parse_args(argv)
    stale = 0
    for name, builder in builders.items():
        text = nbformat.writes(build(builder())) + "\n"
        path = NOTEBOOKS / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                print(f"out of date: notebooks/{name} (run scripts/{script})")
                stale += 1
            continue
        NOTEBOOKS.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote notebooks/{name}")
    return 1 if stale else 0


def main(argv=None) -> int:
    return write_notebooks(BUILDERS, "build_notebooks.py", "Build notebooks 00-02 (without outputs).", argv)


if __name__ == "__main__":
    sys.exit(main())
