"""Speculative decoding: a cheap proposer guesses, the target checks every guess in one forward.

The idea (Leviathan et al., ICML 2023; Chen et al., 2023): *a small draft model proposes
several tokens; the target model verifies them in a single forward pass. Accepted tokens
are kept, and the first rejection resets to that point.* It pays because
decode is memory-bandwidth bound: scoring k + 1 positions reads the weights once, about
what scoring one position costs. It does not pay when the acceptance rate is low (the
draft's forwards are wasted) or when the batch is already large (the step is compute
bound, so the k extra positions per request are no longer free).

One step of a decoding request with ``n`` known tokens (KV for ``n - 1`` of them):

1. **Propose** (before scheduling). The engine asks the proposer for up to k tokens
   ``d1..dk`` per decoding request and sets ``req.spec_token_ids``. Never past
   ``max_tokens`` or ``max_model_len``: a step emits at most k + 1 tokens. (A draft model,
   which writes KV where it guesses, asks for k slots here and guesses after step 2.)
2. **Schedule.** The scheduler grants ``1 + len(spec)`` new tokens and allocates their KV
   slots: speculative tokens count against the execution-token budget and take only blocks
   no running request needs for its plain next step, so it may keep fewer of them (or none:
   a plain decode in the same batch), and a draft never causes a preemption. Prefill is
   unaffected.
3. **Verify** (the runner). One forward over ``[x_n, d1, .., dk]`` at positions
   ``n-1 .. n-1+k`` (a query of k + 1 tokens over the paged context) gives the target's
   distribution after each of them; :func:`verify` keeps the longest agreeing prefix
   ``d1..da`` and adds one token from the target (the correction at the first
   rejection, or a bonus token after all k).
4. **Roll back** (``Scheduler.update_from_output``). The KV written for the ``k - a``
   rejected positions is dropped (``kv.truncate``): blocks left empty go back to the pool.

Two proposers sit behind one interface, ``Proposer.propose(requests, k) -> {request_id: [tokens]}``:

* :class:`DraftModelProposer`: a small model with the same tokenizer. It keeps its own
  paged KV cache, *in the same block ids as the target's*: a second set of cache tensors
  indexed by the same block tables, since both caches hold the same positions. So the
  one block pool accounts for both (a block is draft KV + target KV; the engine's memory
  sizing counts both), and rollback, preemption and freeing need no second allocator.
  It guesses after scheduling, into the ``1 + k`` slots the scheduler allocated for the
  verification, which also hold the draft's look-ahead.
* :class:`NgramProposer` (``speculative_model="ngram"``): no model. Prompt lookup: find
  the last n tokens earlier in the request's own context and propose what followed them.

The acceptance rule (:func:`verify`): greedy requests accept while the draft equals the
target's argmax. Sampled requests use rejection sampling: accept ``d`` with probability
``min(1, p(d) / q(d))``; on rejection draw from ``norm(max(0, p - q))``; after k
acceptances draw the bonus from ``p``. The output then follows the target distribution
``p`` exactly, whatever the draft ``q`` (a deterministic proposer is the one-hot ``q``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch

from ..checks import check_protocol
from ..core.request import Request

# =====================================================================================
# Proposers
# =====================================================================================


@runtime_checkable
class Proposer(Protocol):
    """The proposer contract: guesses the next tokens of decoding requests (step 1 above).

    ``propose(requests, k)`` returns up to ``k`` guesses per request (fewer or none is fine);
    ``draft_probs(request_id, k)`` the distributions ``q`` they were drawn from, which the acceptance
    rule needs to keep the target's distribution exact (None: a deterministic proposer, one-hot ``q``);
    ``forget(request_id)`` drops a finished request's state. ``needs_kv`` declares a proposer that
    writes KV where it guesses (a draft model): it asks for its slots before the scheduler runs and
    guesses into what was granted. ``forwards`` lists the shapes of the step's draft forwards, for the
    modeled clock. Subclass it to inherit the defaults; ``make_speculator`` checks a proposer against it.
    """

    name: str = "proposer"
    needs_kv: bool = False  # writes a KV cache, so its look-ahead positions need blocks first
    forwards: list

    def __init__(self):
        # Shapes of this step's draft forwards, (num_new_tokens, context_lens) each, for the
        # modeled clock: the cost model prices them like any step of the draft model.
        self.forwards: list[tuple[list[int], list[int]]] = []

    def propose(self, requests: Sequence[Request], k: Union[int, Sequence[int]]) -> dict[str, list[int]]:
        """Up to ``k`` (or ``k[i]`` for ``requests[i]``) next tokens per request; fewer or none is fine."""
        raise NotImplementedError

    def draft_probs(self, request_id: str, k: int) -> Optional[torch.Tensor]:
        """``q`` [k, V] of the last proposal for this request, or None if deterministic."""
        return None

    def forget(self, request_id: str) -> None:
        pass

    @staticmethod
    def _per_request(requests, k) -> list[int]:
        return [k] * len(requests) if isinstance(k, int) else [int(x) for x in k]


class NgramProposer(Proposer):
    """Prompt lookup: look the last ``n`` tokens up in the request's own context (longest ``n``
    first, ``n_max`` down to ``n_min``; the most recent earlier occurrence wins) and propose the
    tokens that followed it. Costs no model and no KV; works when text repeats (code, quotes,
    summaries of the prompt, a model stuck in a loop). ``q`` is one-hot: it is deterministic.

    The copy may run into the context's end; it then continues over its own output, LZ77 style,
    so a loop of period 2 yields k tokens of that loop, not 2.
    """

    name = "ngram"

    def __init__(self, n_max: int = 3, n_min: int = 1):
        super().__init__()
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NgramProposer: need 1 <= n_min={n_min} <= n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min

    def propose_tokens(self, tokens: Sequence[int], k: int) -> list[int]:
        L = len(tokens)
        if k <= 0 or L < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0 .. L-1-n
            hits = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
            if hits.size:
                src = int(hits[-1]) + n  # what followed the most recent match
                ext = list(tokens)
                for _ in range(k):  # copy (overlapping the end if need be)
                    ext.append(ext[src])
                    src += 1
                return ext[L:]
        return []

    def propose(self, requests, k):
        self.forwards = []
        return {
            r.request_id: self.propose_tokens(r.all_token_ids, ki)
            for r, ki in zip(requests, self._per_request(requests, k))
            if ki > 0
        }


@dataclass
class _DraftKV:
    """Which positions of a request the draft cache holds: its tokens up to ``num_known`` are the
    request's own, then ``guesses`` (the draft tokens whose KV it wrote last time)."""

    num_known: int
    guesses: list[int]
    num_preemptions: int  # a preemption (recompute or swap) loses the draft's KV


