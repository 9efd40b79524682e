"""Exercises of notebook 06, "Speculative decoding": the acceptance rule.

Speculative decoding (Leviathan et al., ICML 2023; Chen et al., 2023): a small draft model
proposes several tokens; the target model verifies them in a single forward pass. Accepted tokens
are kept, and the first rejection resets to that point.

One verification step of a request: the proposer guessed ``draft = [d1, .., dk]``; the target ran
one forward over the request's newest token and the k guesses, which gives k + 1 distributions:
row j is the target's next-token distribution *before* guess j + 1 (row 0: after the newest
token; row k: after all k guesses). The step emits the accepted guesses plus exactly one token
of the target's own: the correction at the first rejection, or a *bonus* token after all k.

* ``accept_greedy``: greedy requests keep a guess while it equals the target's argmax.
* ``accept_sampled``: sampled requests use rejection sampling, which keeps the output
  distributed exactly as the target alone would sample it, whatever the draft proposes.
* ``tokens_per_step`` and ``speculative_speedup``: what the rule buys on average, Leviathan et
  al.'s formula for the expected tokens per verification and the speed-up over plain decoding.
* ``first_losing_k`` (a judgement question): the draft length at which a draft/target pair
  stops paying, from speed-ups measured on the engine.

``speculative_engine(...)`` (given, at the bottom) builds an ``LLM`` whose verification step runs
*your* rule. Each docstring states the contract (``accept_sampled``'s order of random draws is
part of it: the graders replay them); notebook 06's exercise cell has optional hints. Check your
work with

    make grade EX=06            # or: MINILLM_IMPL=exercises pytest -m ex06 tests/test_exercises.py
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["accept_greedy", "accept_sampled", "tokens_per_step", "speculative_speedup", "first_losing_k",
           "verify", "speculative_engine"]


# =====================================================================================
# Exercise 1: greedy acceptance
# =====================================================================================

def accept_greedy(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """The tokens a greedy verification step emits.

    ``draft``: the k guesses. ``target``: k + 1 token ids, the target's argmax at each row
    (``target[j]`` is what the target itself would generate in place of guess j + 1).

    Rules: the output is exactly what greedy decoding with the target alone would produce
    from here, as far as one verification can tell. A guess is kept only if the target would
    have generated it and every guess before it was kept. After the kept guesses comes one
    token of the target's own: the correction in place of the first rejected guess, or the
    bonus after all k. Always at least one token, at most k + 1.

    >>> accept_greedy([5, 7, 9], [5, 7, 2, 4])      # 5, 7 accepted; 9 rejected, 2 in its place
    [5, 7, 2]
    >>> accept_greedy([5, 7], [5, 7, 8])            # all accepted, plus the bonus token
    [5, 7, 8]
    """
    ### BEGIN SOLUTION
    k = len(draft)
    a = 0
    while a < k and draft[a] == target[a]:
        a += 1
    return list(draft[:a]) + [int(target[a])]
    ### END SOLUTION


# =====================================================================================
# Exercise 2: rejection sampling
# =====================================================================================

def accept_sampled(draft: Sequence[int], p: torch.Tensor, q: Optional[torch.Tensor],
                   generator: torch.Generator) -> list[int]:
    """The tokens a sampled verification step emits (Leviathan et al. 2023, Chen et al. 2023).

    ``p`` [k + 1, V]: the target's probabilities at each row. ``q`` [k, V]: the draft's
    probabilities for each guess, or ``None`` for a deterministic proposer (the n-gram lookup:
    then ``q`` is one-hot at the guess, so ``q(x) = 1``). ``generator``: the request's random
    stream. Draw random numbers in exactly this order, so the engine's tests can replay them:

    For j = 0 .. k - 1, with x = ``draft[j]``, px = ``float(p[j, x])``, qx = ``float(q[j, x])``
    (1.0 when q is None):

    1. draw ``u = float(torch.rand((), generator=generator))``;
    2. **accept** x if ``u * qx < px`` (probability min(1, px / qx)) and go on to the next guess;
    3. otherwise **reject** it: build the residual ``max(0, p[j] - q[j])`` (with q None: ``p[j]``
       with entry x set to 0), fall back to ``p[j]`` itself if the residual sums to 0, draw one
       token ``int(torch.multinomial(residual / residual.sum(), 1, generator=generator))`` and
       return the accepted guesses followed by it.

    If all k guesses are accepted, draw the bonus token from row k,
    ``int(torch.multinomial(p[k], 1, generator=generator))``, and return all guesses + it.

    Why the residual: a guess is kept where the draft under-proposes nothing the target wants;
    where q puts more mass than p, part of it is rejected, and the residual puts back exactly
    the mass p has and q lacks. Together, each emitted token is distributed as p.
    """
    ### BEGIN SOLUTION
    k = len(draft)
    for j, x in enumerate(draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j, x])
        if float(torch.rand((), generator=generator)) * qx < px:
            continue
        if q is None:
            residual = p[j].clone()
            residual[x] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[j]
        tok = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return list(draft[:j]) + [tok]
    return list(draft) + [int(torch.multinomial(p[k], 1, generator=generator))]
    ### END SOLUTION


# =====================================================================================
# Exercise 3: the expected speed-up
# =====================================================================================

def tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens one verification step emits (Leviathan et al. 2023, eq. 1).

    Each of the k guesses is accepted with probability ``alpha`` (0 <= alpha <= 1), independently,
    as long as every guess before it was; the step then adds one token of the target's own (the
    correction or the bonus). So it emits i + 1 tokens when the first i guesses are kept:
    1 + alpha + alpha^2 + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha), which is k + 1 at
    alpha = 1 (every guess kept) and 1 at alpha = 0.

    >>> round(tokens_per_step(0.8, 4), 5)          # 1 + 0.8 + 0.64 + 0.512 + 0.4096
    3.3616
    """
    ### BEGIN SOLUTION
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    ### END SOLUTION


