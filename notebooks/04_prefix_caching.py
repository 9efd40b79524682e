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
# # 04 · Prefix caching
#
# Many requests share the same prefix, a system prompt most of all. Without help, each request computes
# and stores the KV of that identical prefix again: redundant compute and wasted GPU memory. Prefix
# caching computes the KV of a shared prefix once and lets every later request reuse it, which cuts three
# things: prefill computation (GPU compute), KV memory (one copy instead of many), and the time to the
# first token (the shared part of the prefill is skipped).
#
# Paging makes it natural: requests that share a prefix simply point to the same physical blocks (the
# sharing PagedAttention was designed for, Kwon et al., SOSP 2023). This notebook builds it up from the pieces:
#
# 1. the block hash, a chain: how a request finds the blocks it can reuse;
# 2. reference counts and LRU eviction, stepped live on the real engine;
# 3. a shared system prompt at scale: hit rate, prefill saved, TTFT, memory;
# 4. multi-turn chat: each turn prefills only its new tokens;
# 5. what invalidates the cache: editing an early part of the prefix;
# 6. what it is worth: cache-hit pricing;
# 7. parallel sampling: n samples of one prompt share its blocks, copy-on-write;
# 8. exercises: the block hash, the longest-prefix match, eviction, and what an edit invalidates.
#
# minillm's prefix cache is *automatic* (vLLM's APC): nobody marks a prefix as shareable; every full
# block is hashed, and kept after its request finishes until its memory is needed.

# %% [markdown]
# **After this notebook you can:**
#
# - compute a prompt's chained block hashes and how many of its tokens a cache can reuse;
# - follow reference counts and LRU eviction on the real engine, and say which cached block is evicted first;
# - measure what a shared system prompt saves in prefill, memory and TTFT;
# - compute how much of a cached prompt an edit at a given position invalidates;
# - explain how parallel sampling shares a prompt's blocks and copies one on write.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels

import numpy as np
import plotly.graph_objects as go

from minillm import LLM, SamplingParams, impl
from minillm.viz import figures, printouts
from minillm.analysis import metrics, workloads
from minillm.viz import Stepper

# %%
from minillm.core.block_pool import hash_block
from minillm.analysis.workloads import LogNormal
from minillm.sim.replay import replay

ex = impl.load("ex04_prefix_cache")   # your exercises/ex04_prefix_cache.py (MINILLM_IMPL=solutions: the answers);
                                      # re-run this cell after editing the file: impl.load reads it again

def serve(trace, **config):
    """A modeled H100 serving Llama-2-7B with 8 GiB of KV cache, as in notebook 02: deliberately small, to create
    memory pressure (the simulated executor: the real scheduler and block pool, no forward pass). Returns the
    engine, its requests' metrics, the summary."""
    config.setdefault("num_kv_blocks", 1024)                 # blocks of 16: 16,384 positions, 8 GiB of Llama-2-7B KV
    return replay(trace, model="llama-2-7b", cost_model="H100-SXM", max_model_len=8192, max_num_seqs=64, **config)

def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)


# %% [markdown]
# ## 1. The block hash, a chain
#
# Each block's tokens are hashed into a key, which indexes the cached KV block; when a new request
# arrives, the keys of its prompt's blocks are computed and looked up. One subtlety: a block's KV
# depends on every token *before* it (attention saw them), so its key must stand for the whole prefix,
# not only its own tokens. minillm chains it: a block's key is the hash of (its parent block's key, its
# own tokens). Only full blocks get a key; the last, partly filled block is still being written.

