"""The scheduler: every step, decide who runs and how many tokens each processes.

There is no separate prefill and decode phase in the data. Each request has
``num_computed_tokens`` (positions with KV) and ``num_tokens`` (prompt +
output); a step grants it ``num_new_tokens`` under the execution-token budget:

* a decode is the case of 1 new token,
* a prefill the case of many, a chunked prefill the case of a capped many,
* a prefix-cache hit starts ``num_computed_tokens`` above zero.

One pass (``schedule``) goes:

1. **Running requests first**, one new token each (or the rest of a chunked
   prompt). If one cannot get its next KV block, a victim is *preempted*.
2. **Swapped-out requests** come back before anybody new is admitted.
3. **Waiting requests** in policy order, each admitted only if the *admission
   check* passes: a free slot under ``max_num_seqs``, tokens left in the budget,
   and KV memory for its prefill beside the watermark's headroom (``kv.can_allocate``). The first request that
   does not fit stops admission (FCFS head-of-line), and every request left
   waiting gets a reason a person can read.

The scheduler decides and allocates; the runner executes its ``SchedulerOutput``;
``update_from_output`` then applies the results where the requests live: append
tokens, roll back rejected speculative guesses, check stops, finish and free, hold
back or release (static batching, every-N), and tell the policy what ran.

A step is all or nothing: ``checkpoint()`` before it, ``rollback()`` if anything in
it raises (the queues, the requests and the KV tables go back to how they were).
A request's life has one owner: the scheduler's transitions (``admit``, ``preempt``, ``swap_in``,
``reject``, ``finish`` / ``finish_request``, ``fork``, and applying results in ``update_from_output``)
are the only code that saves a request in the step's undo log, each before it changes the request
through the request's own transition method (``Request.admit``, ``preempt``, ...). What the pass
decides with has its own module: the grants (``scheduler_output``), the stop check (``stopping``),
who is preempted and how (``preemption``: the modes' registry), load shedding (``admission_control``),
the groups of ``n`` samples (``parallel_sampling``), the undo log (``step_journal``).
"""

from __future__ import annotations

import heapq
from typing import Optional

from .policies import Policy
from .request import Request, RequestStatus
from .step_journal import StepJournal
from .stopping import StopChecker
from .admission_control import cap_queue, shed_load
from .parallel_sampling import completion_id, group_need
from .preemption import PREEMPTION_MODES, choose_mode, just_placed, preempt_group, schedule_swapped
from .scheduler_output import ScheduledRequest, SchedulerOutput, StepUpdate, grant
from ..step_record import BatchEntry, BlockCopy, ForkEvent, PreemptionEvent, WaitingEntry


