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
# # 06 · Speculative decoding
#
# A small draft model proposes several tokens; the target model verifies them all in a single forward
# pass (Leviathan et al., ICML 2023; Chen et al., 2023). Accepted tokens are kept, and the first
# rejection resets to that point. This works because verifying k tokens costs roughly as much as
# generating one: decode is bandwidth bound, so a few extra positions are nearly free. It converts spare
# compute into lower latency.
#
# The catch comes with it: how often the draft's guesses are kept determines the actual speed-up, and a
# draft that is rarely right can make things slower rather than faster. This notebook:
#
# 1. draft and verify, stepped live on the shipped model and its shipped draft;
# 2. the acceptance rule: greedy, and rejection sampling (why the output does not change);
# 3. the probability α that a guess is kept, against speed-up;
# 4. when speculation makes things slower: low acceptance, a costly draft, a large batch;
# 5. the shipped draft (`speculative_model="default-draft"`) against the n-gram proposer (`"ngram"`);
# 6. exercises: the acceptance rule, inside the engine, and the speed-up formula.
#
# In minillm one step of a decoding request with speculation is: the proposer guesses up to k tokens;
# the scheduler grants the request 1 + k new tokens and allocates their KV slots (they count against
# the execution-token budget, and take only blocks no running request needs for its next token); one
# target forward scores all of them; the scheduler keeps the accepted guesses plus one token of the
# target's own, and frees the KV slots of the rejected guesses (`minillm/spec/speculative.py`).

# %% [markdown]
# **After this notebook you can:**
#
# - run speculative decoding on the shipped model and read one verification step: guesses, accepted ones, the
#   target's own token;
# - state the greedy and the rejection-sampling acceptance rules, and say why neither changes the output's
#   distribution;
# - compute the expected tokens per step and the speed-up from the acceptance rate α, the draft length k and the
#   draft's cost c;
# - tell when speculation makes decoding slower: low acceptance, a costly draft, a batch past the roofline's ridge;
# - choose between a draft model and prompt lookup by measuring on your own traffic.

# %%
from minillm.kernel_check import check_paged_attention, pick_device
DEVICE = pick_device()   # "cuda" with a GPU; without one "cpu", where Triton's interpreter runs the same kernels

import numpy as np
import plotly.graph_objects as go
import torch

from minillm import LLM, SamplingParams, impl
from minillm.viz import Stepper, printouts

# %%
from minillm.sim.costmodel import ModelSpec, RooflineCostModel
from minillm.spec.speculative import (
    alpha_from_tokens_per_step, expected_speedup, expected_tokens_per_step, modeled_speedup, spec_stats,
)

ex = impl.load("ex06_speculative")   # your exercises/ex06_speculative.py (MINILLM_IMPL=solutions: the answer);
                                     # re-run this cell after editing the file: impl.load reads it again

# %% [markdown]
# ## 1. Draft and verify, stepped
#
# The target is the Shakespeare model that ships with minillm (4 layers, 3.4 M parameters); the draft is
# its shipped companion (`speculative_model="default-draft"`: 1 layer, 1.25 M parameters, distilled from
# the target, same tokenizer). k = 4 guesses per step, greedy decoding, and `attention_backend="triton"`:
# every Step runs the Triton kernel for the draft's forwards and the target's verification (a query of
# 5 tokens over the paged cache). The draft keeps its own KV in the *same* block ids as the target's,
# so one block table serves both models.

# %%
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

# %% [markdown]
# Step 0 is the prompt's prefill (no guesses yet: speculation starts once the request decodes). From
# step 1 on, each step is one verification. Five steps, in code:

# %% [markdown]
# **Predict, then run.** With k = 4 guesses per step, what is the most tokens one verification step can add to
# R's output, and the fewest?