def speculative_speedup(alpha: float, k: int, draft_cost_ratio: float) -> float:
    """Walltime speed-up of speculation over plain decoding (Leviathan et al. 2023, Theorem 3.8).

    ``draft_cost_ratio`` c: one draft forward costs c target forwards. One verification step
    costs k draft forwards plus one target forward (verifying k + 1 positions costs what one plain
    decode step costs while decode is memory bound), that is k c + 1 target forwards, and emits
    ``tokens_per_step(alpha, k)`` tokens; plain decoding emits one token per target forward.
    Below 1, speculation makes decoding slower.

    >>> round(speculative_speedup(0.8, 4, 0.05), 3)  # 3.3616 tokens for 4 x 0.05 + 1 = 1.2 forwards
    2.801
    """
    ### BEGIN SOLUTION
    return tokens_per_step(alpha, k) / (k * draft_cost_ratio + 1.0)
    ### END SOLUTION


# =====================================================================================
# Exercise 4 (judgement): the draft length at which speculation stops paying
# =====================================================================================

def first_losing_k(speedup_at: Callable[[int], float], max_k: int = 8) -> Optional[int]:
    """The smallest draft length k (1 to ``max_k``) at which speculation stops paying: its
    speed-up over plain decoding, ``speedup_at(k)``, is at most 1 (a speed-up of exactly 1 gains
    nothing). None when every k up to ``max_k`` pays.

    ``speedup_at(k)`` measures a run of the engine with ``num_speculative_tokens=k`` (or evaluates
    a formula); each call may cost seconds, so ask for k = 1, 2, ... in turn, once each, and stop at
    the answer.

    >>> measured = {1: 1.11, 2: 1.10, 3: 0.93, 4: 0.81}      # speed-up by k, on the modeled clock
    >>> first_losing_k(measured.__getitem__, max_k=4)
    3
    """
    ### BEGIN SOLUTION
    for k in range(1, max_k + 1):
        if speedup_at(k) <= 1.0:
            return k
    return None
    ### END SOLUTION


# =====================================================================================
# Given: how your rule plugs into minillm (nothing to write below)
# =====================================================================================

def verify(logits: torch.Tensor, draft: Sequence[int], draft_probs: Optional[torch.Tensor], params,
           sampler, request_id: str, target_probs: Optional[torch.Tensor] = None) -> list[int]:
    """The engine's ``minillm.spec.acceptance.verify``, calling your two functions: greedy requests
    compare with the target's argmax, sampled ones get p (temperature, top-k, top-p applied)."""
    k = len(draft)
    if params.greedy:
        return accept_greedy(list(draft), logits.argmax(dim=-1).tolist())
    p = target_probs if target_probs is not None else sampler.probs(logits, [params] * (k + 1))
    q = None if draft_probs is None else draft_probs.cpu().float()
    return accept_sampled(list(draft), p.cpu(), q, sampler.generator(request_id, params))


def speculative_engine(model: str = "random", **config):
    """An ``LLM`` (with ``speculative_model=...`` and ``num_speculative_tokens=...`` among the
    ``config``) whose verification steps accept and reject with your rule.

    The runner applies ``EngineConfig.acceptance_rule`` (``minillm.spec.acceptance.verify`` by default)
    to each verifying request; this engine's is yours.
    """
    from minillm import LLM

    return LLM(model=model, **config, acceptance_rule=verify)
