"""Scheduling policies: who goes first, and who is preempted.

A policy plugs into the scheduler through three questions, asked every step:

* ``order_waiting(waiting, now)``: in what order should waiting requests be
  considered for admission? (FCFS: arrival order.)
* ``pick_victim(candidates, now)``: a running request cannot get its next KV
  block; which one gives up its memory? (Default: the most recently admitted.)
* ``preempt_for(request, running, now)``: may this waiting request push a
  running one out (priority)? Return the victim or None.

and may keep its own bookkeeping in ``on_step(scheduled, now)``, called after
every step with the ``ScheduledRequest`` list that ran. A class you write plugs
in the same way as a built-in name: ``LLM(policy=MyPolicy())`` or
``LLM(policy="fcfs")``.

The built-in policies are the usual scheduling policies of LLM serving (notebook 03):

| name       | class      | order of the waiting queue                  | preempts a running request   |
|------------|------------|---------------------------------------------|------------------------------|
| "fcfs"     | ``FCFS``     | arrival                                     | never                        |
| "sjf"      | ``SJF``      | shortest predicted remaining output, aged   | never                        |
| "priority" | ``Priority`` | lower ``priority`` value first, FCFS inside | of a lower class, if it must |
| "mlfq"     | ``MLFQ``     | queue level (tokens generated), FCFS inside | of a lower level, if it must |
| "fair"     | ``Fair``     | tenant with the least weighted service      | never                        |

"If it must": only when the waiting request cannot be admitted otherwise (no free
slot under ``max_num_seqs``, or no KV memory): the fix for head-of-line blocking across classes.
Policies keep per-request state in ``request.policy_state`` (a dict).
"""

from __future__ import annotations

import heapq
import numbers
from collections import defaultdict
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

from .request import Request
from ..checks import check_protocol

__all__ = [
    "Policy",
    "FCFS",
    "SJF",
    "Priority",
    "MLFQ",
    "Fair",
    "POLICIES",
    "make_policy",
    "LengthPredictor",
    "OraclePredictor",
    "HistoryPredictor",
    "PromptPredictor",
    "make_predictor",
]