# %%
tok = spec.engine.tokenizer
req = spec.engine.requests["R"]
for _ in range(5):
    before = req.num_output_tokens
    rec = spec.step()
    e = rec.entry("R")
    new = req.output_token_ids[before:]
    what = (f"{e.num_spec_tokens} guessed, {e.num_spec_accepted} accepted, + 1 from the target"
            if e.num_spec_tokens else "the prompt's prefill")
    print(f"step {rec.step}: {e.num_new_tokens:>2} tokens through the target ({what}) -> {len(new)} new: {tok.decode(new)!r}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# At most k + 1 = 5 (all four guesses kept, plus the target's bonus token), at least 1 (the first guess
# rejected, replaced by the target's own token). A step never adds zero: the target's forward always yields
# one token.
#
# </details>

# %% [markdown]
# A step emits between 1 and k + 1 = 5 tokens: the accepted guesses, then the target's own token at the
# first rejection (or a *bonus* token after all four). Where a guess was wrong, its KV (written during
# verification) is rolled back: blocks left empty go back to the pool. The batch bar above shows each
# step's tokens against a budget of 32: R's own token (solid), then its guesses, accepted (hatched, green
# outline, ✓) or rejected (red cross-hatch, ✗); drag *view step* to see each of the five. The kernel on
# this engine's cache:

# %%
print(check_paged_attention(spec.engine))   # the Triton kernel against its torch reference

# %% [markdown]
# ## 2. The acceptance rule
#
# **Greedy**: keep a guess while it equals the target's argmax at that position. The output is then
# exactly what the target alone would produce, token for token:

# %% [markdown]
# **Predict, then run.** Greedy decoding, once without speculation and once with the shipped draft guessing 4
# tokens a step. Can the two texts differ, given that the draft is a different, smaller model?

# %%
plain = LLM(attention_backend="auto")
greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
a = plain.generate([PROMPT], greedy)[0].text
b = LLM(attention_backend="auto", speculative_model="default-draft", num_speculative_tokens=4).generate([PROMPT], greedy)[0].text
print(f"same text with and without speculation: {a == b}\n{a!r}")

# %% [markdown]
# <details><summary>Answer</summary>
#
# No: the cell prints `True`. A guess is kept only where it equals the target's own argmax, and the first
# rejected one is replaced by the target's token, so every emitted token is one the target alone would have
# chosen. The draft changes how many target forwards it takes, not what comes out.
#
# </details>

# %% [markdown]
# **Sampling** needs more care: the guesses were *drawn* from the draft's distribution q, and the output
# must follow the target's p. Rejection sampling (Leviathan et al., Chen et al., 2023) accepts a guess x
# with probability min(1, p(x) / q(x)); at a rejection it draws a replacement from the residual
# norm(max(0, p − q)). The two paths add up to p exactly. One position, a vocabulary of 5 tokens:

# %%
p = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])          # the target's next-token distribution
q = torch.tensor([0.10, 0.45, 0.20, 0.05, 0.20])          # the draft's
accepted = q * torch.clamp(p / q, max=1.0)                 # drawn from q, then kept: q(x) min(1, p(x)/q(x)) = min(q, p)
reject = 1 - accepted.sum()                                # probability that the guess is rejected
residual = torch.clamp(p - q, min=0) / torch.clamp(p - q, min=0).sum()
total = accepted + reject * residual
print(f"P(accept) = {accepted.sum():.2f}; accepted + rejected-then-resampled = {[round(x, 3) for x in total.tolist()]}; "
      f"p = {[round(x, 3) for x in p.tolist()]}")
fig = go.Figure([go.Bar(name="guess kept: min(p, q)", x=list(range(5)), y=accepted.tolist()),
                 go.Bar(name="replacement after a rejection", x=list(range(5)), y=(reject * residual).tolist())])
fig.add_trace(go.Scatter(name="target p", x=list(range(5)), y=p.tolist(), mode="markers", marker=dict(size=14, symbol="line-ew-open", line=dict(width=3))))
fig.add_trace(go.Scatter(name="draft q", x=list(range(5)), y=q.tolist(), mode="markers", marker=dict(size=10, symbol="x")))
fig.update_layout(barmode="stack", title="rejection sampling: the emitted token follows p, whatever q is",
                  xaxis_title="token", yaxis_title="probability", height=340, plot_bgcolor="white")
fig