class DraftModelProposer(Proposer):
    """A small model proposes k tokens autoregressively, from its own paged KV cache.

    Its cache is a second set of tensors (its own layers, heads and head size) with the same
    number of blocks as the target's, indexed by the same block tables: position ``i`` of a
    request sits in the same block id and offset in both caches. Each step it first *catches
    up*: one forward over the known tokens it has no (valid) KV for (the whole prompt the first
    time, then the tokens the target accepted plus its bonus token), which also yields guess 1;
    then ``k - 1`` one-token forwards yield guesses 2..k. Greedy requests take the draft's
    argmax; sampled ones draw from ``q`` (same temperature/top-k/top-p) and ``q`` is kept for
    the rejection rule.
    """

    name = "draft"
    needs_kv = True

    def __init__(
        self,
        model,
        kv,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: str,
        sampler,
        name: str = "draft",
    ):
        super().__init__()
        self.model = model
        self.kv = kv
        self.device = device
        self.backend = backend
        self.sampler = sampler  # the runner's: one random stream per request for draft and verify
        self.name = name
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model.num_layers)
        ]
        self.state: dict[str, _DraftKV] = {}
        self.probs: dict[str, torch.Tensor] = {}

    def _caches(self):
        abs_ = self.kv.attn_block_size
        if abs_ == self.kv.block_size:
            return self.kv_caches
        return [(k.view(-1, 1, *k.shape[2:]), v.view(-1, 1, *v.shape[2:])) for k, v in self.kv_caches]

    def num_valid(self, req: Request) -> int:
        """Positions whose draft KV is still right: the known tokens it had computed, plus the
        guesses the target accepted; never past the target's own KV (blocks beyond it may have
        been rolled back), and nothing after a preemption."""
        st = self.state.get(req.request_id)
        if st is None or st.num_preemptions != req.num_preemptions:
            return 0
        n = st.num_known
        for g in st.guesses:
            if n >= req.num_tokens or req.output_token_ids[n - req.num_prompt_tokens] != g:
                break
            n += 1
        return min(n, req.num_computed_tokens)

    def _forward(self, ids, q_lens, starts, tables) -> torch.Tensor:
        from ..worker.flat_batch import flat_batch

        input_ids, positions, meta, cu = flat_batch(
            ids, q_lens, starts, tables, self.kv.attn_block_size, self.device, self.backend
        )
        self.forwards.append((list(q_lens), [s + q for s, q in zip(starts, q_lens)]))
        return self.model(input_ids, positions, self._caches(), meta, (cu[1:] - 1).long().to(self.device))

    def _pick(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], Optional[torch.Tensor]]:
        params = [r.sampling_params for r in reqs]
        toks = logits.argmax(dim=-1).tolist()
        rand = [i for i, p in enumerate(params) if not p.greedy]
        q = None
        if rand:
            q = torch.zeros(logits.shape, dtype=torch.float32)
            q[rand] = self.sampler.probs(logits[rand], [params[i] for i in rand]).cpu()
            for i in rand:
                g = self.sampler.generator(reqs[i].request_id, params[i])
                toks[i] = int(torch.multinomial(q[i], 1, generator=g))
        return toks, q

    def propose(self, requests, k):
        self.forwards = []
        self.probs = {}
        work = [(r, ki) for r, ki in zip(requests, self._per_request(requests, k)) if ki > 0]
        if not work:
            return {}
        reqs = [r for r, _ in work]
        tables = [self.kv.block_table(r.request_id) for r in reqs]
        # 1) Catch up on the known tokens without draft KV; the last row gives guess 1.
        ids, q_lens, starts = [], [], []
        for r in reqs:
            v = min(self.num_valid(r), r.num_tokens - 1)  # always feed the newest token
            ids += r.all_token_ids[v:]
            q_lens.append(r.num_tokens - v)
            starts.append(v)
        toks, q = self._pick(self._forward(ids, q_lens, starts, tables), reqs)
        guesses = {r.request_id: [t] for r, t in zip(reqs, toks)}
        qs = {r.request_id: [q[i]] for i, r in enumerate(reqs)} if q is not None else {}
        # 2) k - 1 one-token steps: feed guess j, read guess j + 1 (only requests that want more).
        for j in range(1, max(ki for _, ki in work)):
            live = [i for i, (_, ki) in enumerate(work) if ki > j]
            sub = [reqs[i] for i in live]
            logits = self._forward(
                [guesses[r.request_id][-1] for r in sub],
                [1] * len(sub),
                [r.num_tokens + j - 1 for r in sub],
                [tables[i] for i in live],
            )
            toks, q = self._pick(logits, sub)
            for i, (r, t) in enumerate(zip(sub, toks)):
                guesses[r.request_id].append(t)
                if q is not None and r.request_id in qs:
                    qs[r.request_id].append(q[i])
        for r in reqs:
            g = guesses[r.request_id]
            # KV now holds the known tokens and every guess but the last (it was never fed back).
            self.state[r.request_id] = _DraftKV(r.num_tokens, g[:-1], r.num_preemptions)
            if not r.sampling_params.greedy:
                self.probs[r.request_id] = torch.stack(qs[r.request_id])
        return guesses

    def draft_probs(self, request_id, k):
        q = self.probs.get(request_id)
        return None if q is None else q[:k]

    def forget(self, request_id):
        self.state.pop(request_id, None)
        self.probs.pop(request_id, None)


