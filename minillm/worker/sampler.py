"""Sampling: turn each request's logits into its next token.

First the logits are adjusted where a request asks for it (``apply_penalties``:
``logit_bias``, then the repetition, frequency and presence penalties; ``mask_stop_tokens``: no stop token
before ``min_tokens``). Greedy rows then take the argmax (all at once). The others
are scaled by their temperature, cut to min-p, then to top-k / top-p in one batched sort, and
drawn with the request's own generator, so a seeded request gives the same tokens
whatever else shares its batch. ``token_logprobs`` reports what the model thought
of the chosen token: log-softmax of its unadjusted logits.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..sampling_params import SamplingParams


def filter_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p, batched over rows. [R, V] float32.
    ``top_k`` <= 0 keeps every token; ``min_p`` (vLLM's, Nguyen et al. 2024) drops the tokens less
    likely than ``min_p`` times the most likely one and renormalizes what is left."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if min_p is not None:
        probs = probs * (probs >= min_p[:, None] * probs.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    cum = sorted_p.cumsum(-1)
    keep = (rank < k) & ((cum - sorted_p) < top_p[:, None])  # always keeps the top token
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def apply_penalties(logits: torch.Tensor, requests) -> torch.Tensor:
    """The penalties of each row's request, on a copy of ``logits`` [R, V], in vLLM's order:

    * ``logit_bias`` (the OpenAI API's): each listed token's logit gets its bias added;
    * ``repetition_penalty`` p (Keskar et al. 2019, as transformers'
      ``RepetitionPenaltyLogitsProcessor``): every token of the prompt or the output so far has
      its logit divided by p if positive, multiplied by p if not;
    * ``frequency_penalty`` f and ``presence_penalty`` a (the OpenAI API's): a token that
      occurs c times in the output so far loses ``f * c + a * (c > 0)``.
    """
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        sp = req.sampling_params
        row = logits[i]
        if sp.logit_bias:
            ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=logits.device)
            row[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), dtype=torch.long, device=logits.device
            )
            x = row[seen]
            row[seen] = torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty)
        if (sp.frequency_penalty or sp.presence_penalty) and req.output_token_ids:
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long), minlength=vocab).to(
                device=logits.device, dtype=logits.dtype
            )
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def unusable(rows: torch.Tensor, probabilities: bool = False) -> list[Optional[str]]:
    """Why each row of ``rows`` [R, V] (logits, or with ``probabilities`` the distribution drawn from)
    cannot be sampled; None where it can. A NaN or +inf (float32 overflow, e.g. logits divided by a
    tiny repetition penalty), no finite logit left, probabilities negative or all zero."""
    what = "probabilities" if probabilities else "logits"
    if not probabilities and bool(torch.isfinite(rows.amax(-1)).all()):
        return [None] * len(rows)  # one pass: a row's max is NaN, +inf or -inf only if it is unusable
    nan = torch.isnan(rows).any(-1).tolist()
    posinf = torch.isposinf(rows).any(-1).tolist()
    if probabilities:  # a distribution: nothing negative, something to draw
        empty = ((rows < 0).any(-1) | ~(rows.sum(-1) > 0)).tolist()
        nothing = "its probabilities are negative or all zero"
    else:
        empty = (~torch.isfinite(rows)).all(-1).tolist()
        nothing = "no logit is finite"
    whys: list[Optional[str]] = []
    for has_nan, has_posinf, is_empty in zip(nan, posinf, empty):
        whys.append(
            f"its {what} contain NaN"
            if has_nan
            else f"its {what} contain +inf"
            if has_posinf
            else nothing
            if is_empty
            else None
        )
    return whys


def sample_plain(sampler: "Sampler", logits: torch.Tensor, plain: list, res) -> None:
    """One token per plain row into ``res`` (an ``ExecutionResult``): a request that forks samples
    its row once per completion, each with its completion's stream; penalties, ``min_tokens`` and
    logprobs. ``plain``: (logits row, grant index, ScheduledRequest). A request whose row (or one of
    its fork's rows) cannot be sampled gets no token and its reason in ``res.failed``."""
    from ..core.parallel_sampling import completion_id

    rows, params, ids, reqs, grants = [], [], [], [], []  # grants: the grant index, None for a fork's
    for r, g, s in plain:
        req = s.request
        rows.append(r)
        params.append(req.sampling_params)
        ids.append(req.request_id)
        reqs.append(req)
        grants.append(g)
        parent = req.parent
        if parent is not None and not parent.forked:  # the fork: n - 1 more first tokens
            for i in range(1, parent.n):
                rows.append(r)
                params.append(parent.params[i])
                ids.append(completion_id(parent.request_id, i))
                reqs.append(req)  # same prompt, same (empty) output
                grants.append(None)
    raw = logits[rows].float()
    adjusted = raw
    if any(p.penalized for p in params):
        adjusted = apply_penalties(raw, reqs)
    if any(p.min_tokens for p in params):
        adjusted = mask_stop_tokens(adjusted if adjusted is not raw else raw.clone(), reqs)
    toks, failed_rows = sampler.sample(adjusted, params, ids)
    for j, why in failed_rows.items():  # a fork's row fails its whole group (it has not forked)
        res.failed.setdefault(reqs[j].request_id, f"sampling failed: {why}")
    ok = [j for j in range(len(toks)) if reqs[j].request_id not in res.failed]
    want = [j for j in ok if params[j].logprobs is not None]
    logp = torch.log_softmax(raw[want], dim=-1) if want else None
    for j in ok:
        if grants[j] is not None:
            res.sampled[grants[j]] = [toks[j]]
        else:
            res.fork_sampled[ids[j]] = [toks[j]]
    for row, j in enumerate(want):
        res.logprobs[ids[j]] = [token_logprobs(logp[row], toks[j], params[j].logprobs)]


def stop_token_ids(req) -> list[int]:
    """The tokens that would end ``req``: its stop_token_ids, and EOS unless ignore_eos."""
    sp = req.sampling_params
    ids = list(sp.stop_token_ids)
    if req.eos_token_id is not None and not sp.ignore_eos:
        ids.append(req.eos_token_id)
    return ids


def mask_stop_tokens(logits: torch.Tensor, requests) -> torch.Tensor:
    """``min_tokens``: while a request has fewer output tokens, its stop tokens cannot be drawn
    (their logits become -inf), as transformers' ``MinNewTokensLengthLogitsProcessor``."""
    for i, req in enumerate(requests):
        if len(req.output_token_ids) < req.sampling_params.min_tokens:
            ids = stop_token_ids(req)
            if ids:
                logits[i, ids] = float("-inf")
    return logits


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict:
    """``{token id: Logprob}`` for one position: the ``k`` most likely tokens and ``token``
    (the one sampled, or the prompt's), from a row of log-probabilities [V]. Rank 1 = most likely."""
    from ..outputs import Logprob

    lp = logprobs.float().cpu()
    out = {}
    if k:
        top = torch.topk(lp, k)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            out[t] = Logprob(v, r + 1)
    if token not in out:
        v = lp[token]
        out[token] = Logprob(float(v), int((lp > v).sum()) + 1)
    return out


class Sampler:
    def __init__(self, seed: int = 0):
        self.default_gen = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self._saved: Optional[dict] = None  # random streams as they were when the step began

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_gen
        g = self.generators.get(request_id)
        if g is None:
            g = self.generators[request_id] = torch.Generator().manual_seed(params.seed)
            if self._saved is not None:
                self._saved.setdefault(request_id, None)  # new in this step
        elif self._saved is not None and request_id not in self._saved:
            self._saved[request_id] = g.get_state()
        return g

    # --- one step, all or nothing: a failed step draws no random numbers -------------------
    def checkpoint(self) -> None:
        self._saved = {None: self.default_gen.get_state()}

    def rollback(self) -> None:
        saved, self._saved = self._saved, None
        for rid, state in (saved or {}).items():
            if rid is None:
                self.default_gen.set_state(state)
            elif state is None:
                self.generators.pop(rid, None)
            else:
                self.generators[rid].set_state(state)

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        t = torch.tensor([max(p.temperature, 1e-6) for p in params], device=dev)
        k = torch.tensor([min(p.top_k, logits.shape[-1]) for p in params], device=dev)  # k >= V: all
        tp = torch.tensor([p.top_p for p in params], device=dev)
        mp = torch.tensor([p.min_p for p in params], device=dev) if any(p.min_p for p in params) else None
        return filter_probs(logits.float(), t, k, tp, mp)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        request_ids: list[str],
        probs: Optional[torch.Tensor] = None,
    ) -> tuple[list[Optional[int]], dict[int, str]]:
        """One token per row of ``logits`` [R, V], and the rows that could not be sampled, each with
        why (``unusable``, or a draw that raised): such a row gets None and draws nothing from any
        random stream, so every other row gets what it would have got without it."""
        failed = {i: why for i, why in enumerate(unusable(logits)) if why}
        out: list[Optional[int]] = logits.argmax(dim=-1).tolist()
        rand_rows = [i for i, p in enumerate(params) if not p.greedy]
        if rand_rows:
            if probs is None:
                probs = self.probs(logits[rand_rows], [params[i] for i in rand_rows])
            probs = probs.cpu()
            for j, (i, why) in enumerate(zip(rand_rows, unusable(probs, probabilities=True))):
                if i in failed or why:
                    failed.setdefault(i, why)
                    continue
                try:
                    out[i] = int(torch.multinomial(probs[j], 1, generator=self.generator(request_ids[i], params[i])))
                except RuntimeError as e:
                    failed[i] = f"the draw failed: {e}"
        for i in failed:
            out[i] = None
        return out, failed