# %%
prompt = [501, 502, 503, 504, 601, 602, 603, 604, 701, 702]      # blocks of 4: two full, one partial
parent = None
for i in range(len(prompt) // 4):
    key = hash_block(parent, prompt[4 * i:4 * i + 4])
    print(f"block {i}: tokens {prompt[4 * i:4 * i + 4]}, parent key {parent}, key {key}")
    parent = key
print(f"tokens {prompt[8:]}: a partial block, no key yet")
print("\nthe same four tokens after another prefix get another key:",
      hash_block(None, [601, 602, 603, 604]) != hash_block(hash_block(None, prompt[:4]), [601, 602, 603, 604]))

# %% [markdown]
# A new request computes the keys of its blocks in order and looks each one up; the first miss ends the
# match, since every later key is chained on the missing one. For example, with blocks of 16
# tokens, if the keys of the first 10 blocks match, the KV of those 160 tokens is reused and the prefill
# starts at the 11th block. The engine, blocks of 16: a first request with a 165-token shared prefix and its own
# question, then a second request with the same prefix and another question.

# %% [markdown]
# **Predict, then run.** Two requests share their first 165 tokens and differ after that; blocks of 16. From which token does the second request's prefill start?

# %%
shared = list(range(1000, 1165))                           # 165 tokens: 10 full blocks of 16, and 5 more
llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM", enable_prefix_caching=True,
          block_size=16, num_kv_blocks=64, max_model_len=512)