# %% [markdown]
# The acceptance probability is the overlap of the two distributions, Σ min(p, q): a draft that puts its
# mass where the target does gets its guesses kept. The exercise asks you to write both rules; the
# graders check that your sampled output follows p, and that the engine, running your rule, emits the
# same tokens as with its own.
#
# ## 3. Acceptance rate against speed-up
#
# If each guess is accepted with probability α, independently, one target step emits on average
# 1 + α + α² + ... + α^k = (1 − α^(k+1)) / (1 − α) tokens. If a draft forward costs c target forwards
# and the verification costs one (the memory-bound assumption), the speed-up is
# (1 − α^(k+1)) / ((1 − α)(k c + 1)) (Leviathan et al., 2023; `speculative.expected_speedup`).
#
# Two quantities must not be confused. **α** is a parameter of this model: the probability that a guess
# is kept, given that the guesses before it were. The **acceptance rate** the engine reports
# (`spec_stats`) is a count: accepted guesses over proposed guesses. Guesses after the first rejection are
# proposed but never accepted, so the acceptance rate is below α: at α = 0.8 and k = 4 a step keeps
# 0.8 + 0.8² + 0.8³ + 0.8⁴ = 2.36 of its 4 guesses on average, a rate of 59%. Below, α is *fitted* from a
# run: the value that makes the formula's tokens per target step equal the measured mean
# (`alpha_from_tokens_per_step`).

# %%
alphas = np.linspace(0.0, 0.98, 50)
fig = go.Figure()
for k in (1, 2, 4, 8):
    fig.add_trace(go.Scatter(x=alphas, y=[expected_speedup(a, k, 0.05) for a in alphas], name=f"k = {k}, draft cost c = 0.05"))
fig.add_trace(go.Scatter(x=alphas, y=[expected_speedup(a, 4, 0.36) for a in alphas], name="k = 4, c = 0.36 (the shipped pair)",
                         line=dict(dash="dash", color="black")))
fig.add_hline(y=1.0, line_dash="dot", annotation_text="no gain")
fig.update_layout(title="expected speed-up vs α, the probability that a guess is kept",
                  xaxis_title="α (probability that a guess is kept, given the earlier ones were)",
                  yaxis_title="speed-up over plain decoding (times)", height=380, plot_bgcolor="white")
fig

# %% [markdown]
# More guesses pay only when they are likely to be kept: at low α, k = 8 wastes seven draft forwards for
# one token. Now the shipped pair, measured: the engine runs on a modeled clock where a target step costs
# 10 ms whatever its size (decode is memory bound, so a few more positions cost nothing extra) and a
# draft forward costs the target's 10 ms scaled by the ratio of their weights, c = 1.25 M / 3.43 M ≈ 0.36
# (a small model's weights are largely embeddings, so its draft cannot be much smaller). Greedy, k = 1 to
# 6:

# %% [markdown]
# **Predict, then run.** The shipped draft costs c ≈ 0.36 of a target forward and agrees with the target on
# about half of its greedy tokens (α ≈ 0.5). From the figure above (the dashed curve is k = 4 at that cost),
# will k = 1 be faster or slower than plain decoding? And k = 4?

# %%
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
rows, printed = [], []
for k in (1, 2, 4, 6):
    t, st, llm = timed([PROMPT], greedy, speculative_model="default-draft", num_speculative_tokens=k)
    ratio = llm.engine.speculator.draft_cost_model.ratio
    alpha = alpha_from_tokens_per_step(st["tokens_per_target_step"], k)
    rows.append((k, alpha, base / t, expected_speedup(alpha, k, ratio)))
    printed.append((k, st, alpha, base / t, ratio, rows[-1][3]))
printouts.speculation_by_k(printed)     # per k: tokens per target step, alpha, measured and formula speed-ups

# %% [markdown]
# <details><summary>Answer</summary>
#
# k = 1 gains a little (about 1.1x); k = 4 loses time (about 0.8x): at α ≈ 0.5 the dashed curve is below 1.
# Each extra guess costs a third of a target forward and is kept only about half the time, and only while
# every guess before it was kept.
#
# </details>