# =====================================================================================
# What the engine calls each step
# =====================================================================================


def spec_limit(req: Request, k: int, max_model_len: int) -> int:
    """How many tokens to propose: a step emits up to k + 1 tokens, so never past
    ``max_tokens`` nor ``max_model_len``."""
    return max(
        0, min(k, req.sampling_params.max_tokens - req.num_output_tokens - 1, max_model_len - req.num_tokens - 1)
    )


# A guess a draft model has yet to make: it asks for k slots (``req.spec_token_ids = [DRAFT_SLOT] * k``),
# the scheduler grants and allocates what fits, and the draft then guesses into them.
DRAFT_SLOT = -1


class Speculator:
    """Per step, each decoding request's draft. The n-gram proposer guesses before scheduling; a draft
    model, which writes KV at the positions it guesses, asks for its slots first and guesses once the
    scheduler has granted and allocated them (``draft``). Either way the scheduler trims the draft to
    what fits the budget and the KV cache, and frees the rejected guesses' slots after the step."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int, draft_cost_model=None):
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft_cost_model = draft_cost_model
        self.last_draft_time = 0.0
        self.proposals: dict[str, list[int]] = {}  # this step's drafts by request id (what is verified)

    def propose(self, running: list[Request]) -> None:
        """Before scheduling: ``req.spec_token_ids`` for every decoding request, at most ``spec_limit``
        tokens: the n-gram proposer's guesses, or a draft model's ``DRAFT_SLOT`` placeholders."""
        for r in running:
            r.spec_token_ids = []
        reqs = [r for r in running if r.is_decoding]
        ks = [spec_limit(r, self.k, self.max_model_len) for r in reqs]
        if self.proposer.needs_kv:  # the draft writes KV: slots first
            for r, ki in zip(reqs, ks):
                r.spec_token_ids = [DRAFT_SLOT] * ki
            return
        proposals = self.proposer.propose(reqs, ks)
        for r, ki in zip(reqs, ks):
            r.spec_token_ids = list(proposals.get(r.request_id, []))[:ki]

    def draft(self, out) -> float:
        """After scheduling, before the forward: a draft model guesses into the slots the scheduler
        granted (``out``'s grants, a ``SchedulerOutput``); a slot it leaves unguessed is not verified
        (its KV goes back after the step). Returns the draft's modeled seconds for the clock."""
        if self.proposer.needs_kv:
            granted = [s for s in out.scheduled if s.spec_token_ids]
            guesses = self.proposer.propose([s.request for s in granted], [len(s.spec_token_ids) for s in granted])
            for s in granted:
                g = list(guesses.get(s.request.request_id, []))[: len(s.spec_token_ids)]
                s.num_new_tokens -= len(s.spec_token_ids) - len(g)
                s.spec_token_ids = g
        self.proposals = {s.request.request_id: list(s.spec_token_ids) for s in out.scheduled if s.spec_token_ids}
        cm = self.draft_cost_model
        self.last_draft_time = sum(cm.step_time(q, c) for q, c in self.proposer.forwards) if cm else 0.0
        return self.last_draft_time

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)