first = llm.engine.add_request(shared + list(range(2000, 2035)), SamplingParams(max_tokens=4, ignore_eos=True))
llm.engine.run()
second = llm.engine.add_request(shared + list(range(3000, 3025)), SamplingParams(max_tokens=4, ignore_eos=True))
rec = llm.engine.step()
e = rec.entry(second)
print(f"second request: {len(shared) + 25} prompt tokens; KV reused for {e.num_computed_before} "
      f"({e.num_computed_before // 16} blocks); prefilled {e.num_new_tokens}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# From token 160: the first 10 blocks (160 tokens) are full and shared, so their keys match. The 11th block holds 5 shared tokens and 11 different ones, so its key differs, and the match ends there.
#
# </details>

# %% [markdown]
# The 11th block holds tokens 160 to 175: 5 shared ones and 11 that differ, so its key differs, and the
# prefill starts at token 160: the 11th block onward.
#
# ## 2. Reference counts and LRU eviction, stepped
#
# vLLM's automatic prefix caching (APC) counts references per block: each physical block records how
# many requests use it. When a new request's block key matches a cached block, the block is reused and
# its count goes up; when a request finishes, the count goes down, and a block whose count reaches zero
# can be recycled.
#
# *Recycled*, in minillm, means: back on the free list **with its KV and its key intact**, so a later
# request with the same prefix can take it back. Only when a fresh block is needed and the free list
# hands out a block that still carries a prefix is that prefix *evicted*. The free list is in LRU order
# (least recently freed first), and a finishing request frees its blocks last block first, so a
# prefix's children are evicted before its parents.
#
# The widget: a KV cache of 12 blocks of 4 positions. A, B and C share an 8-token system prompt (two
# blocks) and ask different questions; later D arrives with a 36-token prompt that needs most of the
# cache, and after it E asks about the system prompt again. In the map a block shared by n requests is
# marked `xn`, and a free block that still holds a cached prefix is dotted grey (see the legend). Every
# Step runs the Triton attention kernel on the real (tiny, random) model.

# %%
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

# %% [markdown]
# Three steps (three clicks): A prefills its 11 tokens and its two full system-prompt blocks get keys;
# B arrives, finds both, and prefills only its own 2 tokens; then C the same. The cells below run the
# same requests on their own copy of the engine (`apc_run`), so the widget above stays where you left
# it, ready to step, however many cells have run. The blocks after three steps:

# %%
apc_run = apc_engine()                      # the cells' own copy: the widget above stays yours to step
for _ in range(3):
    rec = apc_run.engine.step()
    print(rec.summary())
print(f"after step {rec.step}:")
printouts.block_owners(rec)        # who holds each block, or that a free one still caches a prefix
st = apc_run.engine.kv.stats()
print(f"prefix cache: {st['hit_blocks']} block hits, {st['prefill_tokens_saved']} prefill tokens saved")
figures.kv_map_figure(rec, colors=apc.colors, width=560)

# %% [markdown]
# Blocks 0 and 1 have three owners (`x3` in the map): the KV of the system prompt exists once and
# serves three requests. Two more steps and A, B, C are done: every count drops to 0, and the blocks
# with keys stay cached (dotted grey in the map: "cached prefix, free").

# %%
for _ in range(2):
    rec = apc_run.engine.step()
print(rec.summary())
printouts.block_owners(rec)        # who holds each block, or that a free one still caches a prefix
print("eviction order, front of the free list first:", list(apc_run.engine.kv.pool.free_queue))

# %% [markdown]
# The system prompt's blocks (0 and 1) are at the *back* of the free list: they were freed last, when
# the last request holding them finished, child before parent. D now needs 9 blocks for its prompt, and
# more as it decodes; fresh blocks come from the front of the free list, evicting the cached prefixes
# there. Run until D is done, then one more step for E:

# %% [markdown]
# **Predict, then run.** D's growth takes the last free blocks. The system prompt's two cached blocks (0, its first, and 1) are at the back of the free list. Which one is evicted first, and how much of the system prompt does E reuse?

# %%
while "D" not in rec.finished:
    rec = apc_run.engine.step()
print(f"after D: {apc_run.engine.kv.stats()['evictions']} cached blocks evicted; "
      f"free list {list(apc_run.engine.kv.pool.free_queue)}")
rec = apc_run.engine.step()
print(rec.summary())
e = rec.entry("E")
print(f"E: {e.num_computed_before} of its {len(SYSTEM) + 2} prompt tokens reused, {e.num_new_tokens} prefilled")

# %% [markdown]
# <details><summary>Answer</summary>
#
# Block 1 (the child) goes first: it was freed before its parent. E finds block 0 still cached and recomputes from the second block on. Evicting a child before its parent keeps the surviving prefix usable.
#
# </details>

# %% [markdown]
# D's growth took the last free blocks, down to one of the system prompt's: the *second* (block 1), the
# child, went before its parent. E finds block 0 still cached and recomputes from the second block on.
# Had the parent gone first, the surviving child would be unreachable: a lookup walks from the first
# block and stops at the first miss. The kernel, checked on this engine's cache (E's block table starts
# with the reused block):

# %%
print(check_paged_attention(apc_run.engine))   # the Triton kernel against its torch reference

# %% [markdown]
# ## 3. A shared system prompt at scale
#
# 400 requests share a 1024-token system prompt, each with its own question (log-normal, around 128
# tokens) and answer (around 128), arriving at 12 per second, on a modeled H100 serving Llama-2-7B with
# 8 GiB of KV cache (16,384 positions, as in notebook 02: a deliberate restriction, well below the
# 58 GB or so an H100 has left after the weights, to create memory pressure). Without and with prefix caching:

# %%
def sys_prompt_trace(rate):
    return workloads.shared_prefix_trace(400, prefix_len=1024, suffix_len=LogNormal(128, 0.8, 4, 1024),
                                         output_len=LogNormal(128, 0.9, 4, 1024), vocab_size=32000, rate=rate, seed=0)

sys_trace = sys_prompt_trace(12)
apc_runs = {name: serve(sys_trace, enable_prefix_caching=caching)
            for name, caching in (("no prefix cache", False), ("prefix cache", True))}     # (engine, metrics, summary)
printouts.prefix_cache_summaries({name: (s["total_input_tokens"] - s["prefill_tokens_saved"], s)   # prompt tokens prefilled
                                  for name, (_, _, s) in apc_runs.items()})

# %%
figures.kv_usage_figure({name: eng.step_records for name, (eng, _, _) in apc_runs.items()},
                        title="KV positions holding KV (a shared block counted once)")

# %%
figures.latency_cdf_figure({name: list(m.values()) for name, (_, m, _) in apc_runs.items()},
                           metrics=("ttft", "e2e_latency"), unit="s", title="time to first token and end-to-end latency")

# %% [markdown]
# All three savings, and here memory is the one that matters most. Without the cache
# every request holds its own copy of the 1024-token prompt, so 8 GiB (16,384 positions) holds about a
# dozen requests (16,384 / (1,024 + a question and an answer of about 128 tokens each) ≈ 13); the queue
# grows, the cache overflows into preemptions (<span title="from the run">145 preemptions</span>), and
# the first token takes seconds. With it the prompt's 64 blocks exist once, each request adds only its
# question and answer, and the prompts prefill about a seventh of their tokens
# (<span title="from the run">71,513 of 480,089</span>).
#
# **Move the slider.** The same workload in a what-if widget: each move re-simulates the 400 requests (the
# same scheduler and block pool) and redraws the TTFT and TPOT CDFs, the KV cache over the run and the
# line under the controls, the previous setting dashed. It starts with the cache on, at 12 requests per
# second and 8 GiB. Turn the cache off; then give it four times the memory; then raise the rate until
# even the cached run's queue grows.

# %%
from minillm.viz.whatif import WhatIf, WhatIfSettings

prefix_whatif = WhatIf(WhatIfSettings(rate=12, kv_capacity_tokens=16_384, enable_prefix_caching=True),
                       controls=("rate", "prefix_caching", "kv"), trace=sys_prompt_trace, model="llama-2-7b",
                       max_num_seqs=64, config=dict(max_model_len=8192),
                       choices=dict(rate=(2, 40, 2), kv=(8_192, 16_384, 32_768, 65_536)))
assert prefix_whatif.summary["ttft_p50"] == apc_runs["prefix cache"][2]["ttft_p50"]     # the run above
prefix_whatif

# %% [markdown]
# ## 4. Multi-turn chat
#
# In a conversation each turn's input includes all previous turns (user messages and assistant answers),
# and the KV of that context can be reused. Without a prefix cache, turn k prefills the entire context;
# with one, only what is new, which cuts the prefill from O(n_total) to O(n_new).
#
# 40 conversations of 6 turns: a 512-token system prompt, user messages around 64 tokens, answers
# around 128, about 8 s of "think time" between turns. (The trace scripts each answer into the next
# turn's prompt, so what is reused is the previous turn's prompt; an engine that also keeps its
# generated answer's blocks reuses those too.) Without a cache every turn prefills its whole context:
# the grey bars. With the cache, once with the 8 GiB of section 3, once with 32 GiB:

# %%
chat = workloads.multi_turn_trace(40, turns=6, system_len=512, user_len=LogNormal(64, 0.8, 4, 512),
                                  answer_len=LogNormal(128, 0.8, 4, 512), vocab_size=32000, think_time=8.0, rate=2.0, seed=0)
turns = sorted({r.turn for r in chat})
chat_runs = {}
for name, blocks in (("8 GiB of KV", 1024), ("32 GiB of KV", 4096)):
    eng, m, s = serve(chat, enable_prefix_caching=True, num_kv_blocks=blocks)
    prefilled = [mean(m[r.request_id].num_prompt_tokens - m[r.request_id].num_cached_tokens for r in chat if r.turn == k)
                 for k in turns]
    chat_runs[name] = (s, eng.kv.stats()["evictions"], prefilled)
printouts.multi_turn_summaries(chat_runs)     # hit rate, evictions, TTFT, tokens prefilled at each turn
context = [mean(r.prompt_len for r in chat if r.turn == k) for k in turns]
fig = go.Figure([go.Bar(name="whole context = prefilled without a cache", x=turns, y=context, marker_color="#ccc")] +
                [go.Bar(name=f"prefilled, prefix cache with {name}", x=turns, y=p) for name, (_, _, p) in chat_runs.items()])
fig.update_layout(barmode="group", title="tokens prefilled per turn: O(n_total) without the cache, O(n_new) with it",
                  xaxis_title="turn", yaxis_title="tokens (mean over conversations)", height=360, plot_bgcolor="white")
fig

# %% [markdown]
# With 32 GiB each turn prefills about what is new in it (the previous answer and the new message),
# whatever the length of the conversation. With 8 GiB the forty conversations' contexts do not all
# fit: while a user thinks, other conversations need blocks, the free list evicts the oldest prefixes,
# and later turns recompute part of their history. A prefix cache is only as good as its capacity,
# which is why some providers keep cached prefixes on disk as well (DeepSeek's API has done so since
# 2024), and why a smaller KV per token matters twice: DeepSeek's V4 models compress the KV along the
# sequence, and at a 1M-token context V4-Pro holds about 10% of the KV cache V3.2 holds, V4-Flash about
# 7% (DeepSeek-AI, *DeepSeek-V4* technical report, April 2026): the same memory keeps ten to fourteen
# times as many cached prefixes. Agentic workloads are where it pays most: each turn appends a few
# hundred tokens to a context of tens or hundreds of thousands, so a turn of 200 new tokens on 20,000
# cached ones is a 99% hit. Measured hit rates come close when the client keeps its prompt byte-stable:
# the BitFun coding agent reports a 98.67% average KV-cache hit rate with DeepSeek V4 Pro over one
# SWE-Bench-Pro run (GitHub discussion GCWing/BitFun#2273, 2026).
#
# ## 5. What invalidates the cache
#
# Chaining has a consequence: if anything early in the context changes (a coding agent's user edits the
# tool list, the global prompt, or a project-notes file such as AGENTS.md that sits in the cached prefix),
# the KV of everything after it is invalidated and must be recomputed. An agent's context of 2048
# tokens (tool list and project notes first, then the conversation) is cached; then one token is edited
# at a given position and the context is sent again:

# %% [markdown]
# **Predict, then run.** A 2,048-token context is cached. One token is edited: in the first block, or near the end. How much is recomputed in each case?

# %%
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

# %% [markdown]
# <details><summary>Answer</summary>
#
# An edit in the first block recomputes the whole context: every later key is chained on the edited one. An edit near the end recomputes only from its block on, almost nothing.
#
# </details>

# %% [markdown]
# An edit in the first block (the tool list, the system prompt) costs the whole context; an edit near
# the end costs almost nothing. Hence the design rule: keep the prefix as stable as possible. Put what changes (timestamps, the latest message) at the end; keep tool
# definitions and instructions fixed, and first. A client that broke the rule shows the cost: when Qwen
# Code began loading tool schemas on demand instead of keeping them in the fixed prefix, a user's
# DeepSeek V4 Flash hit rate fell from about 98% to about 81% and the daily bill tripled (QwenLM/qwen-code
# discussion #4065, 2026).
#
# ## 6. What it is worth
#
# Providers pass the saving on in their API prices. DeepSeek's published prices for its V4 Flash model
# (its pricing page, api-docs.deepseek.com/quick_start/pricing, since the end of April 2026, when the
# cache-hit price was cut to a tenth of its launch price of \$0.028), for example, charge \$0.0028 per
# million input tokens on a cache hit and \$0.14 on a miss, 50x more.
# A workload pays a blend, weighted by its hit rate:

# %%
HIT, MISS = 0.0028, 0.14                    # $ per 1M input tokens: DeepSeek V4 Flash, cache hit and miss (April 2026)
print(f"a hit costs {MISS / HIT:.0f}x less than a miss")

def price(hit_rate):
    return hit_rate * HIT + (1 - hit_rate) * MISS

points = {"no cache": 0.0, "shared system prompt (section 3)": apc_runs["prefix cache"][2]["prefix_cache_hit_rate"],
          "multi-turn chat, 32 GiB (section 4)": chat_runs["32 GiB of KV"][0]["prefix_cache_hit_rate"],
          "agentic turn, 200 new on 20,000 cached": 20_000 / 20_200}
for name, h in points.items():
    print(f"{name:<40} hit rate {h:6.1%}: ${price(h):.4f} per 1M input tokens, {MISS / price(h):4.1f}x less than "
          f"no cache; the misses are {(1 - h) * MISS / price(h):4.0%} of the bill")
h = np.linspace(0, 1, 201)
fig = go.Figure(go.Scatter(x=h, y=price(h), mode="lines", name="effective price"))
for name, hr in points.items():
    fig.add_trace(go.Scatter(x=[hr], y=[price(hr)], mode="markers+text", text=[name], textposition="top left",
                             showlegend=False))
fig.update_layout(title="input price vs cache hit rate", xaxis=dict(title="cache hit rate", tickformat=".0%"),
                  yaxis=dict(title="$ per 1M input tokens", type="log"), height=380, plot_bgcolor="white")
fig

# %% [markdown]
# The price falls slowly until the hit rate is high, then fast: even on the agentic turn, at 99%, the 1%
# of misses is still about a third of the bill (the last line printed). A high hit rate is a commercial
# advantage, not just a technical metric.

# %% [markdown]
# ## 7. Parallel sampling: n samples of one prompt, copy-on-write
#
# A prefix shared *within* one request: `SamplingParams(n=8)` asks for 8 samples of the same prompt
# (best-of-n, self-consistency, a choice of drafts). The prompt's KV is identical for all 8, so
# PagedAttention computes it once and stores it once (Kwon et al., SOSP 2023, section 4.4):
#
# * **fork**: the prompt runs as one sequence; when its last position is computed, its logits are
#   sampled 8 times (sample i with its own random stream) and 7 new sequences are created that point
#   at the *same* blocks. Each block's reference count becomes 8. Nothing is copied.
# * **copy-on-write**: full blocks are never written again, so sharing them costs nothing. The
#   prompt's last block is only partly filled, and every sample is about to write its next token into
#   it. A sequence that must write into a block whose count is above 1 first gets a fresh block and a
#   copy of the contents (the block-copy kernel, `minillm_kernels.ops.copy_blocks`), and the shared block loses a
#   reference; the last holder writes in place.
#
# The scheduler treats the 8 as a group: admitted only if `max_num_seqs` has 8 seats (and a spare block
# per sample for its first decode), preempted together. The widget: one 10-token prompt (two full blocks of 4
# and a half-full third), `n=4`. The first Step prefills and forks: the three prompt blocks show `x4`.
# The second Step: three samples copy the half-full block, the fourth writes into it in place.

# %%
FORK_PROMPT = list(range(100, 110))             # 10 tokens: blocks of 4, the third half full

def fork_engine():
    llm = LLM(model="random", device=DEVICE, dtype="auto", attention_backend="triton", block_size=4,
              num_kv_blocks=16, max_num_seqs=4, clock="modeled", cost_model=0.010)
    llm.engine.add_request(FORK_PROMPT, SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=0, ignore_eos=True),
                           request_id="P")
    return llm

