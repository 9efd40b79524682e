"""Fast-forward: the simulator's engine stepped without walking every running request every step.

In a simulated step most running requests do the same thing: decode one placeholder token, which
fits the block they are part way through and stops nothing. What can differ from one request to
the next are *events*: a request whose next position starts a block (it needs one from the pool),
a request whose next token may stop it, a prompt chunk, an arrival, an admission. ``FastForward``
steps an engine exactly as ``engine.step()`` would, but does per-request work only at events:

* a decoding request is *lazy*: the steps it takes are counted, not applied, and its tokens, their
  times and its computed positions catch up (``Request.append_tokens``, ``Request.advance``) when it
  needs a block (``kv.allocate(req, 1)``, at its step, in the running order), when its token may
  stop it (the real stop check, ``StopChecker.check``, on the step that may: ``num_tokens_before_stop``
  says which), before a step this module does not take, and at the end (``sync``);
* the step's price comes from totals kept as the batch changes (``RooflineCostModel.decode_step_time``
  / ``batch_time``, the same arithmetic ``modeled_step_time`` does over the grants);
* arrivals, the admission pass in the policy's order (``Scheduler.admit``, ``kv.can_allocate`` /
  ``kv.explain_wait`` and the same waiting reasons), prompt chunks and finishes (``Scheduler.finish``,
  then the policy's ``on_step`` over the finished requests' grants) go through the scheduler's, the KV
  manager's and the policy's own methods, in the order the scheduler's pass takes them;
* a *quiet* step, where every running request is lazy and none of their tokens may stop one, nobody
  waits and nobody arrives (at most a lazy request takes a block), is the same few sums each time: a
  run of them (``run``) prices each from the batch's totals with the parts that depend on its size alone
  worked out once (``_DecodePrice``), and, for ``simulate(records="summary")`` with no ``progress`` to
  show records to, keeps each one's ``StepSummary`` without making its record.

It covers one configuration, the one long simulations run (``simulate(records=False)`` and
``simulate(records="summary")``): the simulated executor on a modeled clock priced by the roofline,
the paged KV manager without prefix caching, continuous batching re-formed every step, chunked prefill
(on or off; a running prompt's chunk capped by the budget left at its turn), no speculation, no parallel
sampling, no load shedding, and one of the built-in policies:

* FCFS and SJF (neither preempts to admit; SJF's predictor observes the finished requests' grants);
* priority classes: a step whose admission may push a running request out for a waiting one of a higher
  class (``Priority.preempt_for``) is passed on;
* MLFQ: a lazy request's new tokens are counted against its quantum (``MLFQ.look``) when it is brought up
  to date and before a boost sends everyone back to level 0 (``MLFQ.boost_due``); a step whose admission
  may miss a seat or memory, where MLFQ may preempt for it, is passed on;
* fair queuing with whole-number charges: the grants given one by one go through ``Fair.on_step``, the
  lazy requests' tokens are charged to their tenants from per-tenant counts (sums of whole numbers: the
  same counters in any order).

Nothing is recorded per request: ``record="none"``, or ``record="totals"``, whose
records add the step's counts (its prefill and decode tokens, the running requests' ids, the KV
cache's totals: ``kv.totals``'s counts, taken from the pool's counters and the computed positions
kept as the batch changes) and the waiting requests behind the one that stops admission ("queued
behind ...", up to ``record_max_waiting``), none of them kept in ``engine.step_records``
(``record_history=0``, as ``simulate`` sets it). A step it cannot take the same way (a running
request would not get its block or its token: preemption, or a budget spent before a decoding request's
turn; a swapped-out request; a policy that may preempt to admit) is taken by ``engine.step()`` itself, with
every lazy request brought up to date first (after a few in a row, a run of steps goes to ``engine.step()``
straight away). ``FastForward.covers`` says whether an engine is one it can step at all;
``tests/test_simulated.py`` (fixed and random settings) and ``scripts/sim_fingerprint.py`` hold it to
``engine.step()`` in both record modes: the same records, block tables, free list, tokens, token times,
metrics and policy state.

A fast step is not undone if it raises (``engine.step()`` is all or nothing; the simulation loop
that uses this one stops on an exception).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable, Optional

from ..core.kv_cache import PagedKVCacheManager
from ..core.policies import FCFS, MLFQ, SJF, Fair, Priority
from ..core.preemption import just_placed
from ..core.request import Request, RequestStatus
from ..core.scheduler_output import SchedulerOutput, grant
from ..step_record import KVSnapshot, StepRecord, WaitingEntry
from .costmodel import RooflineCostModel
from .sim_executor import PLACEHOLDER_TOKEN, SimulatedExecutor
from .step_summary import KVTotals, StepSummary

__all__ = ["FastForward"]

_NO_CHUNKS: dict = {}  # (no running request computes its prompt: read, never written)


class _Lazy:
    """A running request that computes one token a step (it decodes; or, for one step, its prompt's last
    token), its steps not yet applied: tokens are applied up to step ``tokens_at`` and computed positions
    up to ``computed_at`` (exclusive); it next needs a block at step ``block_at`` and its token of step
    ``check_at`` may stop it."""

    __slots__ = ("tokens_at", "computed_at", "block_at", "check_at")

    def __init__(self, step: int):
        self.tokens_at = self.computed_at = step
        self.block_at = self.check_at = -1


class _DecodePrice:
    """``RooflineCostModel.decode_step_time(num_decodes, total_context)`` for one ``num_decodes``: ``batch_time``'s
    arithmetic (tokens = ``num_decodes``, attention pairs = the context) with what depends on ``num_decodes`` alone
    worked out once. The same operations on the same numbers in the same order: the same float."""

    __slots__ = (
        "token_flops",
        "pair_flops",
        "weight_bytes",
        "kv_bytes",
        "token_bytes",
        "flops_per_s",
        "bytes_per_s",
        "allreduce",
        "overhead",
    )

    def __init__(self, cm: RooflineCostModel, num_decodes: int):
        m = cm.model
        self.token_flops = 2.0 * m.num_params * num_decodes
        self.pair_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim  # (times the pairs: the context)
        self.weight_bytes, self.kv_bytes = m.weight_bytes, m.kv_bytes_per_token
        self.token_bytes = m.kv_bytes_per_token * num_decodes
        self.flops_per_s, self.bytes_per_s = cm.flops_per_s, cm.bytes_per_s
        self.allreduce, self.overhead = cm.allreduce_time(num_decodes), cm.hardware.step_overhead

    def __call__(self, total_context: int) -> float:
        flops = self.token_flops + self.pair_flops * total_context
        nbytes = float(self.weight_bytes + self.kv_bytes * total_context + self.token_bytes)
        compute, memory = flops / self.flops_per_s, nbytes / self.bytes_per_s
        return max(compute, memory) + self.allreduce + self.overhead


class FastForward:
    """Steps ``engine`` (one it ``covers``) as ``engine.step()`` would; ``step()`` returns the same record.

    Between two steps the running requests' tokens lag behind: call ``sync()`` before reading them, or
    before changing the engine other than by ``add_request`` (an abort, say)."""

    def __init__(self, engine):
        if not self.covers(engine):
            raise ValueError(
                "FastForward: the engine's configuration is not the one fast-forward covers "
                "(FastForward.covers says which)"
            )
        self.engine = engine
        self.s, self.kv, self.cm, self.clock = engine.scheduler, engine.kv, engine.cost_model, engine.clock
        self.config = engine.config
        self.lazy: dict[Request, _Lazy] = {}
        self.rank: dict[Request, int] = {}  # a running request's place in the running order
        self.next_rank = 0
        self.block_due: dict[int, list[Request]] = {}  # step -> lazy requests that need a block then
        self.check_due: dict[int, list[Request]] = {}  # step -> lazy requests whose token then may stop them
        self.prefilling: list[Request] = []  # running requests with more than one token to compute
        self.num_lazy = 0
        self.num_lazy_prefill = 0  # lazy requests whose token ends their prompt (no output yet): a prefill
        self.lazy_context = 0  # the lazy requests' computed positions, at the step's start
        self.totals = engine.record_mode == "totals"  # records with the step's counts (else record="none")
        self.keeps_order = type(engine.policy) is FCFS  # admission walks the queue itself (SJF: its order)
        # A policy that may push a running request out to admit a waiting one: priority classes, MLFQ's levels
        policy = engine.policy
        kind = {Priority: "classes", MLFQ: "levels"}.get(type(policy))
        self.preempts_to_admit = kind if kind and policy.preempt else None
        # MLFQ looks at every grant's new tokens (``MLFQ.look``): a lazy request is looked at when it is brought
        # up to date, and every running request before a boost sends everyone back to level 0
        self.mlfq = policy if type(policy) is MLFQ else None
        # Fair queuing charges every grant's tokens to its tenant (``Fair.on_step``): the lazy requests' tokens
        # are charged per tenant from their counts (``_charge_tenants``)
        self.fair = engine.policy if type(engine.policy) is Fair else None
        # A step with no grant given one by one can be quiet (``_is_quiet``); not under MLFQ or fair queuing,
        # which look at every step's grants
        self.may_be_quiet = self.mlfq is None and self.fair is None
        self.lazy_by_tenant: dict = {}  # tenant -> lazy requests
        self.lazy_prefill_by_tenant: dict = {}  # tenant -> lazy requests whose token ends their prompt
        self.base = engine.step_count  # self.times[i]: the clock at the end of step base + i
        self.times: list[float] = []  # (from the step the lazy requests were last tracked)
        self.placeholders = [PLACEHOLDER_TOKEN] * (self.config.max_model_len + 1)
        self.decode_prices: dict[int, _DecodePrice] = {}  # a quiet step's price, by the number of lazy requests
        self.steps_taken = self.steps_passed_on = 0  # (how many steps each way: for the tests and the docs)
        # Steps passed on in a row, and how many more go straight to ``engine.step()`` (a run of them, as
        # under memory pressure, does not pay for tracking the requests anew after each one)
        self.passed_in_a_row = self.plain_steps = 0
        self._enter()

    @staticmethod
    def covers(engine) -> bool:
        """Is ``engine`` configured the way this module steps it (see the module's docstring)?"""
        cfg = engine.config
        return (
            type(engine.executor) is SimulatedExecutor
            and engine.record_mode in ("none", "totals")
            and (engine.record_mode == "none" or cfg.record_history == 0)  # no record kept in step_records
            and engine.clock.name == "modeled"
            and engine.speculator is None
            and type(engine.cost_model) is RooflineCostModel
            and type(engine.kv) is PagedKVCacheManager
            and not engine.kv.enable_prefix_caching
            and (type(engine.policy) in (FCFS, SJF, Priority, MLFQ) or FastForward._whole_charges(engine.policy))
            and cfg.batching == "continuous"
            and cfg.schedule_every == 1
            and cfg.interference == "chunked"
            and cfg.phase_clock is None
            and cfg.max_queue_len is None
            and cfg.max_queue_delay is None
        )

    @staticmethod
    def _whole_charges(policy) -> bool:
        """Fair queuing whose charges are whole numbers (whole weights, every tenant's weight 1): its counters
        are then sums of whole numbers, the same whatever order (and grouping) the tokens are added in."""
        return (
            type(policy) is Fair
            and not policy.tenant_weights
            and policy.input_weight.is_integer()
            and policy.output_weight.is_integer()
        )

    # --- the lazy requests ------------------------------------------------------------------------
    def _enter(self) -> None:
        """Start from the engine as it is: every running request that decodes becomes lazy."""
        self._leave()
        step = self.base = self.engine.step_count
        for req in self.s.running:
            self._place(req)
            self._track(req, step)

    def _leave(self) -> None:
        """Track nothing (the engine is up to date): before ``_enter``, or while ``engine.step()`` steps it."""
        self.times = []
        self.lazy, self.block_due, self.check_due, self.prefilling = {}, {}, {}, []
        self.num_lazy = self.num_lazy_prefill = self.lazy_context = 0
        self.lazy_by_tenant, self.lazy_prefill_by_tenant = {}, {}
        self.rank = {}

    def _place(self, req: Request) -> None:
        self.rank[req] = self.next_rank
        self.next_rank += 1

    def _track(self, req: Request, step: int) -> None:
        """``req`` (running, everything applied before ``step``) from ``step`` on: lazy when one token is left
        to compute (it decodes, or its prompt's last token is a prefill of one token at ``step``)."""
        if req.num_tokens - req.num_computed_tokens != 1 or req.spec_token_ids:
            self.prefilling.append(req)
            return
        lazy = self.lazy[req] = _Lazy(step)
        self.num_lazy += 1
        self.num_lazy_prefill += req.num_output_tokens == 0
        self.lazy_context += req.num_computed_tokens
        if self.fair is not None:
            t = req.tenant
            self.lazy_by_tenant[t] = self.lazy_by_tenant.get(t, 0) + 1
            if req.num_output_tokens == 0:
                self.lazy_prefill_by_tenant[t] = self.lazy_prefill_by_tenant.get(t, 0) + 1
        self._due_block(req, lazy, step, req.num_computed_tokens)
        self._due_check(req, lazy, step)

    def _due_block(self, req: Request, lazy: _Lazy, step: int, computed: int) -> None:
        """The step whose position (``computed`` at ``step``, one more each step) is the first past its blocks."""
        lazy.block_at = step + self.kv.num_held_blocks(req.request_id) * self.kv.block_size - computed
        self.block_due.setdefault(lazy.block_at, []).append(req)

    def _due_check(self, req: Request, lazy: _Lazy, step: int) -> None:
        """The first step whose token may stop ``req`` (its tokens applied before ``step``)."""
        lazy.check_at = step + self.s.stops.num_tokens_before_stop(req, PLACEHOLDER_TOKEN)
        self.check_due.setdefault(lazy.check_at, []).append(req)

    def _catch_up(self, req: Request, lazy: _Lazy, step: int, tokens: bool = True) -> None:
        """Apply ``req``'s steps before ``step``: its computed positions, and its tokens with their times."""
        k = step - lazy.tokens_at
        if k and tokens:
            i = lazy.tokens_at - self.base
            req.append_tokens(self.placeholders[:k], self.times[i : i + k])
            lazy.tokens_at = step
        k = step - lazy.computed_at
        if k:
            req.advance(k)
            lazy.computed_at = step

    def sync(self) -> None:
        """Bring every lazy request up to date (they stay lazy): the engine then reads as ``engine.step()``
        would have left it."""
        step = self.engine.step_count
        for req, lazy in self.lazy.items():
            self._catch_up(req, lazy, step)
            if self.fair is not None:  # its tokens are charged: Fair's next look starts from here
                self.fair.charged(req)
        if self.mlfq is not None:
            for req in self.s.running:
                self.mlfq.look(req)

    def _due(self, table: dict, step: int, field: str) -> list[Request]:
        """The lazy requests still due at ``step`` in ``table``, in the running order."""
        reqs = table.pop(step, ())
        lazy = self.lazy
        due = [r for r in reqs if r in lazy and getattr(lazy[r], field) == step]
        if len(due) > 1:
            due.sort(key=self.rank.__getitem__)
        return due

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """One step, the record ``engine.step()`` would return: schedule, execute (price it), apply, record,
        commit; a step this module does not take is passed on to ``engine.step()``."""
        if self.plain_steps:
            return self._plain_step()
        e, s, kv = self.engine, self.s, self.kv
        step = e.step_count
        if self._is_quiet(step):
            return self._quiet_step(step)
        budget = self.config.max_num_batched_tokens
        # The running requests' part of the pass, unless a request would miss its block or its tokens.
        due = self._due(self.block_due, step, "block_at")  # (a step passed on tracks everything anew)
        chunks = self._chunks(budget) if self.prefilling else _NO_CHUNKS
        if chunks is None or s.swapped or s.held or s.has_groups:
            return self._pass_on()
        need, demand = len(due), self.num_lazy
        if chunks:
            need += sum(map(kv.num_blocks_needed, chunks, chunks.values()))
            demand += sum(chunks.values())
        if need > kv.num_free_blocks or (self.preempts_to_admit is not None and self._may_preempt_to_admit(need)):
            return self._pass_on()
        self.steps_taken += 1
        self.passed_in_a_row = 0
        now, out = self._schedule(step, due, chunks, budget - demand)  # 1. who runs, and how many tokens each
        num_running_grants = len(out.scheduled) - len(out.admitted)
        duration, sched = self._price(out)  # 2. the step's price on the modeled clock
        self.clock.advance(duration)
        end = self.clock.now()
        self.times.append(end)
        num_batched = self.num_lazy + sum(g.num_new_tokens for g in out.scheduled)
        num_decode = (
            self.num_lazy - self.num_lazy_prefill + sum(g.num_new_tokens for g in out.scheduled if g.phase == "decode")
        )
        counts = (self.num_lazy + len(out.scheduled), num_batched, num_decode)
        finished = self._apply(step, out, num_running_grants, end)  # 3. the results, where the requests live
        record = self._record(step, end, duration, sched, counts, out.admitted, out.waiting, finished)  # 4.
        s.commit()  # 5. the step stands; finished requests leave
        for req in finished:
            self.rank.pop(req, None)
            e.active.pop(req.request_id, None)
            e.executor.forget(req.request_id)
        self._count_step()
        return record

    def _record(
        self,
        step: int,
        end: float,
        duration: float,
        sched: float,
        counts: tuple,
        admitted: list[str],
        waiting: list[WaitingEntry],
        finished: list[Request],
    ) -> StepRecord:
        """What the step did (record="none", or "totals": its counts too); ``counts``: the requests that ran, the
        tokens they computed, of which decode tokens."""
        num_grants, num_batched, num_decode = counts
        return StepRecord(
            step=step,
            time=end,
            duration=duration,
            batch=[],
            batch_size=num_grants,
            num_prefill_tokens=num_batched - num_decode if self.totals else 0,
            num_decode_tokens=num_decode if self.totals else 0,
            num_batched_tokens=num_batched,
            token_budget=self.config.max_num_batched_tokens,
            admitted=admitted,
            finished=[r.request_id for r in finished] if finished else [],
            preempted=[],
            waiting=waiting,
            kv=self._kv_totals() if self.totals else None,
            running=list(map(attrgetter("request_id"), self.s.running)) if self.totals else [],
            finish_reasons={r.request_id: r.finish_reason for r in finished} if finished else {},
            reformed=True,
            clock=self.clock.name,
            schedule_time=sched,
            swap_time=0.0,
        )

    # --- a quiet step: every running request decodes, nothing else happens ----------------------------
    def _is_quiet(self, step: int) -> bool:
        """Is ``step`` one where every running request is lazy, no token may stop one, nobody waits and nobody
        arrives by now? Such a step is the same sums each time: the lazy requests' decodes priced from their
        totals, an empty admission pass, no result applied one by one; at most a block for the lazy requests
        whose next position starts one. (MLFQ and fair queuing look at every step's grants: not quiet.)"""
        s = self.s
        if (
            not self.may_be_quiet
            or not self.num_lazy
            or self.prefilling
            or s.waiting
            or step in self.check_due
            or s.swapped
            or s.held
            or s.has_groups
        ):
            return False
        return not s.incoming or s.incoming[0][0] > self.clock.now()

    def run(self, on_record: Callable[[StepRecord], None], quiet_summaries: Optional[list] = None) -> None:
        """``engine.run()``'s loop without its list: steps until no request is left unfinished, ``on_record(record)``
        after each step; a run of quiet steps goes through ``_quiet_steps``. Every lazy request synced at the end.

        With ``quiet_summaries`` (a list; record="totals"), a quiet step makes no record and is not passed to
        ``on_record``: what ``StepSummary.from_record`` would make of its record is appended to the list instead
        (``simulate(records="summary")`` with nobody to show each record to)."""
        e = self.engine
        if not self.totals:
            quiet_summaries = None
        while e.has_unfinished_requests():
            if not self.plain_steps and self._is_quiet(e.step_count):
                self._quiet_steps(on_record, quiet_summaries=quiet_summaries)
            else:
                on_record(self.step())
        self.sync()

    def _quiet_step(self, step: int) -> StepRecord:
        """``step()`` for a quiet step (``_is_quiet``)."""
        records = []
        self._quiet_steps(records.append, limit=1)
        return records[0]

    def _quiet_steps(
        self,
        on_record: Callable[[StepRecord], None],
        limit: Optional[int] = None,
        quiet_summaries: Optional[list] = None,
    ) -> None:
        """Quiet steps (``_is_quiet``) one after another, ``on_record(record)`` after each, while they are quiet (at
        most ``limit``): what the general path of ``step()`` does when the pass grants nothing one by one, admits
        nobody and no lazy request's token may stop it. The batch stays the same through the run: its price
        (``_DecodePrice``) and its schedule time are worked out once. ``quiet_summaries``: see ``run``."""
        e, s, kv, clock, lazy, num_lazy = self.engine, self.s, self.kv, self.clock, self.lazy, self.num_lazy
        price = self.decode_prices.get(num_lazy)
        if price is None:
            price = self.decode_prices[num_lazy] = _DecodePrice(self.cm, num_lazy)
        sched = self.cm.schedule_time(len(s.running), 0)
        while True:
            step = e.step_count
            due = self._due(self.block_due, step, "block_at") if step in self.block_due else ()
            if len(due) > kv.num_free_blocks:  # a request would miss its block
                on_record(self._pass_on())
                return
            self.steps_taken += 1
            self.passed_in_a_row = 0
            s.begin_pass(clock.now())  # 1. counted, the clock moved (nobody arrives by now)
            for req in due:  # (in the running order)
                self._take_block(req, lazy[req], step)
            duration = price(self.lazy_context + num_lazy) + sched + 0.0 + 0.0  # 2. as _price prices it
            clock.advance(duration)
            end = clock.now()
            self.times.append(end)
            counts = (num_lazy, num_lazy, num_lazy - self.num_lazy_prefill)
            self.lazy_context += num_lazy  # 3. as _apply applies it: every token counted
            self.num_lazy_prefill = 0
            self.lazy_prefill_by_tenant = {}
            s.policy.on_step([], end)
            # 4. what the step did; 5. it stands (nothing to commit: the pass saved no request and no arrival, and
            # the KV manager keeps no journal under fast-forward)
            if quiet_summaries is not None:
                quiet_summaries.append(self._quiet_summary(step, end, duration, sched, counts))
                self._count_step()
            else:
                record = self._record(step, end, duration, sched, counts, [], [], [])
                self._count_step()
                on_record(record)
            if limit is not None:
                limit -= 1
                if not limit:
                    return
            if self.plain_steps or not self._is_quiet(e.step_count):
                return

    def _count_step(self) -> None:
        """The step stands: the engine's step count advances, as ``engine.step()`` advances it."""
        e = self.engine
        e.step_count += 1

    def _quiet_summary(self, step: int, end: float, duration: float, sched: float, counts: tuple) -> StepSummary:
        """``StepSummary.from_record`` of a quiet step's record (record="totals"; nobody waits, nobody admitted,
        finished, preempted or rejected), made without the record (its fields in from_record's order)."""
        num_grants, num_batched, num_decode = counts
        kv, bs = self.kv, self.kv.block_size
        num_free = kv.pool.num_free
        kv_totals = KVTotals(self.lazy_context, kv.num_blocks * bs, num_free * bs, (kv.num_blocks - num_free) * bs)
        return StepSummary(
            step,
            end,  # time
            duration,
            num_grants,  # batch_size
            num_batched,  # num_batched_tokens
            num_batched - num_decode,  # num_prefill_tokens
            num_decode,  # num_decode_tokens
            len(self.s.running),  # num_running
            0,  # num_waiting
            0,  # num_admitted
            0,  # num_finished
            0,  # num_preempted
            0,  # num_rejected
            kv_totals,
            sched,  # schedule_time
            0.0,  # swap_time
            self.clock.name,
        )

    def _kv_totals(self) -> KVSnapshot:
        """``kv.totals`` after the step's results: the pool's counters, and the positions holding KV (each
        running request's computed ones; no block has two holders) from the lazy requests' total."""
        kv, bs = self.kv, self.kv.block_size
        computed = self.lazy_context
        if self.prefilling:
            computed += sum(r.num_computed_tokens for r in self.prefilling)
        num_free = kv.pool.num_free
        blocks_used = kv.num_blocks - num_free
        return KVSnapshot(
            total=kv.num_blocks * bs,
            used=computed,
            free=num_free * bs,
            blocks_total=kv.num_blocks,
            blocks_used=blocks_used,
            blocks_free=num_free,
            block_size=bs,
            cached=kv.pool.num_cached_free * bs,
            partial_waste=blocks_used * bs - computed,
            swap_used_blocks=kv.swap_used,
            swap_total_blocks=kv.num_swap_blocks,
        )

    def _chunks(self, budget: int) -> Optional[dict]:
        """The prompt chunks the running part of the pass grants (``Scheduler._schedule_running``): each running
        request computing its prompt gets the rest of it, capped by the budget left at its turn in the running
        order, and nothing once the budget is spent. None when a lazy request's turn finds the budget spent
        (its token is cut: a step passed on)."""
        rest = [r.num_tokens - r.num_computed_tokens for r in self.prefilling]
        if self.num_lazy + sum(rest) <= budget:
            return dict(zip(self.prefilling, rest))
        chunks, lazy = {}, self.lazy
        for req in self.s.running:  # (the running order)
            if budget <= 0:
                if req in lazy:
                    return None
                continue
            if req in lazy:
                budget -= 1
                continue
            chunks[req] = n = min(req.num_tokens - req.num_computed_tokens, budget)
            budget -= n
        return chunks

    def _may_preempt_to_admit(self, need: int) -> bool:
        """Could this pass's admission push a running request out for a waiting one (``Policy.preempt_for``)?
        Read before the pass changes anything (``need``: the blocks the running requests take first). A request
        admitted by the pass is never the victim (``preemption.just_placed``). Priority classes: only for a
        request, waiting or arriving now, of a higher class (a smaller ``priority``) than one running before the
        pass (``pick_victim`` names a newer one of a class before an older one). MLFQ, whose running requests'
        levels move with their tokens: only when a request waiting or arriving now could miss a seat or KV
        memory (every one of them admitted, each with its whole prompt, would not fit)."""
        s, kv = self.s, self.kv
        if not s.running:
            return False
        now, heap = self.clock.now(), s.incoming  # (requests running: the clock does not jump to an arrival)
        candidates, todo = (
            list(s.waiting),
            [0],
        )  # and the heap's entries due by now: a walk that stops below a later one
        while todo:
            i = todo.pop()
            if i < len(heap) and heap[i][0] <= now:
                candidates.append(heap[i][2])
                todo += (2 * i + 1, 2 * i + 2)
        if not candidates:
            return False
        if self.preempts_to_admit == "classes":
            best = min(r.priority for r in candidates)
            return any(r.priority > best for r in s.running)
        if len(s.running) + len(candidates) > self.config.max_num_seqs:
            return True
        blocks = need + sum(kv.blocks_for(r.num_tokens) for r in candidates)
        return blocks > kv.num_free_blocks - kv.watermark_blocks

    def _schedule(self, step: int, due: list[Request], chunks: dict, budget: int) -> tuple[float, SchedulerOutput]:
        """The pass (``Scheduler.schedule``): arrivals join the queue; the running requests in the running
        order (a new block for each lazy one ``due`` one, its chunk for each one computing its prompt: ``chunks``;
        the lazy ones' token is counted, not granted one by one); then admission with the ``budget``
        left. Returns the clock at the pass and its output (the chunks', then the admitted requests' grants)."""
        s, kv, lazy = self.s, self.kv, self.lazy
        if not (s.running or s.waiting):  # nothing can run now: the clock jumps to the next arrival
            t = s.next_arrival()
            if t is not None and t > self.clock.now():
                self.clock.wait_until(t)
        now = self.clock.now()
        s.begin_pass(now)  # counted, the clock moved, arrivals join the queue
        out = SchedulerOutput(scheduled=[], token_budget=self.config.max_num_batched_tokens)
        for req in sorted(due + list(chunks), key=self.rank.__getitem__) if chunks else due:
            entry = lazy.get(req)
            if entry is None:
                n = chunks[req]
                kv.allocate(req, n)
                out.scheduled.append(grant(req, n))
                continue
            self._take_block(req, entry, step)
        self._admit(now, out, budget)  # (nothing is swapped out)
        return now, out

    def _take_block(self, req: Request, entry: _Lazy, step: int) -> None:
        """A lazy request's next position starts a block at ``step``: its computed positions caught up, a block
        from the pool (``kv.allocate(req, 1)``), and the step it next needs one."""
        self._catch_up(req, entry, step, tokens=False)
        computed = req.num_computed_tokens
        if not self.kv.allocate(req, 1):
            raise RuntimeError(f"fast-forward: no KV block for request {req.request_id!r} at step {step}")
        self._due_block(req, entry, step, computed)

    def _price(self, out: SchedulerOutput) -> tuple[float, float]:
        """(duration, schedule time) as ``modeled_step_time`` prices the step: the lazy requests' decodes
        from their totals, the other grants one by one; the pass over the running and waiting requests."""
        grants, lazy_context = out.scheduled, self.lazy_context + self.num_lazy  # the lazy ones' KV after it
        if all(g.num_new_tokens == 1 for g in grants):
            step_time = self.cm.decode_step_time(
                self.num_lazy + len(grants), lazy_context + sum(g.num_computed_before + 1 for g in grants)
            )
        else:  # attention pairs: sum(q c) - (sum(q^2) - sum(q)) / 2, as RooflineCostModel.step_time counts them
            tokens = self.num_lazy + sum(g.num_new_tokens for g in grants)
            context = lazy_context + sum(g.num_computed_before + g.num_new_tokens for g in grants)
            qc = lazy_context + sum(g.num_new_tokens * (g.num_computed_before + g.num_new_tokens) for g in grants)
            q2 = self.num_lazy + sum(g.num_new_tokens * g.num_new_tokens for g in grants)
            step_time = self.cm.batch_time(tokens, context, qc - (q2 - tokens) / 2)
        sched = self.cm.schedule_time(len(self.s.running), len(self.s.waiting))
        return step_time + sched + 0.0 + 0.0, sched  # no swap, no draft

    def _apply(self, step: int, out: SchedulerOutput, num_running_grants: int, end: float) -> list[Request]:
        """``Scheduler.update_from_output`` for this step, in the grants' order: the lazy requests whose
        token may stop them and the running prompt chunks (the running order), then the admitted requests;
        every other lazy request's token is counted; then the policy's ``on_step``. Returns the requests that
        finished, in that order."""
        s, lazy = self.s, self.lazy
        checks = self._due(self.check_due, step, "check_at")
        chunks = out.scheduled[:num_running_grants]
        order = sorted(checks + [g.request for g in chunks], key=self.rank.__getitem__) if chunks else checks
        admitted = [g.request for g in out.scheduled[num_running_grants:]]
        by_req = {g.request: g for g in out.scheduled}
        finished = []
        self.lazy_context += self.num_lazy
        charges = (dict(self.lazy_by_tenant), self.lazy_prefill_by_tenant) if self.fair is not None else None
        for req in order + admitted:
            entry = lazy.get(req)
            if entry is not None:
                self._catch_up(req, entry, step)
                req.advance(1)
                entry.tokens_at = entry.computed_at = step + 1
                req.append_token(PLACEHOLDER_TOKEN, end)
                reason = s.stops.check(req, PLACEHOLDER_TOKEN)
                if reason is None:
                    self._due_check(req, entry, step + 1)
                    continue
                del lazy[req]
                self.num_lazy -= 1
                self.lazy_context -= req.num_computed_tokens
                if self.fair is not None:
                    self.lazy_by_tenant[req.tenant] -= 1
            else:
                g = by_req[req]
                req.advance(g.num_new_tokens)
                if not g.samples:
                    continue
                req.append_token(PLACEHOLDER_TOKEN, end)
                reason = s.stops.check(req, PLACEHOLDER_TOKEN)
                if reason is None:
                    continue
            s.finish(req, reason, end)
            finished.append(req)
        # Who computes a prompt next step, who decodes (lazy from the next step on).
        prefilling, self.prefilling = self.prefilling + admitted, []
        self.num_lazy_prefill = 0  # (every lazy request has output now)
        self.lazy_prefill_by_tenant = {}
        for req in prefilling:
            if req.status is RequestStatus.RUNNING:
                self._track(req, step + 1)
        if charges is not None:
            self._charge_tenants(out, end, *charges)
            return finished
        if self.mlfq is not None and self.mlfq.boost_due(end):  # every running request looked at first
            for req, entry in lazy.items():
                self._catch_up(req, entry, step + 1)
            for req in s.running:
                self.mlfq.look(req)
        # The policy's look at the step: the grants of the requests that finished, in the grants' order
        # (what SJF reads: its predictor observes each finished request; FCFS reads nothing).
        s.policy.on_step([by_req.get(r) or grant(r, 1) for r in finished], end)
        return finished

    def _charge_tenants(self, out: SchedulerOutput, end: float, lazy_by_tenant: dict, lazy_prefill: dict) -> None:
        """``Fair.on_step`` for this step: the grants given one by one (prompt chunks, admissions) through it,
        then each lazy request's token, charged per tenant as it charges one (``output_weight`` per token
        generated, ``input_weight`` more when the token ends its prompt), from the counts at the step's start;
        the tenants whose requests still run are the ones that ran (every lazy request had its token)."""
        self.fair.on_step(out.scheduled, end)
        self.fair.charge_tenants(lazy_by_tenant, lazy_prefill, {t for t, n in self.lazy_by_tenant.items() if n})

    def _admit(self, now: float, out: SchedulerOutput, budget: int) -> None:
        """3. The admission pass in the policy's order (FCFS: the queue itself, whose head leaves as it is
        admitted; SJF, priority: ``order_waiting``'s sorted copy): each request while it fits (a seat, the budget, KV
        memory beside the watermark's headroom); the first that does not gets the waiting reason, and the
        ones after it are queued behind it."""
        s, kv, cfg = self.s, self.kv, self.config
        order = None if self.keeps_order else s.policy.order_waiting(list(s.waiting), now)
        i = 0  # queue[i] is next (the FCFS queue: its head)
        while True:
            queue = s.waiting if order is None else order
            if i >= len(queue):
                return
            req = queue[i]
            n = req.num_tokens
            if s.num_seqs() + 1 > cfg.max_num_seqs:
                self._no_preemption_for(req, now, out)
                reason = f"max_num_seqs={cfg.max_num_seqs} requests already running"
            elif n > budget and (not cfg.enable_chunked_prefill or budget <= 0):
                reason = (
                    f"prefill of {n} tokens does not fit the {budget} tokens left "
                    f"in the budget of {cfg.max_num_batched_tokens}"
                    + ("" if cfg.enable_chunked_prefill else " (chunked prefill is off)")
                )
            else:
                n = min(n, budget)  # chunked prefill: take what fits
                if kv.can_allocate(req, n, [], 0)[0]:
                    s.admit(req, n, [], now, out)
                    self._place(req)
                    budget -= n
                    i += order is not None
                    continue
                self._no_preemption_for(req, now, out)
                reason = kv.explain_wait(req, n, [], 0, requests={r.request_id: r for r in s.running})
            self._waiting_entries(out, queue, i, reason)
            return

    def _no_preemption_for(self, req: Request, now: float, out: SchedulerOutput) -> None:
        """``req`` finds no seat or no KV memory: the scheduler asks the policy for a running request to push
        out for it (``Policy.preempt_for``); ``_may_preempt_to_admit`` passed this step on if it could name one."""
        if self.preempts_to_admit is not None:
            victim = self.s.policy.preempt_for(req, self.s.running, now)
            if victim is not None and not just_placed(victim, out):
                raise RuntimeError(f"fast-forward: admitting {req.request_id!r} would preempt {victim.request_id!r}")

    def _waiting_entries(self, out: SchedulerOutput, queue: list[Request], i: int, reason: str) -> None:
        """``queue[i]`` waits for ``reason``; the requests after it are "queued behind" it, as many as the
        record takes (``Scheduler.max_waiting_entries``, None: all; record="none": none)."""
        cap = self.s.max_waiting_entries
        head = queue[i].request_id
        out.waiting.append(WaitingEntry(head, reason))
        more = len(queue) - i - 1 if cap is None else max(0, cap - len(out.waiting))
        behind = f"queued behind {head}"
        out.waiting.extend(WaitingEntry(r.request_id, behind) for r in queue[i + 1 : i + 1 + more])

    def _pass_on(self) -> StepRecord:
        """A step this module does not take: ``engine.step()`` takes it, every lazy request up to date. After
        two or more in a row, the next 1, 2, 4, ... 32 steps go straight to ``engine.step()`` too."""
        self.steps_passed_on += 1
        self.sync()
        record = self.engine.step()
        self.passed_in_a_row += 1
        self.plain_steps = min(32, 2 ** (self.passed_in_a_row - 2)) if self.passed_in_a_row > 1 else 0
        if self.plain_steps:
            self._leave()
        else:
            self._enter()
        return record

    def _plain_step(self) -> StepRecord:
        """One of a run of steps passed straight on (nothing is tracked meanwhile); tracking starts again after."""
        self.steps_passed_on += 1
        self.plain_steps -= 1
        record = self.engine.step()
        if not self.plain_steps:
            self._enter()
        return record
