"""Preemption: who gives back its KV when memory or a seat runs out, and how (recompute or swap).

A victim either drops its KV and recomputes it later (back to the front of the waiting queue) or has it copied
to host memory and back (swap); "auto" picks by the preemption cost rule. A parallel-sampling group goes together.
``schedule_swapped`` is the way back: swapped-out requests return (step 2 of the pass) before anyone new.

The modes are a registry (``PREEMPTION_MODES``): a mode says whether it can take a victim now
(``possible``) and gives back the victim's KV (``evict``), returning where the victim waits (its new
status) and whether its KV is kept. ``Scheduler.preempt`` is the transition that calls it. A new mode
is a class here, its name in ``EngineConfig.preemption_mode``'s choices (``config.py``, read from this
registry), and whatever its KV manager needs to hold the KV elsewhere.
"""

from __future__ import annotations

from .request import Request, RequestStatus
from ..step_record import WaitingEntry


class Recompute:
    """Drop the KV: the victim waits again at the front of the queue and computes it again later."""

    name = "recompute"

    def possible(self, sched, victim: Request) -> bool:
        return True

    def evict(self, sched, victim: Request, out) -> tuple[RequestStatus, bool]:
        sched.kv.free(victim)
        sched.counters["recomputed_tokens"] += victim.num_computed_tokens
        sched.writable_waiting().insert(0, victim)  # back to the front of the queue
        return RequestStatus.PREEMPTED, False


class Swap:
    """Copy the KV to host memory (``out.swap_out``): the victim waits in ``sched.swapped``."""

    name = "swap"

    def possible(self, sched, victim: Request) -> bool:
        return sched.kv.supports_swapping and sched.kv.can_swap_out(victim)

    def evict(self, sched, victim: Request, out) -> tuple[RequestStatus, bool]:
        mapping = sched.kv.swap_out(victim)
        out.swap_out.extend(mapping)
        sched.counters["swapped_out_blocks"] += len(mapping)
        sched.swapped.append(victim)
        return RequestStatus.SWAPPED, True


PREEMPTION_MODES = {mode.name: mode for mode in (Recompute(), Swap())}


def choose_mode(sched, victim: Request) -> str:
    """The preemption mode for ``victim`` (``EngineConfig.preemption_mode``; "auto" asks the cost model);
    "recompute" when the mode cannot take it now (the swap pool is full)."""
    mode = sched.config.preemption_mode
    if mode == "auto":
        # The preemption cost rule: swap when M_KV / B_PCIe < (n_input + n_generated) / S_prefill.
        cm = sched.cost_model
        if cm is None or not getattr(cm, "kv_bytes_per_token", 0):
            return "recompute"
        mode = cm.preemption_mode(victim.num_computed_tokens)
    if not PREEMPTION_MODES[mode].possible(sched, victim):
        return "recompute"  # e.g. swap pool full: fall back
    return mode


def preempt_group(sched, victim: Request, out, reason: str) -> int:
    """Preempt ``victim``, and with it the other running sequences of its parallel-sampling
    group (a group is preempted together). Returns the budget tokens given back."""
    group = [victim]
    p = victim.parent
    if p is not None and p.forked:
        group += [m for m in p.members if m is not victim and m.status is RequestStatus.RUNNING and m in sched.running]
    budget = 0
    for m in group:
        budget += unschedule(m, out)
        sched.preempt(
            m,
            out,
            reason if m is victim else f"{reason}; preempted with {victim.request_id}, its parallel-sampling group",
        )
    return budget


def just_placed(req: Request, out) -> bool:
    """Admitted or swapped in by this very pass, or a member of its parallel-sampling group was: not
    preempted by it (no ping-pong; the group goes together, and a block swapped in is filled only
    after the pass's swap-outs have read theirs)."""
    p = req.parent
    group = p.members if p is not None and p.forked else (req,)
    return any(m.request_id in out.admitted or m.request_id in out.swapped_in for m in group)


def unschedule(victim: Request, out) -> int:
    """Take a running request back out of this step's batch (it is about to be preempted);
    returns the budget tokens it gave back (none if this pass has not granted it any yet).
    A search of the batch: preemptions are rare, grants happen for every request every step."""
    for i, s in enumerate(out.scheduled):
        if s.request is victim:
            del out.scheduled[i]
            return s.num_new_tokens
    return 0


def schedule_swapped(sched, out, budget: int) -> int:
    """2. Swapped-out requests come back (KV copied in) before anybody new is admitted, oldest
    first while blocks and seats allow. Returns the budget left."""
    cfg = sched.config
    while sched.swapped and sched.num_seqs() + sched.swapped[0].num_seqs <= cfg.max_num_seqs and budget > 0:
        req = sched.swapped[0]
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        ok, need, free = sched.kv.can_swap_in(req, n)
        if not ok:
            out.waiting.append(
                WaitingEntry(req.request_id, f"swapped out: needs {need} blocks to come back, {free} free")
            )
            break
        sched.swap_in(req, n, out)
        budget -= n
    for req in sched.swapped[1:]:
        out.waiting.append(WaitingEntry(req.request_id, f"swapped out: queued behind {sched.swapped[0].request_id}"))
    return budget
