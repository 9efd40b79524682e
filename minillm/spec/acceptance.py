"""The acceptance rule of speculative decoding: which drafted tokens the target keeps, and one of its own.

``verify`` is the default (``EngineConfig.acceptance_rule=None``); ``check_verified`` checks what any rule
returned before the engine counts it. Leviathan et al. (ICML 2023) and Chen et al. (2023) prove that
accepting guess x with probability min(1, p(x)/q(x)), and on a rejection sampling from norm(max(0, p - q)),
emits tokens distributed exactly as the target's p.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch


def verify(
    logits: torch.Tensor,
    draft: Sequence[int],
    draft_probs: Optional[torch.Tensor],
    params,
    sampler,
    request_id: str,
    target_probs: Optional[torch.Tensor] = None,
) -> list[int]:
    """The tokens one verification step emits: the accepted draft prefix plus one target token.

    ``logits`` [k + 1, V]: the target's logits after the request's newest token and after
    each of the k draft tokens. ``draft_probs`` [k, V]: the draft's distribution ``q`` for
    each guess, or None for a deterministic proposer (``q`` one-hot at the guess).
    Random draws use the request's own generator (``sampler.generator``), the same stream
    the draft sampled from, so seeded requests stay reproducible. ``target_probs`` [k + 1, V]:
    ``p`` if already computed (the runner batches it), else computed here from ``logits``.
    """
    k = len(draft)
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        a = 0
        while a < k and draft[a] == target[a]:  # accept while the draft matches the argmax
            a += 1
        return list(draft[:a]) + [target[a]]  # the correction, or the bonus token if a == k
    p = target_probs if target_probs is not None else sampler.probs(logits, [params] * (k + 1))
    p = p.cpu()  # the target's distribution (temperature, top-k/p)
    q = None if draft_probs is None else draft_probs.cpu().float()
    g = sampler.generator(request_id, params)
    for j, x in enumerate(draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j, x])
        if float(torch.rand((), generator=g)) * qx < px:  # accept with probability min(1, p/q)
            continue
        # Rejected: sample from the residual norm(max(0, p - q)), the part of p that q under-covers.
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: nothing to correct
            residual = p[j]
        tok = int(torch.multinomial(residual / residual.sum(), 1, generator=g))
        return list(draft[:j]) + [tok]
    return list(draft) + [int(torch.multinomial(p[k], 1, generator=g))]  # all accepted: bonus token


def check_verified(hook, tokens, draft: Sequence[int], vocab_size: int, request_id: str) -> list[int]:
    """What an acceptance rule (``ModelRunner.verify``) returned, checked before the engine
    counts it: token ids (plain ints) in the vocabulary, the accepted guesses a prefix of the
    draft, plus exactly one token of the target's: 1 to k + 1 tokens in all."""

    def bad(why: str):
        name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"
        return ValueError(
            f"ModelRunner.verify (the acceptance rule {name}) returned {tokens!r} for "
            f"request {request_id!r} with draft {list(draft)} (k={len(draft)}): {why}"
        )

    toks = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    if isinstance(toks, (str, bytes)) or not isinstance(toks, (list, tuple)):
        raise bad("expected a list of token ids")
    out = []
    for t in toks:
        if isinstance(t, bool):
            raise bad(f"{t!r} is not a token id")
        try:
            t = operator.index(t)
        except TypeError:
            raise bad(f"{t!r} is not a token id (an integer)") from None
        if not 0 <= t < vocab_size:
            raise bad(f"token {t} is outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    k = len(draft)
    if not 1 <= len(out) <= k + 1:
        raise bad(f"{len(out)} tokens; a verification emits the accepted guesses plus one token: 1 to {k + 1}")
    if out[:-1] != [int(d) for d in draft[: len(out) - 1]]:
        raise bad(f"the accepted tokens {out[:-1]} are not the first {len(out) - 1} draft tokens")
    return out