fork = Stepper(fork_engine, title="parallel sampling: a 10-token prompt, n=4 samples, blocks of 4")
fork

# %% [markdown]
# The same two steps on a copy of the engine, read from their `StepRecord`s: the fork (which blocks, shared by
# how many sequences) and the copies (which block was copied where, for whom).

# %%
fork_run = fork_engine().engine
rec_fork, rec_copy = fork_run.step(), fork_run.step()
print(rec_fork.summary())
print(rec_copy.summary())
printouts.fork_sharing(rec_fork, rec_copy, prompt_blocks=3)
f = rec_fork.forks[0]
assert len(f.shared_blocks) == 3 and len(rec_copy.copies) == 3 and rec_copy.kv.blocks_used == 6
fork_run.run()
for c in fork_run.get_output("P").outputs:
    print(f"sample {c.index}: {c.token_ids}")

# %% [markdown]
# At scale, on the modeled H100 with Llama-2-7B and 8 GiB of KV (1,024 blocks of 16) of sections 3 and 4: 48
# prompts of 512 tokens arrive at 4 per second, and each wants 8 samples of 128 tokens. Either as one
# request with `n=8` (forked, copy-on-write), or as 8 separate requests per prompt (what a client does
# without `n`; prefix caching off, so nothing is shared):