@runtime_checkable
class Policy(Protocol):
    """The scheduling-policy contract (the module's docstring is its lesson): four hooks, with defaults.

    A class that subclasses ``Policy`` inherits the defaults and overrides what it changes (FCFS changes
    nothing); any object with the four hooks keeps the contract too. ``make_policy`` checks a policy
    object against it when the engine is built, naming a missing hook."""

    name: str = "base"

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        return waiting

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: r.admit_seq)  # the most recently admitted

    def preempt_for(self, request: Request, running: list[Request], now: float) -> Optional[Request]:
        return None

    def on_step(self, scheduled: list, now: float) -> None:
        """Called after each step with the list of ScheduledRequest that ran."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _generated_since_last_look(req: Request, key: str) -> int:
    """Output tokens this request produced since the policy last looked (policy_state[key])."""
    last = req.policy_state.get(key, 0)
    req.policy_state[key] = req.num_output_tokens
    return max(0, req.num_output_tokens - last)


def _is_done(req: Request) -> bool:
    return req.is_finished or req.pending_finish_reason is not None


# =====================================================================================
# FCFS
# =====================================================================================


class FCFS(Policy):
    """First come, first served: arrival order (preempted requests go back to the front).

    Fair by construction and free of starvation, but short requests queue behind long ones
    (head-of-line blocking).
    """

    name = "fcfs"


# =====================================================================================
# SJF and its output-length predictors
# =====================================================================================


@runtime_checkable
class LengthPredictor(Protocol):
    """The output-length predictor contract: how many tokens a request will generate (SJF's missing input).

    ``predict(request) -> float`` is asked once per request, when SJF first sees it;
    ``observe(request)`` is told about every finished request (its true length is known). Subclass it
    to inherit ``observe`` (which learns nothing); ``make_predictor`` checks an object against it.
    """

    name: str = "predictor"

    def predict(self, request: Request) -> float:
        raise NotImplementedError

    def observe(self, request: Request) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class OraclePredictor(LengthPredictor):
    """The true length: the trace's ``expected_output_len``, else ``max_tokens``.

    Only a simulation knows this; it gives SJF's best case (SJF minimises the mean
    completion time when all job lengths are known).
    """

    name = "oracle"

    def predict(self, request: Request) -> float:
        if request.expected_output_len is not None:
            return float(request.expected_output_len)
        return float(request.max_tokens)


class HistoryPredictor(LengthPredictor):
    """Historical statistics: the mean output length of finished requests of the same class.

    ``key`` picks the class: "tenant" (default), "priority", or a function of the request.
    An unseen class falls back to the mean over all classes, then to ``prior`` tokens.
    It never reads ``max_tokens`` (in a simulation that would be the oracle's answer).
    """

    name = "history"

    def __init__(self, key: Union[str, Callable[[Request], Any]] = "tenant", prior: float = 128.0):
        if isinstance(key, str):
            if key not in ("tenant", "priority"):
                raise ValueError(f"HistoryPredictor(key={key!r}): 'tenant', 'priority' or a function")
            attr = key
            key = lambda r: getattr(r, attr)  # noqa: E731
        self.key = key
        self.prior = float(prior)
        self.sums: dict[Any, float] = defaultdict(float)
        self.counts: dict[Any, int] = defaultdict(int)

    def predict(self, request: Request) -> float:
        k = self.key(request)
        if self.counts.get(k):
            return self.sums[k] / self.counts[k]
        n = sum(self.counts.values())
        return sum(self.sums.values()) / n if n else self.prior

    def observe(self, request: Request) -> None:
        k = self.key(request)
        self.sums[k] += request.num_output_tokens
        self.counts[k] += 1


class PromptPredictor(LengthPredictor):
    """Signals in the user's prompt: 'brief answer' is short, 'explain in detail' long.

    With the prompt's text: ``base`` tokens, times ``short_factor`` if a short hint appears,
    times ``long_factor`` if a long hint appears. Without text (token ids only) it has no
    signal and predicts ``base`` for everyone (SJF then degenerates to aged FCFS).
    """

    name = "prompt"
    SHORT_HINTS = (
        "brief",
        "briefly",
        "short answer",
        "one word",
        "one sentence",
        "yes or no",
        "tl;dr",
        "concise",
        "in a few words",
    )
    LONG_HINTS = (
        "explain in detail",
        "in detail",
        "step by step",
        "essay",
        "write a story",
        "comprehensive",
        "elaborate",
        "long",
    )

    def __init__(self, base: float = 128.0, short_factor: float = 0.25, long_factor: float = 4.0):
        self.base, self.short_factor, self.long_factor = float(base), float(short_factor), float(long_factor)

    def predict(self, request: Request) -> float:
        text = (request.prompt or "").lower()
        p = self.base
        if any(h in text for h in self.SHORT_HINTS):
            p *= self.short_factor
        if any(h in text for h in self.LONG_HINTS):
            p *= self.long_factor
        return p


PREDICTORS = {"oracle": OraclePredictor, "history": HistoryPredictor, "prompt": PromptPredictor}


def make_predictor(spec: Union[str, LengthPredictor]) -> LengthPredictor:
    if isinstance(spec, str):
        if spec not in PREDICTORS:
            raise ValueError(f"predictor={spec!r}: one of {sorted(PREDICTORS)} or a LengthPredictor")
        return PREDICTORS[spec]()
    if isinstance(spec, (str, type, numbers.Number)) or spec is None:
        raise ValueError(f"predictor={spec!r}: one of {sorted(PREDICTORS)} or a LengthPredictor")
    return check_protocol(spec, LengthPredictor, "SJF(predictor=...)")


class SJF(Policy):
    """Shortest job first: the shortest *predicted remaining* output goes first, with aging.

    Order key of a waiting request (smaller first; ties by arrival)::

        key = max(0, predicted - generated) - aging * (now - arrival)

    ``aging`` is in predicted tokens forgiven per second waited (0 = pure SJF). Every
    waiting request ages at the same rate, so the key is ``(P + aging * arrival) - aging * now``:
    a request's rank is fixed when it arrives. **The bound**: a request predicted at P is
    passed only by requests that arrived before ``arrival + (P - P_min) / aging`` seconds
    (P_min the smallest prediction, 1 for the oracle), so it waits at most the time to
    serve those, a finite set on any bounded arrival rate. Without aging a steady stream of
    short requests starves it for as long as the stream lasts (long requests can
    starve).

    ``predictor``: "oracle" (the true length), "history" (per-class mean), "prompt"
    (hints in the text), or a ``LengthPredictor``. Non-preemptive: a victim under memory
    pressure is the running request with the longest predicted remaining output.
    """

    name = "sjf"

    def __init__(self, predictor: Union[str, LengthPredictor] = "oracle", aging: float = 100.0):
        if aging < 0:
            raise ValueError(f"SJF(aging={aging!r}): must be >= 0 (tokens per second waited)")
        self.predictor = make_predictor(predictor)
        self.aging = float(aging)

    def predicted(self, req: Request) -> float:
        p = req.policy_state.get("sjf_predicted")
        if p is None:
            p = req.policy_state["sjf_predicted"] = float(self.predictor.predict(req))
        return p

    def remaining(self, req: Request) -> float:
        return max(0.0, self.predicted(req) - req.num_output_tokens)

    def key(self, req: Request, now: float) -> float:
        return self.remaining(req) - self.aging * max(0.0, now - req.arrival_time)

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: (self.key(r, now), r.arrival_time))

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (self.remaining(r), r.admit_seq))

    def on_step(self, scheduled: list, now: float) -> None:
        for s in scheduled:
            r = s.request
            if _is_done(r) and not r.policy_state.get("sjf_observed"):
                r.policy_state["sjf_observed"] = True
                self.predictor.observe(r)

    def __repr__(self) -> str:
        return f"SJF(predictor={self.predictor!r}, aging={self.aging:g})"


# =====================================================================================
# Priority classes
# =====================================================================================


class Priority(Policy):
    """Priority classes: lower ``request.priority`` first (vLLM's convention), FCFS inside a class.

    With ``preempt=True`` a waiting request that cannot be admitted (no slot, no KV memory)
    pushes out a running request of a *lower* class: the lowest class, most recently
    admitted first. The same rule picks the victim when a running request needs a block.
    """

    name = "priority"

    def __init__(self, preempt: bool = True):
        self.preempt = bool(preempt)

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.admit_seq))

    def preempt_for(self, request: Request, running: list[Request], now: float) -> Optional[Request]:
        if not self.preempt:
            return None
        lower = [r for r in running if r.priority > request.priority]
        return self.pick_victim(lower, now) if lower else None

    def __repr__(self) -> str:
        return f"Priority(preempt={self.preempt})"


# =====================================================================================
# Multi-level feedback queue
# =====================================================================================


class MLFQ(Policy):
    """Multi-level feedback queue, with tokens generated as the time slice (as in FastServe, Wu et al., 2023).

    Every request enters level 0. ``quanta[i]`` is how many tokens a request may generate
    at level i before it is demoted to level i+1; the last level (``len(quanta)``) has no
    quantum. ``quanta=(16, 64, 256)`` gives 4 levels (3 to 5 is typical).
    Short requests finish in the top levels; long ones sink, without any length prediction.

    Waiting requests are ordered by level, FCFS inside a level. With ``preempt=True`` a
    waiting request that cannot be admitted pushes out a running request of a lower
    level (deepest level, most recently admitted first).

    Starvation: every ``boost_interval`` (clock seconds, or steps with
    ``boost_unit="steps"``) every request goes back to level 0, where FCFS puts the
    oldest first. ``boost_interval=None`` turns boosting off. **The bound**: a request
    pushed out waits at most until the next boost, then behind older requests only; e.g.
    with one slot and short requests of s tokens streaming in, no gap between two of a
    demoted request's tokens exceeds ``boost_interval + (s + 1)`` steps (the request in the
    slot finishes, then its re-prefill yields a token). Without boosting it waits as long
    as the stream lasts.
    """

    name = "mlfq"

    def __init__(
        self,
        quanta: Sequence[int] = (16, 64, 256),
        boost_interval: Optional[float] = 30.0,
        boost_unit: str = "seconds",
        preempt: bool = True,
    ):
        quanta = tuple(int(q) for q in quanta)
        if not quanta or any(q < 1 for q in quanta):
            raise ValueError(f"MLFQ(quanta={quanta!r}): need at least one quantum, each >= 1 token")
        if boost_unit not in ("seconds", "steps"):
            raise ValueError(f"MLFQ(boost_unit={boost_unit!r}): 'seconds' or 'steps'")
        if boost_interval is not None and boost_interval <= 0:
            raise ValueError(f"MLFQ(boost_interval={boost_interval!r}): must be > 0 or None")
        self.quanta = quanta
        self.num_levels = len(quanta) + 1
        self.boost_interval = boost_interval
        self.boost_unit = boost_unit
        self.preempt = bool(preempt)
        self.epoch = 0  # bumped by each boost; a request from an older epoch is at level 0
        self.num_boosts = 0
        self._last_boost: Optional[float] = None
        self._steps = 0

    def _state(self, req: Request) -> list:
        st = req.policy_state.get("mlfq")
        if st is None or st[2] != self.epoch:
            st = req.policy_state["mlfq"] = [0, 0, self.epoch]  # level, tokens at this level, epoch
        return st

    def level(self, req: Request) -> int:
        return self._state(req)[0]

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: (self.level(r), r.arrival_time))

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (self.level(r), r.admit_seq))

    def preempt_for(self, request: Request, running: list[Request], now: float) -> Optional[Request]:
        if not self.preempt:
            return None
        lvl = self.level(request)
        lower = [r for r in running if self.level(r) > lvl]
        return self.pick_victim(lower, now) if lower else None

    def on_step(self, scheduled: list, now: float) -> None:
        boost = self.boost_due(now)
        self._steps += 1
        for s in scheduled:
            self.look(s.request)
        if self.boost_interval is None:
            return
        if self._last_boost is None:
            self._last_boost = 0.0 if self.boost_unit == "steps" else now
        if boost:
            self.epoch += 1  # everyone back to level 0 (lazily, per request)
            self.num_boosts += 1
            self._last_boost = now if self.boost_unit == "seconds" else float(self._steps)

    def look(self, req: Request) -> None:
        """The tokens ``req`` generated since the policy last looked count against its level's quantum;
        each quantum used up demotes it one level. (No new token: nothing to count.)"""
        new = _generated_since_last_look(req, "mlfq_seen")
        if not new:
            return
        st = self._state(req)
        st[1] += new
        while st[0] < len(self.quanta) and st[1] >= self.quanta[st[0]]:
            st[1] -= self.quanta[st[0]]  # quantum used up: demote
            st[0] += 1

    def boost_due(self, now: float) -> bool:
        """Does the next ``on_step`` (at clock ``now``) send every request back to level 0?"""
        if self.boost_interval is None:
            return False
        if self.boost_unit == "steps":  # (counted from step 0)
            return self._steps + 1 - (self._last_boost or 0.0) >= self.boost_interval
        return self._last_boost is not None and now - self._last_boost >= self.boost_interval

    def __repr__(self) -> str:
        return (
            f"MLFQ(quanta={self.quanta}, boost_interval={self.boost_interval}, "
            f"boost_unit={self.boost_unit!r}, preempt={self.preempt})"
        )


# =====================================================================================
# Fair queuing across tenants: the virtual token counter (VTC)
# =====================================================================================


class Fair(Policy):
    """Per-tenant fair queuing with virtual token counters (VTC, Sheng et al., OSDI 2024).

    Each tenant (``request.tenant``; None is a tenant too) has a counter of the service it
    received: ``input_weight`` per prompt token prefilled plus ``output_weight`` per token
    generated, divided by the tenant's weight (``tenant_weights``, default 1). The tenant
    with the smallest counter is served next, FCFS inside a tenant. Counters are charged in
    ``on_step`` from what actually ran; while forming one admission order, each pick also
    charges its prompt provisionally, so one pass does not admit a burst from one tenant.

    A tenant that comes back after being idle has its counter lifted to the smallest
    counter of the tenants still active, so idleness is not banked as credit.

    **The bound**: while two tenants both have requests waiting, their counters differ by
    at most ``(max_num_seqs + 1) * C_max``, where ``C_max`` is the largest weighted cost of
    one request (``(input_weight * prompt + output_weight * output) / weight``): a tenant
    is admitted only when its counter is the smallest, and after that it can gain at
    most what its requests in flight (at most ``max_num_seqs``) still have to receive.
    """

    name = "fair"

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0, tenant_weights: Optional[dict] = None):
        if input_weight < 0 or output_weight < 0:
            raise ValueError(f"Fair(input_weight={input_weight!r}, output_weight={output_weight!r}): must be >= 0")
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self.tenant_weights = dict(tenant_weights or {})
        for t, w in self.tenant_weights.items():
            if not w > 0:
                raise ValueError(f"Fair(tenant_weights[{t!r}]={w!r}): must be > 0")
        self.counters: dict[Any, float] = defaultdict(float)
        self._active: set = set()  # tenants with requests waiting or running at the last look
        self._running_tenants: set = set()  # tenants with requests in the last step's batch

    def weight(self, tenant: Any) -> float:
        return float(self.tenant_weights.get(tenant, 1.0))

    def cost(self, req: Request) -> float:
        """Weighted cost of a whole request (what C_max in the bound is made of)."""
        out = req.expected_output_len or req.max_tokens
        cost = self.input_weight * req.num_prompt_tokens + self.output_weight * out
        return cost / self.weight(req.tenant)

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        queues: dict[Any, list[Request]] = {}
        for r in sorted(waiting, key=lambda r: r.arrival_time):
            queues.setdefault(r.tenant, []).append(r)
        if self._active:
            floor = min(self.counters[t] for t in self._active)
            for t in queues:
                if t not in self._active:  # back from idle: no banked credit
                    self.counters[t] = max(self.counters[t], floor)
        self._active = set(queues) | self._running_tenants
        # Merge the tenants' FIFO queues by (provisionally charged) counter.
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
                heapq.heappush(heap, (c + self.input_weight * todo / self.weight(t), i, t))
        return order

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: (self.counters[r.tenant], r.admit_seq))

    def on_step(self, scheduled: list, now: float) -> None:
        running = set()
        for s in scheduled:
            r = s.request
            self.charge(
                r.tenant, _generated_since_last_look(r, "fair_seen"), s.num_new_tokens if s.phase == "prefill" else 0
            )
            if not _is_done(r):
                running.add(r.tenant)
        self._running_tenants = running

    def charge(self, tenant: Any, generated: int, prefilled: int = 0) -> None:
        """Charge ``tenant`` for ``generated`` output tokens and ``prefilled`` prompt tokens (weighted)."""
        cost = self.output_weight * generated
        if prefilled:
            cost += self.input_weight * prefilled
        self.counters[tenant] += cost / self.weight(tenant)

    def charge_tenants(self, generated: dict, prefilled: dict, still_running: set) -> None:
        """``on_step``'s charges given per tenant instead of grant by grant (the simulator's fast path: the same
        counters when every charge is a whole number): ``generated[t]`` tokens and ``prefilled[t]`` prompt
        tokens; the tenants in ``still_running`` ran in the step and still have requests running."""
        for t, n in generated.items():
            self.charge(t, n, prefilled.get(t, 0))
        self._running_tenants |= still_running

    def charged(self, req: Request) -> None:
        """Every token ``req`` has generated so far is charged (``charge_tenants`` charged them)."""
        _generated_since_last_look(req, "fair_seen")

    def __repr__(self) -> str:
        return (
            f"Fair(input_weight={self.input_weight:g}, output_weight={self.output_weight:g}, "
            f"tenant_weights={self.tenant_weights})"
        )


# =====================================================================================
# Names
# =====================================================================================

POLICIES = {"fcfs": FCFS, "sjf": SJF, "priority": Priority, "mlfq": MLFQ, "fair": Fair}


def make_policy(spec, **kwargs) -> Policy:
    """A policy from a name in ``POLICIES`` (with constructor ``kwargs``), a policy class, or a policy
    object (returned as is: a ``Policy`` subclass, or any object with the four hooks), checked against
    the ``Policy`` protocol."""
    if isinstance(spec, str) and spec.lower() in POLICIES:
        return POLICIES[spec.lower()](**kwargs)
    if isinstance(spec, (str, numbers.Number, bytes, list, tuple, dict)) or spec is None:
        raise ValueError(f"EngineConfig.policy={spec!r}: must be one of {sorted(POLICIES)} or a Policy object")
    if isinstance(spec, type):
        spec = spec(**kwargs)
    elif kwargs:
        raise ValueError(f"make_policy({spec!r}, ...): keyword arguments need a policy name or class")
    return check_protocol(
        spec, Policy, "EngineConfig.policy (subclass minillm.core.policies.Policy to inherit the defaults)"
    )