# --- building it ----------------------------------------------------------------------------


def resolve_draft_path(name: str) -> str:
    if name == "default-draft":
        from ..model.loader import DEFAULT_DRAFT_DIR

        if not (DEFAULT_DRAFT_DIR / "config.json").exists():
            raise ValueError(
                f"EngineConfig.speculative_model='default-draft': the shipped draft at "
                f"{DEFAULT_DRAFT_DIR} has no weights yet (run scripts/train_shakespeare.py)"
            )
        return str(DEFAULT_DRAFT_DIR)
    if not os.path.isdir(name):
        raise ValueError(
            f"EngineConfig.speculative_model={name!r}: expected a checkpoint directory, "
            "'default-draft' (the shipped draft) or 'ngram' (prompt lookup)"
        )
    return os.fspath(name)


def draft_kv_bytes_per_block(config, dtype: torch.dtype) -> int:
    """Bytes the draft's KV adds to each block (0 for the n-gram proposer): for memory sizing."""
    if config.speculative_model in (None, "ngram"):
        return 0
    from ..sim.costmodel import ModelSpec
    from ..model.loader import load_config

    draft = ModelSpec.from_hf_config(load_config(resolve_draft_path(config.speculative_model)))
    return draft.kv_block_bytes(config.block_size, torch.finfo(dtype).bits // 8)


class ScaledCostModel:
    """A cost model that knows no model shapes (e.g. a constant per step), scaled for the draft
    by the ratio of weights read: a guess, stated as such."""

    def __init__(self, base, ratio: float):
        self.base, self.ratio = base, ratio
        self.name = f"{getattr(base, 'name', 'cost-model')} x {ratio:.3g}"

    def step_time(self, num_new_tokens, context_lens) -> float:
        return self.base.step_time(num_new_tokens, context_lens) * self.ratio


def draft_cost_model(target_cost_model, draft_spec, target_spec):
    """The draft's cost model: the same hardware roofline for the draft's shape, or (for a cost
    model without shapes) the target's scaled by the weight ratio. None without a cost model."""
    from ..sim.costmodel import RooflineCostModel

    cm = target_cost_model
    if cm is None:
        return None
    if isinstance(cm, RooflineCostModel):
        return RooflineCostModel(
            cm.hardware,
            draft_spec,
            flops_efficiency=cm.flops_efficiency,
            bandwidth_efficiency=cm.bandwidth_efficiency,
            pcie_efficiency=cm.pcie_efficiency,
        )
    return ScaledCostModel(cm, draft_spec.weight_bytes / target_spec.weight_bytes)


def make_speculator(
    config, kv, target_spec, cost_model, device: torch.device, dtype: torch.dtype, backend: str, sampler
) -> Speculator:
    """The speculator ``EngineConfig.speculative_model`` names, built from the engine's parts: its KV
    manager (a draft model's cache uses the same block tables), the target's shape (``ModelSpec``) and cost
    model (the draft's is priced alike), the device and dtype, and the runner's attention ``backend`` and
    ``sampler`` (one random stream per request for draft and verification)."""
    draft_cm = None
    if config.speculative_model == "ngram":
        proposer: Proposer = NgramProposer()
    else:
        from ..sim.costmodel import ModelSpec
        from ..model.loader import load_model

        path = resolve_draft_path(config.speculative_model)
        dtype_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        model, hf = load_model(path, dtype_name, str(device), config.seed)
        if hf.vocab_size != target_spec.vocab_size:
            raise ValueError(
                f"EngineConfig.speculative_model={config.speculative_model!r}: vocabulary of "
                f"{hf.vocab_size} tokens, the target's has {target_spec.vocab_size} (a draft "
                "must share the target's tokenizer)"
            )
        proposer = DraftModelProposer(
            model,
            kv,
            kv.num_blocks,
            config.block_size,
            device,
            dtype,
            backend,
            sampler,
            name=os.path.basename(os.path.normpath(path)),
        )
        draft_cm = draft_cost_model(cost_model, ModelSpec.from_hf_config(hf), target_spec)
    check_protocol(proposer, Proposer, f"EngineConfig.speculative_model={config.speculative_model!r}")
    return Speculator(proposer, config.num_speculative_tokens, config.max_model_len, draft_cm)


# =====================================================================================
# Analysis: where speculation pays
# =====================================================================================


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one target step emits when each guess is accepted independently with probability
    ``alpha``: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r}: must be in [0, 1]")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(acceptance_rate: float, k: int, draft_cost_ratio: float) -> float:
    """Walltime improvement of speculative decoding over plain decoding (Leviathan et al. 2023):
    ``(1 - a^(k+1)) / ((1 - a) (k c + 1))``, ``a`` = per-token acceptance probability,
    ``c`` = the cost of one draft forward relative to one target forward.

    It assumes the verification of k + 1 positions costs one target step (memory bound,
    small batch); :func:`modeled_speedup` drops that assumption. Below 1, speculation is slower.
    """
    if k < 0 or draft_cost_ratio < 0:
        raise ValueError(f"k={k!r} and draft_cost_ratio={draft_cost_ratio!r} must be >= 0")
    return expected_tokens_per_step(acceptance_rate, k) / (k * draft_cost_ratio + 1.0)