# %%
import random as _random

def sampling_run(shared, prompts=48, n=8, prompt_len=512, out_len=128):
    llm = LLM(model="llama-2-7b", executor="simulated", clock="modeled", cost_model="H100-SXM", max_model_len=2048,
              max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=1024, record="summary")
    engine, rng = llm.engine, _random.Random(0)
    for i in range(prompts):
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        for sp in ([SamplingParams(n=n, max_tokens=out_len, ignore_eos=True)] if shared else
                   [SamplingParams(max_tokens=out_len, ignore_eos=True)] * n):
            engine.add_request(prompt, sp, arrival_time=i / 4)
    records = engine.run()
    m = {rid: r.metrics for rid, r in engine.requests.items()}
    return engine, records, metrics.summarize(m, records, max_num_seqs=64)

sampling_runs = {"n=8, shared (copy-on-write)": sampling_run(True), "8 separate requests": sampling_run(False)}
printouts.sampling_summaries(sampling_runs)
shared_s, separate_s = sampling_runs["n=8, shared (copy-on-write)"][2], sampling_runs["8 separate requests"][2]
assert shared_s["output_throughput"] > separate_s["output_throughput"] and shared_s["num_preemptions"] < separate_s["num_preemptions"]

# %% [markdown]
# The same tokens, in a fraction of the memory. A prompt's 512 tokens are 32 blocks; its 8 separate requests
# hold 8 x 32 = 256 blocks of identical KV before the first output token, a quarter of the cache, so
# only a few prompts fit at once: the queue grows, running requests are preempted and recomputed, and the
# first token waits for seconds. Forked, the 8 samples hold the 32 prompt blocks once plus one block each
# as they start writing, so every arriving prompt is admitted at once (the lines above: the running
# sequences, the preemptions, TTFT and throughput of both runs).

