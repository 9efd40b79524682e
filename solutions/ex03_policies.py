"""Exercises of notebook 03, "Scheduling policies": three policies, written against the engine's
policy interface and run inside the real scheduler.

A policy answers the scheduler's questions every step (``minillm/core/policies.py``):

* ``order_waiting(waiting, now)``: in what order are waiting requests considered for admission?
* ``pick_victim(candidates, now)``: a running request needs a KV block and none is free: who
  gives up its memory?
* ``preempt_for(request, running, now)``: may this waiting request push a running one out?
* ``on_step(scheduled, now)``: bookkeeping after every step (``scheduled`` is the list of
  ``ScheduledRequest`` that ran: ``.request``, ``.num_new_tokens``, ``.phase``).

Each class below plugs in like a built-in name::

    from minillm import LLM, impl
    ex = impl.load("ex03_policies")
    llm = LLM(policy=ex.SJFWithAging(aging=50.0))

Requests carry what a policy needs: ``arrival_time``, ``num_output_tokens`` (generated so far),
``num_tokens`` / ``num_computed_tokens``, ``priority``, ``tenant``, ``admit_seq`` (order of the
last admission) and ``policy_state``, a dict where a policy may keep its own per-request notes.
Each docstring states the contract (what comes in, what goes out, the rules, an example);
notebook 03's exercise cells have optional hints. Check your work with

    make grade EX=03            # or: MINILLM_IMPL=exercises pytest -m ex03 tests/test_exercises.py

The graders run your policy and the engine's own (``minillm.core.policies``) on the same traces and
compare every request's schedule, and check the bounds each policy promises (no starvation).
The scheduler under load (chunked prefill, scheduling every N steps, goodput, the queue cap) has
its exercises in ``ex03b_under_load.py``, beside notebook 03b.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Any, Optional, Sequence, Union

from minillm.core.policies import LengthPredictor, Policy, make_predictor
from minillm.core.request import Request

__all__ = ["SJFWithAging", "MLFQPolicy", "FairPolicy"]


# =====================================================================================
# Exercise 1: shortest job first, with aging
# =====================================================================================

class SJFWithAging(Policy):
    """Shortest (predicted) job first, with aging so that long requests cannot starve.

    SJF gives the smallest mean completion time when all job lengths are known, but long
    requests can starve, and the length must be *predicted*. ``predictor``
    is a name of ``minillm.core.policies`` ("oracle": the true length, only a simulation knows it;
    "history": the mean of finished requests of the same tenant; "prompt": hints in the text)
    or a ``LengthPredictor``. Aging forgives a waiting request ``aging`` predicted tokens for
    every second it has waited, so its rank improves until it is served.

    Non-preemptive: ``pick_victim`` (given) gives up the running request with the longest
    predicted remaining output.
    """
    name = "sjf-aging"

    def __init__(self, predictor: Union[str, LengthPredictor] = "oracle", aging: float = 100.0):
        if aging < 0:
            raise ValueError(f"SJFWithAging(aging={aging!r}): must be >= 0 (tokens per second waited)")
        self.predictor = make_predictor(predictor)
        self.aging = float(aging)

    def predicted(self, req: Request) -> float:
        """Predicted output length of ``req``, asked once and kept in ``req.policy_state``."""
        p = req.policy_state.get("sjf_predicted")
        if p is None:
            p = req.policy_state["sjf_predicted"] = float(self.predictor.predict(req))
        return p

    def remaining(self, req: Request) -> float:
        """Predicted tokens ``req`` still has to generate, given ``predicted(req)`` and the tokens
        it has generated so far (``req.num_output_tokens``).

        Rules: never below 0 (a request may outlive its prediction). A request preempted and
        requeued keeps the tokens it generated, so it is "shorter" now. Example: predicted 40,
        15 generated: 25; 45 generated: 0.
        """
        ### BEGIN SOLUTION
        return max(0.0, self.predicted(req) - req.num_output_tokens)
        ### END SOLUTION

    def key(self, req: Request, now: float) -> float:
        """The order key of a waiting request at time ``now`` (smaller goes first): its
        ``remaining`` tokens, forgiven ``aging`` tokens for every second it has waited since
        ``req.arrival_time`` (a request never counts negative waiting time).

        With ``aging = 0`` this is pure SJF. Example: 40 tokens remaining, arrived at 0.0,
        aging 10: key 40 at ``now = 0``, 20 at ``now = 2``. (Every waiting request ages at the
        same rate, so a request's rank among the others is fixed when it arrives: one predicted
        at P is passed only by requests that arrived before ``arrival + (P - P_min) / aging``.
        That is the bound that ends starvation.)
        """
        ### BEGIN SOLUTION
        return self.remaining(req) - self.aging * max(0.0, now - req.arrival_time)
        ### END SOLUTION

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        """The waiting requests in admission order: smallest ``key(req, now)`` first; equal
        keys by arrival time, earliest first. A new list; ``waiting`` itself is left as it is.
        """
        ### BEGIN SOLUTION
        return sorted(waiting, key=lambda r: (self.key(r, now), r.arrival_time))
        ### END SOLUTION

    # --- given ------------------------------------------------------------------------
    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (self.remaining(r), r.admit_seq))

    def on_step(self, scheduled: list, now: float) -> None:
        for s in scheduled:            # teach a history predictor the true length of finished requests
            r = s.request
            done = r.is_finished or r.pending_finish_reason is not None
            if done and not r.policy_state.get("sjf_observed"):
                r.policy_state["sjf_observed"] = True
                self.predictor.observe(r)

    def __repr__(self) -> str:
        return f"SJFWithAging(predictor={self.predictor!r}, aging={self.aging:g})"


# =====================================================================================
# Exercise 2: multi-level feedback queue, with tokens as the time slice
# =====================================================================================

class MLFQPolicy(Policy):
    """MLFQ for LLM serving (as in FastServe, Wu et al., 2023): new requests enter the top queue,
    and a request that uses up its queue's time slice is demoted to the next level; in LLM
    serving the natural time slice is a number of tokens generated.

    * Levels ``0 .. len(quanta)``: every request starts at level 0. At level ``i < len(quanta)``
      a request may generate ``quanta[i]`` tokens; then it moves to level ``i + 1`` and starts
      counting again. The last level has no quantum.
    * Waiting requests go by level (0 first), first come first served inside a level.
    * With ``preempt=True`` a waiting request that cannot be admitted (no free slot, no KV
      memory) pushes out a running request of a *deeper* level: short requests get in past
      long ones without any length prediction.
    * Every ``boost_interval`` seconds (the engine's clock) every request goes back to level 0
      (the priority boost, which prevents starvation); ``None`` turns boosting off.

    The per-request state (given): ``self.state(req)`` is a list ``[level, tokens counted at this
    level, epoch]``. A boost only increments ``self.epoch``: a request whose state is from an
    older epoch is lazily reset to ``[0, 0, epoch]`` the next time it is looked at.
    """
    name = "mlfq-yours"

    def __init__(self, quanta: Sequence[int] = (16, 64, 256), boost_interval: Optional[float] = 30.0,
                 preempt: bool = True):
        quanta = tuple(int(q) for q in quanta)
        if not quanta or any(q < 1 for q in quanta):
            raise ValueError(f"MLFQPolicy(quanta={quanta!r}): need at least one quantum, each >= 1 token")
        if boost_interval is not None and boost_interval <= 0:
            raise ValueError(f"MLFQPolicy(boost_interval={boost_interval!r}): must be > 0 or None")
        self.quanta = quanta
        self.boost_interval = boost_interval
        self.preempt = bool(preempt)
        self.epoch = 0                       # bumped by each boost
        self.num_boosts = 0
        self.last_boost: Optional[float] = None

    # --- given ------------------------------------------------------------------------
    def state(self, req: Request) -> list:
        """``[level, tokens counted at this level, epoch]`` of ``req`` (reset after a boost)."""
        st = req.policy_state.get("mlfq_yours")
        if st is None or st[2] != self.epoch:
            st = req.policy_state["mlfq_yours"] = [0, 0, self.epoch]
        return st

    def level(self, req: Request) -> int:
        return self.state(req)[0]

    @staticmethod
    def new_output_tokens(req: Request) -> int:
        """Output tokens ``req`` generated since the last call for it (0 the second time)."""
        last = req.policy_state.get("mlfq_yours_seen", 0)
        req.policy_state["mlfq_yours_seen"] = req.num_output_tokens
        return max(0, req.num_output_tokens - last)

    # --- yours ---------------------------------------------------------------------------
    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        """The waiting requests in admission order (a new list): shallower levels first (level 0
        before 1), first come first served inside a level."""
        ### BEGIN SOLUTION
        return sorted(waiting, key=lambda r: (self.level(r), r.arrival_time))
        ### END SOLUTION

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        """The running request to give up its memory: one at the *deepest* level among the
        candidates (the longest-running kind); among those, the most recently admitted (the
        largest ``admit_seq``), which has done the least work there. Example: levels 0, 2, 1, 2
        admitted in that order: the fourth."""
        ### BEGIN SOLUTION
        return max(candidates, key=lambda r: (self.level(r), r.admit_seq))
        ### END SOLUTION

    def preempt_for(self, request: Request, running: list[Request], now: float) -> Optional[Request]:
        """A running request that the waiting ``request`` may push out, or ``None``.

        Rules: only with ``preempt`` on; only a request at a strictly *deeper* level than
        ``request``'s (never one at the same level); among those, the one ``pick_victim``
        would choose."""
        ### BEGIN SOLUTION
        if not self.preempt:
            return None
        lvl = self.level(request)
        lower = [r for r in running if self.level(r) > lvl]
        return self.pick_victim(lower, now) if lower else None
        ### END SOLUTION

    def on_step(self, scheduled: list, now: float) -> None:
        """Bookkeeping after each step (``now``: the clock at its end; ``scheduled``: who ran).

        **Demotion.** Afterwards, every request that ran is at the level its output tokens put
        it at: the tokens it generated in the step (``new_output_tokens``) count at its level
        (``state(req)[1]``); a request that has counted ``quanta[i]`` tokens at level ``i``
        moves to level ``i + 1`` and the tokens beyond the quantum count there. One step can
        emit several tokens (speculative decoding) and so cross several levels at once. The
        last level has no quantum. Example: quanta ``(2, 3, 4)``, a request at level 0 that has
        counted 1 token emits 10 in one step: 11 = 2 + 3 + 4 + 2, so it ends at level 3 with 2
        counted.

        **Boost** (only when ``boost_interval`` is not None). The very first call only starts
        the timer (``self.last_boost = now``). Later, once at least ``boost_interval`` seconds
        have passed since ``self.last_boost``: every request goes back to level 0 (increment
        ``self.epoch``; ``state`` resets the rest lazily), ``self.num_boosts`` counts it, and
        the timer restarts at ``now``.
        """
        ### BEGIN SOLUTION
        for s in scheduled:
            st = self.state(s.request)
            st[1] += self.new_output_tokens(s.request)
            while st[0] < len(self.quanta) and st[1] >= self.quanta[st[0]]:
                st[1] -= self.quanta[st[0]]
                st[0] += 1
        if self.boost_interval is None:
            return
        if self.last_boost is None:
            self.last_boost = now
        elif now - self.last_boost >= self.boost_interval:
            self.epoch += 1
            self.num_boosts += 1
            self.last_boost = now
        ### END SOLUTION

    def __repr__(self) -> str:
        return f"MLFQPolicy(quanta={self.quanta}, boost_interval={self.boost_interval}, preempt={self.preempt})"


# =====================================================================================
# Exercise 3: fair queuing across tenants (virtual token counters)
# =====================================================================================

class FairPolicy(Policy):
    """Fair queuing across tenants: an equal share of service per tenant, for multi-tenant systems
    (at the price of more bookkeeping); the virtual token counter of VTC (Sheng et al., OSDI 2024).

    Each tenant (``request.tenant``; ``None`` is a tenant too) has a counter of the service it has
    received (``self.counters``): ``input_weight`` per prompt token prefilled plus
    ``output_weight`` per token generated (generating costs more: it takes a step per token).
    The tenant that has received the least is served next; inside a tenant, first come first
    served. This is the virtual token counter (VTC) of Sheng et al., OSDI 2024, without its
    refinements (the engine's ``minillm.core.policies.Fair`` adds tenant weights, and lifts a tenant
    returning from idleness to the others' level so idle time is not banked as credit).
    """
    name = "fair-yours"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        if input_weight < 0 or output_weight < 0:
            raise ValueError(f"FairPolicy(input_weight={input_weight!r}, output_weight={output_weight!r}): "
                             "must be >= 0")
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.counters: dict[Any, float] = defaultdict(float)

    @staticmethod
    def new_output_tokens(req: Request) -> int:
        """(Given.) Output tokens ``req`` generated since the last call for it."""
        last = req.policy_state.get("fair_yours_seen", 0)
        req.policy_state["fair_yours_seen"] = req.num_output_tokens
        return max(0, req.num_output_tokens - last)

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        """Every waiting request once, in an admission order that interleaves the tenants by
        their counters.

        Rules:

        * inside a tenant, first come first served (by ``arrival_time``);
        * each next place in the order goes to the tenant with the smallest counter, where a
          tenant's counter includes a *provisional* charge for each of its requests already
          placed in this order: ``input_weight`` per token it has to prefill
          (``num_tokens - num_computed_tokens``). So one pass does not admit a whole burst
          from one tenant;
        * equal counters: the tenant whose oldest waiting request arrived first goes first;
        * the provisional charges are for this ordering only: ``self.counters`` is unchanged
          (a request in the order may still not be admitted).

        Example: counters at 0; tenant x waits with x1 (10 tokens, oldest), x2; tenant y with
        y1 (30 tokens), y2. Order: x1 (tie, x's oldest came first; x now at 10), y1 (y at 0;
        then 30), x2 (x at 10), y2.
        """
        ### BEGIN SOLUTION
        queues: dict[Any, list[Request]] = {}
        for r in sorted(waiting, key=lambda r: r.arrival_time):
            queues.setdefault(r.tenant, []).append(r)
        heap = [(self.counters[t], i, t) for i, t in enumerate(queues)]
        heapq.heapify(heap)
        pos = {t: 0 for t in queues}
        order = []
        while heap:
            c, i, t = heapq.heappop(heap)
            r = queues[t][pos[t]]
            order.append(r)
            pos[t] += 1
            if pos[t] < len(queues[t]):
                todo = max(0, r.num_tokens - r.num_computed_tokens)
                heapq.heappush(heap, (c + self.input_weight * todo, i, t))
        return order
        ### END SOLUTION

    def on_step(self, scheduled: list, now: float) -> None:
        """Charge each tenant (``self.counters[tenant]``) for what its requests received in this
        step: ``output_weight`` per token generated (``new_output_tokens``), and for a prefill
        (``s.phase == "prefill"``) ``input_weight`` per prompt token processed
        (``s.num_new_tokens``). A decode step's token is paid as output only.

        Example (weights 1 and 2): a 12-token prompt prefilled in one step, then 5 tokens
        generated in all: 12 + 2 x 5 = 22."""
        ### BEGIN SOLUTION
        for s in scheduled:
            r = s.request
            charge = self.output_weight * self.new_output_tokens(r)
            if s.phase == "prefill":
                charge += self.input_weight * s.num_new_tokens
            self.counters[r.tenant] += charge
        ### END SOLUTION

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        """(Given.) The request of the tenant served most, most recently admitted first."""
        return max(candidates, key=lambda r: (self.counters[r.tenant], r.admit_seq))

    def __repr__(self) -> str:
        return f"FairPolicy(input_weight={self.input_weight:g}, output_weight={self.output_weight:g})"