# %% [markdown]
# The engine's measurements follow the formula. A draft whose guesses are kept with the α printed above,
# but which costs over a third of the target per forward, gains a little with one or two guesses and
# loses time from four on: each rejected guess wasted a draft forward. Published pairs have far cheaper
# drafts: a 4 B-parameter draft for the 70 B Chinchilla (Chen et al., 2023: c ≈ 0.06 by parameters),
# T5-small (77 M) for T5-XXL (11 B) (Leviathan et al., 2023: c ≈ 0.007 as a ratio of parameter counts, not a measured cost), and section 4's 125 M draft for
# Llama-3-8B (<span title="from the run">c = 0.016</span>, printed there). With so small a c the same α gives a clear gain.
#
# ## 4. When speculation makes things slower
#
# Section 3 showed two ways to lose time: a draft that is rarely right (a low α: the curves fall below 1
# on the left) and a draft that costs too much per forward (the shipped pair, dashed); the fix is a better
# or cheaper draft, or none. The third is the assumption behind "nearly free": verification of k + 1
# positions costs one plain step only while the verification step is memory bound, that is, while the
# batch is small. Verifying k + 1 positions
# multiplies a step's arithmetic by k + 1 without adding weight reads, so the verification step crosses
# the roofline's ridge long before a plain decode step would (the cell prints which bound each is in);
# past it, k + 1 positions per request cost up to k + 1 times as much. The roofline cost
# model prices it (`speculative.modeled_speedup`): Llama-3-8B on an H100 with a Llama-shaped draft of
# about 125 M parameters, α = 0.8, 256 positions of context per request (and, dashed, 4096):

# %%
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
                  xaxis=dict(title="batch size (requests decoding together)", type="log"),
                  yaxis_title="speed-up over plain decoding (times)", plot_bgcolor="white")
printouts.verification_costs((b, modeled_speedup(target, draft, b, 256, 4, 0.8),      # plain step: 1 position, verify: 5
                              *(target.breakdown([n] * b, [256] * b)["bound"] for n in (1, 5))) for b in (1, 64, 512))
assert target.breakdown([1] * 512, [256] * 512)["bound"] == "memory" and target.breakdown([5] * 64, [256] * 64)["bound"] == "compute"
fig

# %% [markdown]
# At batch 1 the verification costs what a plain step does, and four guesses at α = 0.8 give a large
# gain. By batch 64 the verification step has crossed the ridge, while a plain step stays memory bound
# even at 512 (the cell asserts both); by a few hundred requests five positions per request cost several
# plain steps, and the gain is gone: speculation converts *spare* compute into
# latency, and a big batch has none to spare. Long contexts postpone this (dashed): each request's own
# KV reads keep the step memory bound. Batch size thus becomes a variable in a new way: an
# engine can speculate at low load and stop at high load.
#
# ## 5. The shipped draft against the n-gram proposer
#
# A draft model is one way to guess. Another costs nothing: **prompt lookup** (`speculative_model="ngram"`)
# finds the last few tokens earlier in the request's own context and proposes what followed them there.
# It is right when text repeats: code, quotes, summaries of the prompt, and small models stuck in loops.
# Two prompts, eight requests each (each sampled with its own seed, so eight different texts), greedy and
# sampled (temperature 0.8), k = 4:

# %%
texts = {"Romeo": PROMPT,
         "a dialogue": "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"}
compare = []
for temp in (0.0, 0.8):
    params = [SamplingParams(max_tokens=48, temperature=temp, seed=i, ignore_eos=True) for i in range(8)]
    for name, text in texts.items():
        base, _, _ = timed([text] * 8, params)
        for proposer in ("default-draft", "ngram"):
            t, st, _ = timed([text] * 8, params, speculative_model=proposer, num_speculative_tokens=4)
            compare.append((temp, name, proposer, st["acceptance_rate"] or 0.0, st["tokens_per_target_step"], base / t))
printouts.acceptance_by_proposer(compare)
fig = go.Figure()
for proposer in ("default-draft", "ngram"):
    rows = [r for r in compare if r[2] == proposer]
    fig.add_trace(go.Bar(name=proposer, x=[f"{n}, {'greedy' if t == 0 else 'T=0.8'}" for t, n, *_ in rows], y=[r[5] for r in rows]))
fig.add_hline(y=1.0, line_dash="dot")
fig.update_layout(barmode="group", title="speed-up on the modeled clock (10 ms per target step), k = 4",
                  xaxis_title="prompt and sampling", yaxis_title="speed-up over plain decoding (times)",
                  height=360, plot_bgcolor="white")
fig