# %% [markdown]
# ## Exercises
#
# The pieces of this notebook, in `exercises/ex04_prefix_cache.py`. They plug into the real engine:
# `ex.prefix_engine(...)` builds an `LLM` whose block keys, prefix lookups and block pool are yours; the
# graders run the same requests with minillm's prefix cache and with yours, step by step.
#
# **Exercise 1, `hash_block` and `block_hashes`**: the chained key (section 1).

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 1's first cell computes a chain of keys with the engine's `hash_block`; yours must give the same keys. Which Python types can be hashed?
#
# </details>
# <details><summary>Hint 2</summary>
#
# Section 1: only full blocks get a key, and each key is chained on the one before. The cell below compares your keys with the engine's on section 1's prompt.
#
# </details>

# %%
with impl.attempt("ex04.hash_block / block_hashes"):
    mine = ex.block_hashes(prompt, 4)
    print(f"{len(mine)} keys for {len(prompt)} tokens in blocks of 4; the first is the engine's: "
          f"{mine[0] == hash_block(None, prompt[:4])}")

# %% [markdown]
# **Exercise 2, `longest_prefix_match`**: the cached blocks a request can reuse (section 1).
# **Exercise 3, `EvictingBlockPool`**: `evict`, `get_new_blocks`, `touch` and `free_blocks` (section 2). Below,
# section 2's five requests on an engine built from your three pieces (on the simulated executor:
# only the block decisions matter here), next to minillm's own:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 1's 165-token example: the second prefill starts at token 160. The match ends at the first key that misses (or names a block holding other tokens), and it never covers the prompt's last token (Exercise 5's hint says why).
#
# </details>
# <details><summary>Hint 2</summary>
#
# Section 2's stepped run is the behaviour to reproduce: which blocks go back to the free list, in what order, and which cached block is evicted first. The docstrings of `touch`, `get_new_blocks`, `evict` and `free_blocks` are the contract; the cell below replays section 2 on your pool.
#
# </details>