def alpha_from_tokens_per_step(tokens_per_step: float, k: int) -> float:
    """Invert :func:`expected_tokens_per_step` (bisection): the per-token acceptance probability
    that explains a measured mean of tokens per target step."""
    if not 1.0 <= tokens_per_step <= k + 1:
        raise ValueError(f"tokens_per_step={tokens_per_step!r}: must be in [1, k + 1 = {k + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tokens_per_step else (lo, mid)
    return (lo + hi) / 2


def modeled_speedup(cost_model, draft_cost_model, batch: int, context_len: int, k: int, alpha: float) -> dict:
    """Speculation priced by cost models for ``batch`` requests decoding at ``context_len``.

    Plain decode: one target step of ``batch`` x 1 token per token. Speculative: k draft steps
    (``batch`` x 1 token each) + one target step of ``batch`` x (k + 1) tokens, emitting
    :func:`expected_tokens_per_step` tokens per request. At batch 1 the verification costs about a
    plain step (memory bound); at a large batch it is compute bound and costs up to k + 1 times
    as much, which is where speculation stops paying. Returns the pieces and ``speedup``.
    """
    B, c = int(batch), int(context_len)
    plain = cost_model.step_time([1] * B, [c] * B)
    draft = k * draft_cost_model.step_time([1] * B, [c] * B) if draft_cost_model is not None else 0.0
    verify_t = cost_model.step_time([k + 1] * B, [c + k + 1] * B)
    tokens = expected_tokens_per_step(alpha, k)
    spec_per_token = (draft + verify_t) / tokens
    return dict(
        batch=B,
        k=k,
        alpha=alpha,
        plain_step=plain,
        draft_time=draft,
        verify_time=verify_t,
        tokens_per_step=tokens,
        plain_time_per_token=plain,
        spec_time_per_token=spec_per_token,
        speedup=plain / spec_per_token,
    )


def spec_stats(records) -> dict:
    """Per-run numbers from StepRecords: proposed, accepted, acceptance rate (accepted / proposed)
    and mean tokens per target step (tokens a request emits per decode step it takes part in)."""
    proposed = sum(r.spec_proposed for r in records)
    accepted = sum(r.spec_accepted for r in records)
    steps = [e for r in records for e in r.batch if e.phase == "decode" and e.num_output_tokens > 0]
    spec_steps = [e for e in steps if e.num_spec_tokens]
    return dict(
        proposed=proposed,
        accepted=accepted,
        acceptance_rate=accepted / proposed if proposed else None,
        decode_steps=len(steps),
        spec_steps=len(spec_steps),
        tokens_per_target_step=(sum(1 + e.num_spec_accepted for e in steps) / len(steps) if steps else None),
    )