# %% [markdown]
# Greedy, the small shipped model falls into loops (look at its text in section 2), so prompt lookup
# finds guesses in the request's own recent output. It does not guess better than the draft model: about
# the same share of its guesses is accepted (<span title="from the run">27%</span> against the draft's
# <span title="from the run">26%</span> on Romeo, <span title="from the run">37%</span> against
# <span title="from the run">32%</span> on the dialogue), and it emits fewer tokens per target step. Its
# gain is the cost: a guess looked up in the context costs no forward at all, while each of the draft
# model's costs a third of a target step. So prompt lookup gives the best results here
# (<span title="from the run">1.45x</span> and <span title="from the run">1.66x</span>), while the draft
# model loses time.
# Sampled at T = 0.8 the text stops repeating and prompt lookup finds almost nothing to propose, while
# the draft model, which learned the target's distribution, has more of its guesses accepted than it
# did greedy, on both prompts (compare the greedy and sampled rows; rejection sampling accepts by
# overlap of distributions, not by exact match). Neither is always right: measure on your traffic, and
# improve the draft or turn speculation off.

# %% [markdown]
# ## Exercises
#
# **Exercises 1 and 2, `accept_greedy` and `accept_sampled`** in `exercises/ex06_speculative.py`: the
# acceptance rule of section 2. `ex.speculative_engine(...)` builds an `LLM` whose verification steps run your rule; below,
# the shipped pair with your rule, greedy (must equal plain decoding) and sampled:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# `accept_greedy`: section 1's printout shows steps of 4 guesses emitting 1 to 5 tokens; the invariant the graders hold is section 2's first cell: greedy speculation emits exactly what plain decoding does, token for token. Check the docstring's example by hand first.
#
# </details>
# <details><summary>Hint 2</summary>
#
# `accept_sampled`: the graders replay your random draws, so follow the docstring's order of draws exactly. Section 2's bar chart is the invariant: the mass kept plus the mass rejected and resampled adds up to p. With `q` None the draft proposed a token with certainty: what is q then?
#
# </details>

# %%
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

# %% [markdown]
# **Exercise 3, `tokens_per_step` and `speculative_speedup`** in `exercises/ex06_speculative.py`: the
# formula of section 3, written yourself. `tokens_per_step(alpha, k)` is the mean number of tokens one
# verification emits when each guess is kept with probability α; `speculative_speedup(alpha, k, c)`
# divides it by the cost of a step in target forwards. The graders compare with sums worked by hand,
# with the engine's own `expected_tokens_per_step` and `expected_speedup` switched off. Below, your
# formula against the engine's and against the speed-up the shipped pair measures on the modeled clock:

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 3's first paragraph gives the series. Check your function at both ends before the middle: at α = 0 a step emits one token, at α = 1 every guess is kept (mind the division there). The cell below prints the value expected at α = 0.8, k = 4.
#
# </details>
# <details><summary>Hint 2</summary>
#
# Count what one verification step costs in target forwards (section 3's second paragraph), and what plain decoding emits per target forward. The docstring's example (k = 4, c = 0.05) is the case to check by hand.
#
# </details>

# %%
with impl.attempt("ex06.tokens_per_step"):
    print(f"alpha = 0.8, k = 4: {ex.tokens_per_step(0.8, 4):.4f} tokens per step (expected 3.3616; "
          f"the engine's formula: {expected_tokens_per_step(0.8, 4):.4f})")
with impl.attempt("ex06.speculative_speedup"):
    plain_t, _, _ = timed([PROMPT], greedy)
    for k in (1, 4):
        t, st, llm = timed([PROMPT], greedy, speculative_model="default-draft", num_speculative_tokens=k)
        alpha = alpha_from_tokens_per_step(st["tokens_per_target_step"], k)
        c = llm.engine.speculator.draft_cost_model.ratio
        print(f"k = {k}, alpha ~ {alpha:.2f}, c = {c:.2f}: your formula {ex.speculative_speedup(alpha, k, c):.2f}x, "
              f"the engine's {expected_speedup(alpha, k, c):.2f}x, measured {plain_t / t:.2f}x")

# %% [markdown]
# **Exercise 4 (judgement), `first_losing_k`**: section 3 measured the shipped pair at k = 1, 2, 4 and 6. At
# which draft length does it stop paying, that is, first give a speed-up of at most 1? Guess from section 3's
# printout, then write the function. The cell below hands it the engine's own measurement at each k it asks
# for (a run on the modeled clock; the runs section 3 made are reused), so the answer comes from this run.