# %%
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

# %% [markdown]
# **Exercise 4, the fork and copy-on-write** (section 7), in `exercises/ex04b_parallel_sampling.py`: `fork` (the new
# sequence's block table and the reference counts after), `block_to_write` (which block the next position falls
# in) and `copy_on_write` (copy or not, which block, the counts after). `ex4b.cow_kv_manager` is a factory for
# `EngineConfig.kv_manager`: section 7's four samples on your fork and copies, next to minillm's own.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 7's two steps, read from their step records: the fork (which blocks, shared by how many sequences) and the copy (which block, when). The invariant: a block more than one sequence holds is never written, and a block only one holds is never copied.
#
# </details>

# %%
ex4b = impl.load("ex04b_parallel_sampling")
with impl.attempt("ex04b.fork / block_to_write / copy_on_write"):
    for name, factory in (("minillm's", None), ("yours", ex4b.cow_kv_manager)):
        llm = LLM(model="random", executor="simulated", block_size=4, num_kv_blocks=16, kv_manager=factory)
        llm.engine.add_request(FORK_PROMPT, SamplingParams(n=4, max_tokens=3, ignore_eos=True), request_id="P")
        recs = llm.engine.run()
        print(f"{name:>9}: forked {[len(f.sequences) for r in recs for f in r.forks]} ways, copies "
              f"{[(c.src_block, c.dst_block) for r in recs for c in r.copies]}, at most "
              f"{max(r.kv.blocks_used for r in recs)} blocks in use")