class Scheduler:
    def __init__(self, config, kv, policy, cost_model=None, tokenizer=None):
        self.config = config
        self.kv = kv  # a KVCacheManager (kv_manager.py): paged, reserved or a student's
        self.prefix_caching = kv.supports_prefix_caching and kv.enable_prefix_caching
        self.policy = policy
        self.cost_model = cost_model  # for preemption_mode="auto"
        self.waiting: list[Request] = []  # arrived, not running: new, or preempted (recompute)
        self._shared_waiting: Optional[list] = None  # the queue list a checkpoint or a pass still reads
        self.incoming: list = []  # heap of (arrival_time, seq, request): not arrived yet
        self.now = 0.0  # the clock at the last pass
        self._add_seq = 0  # ties in ``incoming`` keep submission order
        # Cap on StepRecord.waiting (record="none": only the request that stopped admission)
        self.max_waiting_entries: Optional[int] = 0 if config.record == "none" else config.record_max_waiting
        self.running: list[Request] = []  # holds KV; scheduled every step
        self.swapped: list[Request] = []  # KV sits in host memory
        self.held: list[Request] = []  # done generating, waiting to be returned (static / every-N)
        self.num_passes = 0
        self._admit_counter = 0
        self.counters = dict(
            **{f"preemptions_{mode}": 0 for mode in PREEMPTION_MODES},
            swapped_out_blocks=0,
            swapped_in_blocks=0,
            recomputed_tokens=0,
            rejected=0,
        )
        self.stops = StopChecker(config, tokenizer)  # when a request ends (stop strings need the tokenizer)
        self.journal = StepJournal()  # what the step in progress changed (see checkpoint)
        # An entry per grant (StepUpdate.batch) and per running request given none (not_scheduled)
        self.record_batch = config.record not in ("totals", "none")
        self._arrivals: list = []  # (time, seq, request) released from ``incoming`` this step
        self._forked: list = []  # parents whose groups forked this step (undone on rollback)
        self.has_groups = False  # was any request with n > 1 ever added? (seat counting)

    # --- bookkeeping ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. One from the future (a trace) waits in ``incoming`` until the clock
        reaches its arrival time, so a pass never looks at requests that have not arrived."""
        if req.parent is not None:
            self.has_groups = True
        if req.arrival_time <= self.now:
            self.waiting.append(req)
        else:
            self._add_seq += 1
            heapq.heappush(self.incoming, (req.arrival_time, self._add_seq, req))

    def _release_arrivals(self, now: float) -> None:
        self.now = max(self.now, now)
        while self.incoming and self.incoming[0][0] <= now:
            item = heapq.heappop(self.incoming)
            self._arrivals.append(item)
            self.waiting.append(item[2])

    def next_arrival(self) -> Optional[float]:
        """Arrival time of the next request that has not arrived yet (None if none)."""
        return self.incoming[0][0] if self.incoming else None

    def is_idle(self) -> bool:
        """Nothing that has arrived is left to run: no request waiting, running, swapped or held (one
        from the future may still wait in ``incoming``). The engine then waits for ``next_arrival``."""
        return not (self.waiting or self.running or self.swapped or self.held)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.held or self.incoming)

    def remove(self, req: Request) -> None:
        """Take a request out of every queue and give back its KV (abort)."""
        for q in (self.waiting, self.running, self.swapped, self.held):
            if req in q:
                q.remove(req)
        if any(item[2] is req for item in self.incoming):
            self.incoming = [item for item in self.incoming if item[2] is not req]
            heapq.heapify(self.incoming)
        self.kv.free(req)

    # --- transitions: the only code that saves a request in the step's undo log ----------------
    # Each saves the request (every field: ``Request.snapshot``) before it changes it, moves it
    # between the queues, and changes its state through the request's own transition method.
    def admit(self, req: Request, n: int, cached: list, now: float, out: SchedulerOutput) -> None:
        """WAITING -> RUNNING: ``req`` gets its blocks (the ``cached`` prefix blocks shared), leaves the
        queue, runs, and is granted ``n`` tokens of its prompt after the cached prefix."""
        computed = len(cached) * self.kv.block_size
        self.journal.save(req)
        self.kv.allocate(req, n, cached)
        if self.prefix_caching:
            self.kv.record_lookup(req, cached)
        self.writable_waiting().remove(req)
        self._admit_counter += 1
        req.admit(computed, self._admit_counter, now)
        if self.prefix_caching:
            self.kv.cache_full_blocks(req, min(computed + n, req.num_tokens))
        self.running.append(req)
        out.admitted.append(req.request_id)
        out.scheduled.append(grant(req, n))

    def preempt(self, victim: Request, out: SchedulerOutput, reason: str) -> None:
        """RUNNING -> back in the queue or swapped out, as the preemption mode (``preemption.py``)
        says: the mode gives back its KV and says where it waits."""
        mode = choose_mode(self, victim)
        self.journal.save(victim)
        self.running.remove(victim)
        status, keeps_kv = PREEMPTION_MODES[mode].evict(self, victim, out)
        victim.preempt(status, keeps_kv)
        self.counters[f"preemptions_{mode}"] += 1
        out.preempted.append(PreemptionEvent(victim.request_id, mode, reason))

    def swap_in(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """SWAPPED -> RUNNING: its KV is copied back, and it is granted ``n`` tokens."""
        self.swapped.remove(req)
        self.journal.save(req)
        copies = self.kv.swap_in(req)
        out.swap_in.extend(copies)
        self.counters["swapped_in_blocks"] += len(copies)
        self.kv.allocate(req, n)
        if self.prefix_caching:
            self.kv.cache_full_blocks(req, min(req.num_computed_tokens + n, req.num_tokens), shareable=False)
        req.resume()
        self.running.append(req)
        out.swapped_in.append(req.request_id)
        out.scheduled.append(grant(req, n))

    def reject(self, req: Request, out: SchedulerOutput, reason: str) -> None:
        """WAITING -> turned away (load shedding): ``update_from_output`` finishes it as "rejected"."""
        self.journal.save(req)
        self.writable_waiting().remove(req)
        req.reject(reason)
        self.counters["rejected"] += 1
        out.rejected.append(WaitingEntry(req.request_id, reason))
        out.rejected_requests.append(req)

    def finish(self, req: Request, reason: str, t: float, detail: Optional[str] = None) -> bool:
        """RUNNING -> done generating: its KV is freed. Returns True if it leaves now,
        False if it is held back until the batch (static) or the next pass (every-N) comes."""
        self.journal.save(req)
        self.running.remove(req)
        self.kv.free(req)
        if self.config.batching == "static" or self.config.schedule_every > 1:
            req.hold(reason, detail)
            self.held.append(req)
            return False
        req.finish(reason, t, detail or None)
        return True

    def finish_request(self, req: Request, reason: str, t: float, detail: Optional[str] = None) -> None:
        """-> FINISHED: the request leaves the engine (returned from the held set, rejected, aborted)."""
        self.journal.save(req)
        req.finish(reason, t, detail)

    def fork(self, first: Request, result, t: float, upd: StepUpdate) -> None:
        """Parallel sampling (``parallel_sampling.py``): the prompt is computed and its logits were
        sampled once per completion. The other n - 1 sequences start RUNNING, each sharing every block
        of ``first``, with its own first token. A rollback removes them again."""
        parent = first.parent
        parent.fork()
        self._forked.append(parent)
        shared: list[int] = []
        for i in range(1, parent.n):
            seq = first.fork(completion_id(parent.request_id, i), parent.params[i], i)
            shared = self.kv.fork(first, seq)
            parent.members.append(seq)
            self.running.append(seq)
            upd.forked.append(seq)
            # The runner sampled each completion's first token; the simulator, which samples
            # nothing, gives them all the first sequence's placeholder.
            tok = result.fork_sampled.get(seq.request_id, first.output_token_ids[-1:])[0]
            seq.append_token(tok, t)
            if seq.output_logprobs is not None:
                seq.output_logprobs.extend(result.logprobs.get(seq.request_id, ()))
            reason = self.stops.check(seq, tok)
            if reason and self.finish(seq, reason, t):
                upd.finished.append(seq)
        upd.forks.append(ForkEvent(parent.request_id, [m.request_id for m in parent.members], shared))

    # --- one step, all or nothing (the undo log: minillm/core/step_journal.py) ----------
    def checkpoint(self) -> tuple:
        """Before a step: what ``rollback`` needs to undo it (the queues are copied; requests and
        KV tables are saved as the step first touches them)."""
        self.journal = StepJournal()
        self._arrivals = []
        self._forked = []
        self.kv.begin_step()
        # The waiting queue is not copied (it may be long): the step copies it before its first
        # change other than arrivals appended at the end (``writable_waiting``).
        self._shared_waiting = self.waiting
        return (
            (self.waiting, len(self.waiting)),
            list(self.running),
            list(self.swapped),
            list(self.held),
            dict(self.counters),
            self.num_passes,
            self._admit_counter,
            self.now,
        )

    def commit(self) -> None:
        """The step is done (its copies and forward ran): forget the undo log."""
        self.kv.end_step()
        self.journal = StepJournal()
        self._arrivals = []
        self._forked = []
        self._shared_waiting = None

    def rollback(self, checkpoint: tuple) -> None:
        """The step raised: put the queues, the requests and the KV tables back. A request whose
        KV blocks another request wrote into during the step recomputes from that position."""
        (
            (self.waiting, num_waiting),
            self.running,
            self.swapped,
            self.held,
            self.counters,
            self.num_passes,
            self._admit_counter,
            self.now,
        ) = checkpoint
        del self.waiting[num_waiting:]  # arrivals appended to the checkpoint's own list
        self._shared_waiting = None
        self.journal.restore()
        for parent in self._forked:  # the forked sequences never existed
            parent.unfork()
        self._forked = []
        for item in self._arrivals:
            heapq.heappush(self.incoming, item)
        self._arrivals = []
        for rid, pos in self.kv.rollback().items():
            req = next((r for r in self.running if r.request_id == rid), None)
            if req is not None:
                req.lose_kv_from(pos)

    def writable_waiting(self) -> list[Request]:
        """The waiting queue, to change in place: copied first if a checkpoint or the pass's
        admission loop still reads this list (copy on write)."""
        if self.waiting is self._shared_waiting:
            self.waiting = list(self.waiting)
        return self.waiting

    # --- applying a step's results -----------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result, t: float) -> StepUpdate:
        """Apply what the executor returned (``result.sampled``, ``result.spec_accepted``) at
        clock time ``t``: each scheduled request advances, rejected guesses give back their
        KV, stops finish requests, and held requests are returned when their batch is done."""
        if len(result.sampled) != len(out.scheduled):  # one token list per grant, in the grants' order
            raise RuntimeError(f"executor: {len(result.sampled)} token lists for {len(out.scheduled)} grants")
        finished: list[Request] = []
        for req in out.released:  # held back until this pass (static / every-N)
            self._return_held(req, self.now)
            finished.append(req)
        for req, w in zip(out.rejected_requests, out.rejected):
            self.finish_request(req, "rejected", self.now, detail=w.reason)
            finished.append(req)

        upd = StepUpdate(batch=[], finished=finished)
        self.journal.save_progress(out.scheduled)
        for s, new in zip(out.scheduled, result.sampled):  # each grant with its new tokens (empty: none)
            req = s.request
            req.advance(s.num_new_tokens)
            self._settle_guesses(s, result, upd)
            reason = None
            for tok in new:
                req.append_token(tok, t)
                reason = self.stops.check(req, tok)
                if reason:
                    break
            if reason and req.num_output_tokens > s.num_output_before + 1:
                req.drop_past_stop()
            self._after_tokens(s, result, t, upd)
            failed = result.failed.get(req.request_id) if result.failed else None  # its sampling failed: it alone
            if failed:
                reason = "abort"
            if reason and self.finish(req, reason, t, failed):
                finished.append(req)
        if self.config.batching == "static" and not self.running and self.held:
            finished += self._release_held(t)  # the whole static batch is done: return it now
        if self.record_batch:  # the sequences forked now had no grant in this step
            out.not_scheduled.extend(
                WaitingEntry(
                    seq.request_id,
                    f"forked from {seq.parent.request_id} at the end of this step: it decodes from the next step",
                )
                for seq in upd.forked
                if seq.status is RequestStatus.RUNNING
            )
        self.policy.on_step(out.scheduled, t)
        return upd

    def _release_held(self, t: float) -> list[Request]:
        """Finish every held request (finished earlier, kept back by static / every-N batching)."""
        released, self.held = self.held, []
        for req in released:
            self._return_held(req, t)
        return released

    def _return_held(self, req: Request, t: float) -> None:
        """A held request leaves with the reason it was held with."""
        reason = req.pending_finish_reason
        assert reason is not None, f"held request {req.request_id} has no pending finish reason"
        self.finish_request(req, reason, t)

    def _settle_guesses(self, s: ScheduledRequest, result, upd: StepUpdate) -> None:
        """Speculative decoding: the KV slots of rejected guesses go back (``_allocate_lookahead``
        allocated them), and so do those of slots a draft model left unguessed."""
        req = s.request
        if not (s.spec_token_ids or req.spec_token_ids):
            return
        accepted = result.spec_accepted.get(req.request_id, 0) if s.spec_token_ids else 0
        if s.spec_token_ids:
            self.journal.save(req)
            upd.count_guesses(len(s.spec_token_ids), accepted)
        req.settle_guesses(len(s.spec_token_ids), accepted)
        self.kv.truncate(req, req.num_computed_tokens)

    def _after_tokens(self, s: ScheduledRequest, result, t: float, upd: StepUpdate) -> None:
        """After a request's new tokens are appended: keep their logprobs, record the batch entry,
        fork a parallel-sampling group whose prompt is done."""
        req = s.request
        appended = len(req.output_token_ids) - s.num_output_before
        if result.logprobs or result.prompt_logprobs:
            self._keep_logprobs(req, appended, result.logprobs, result.prompt_logprobs)
        if self.record_batch:
            accepted = result.spec_accepted.get(req.request_id, 0) if result.spec_accepted else 0
            upd.batch.append(
                BatchEntry(
                    req.request_id,
                    s.phase,
                    s.num_new_tokens,
                    s.num_computed_before,
                    req.num_computed_tokens,
                    len(s.spec_token_ids),
                    accepted,
                    appended,
                )
            )
        if appended and req.parent is not None and not req.parent.forked:
            self.fork(req, result, t, upd)

    @staticmethod
    def _keep_logprobs(req: Request, appended: int, logprobs: dict, prompt_logprobs: dict) -> None:
        """The step's logprobs of the tokens kept (``SamplingParams.logprobs`` / ``prompt_logprobs``)."""
        if logprobs and req.output_logprobs is not None:
            req.output_logprobs.extend(logprobs.get(req.request_id, ())[:appended])
        if prompt_logprobs and req.request_id in prompt_logprobs:
            kept = req.prompt_logprobs
            assert kept is not None, f"prompt logprobs for {req.request_id}, which asked for none"
            for pos, lp in prompt_logprobs[req.request_id]:
                if kept[pos] is None:  # recomputed after a preemption: kept
                    kept[pos] = lp

    # --- the pass ----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = self._schedule_pass(now)
        cap_queue(self, now, out)  # after admission: a free slot never turns a request away
        if self.kv.supports_forking:  # copy-on-write, before the forward
            out.copies.extend(BlockCopy(*c) for c in self.kv.take_copies())
        return out

    def begin_pass(self, now: float) -> bool:
        """A pass starts at ``now``: it is counted, the clock moves, the requests that have arrived join
        the queue. Returns whether this pass re-forms the batch (one pass in ``schedule_every``)."""
        reform = self.num_passes % self.config.schedule_every == 0
        self.num_passes += 1
        self._release_arrivals(now)
        return reform

    def _schedule_pass(self, now: float) -> SchedulerOutput:
        cfg = self.config
        reform = self.begin_pass(now)
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[], token_budget=budget, reformed=reform)

        # Requests finished earlier leave now (every N steps; a static batch leaves as a whole
        # in update_from_output).
        if self.held and cfg.batching != "static" and reform:
            out.released.extend(self.held)
            self.held = []

        shed_load(self, now, out)

        static_blocked = cfg.batching == "static" and bool(self.running or self.held)
        prefill_first = cfg.interference == "prefill-priority"
        if prefill_first and reform and not static_blocked and self._admissible_head(now):
            budget = self._admit_waiting(now, out, budget, allow_chunk=False)
            if out.admitted:  # a prefill step: running decodes stall this step
                if self.record_batch:
                    out.not_scheduled.extend(
                        WaitingEntry(
                            r.request_id, "prefill-priority: this step runs a new prompt's prefill, decodes wait"
                        )
                        for r in self.running
                        if r.request_id not in out.admitted
                    )
                return out

        budget = self._schedule_running(now, out, budget)  # 1. running requests
        if not reform:
            return out
        budget = schedule_swapped(self, out, budget)  # 2. swapped-out requests come back
        why = self._no_admission_reason(now, static_blocked)  # 3. waiting requests, unless ...
        if why is not None:
            out.waiting.extend(WaitingEntry(req.request_id, why) for req in self._arrived(now))
            return out
        self._admit_waiting(now, out, budget, allow_chunk=cfg.enable_chunked_prefill)
        return out

    def _schedule_running(self, now: float, out: SchedulerOutput, budget: int) -> int:
        """1. Running requests: one new token each (or the next chunk of their prompt), preempting
        (the policy's victim) when a block is needed and none is free. Returns the budget left."""
        # Speculative tokens never crowd out another running request's next token.
        guesses = self.config.speculative_model is not None and any(r.spec_token_ids for r in self.running)
        decodes_left = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1) if guesses else 0
        spare = self._spare_blocks() if decodes_left else 0  # blocks the drafts may take
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:  # preempted above
                continue
            if budget <= 0:
                if self.record_batch:
                    out.not_scheduled.append(
                        WaitingEntry(
                            req.request_id,
                            f"the token budget of {self.config.max_num_batched_tokens} was spent before its turn",
                        )
                    )
                continue
            n = req.num_tokens - req.num_computed_tokens  # known tokens without KV yet
            if n == 1 and decodes_left:
                decodes_left -= 1  # this one's own next token
            # Speculative tokens count against the budget: keep as many as fit after the known
            # ones (and the later decodes'), and as many as the spare blocks hold (a draft never
            # preempts anyone): the scheduler allocates their lookahead slots here.
            spec = req.spec_token_ids[: max(0, budget - n - decodes_left)]
            if spec:
                spec, spare = self._allocate_lookahead(req, n, spec, spare)
            n = min(n + len(spec), budget)
            while not self.kv.allocate(req, n):
                # The victim is chosen among all running requests; one already granted tokens
                # this pass gives them back.
                victim = self.policy.pick_victim(list(self.running), now)
                budget += preempt_group(self, victim, out, f"{req.request_id} needed a KV block and none was free")
                if req.status is not RequestStatus.RUNNING:  # the victim, or in its group
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            if self.prefix_caching:
                self.kv.cache_full_blocks(req, min(req.num_computed_tokens + n, req.num_tokens), shareable=False)
            out.scheduled.append(grant(req, n, spec))
            budget -= n
        return budget

    def _spare_blocks(self) -> int:
        """Free blocks no running request needs for its plain next step: what drafts may take."""
        kv = self.kv
        if not kv.allocates_on_demand:  # a reservation: its region has room or not
            return 0
        return kv.num_free_blocks - sum(
            kv.num_blocks_needed(r, r.num_tokens - r.num_computed_tokens) for r in self.running
        )

    def _allocate_lookahead(self, req: Request, n: int, spec: list, spare: int) -> tuple[list, int]:
        """Speculative decoding: the KV slots of ``n`` known tokens plus the draft ``spec`` (1 + k
        positions for a decode), the draft trimmed to what ``spare`` blocks hold. Returns the draft
        kept and the spare blocks left. The rejected guesses' slots go back in ``update_from_output``."""
        kv = self.kv
        if not kv.allocates_on_demand:
            return (spec if kv.allocate(req, n + len(spec)) else []), spare
        plain = kv.num_blocks_needed(req, n)
        while spec and kv.num_blocks_needed(req, n + len(spec)) - plain > spare:
            spec = spec[:-1]
        if spec:
            spare -= kv.num_blocks_needed(req, n + len(spec)) - plain
            kv.allocate(req, n + len(spec))
        return spec, spare

    def _no_admission_reason(self, now: float, static_blocked: bool) -> Optional[str]:
        """3. Why no waiting request is admitted this pass, or None (admission goes ahead)."""
        if static_blocked:
            return "static batching: waits until the whole current batch has finished"
        if self.config.interference == "decode-priority" and any(r.is_decoding for r in self.running):
            return "decode-priority: no new prefill while requests are decoding"
        if self.swapped:
            return "swapped-out requests come back first"
        return None

    def _arrived(self, now: float) -> list[Request]:
        """The waiting requests that have arrived by ``now``: all of them, since one from the
        future waits in ``incoming`` until ``_release_arrivals`` (a copy, not a scan)."""
        if now >= self.now:
            return list(self.waiting)
        return [r for r in self.waiting if r.arrival_time <= now]

    def _admission_order(self, now: float) -> list[Request]:
        """Waiting requests in the policy's order. A policy that keeps the queue's order (FCFS)
        gets no copy: the pass walks the queue itself, as far as admission and the capped
        waiting reasons go, and a change to the queue meanwhile copies it first. So a long
        queue costs a pass nothing it does not look at."""
        # (read on the class: a wrapper that forwards attributes to a policy is not one that keeps the order)
        if getattr(type(self.policy), "order_waiting", None) is Policy.order_waiting and now >= self.now:
            self._shared_waiting = self.waiting
            return self.waiting
        return self.policy.order_waiting(self._arrived(now), now)

    def _admissible_head(self, now: float) -> bool:
        arrived = bool(self.waiting) if now >= self.now else bool(self._arrived(now))
        return arrived and len(self.running) < self.config.max_num_seqs

    def _admit_waiting(self, now, out, budget, allow_chunk) -> int:
        cfg = self.config
        order = self._admission_order(now)
        blocker: Optional[str] = None
        cap = self.max_waiting_entries
        for req in order:
            if blocker is not None:
                if cap is not None and len(out.waiting) >= cap:
                    break  # long queue: record only the first entries
                out.waiting.append(WaitingEntry(req.request_id, f"queued behind {blocker}"))
                continue
            seats, extra_blocks = group_need(req)
            while self.num_seqs() + seats > cfg.max_num_seqs:
                victim = self.policy.preempt_for(req, self.running, now)
                if victim is None or just_placed(victim, out):
                    break
                budget += preempt_group(self, victim, out, f"{req.request_id} has higher priority")
            if self.num_seqs() + seats > cfg.max_num_seqs:
                group = f" (it needs {seats} for its parallel samples)" if seats > 1 else ""
                full = f"max_num_seqs={cfg.max_num_seqs} requests already running{group}"
                out.waiting.append(WaitingEntry(req.request_id, full))
                blocker = req.request_id
                continue
            cached = self.kv.find_cached_prefix(req) if self.prefix_caching and req.prompt_logprobs is None else []
            computed = len(cached) * self.kv.block_size
            n = req.num_tokens - computed
            if n > budget:
                if not allow_chunk or budget <= 0:
                    off = "" if allow_chunk else " (chunked prefill is off)"
                    fit = f"does not fit the {budget} tokens left in the budget of {cfg.max_num_batched_tokens}{off}"
                    out.waiting.append(WaitingEntry(req.request_id, f"prefill of {n} tokens {fit}"))
                    blocker = req.request_id
                    continue
                n = budget  # chunked prefill: take what fits
            ok, need, free = self.kv.can_allocate(req, n, cached, extra_blocks)
            while not ok:  # priority: push lower classes out until it fits
                victim = self.policy.preempt_for(req, self.running, now)
                if victim is None or just_placed(victim, out):
                    break
                budget += preempt_group(self, victim, out, f"{req.request_id} has higher priority and needs its memory")
                ok, need, free = self.kv.can_allocate(req, n, cached, extra_blocks)
            if not ok:
                reason = self.kv.explain_wait(
                    req, n, cached, extra_blocks, requests={r.request_id: r for r in self.running}
                )
                if extra_blocks:
                    reason += f" ({extra_blocks} more for its parallel samples)"
                out.waiting.append(WaitingEntry(req.request_id, reason))
                blocker = req.request_id
                continue
            self.admit(req, n, cached, now, out)
            budget -= n
        return budget

    def num_seqs(self) -> int:
        """Sequences the running set counts against ``max_num_seqs``: one each, except a
        parallel-sampling group that has not forked yet, which counts all n."""
        if not self.has_groups:
            return len(self.running)
        return sum(r.num_seqs for r in self.running)