# %% [markdown]
# <details><summary>Hint 1</summary>
#
# Section 3's printout: which of the k it tried gained and which lost? The answer lies between the last k that
# gained and the first that lost; the docstring says what a speed-up of exactly 1 counts as.
#
# </details>
# <details><summary>Hint 2</summary>
#
# Each call of `speedup_at` is a run of the engine, and the graders count them: ask in the order you would run
# them by hand, and stop as soon as you know the answer.
#
# </details>

# %%
with impl.attempt("ex06.first_losing_k"):
    def measured_speedup(k):
        t, _, _ = timed([PROMPT], greedy, speculative_model="default-draft", num_speculative_tokens=k)
        return timed([PROMPT], greedy)[0] / t
    k_stop = ex.first_losing_k(measured_speedup, max_k=8)
    print(f"the shipped draft/target pair stops paying at k = {k_stop} (measured on the modeled clock)")

# %% [markdown]
# ### Grading
#
# Your code goes in `exercises/ex06_speculative.py` (its stubs raise `NotImplementedError` until you fill them in;
# the docstrings say exactly what each must do). The cells above run *your* version: `impl.load` reads
# the environment variable `MINILLM_IMPL` (unset: `exercises`, yours; `solutions`: the reference answers).
# From the repository root:
#
# ```bash
# make grade EX=06                                            # every ex06 grader, against exercises/
# MINILLM_IMPL=exercises .venv/bin/python -m pytest -m ex06 tests/test_exercises.py -k accept_sampled   # one exercise
# ```
#
# A failing grader says what it expected and where the expectation came from (numbers worked by hand,
# the engine's cost model, or what the real scheduler did on the same requests).
#
# After a grade that fails an exercise you attempted (a stub left untouched is no attempt), that
# exercise's cell above offers its worked answer, folded: the reference code and why it works. Open it
# once you have tried. From a cell, `impl.grade("06")` prints the same report and offers the answers
# of the exercises it failed; `impl.show_worked_answer("ex06", 1)` opens exercise 1's.

# %% [markdown]
# ## Summary
#
# 1. A draft proposes k tokens, the target verifies them all in one forward, and the step keeps the accepted guesses plus one token of the target's own.
# 2. Greedy keeps a guess while it equals the target's argmax; sampling keeps it with probability min(1, p/q) and resamples from the residual, so the output still follows p.
# 3. One step emits (1 − α^(k+1)) / (1 − α) tokens on average and costs k c + 1 target forwards.
# 4. Speculation converts spare compute into latency: it loses with low acceptance, a costly draft, or a batch large enough to be compute bound.
# 5. The shipped draft (c ≈ 0.36) pays only at small k; prompt lookup costs nothing and wins where text repeats.

# %% [markdown]
# ## Check your understanding
#
# 1. Why can verifying k + 1 positions cost about as much as one plain decode step, and when does that stop
#    being true?
# 2. At α = 0 (every guess rejected), how many tokens does a step emit, and what does it cost?
# 3. A draft whose distribution q equals the target's p exactly: what is the acceptance probability, and the
#    speed-up at k = 4 if the draft cost nothing?
# 4. Why does rejection sampling need the draft's probabilities q, while the greedy rule needs only its tokens?
# 5. Why did prompt lookup do best greedy and find almost nothing at T = 0.8?
#
# <details><summary>Answers</summary>
#
# 1. Decode is memory bound: the step reads every weight once whatever the number of positions, so a few more
#    positions add arithmetic the GPU had idle. Past the roofline's ridge (a large batch, section 4) the extra
#    positions cost their arithmetic, up to k + 1 times a plain step.
# 2. One token, the target's own, for k c + 1 target forwards: slower than plain decoding by that factor.
# 3. Σ min(p, q) = 1: every guess is kept, so a step emits k + 1 = 5 tokens for one target forward, 5x.
# 4. Greedy compares a guess with the target's argmax; sampling accepts x with probability min(1, p(x) / q(x))
#    and draws a rejection's replacement from max(0, p − q), both of which need q.
# 5. Greedy, the small model falls into loops, so the recent context predicts what comes next; sampled text
#    rarely repeats, so there is nothing earlier in the context to copy.
#
# </details>