# %% [markdown]
# **Exercise 5, `tokens_reused_after_edit`**: what an edit invalidates (section 5). A prompt cached in
# full is sent again with some of its tokens changed: how many of its tokens does the prefix cache still
# serve? Below, your answer for each edit of section 5, next to what minillm's prefix cache reused there:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 5's figure: an edit in the first block costs the whole context, one near the end almost nothing. Which of the `edited_positions` decides the answer?
#
# </details>
# <details><summary>Hint 2</summary>
#
# Check the case of no edit against section 1: even then the prompt's last token is computed again (its logits choose the first output token). The docstring says which positions are invalid, and the error must name the bad one.
#
# </details>

# %%
with impl.attempt("ex04.tokens_reused_after_edit"):
    for pos, again in zip(positions, recomputed):
        print(f"edit at token {pos:>4}: yours {ex.tokens_reused_after_edit(2048, [pos], 16):>4} tokens reused, "
              f"minillm's prefix cache {2048 - again:>4}")

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex04_prefix_cache.py` and `exercises/ex04b_parallel_sampling.py` (their stubs raise `NotImplementedError` until you fill them in;
# the docstrings say exactly what each must do). The cells above run *your* version: `impl.load` reads
# the environment variable `MINILLM_IMPL` (unset: `exercises`, yours; `solutions`: the reference answers).
# From the repository root:
#
# ```bash
# make grade EX=04                                            # every ex04 grader, against exercises/
# make grade EX=04b                                           # the fork and copy-on-write
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex04 tests/test_exercises.py -k "pool or evict"   # one exercise
# ```
#
# A failing grader says what it expected and where the expectation came from (numbers worked by hand,
# the engine's cost model, or what the real scheduler did on the same requests).
#
# After a grade that fails an exercise you attempted (a stub left untouched is no attempt), that
# exercise's cell above offers its worked answer, folded: the reference code and why it works. Open it
# once you have tried. From a cell, `impl.grade("04")` prints the same report and offers the answers
# of the exercises it failed; `impl.show_worked_answer("ex04", 1)` opens exercise 1's.

# %% [markdown]
# ## Summary
#
# 1. Each full block's key hashes its tokens together with the previous block's key, so a key names the whole prefix up to it.
# 2. A new request looks its keys up in order; the first miss ends the match, and the prefill starts there.
# 3. Shared blocks carry reference counts; freed blocks stay cached until their memory is needed, evicted least recently used first, children before parents.
# 4. A shared system prompt saves prefill, memory and TTFT; an edit invalidates everything after it, so keep prefixes stable.
# 5. Parallel sampling forks one prompt's blocks to n sequences and copies a block only when a sequence writes into a shared one.

# %% [markdown]
# ## Check your understanding
#
# 1. Why does a block's key include its parent's key, not just its own tokens?
# 2. Why is the last token of a fully cached prompt computed again?
# 3. Without prefix caching, 8 GiB held about a dozen requests with a 1024-token system prompt. Why so many more with it?
# 4. When does copy-on-write copy a block, and why only then?
#
# <details><summary>Answers</summary>
#
# 1. The same tokens at a different position after a different prefix have different KV; chaining makes a key match only when the whole prefix matches.
# 2. Its logits choose the first output token, and a cached block stores KV, not logits.
# 3. The prompt's KV is stored once and shared by all; each request holds only its own suffix and answer.
# 4. When a sequence must write into a block other sequences still hold (the partly filled last block of the prompt); full shared blocks are only read, so they never need a copy.
#
# </details>
