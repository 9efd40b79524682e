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
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..detokenizer import IncrementalDetokenizer, find_stop
from .policies import Policy
from .request import Request, RequestStatus
from .step_journal import StepJournal
from .parallel_sampling import completion_id
from ..step_record import BatchEntry, BlockCopy, ForkEvent, PreemptionEvent, WaitingEntry


@dataclass(slots=True)          # one per request per step: slots make it cheap to create
class ScheduledRequest:
    request: Request
    num_new_tokens: int          # tokens processed this step (counted against the budget)
    num_computed_before: int
    num_output_before: int       # output tokens before the step (the undo log reads both)
    phase: str                   # "prefill" | "decode" (a label: one rule covers both)
    samples: bool                # does the step reach the end of the known tokens (a token is sampled)?
    spec_token_ids: Sequence[int] = ()   # draft tokens to verify (a list when there are some)


def grant(req: Request, num_new_tokens: int, spec_token_ids: list[int] = ()) -> ScheduledRequest:
    """This step's grant to ``req``: ``num_new_tokens`` positions from ``num_computed_tokens`` on
    (with ``spec_token_ids`` guesses to verify at the end). A *decode* is the grant of the newest
    token of a request that has output; anything else is a *prefill* (the label only)."""
    before = req.num_computed_tokens
    num_output = len(req.output_token_ids)
    num_tokens = len(req.prompt_token_ids) + num_output
    decode = num_output > 0 and before >= num_tokens - 1
    return ScheduledRequest(req, num_new_tokens, before, num_output, "decode" if decode else "prefill",
                            before + num_new_tokens >= num_tokens + len(spec_token_ids),
                            list(spec_token_ids) if spec_token_ids else ())


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    token_budget: int
    admitted: list[str] = field(default_factory=list)
    preempted: list[PreemptionEvent] = field(default_factory=list)
    waiting: list[WaitingEntry] = field(default_factory=list)
    rejected: list[WaitingEntry] = field(default_factory=list)
    rejected_requests: list[Request] = field(default_factory=list)  # the same, as requests
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block)
    swapped_in: list[str] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)           # copy-on-write: src -> dst, before the forward
    released: list[Request] = field(default_factory=list)  # finished earlier, returned now (static / every-N)
    reformed: bool = True          # did this pass re-form the batch?

    @property
    def num_batched_tokens(self) -> int:
        return sum([s.num_new_tokens for s in self.scheduled])


@dataclass
class StepUpdate:
    """What applying one step's results did (``Scheduler.update_from_output``)."""
    batch: list[BatchEntry]
    finished: list[Request]          # finished (or returned from the held set) this step
    forked: list[Request] = field(default_factory=list)     # sequences forked this step (parallel sampling)
    forks: list[ForkEvent] = field(default_factory=list)
    spec_proposed: int = 0
    spec_accepted: int = 0


class Scheduler:
    def __init__(self, config, kv, policy, cost_model=None, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer       # for stop strings (SamplingParams.stop), matched on text
        self.kv = kv                     # PagedKVCacheManager | ReservedKVCacheManager
        self.policy = policy
        self.cost_model = cost_model     # for preemption_mode="auto"
        self.waiting: list[Request] = []     # arrived, not running: new, or preempted (recompute)
        self._shared_waiting: Optional[list] = None   # the queue list a checkpoint or a pass still reads
        self.incoming: list = []             # heap of (arrival_time, seq, request): not arrived yet
        self.now = 0.0                       # the clock at the last pass
        self._add_seq = 0                    # ties in ``incoming`` keep submission order
        # Cap on StepRecord.waiting (record="none": only the request that stopped admission)
        self.max_waiting_entries: Optional[int] = 0 if config.record == "none" else config.record_max_waiting
        self.running: list[Request] = []     # holds KV; scheduled every step
        self.swapped: list[Request] = []     # KV sits in host memory
        self.held: list[Request] = []        # done generating, waiting to be returned (static / every-N)
        self.num_passes = 0
        self._admit_counter = 0
        self.counters = dict(preemptions_recompute=0, preemptions_swap=0, swapped_out_blocks=0,
                             swapped_in_blocks=0, recomputed_tokens=0, rejected=0)
        self.simulated = config.executor == "simulated"
        self.journal = StepJournal()        # what the step in progress changed (see checkpoint)
        self.record_batch = config.record != "none"   # build StepUpdate.batch (record="none": nobody reads it)
        self._arrivals: list = []           # (time, seq, request) released from ``incoming`` this step
        self._forked: list = []             # parents whose groups forked this step (undone on rollback)
        self.has_groups = False             # was any request with n > 1 ever added? (seat counting)

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

    def finish(self, req: Request, reason: str, t: float) -> bool:
        """The request is done generating: its KV is freed. Returns True if it leaves now,
        False if it is held back until the batch (static) or the next pass (every-N) comes."""
        self.journal.save(req)
        self.running.remove(req)
        self.kv.free(req)
        if self.config.batching == "static" or self.config.schedule_every > 1:
            req.pending_finish_reason = reason
            self.held.append(req)
            return False
        self.finish_request(req, reason, t)
        return True

    def finish_request(self, req: Request, reason: str, t: float, detail: Optional[str] = None) -> None:
        """The request leaves the engine: status, reason and its last metrics."""
        self.journal.save(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if detail is not None:
            req.finish_detail = detail
        req.metrics.finish_reason = reason
        req.metrics.finish_time = t
        req.metrics.num_output_tokens = req.num_output_tokens

    # --- one step, all or nothing -----------------------------------------------------
    def checkpoint(self) -> tuple:
        """Before a step: what ``rollback`` needs to undo it (the queues are copied; requests and
        KV tables are saved as the step first touches them)."""
        self.journal = StepJournal()
        self._arrivals = []
        self._forked = []
        self.kv.begin_step()
        # The waiting queue is not copied (it may be long): the step copies it before its first
        # change other than arrivals appended at the end (``_writable_waiting``).
        self._shared_waiting = self.waiting
        return ((self.waiting, len(self.waiting)), list(self.running), list(self.swapped), list(self.held),
                dict(self.counters), self.num_passes, self._admit_counter, self.now)

    def _writable_waiting(self) -> list[Request]:
        """The waiting queue, to change in place: copied first if a checkpoint or the pass's
        admission loop still reads this list (copy on write)."""
        if self.waiting is self._shared_waiting:
            self.waiting = list(self.waiting)
        return self.waiting

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
        ((self.waiting, num_waiting), self.running, self.swapped, self.held, self.counters, self.num_passes,
         self._admit_counter, self.now) = checkpoint
        del self.waiting[num_waiting:]       # arrivals appended to the checkpoint's own list
        self._shared_waiting = None
        self.journal.restore()
        for parent in self._forked:          # the forked sequences never existed
            parent.forked = False
            del parent.members[1:]
        self._forked = []
        for item in self._arrivals:
            heapq.heappush(self.incoming, item)
        self._arrivals = []
        for rid, pos in self.kv.rollback().items():
            req = next((r for r in self.running if r.request_id == rid), None)
            if req is not None and req.num_computed_tokens > pos:
                req.num_computed_tokens = pos
                req.num_cached_tokens = min(req.num_cached_tokens, pos)

    # --- applying a step's results -----------------------------------------------------
    def check_stop(self, req: Request, tok: int) -> Optional[str]:
        """Does ``tok`` (just appended) end the request? "stop", "length" or None. Before
        ``min_tokens`` tokens only the length limits end it; a stop token or string that ends
        it is kept in ``req.stop_reason`` (EOS leaves it None, as in vLLM)."""
        sp = req.sampling_params
        n_out = len(req.output_token_ids)     # (plain len: this runs once per token, keep it cheap)
        early = n_out < sp.min_tokens
        if tok == req.eos_token_id and not sp.ignore_eos and not early:
            return "stop"
        if sp.stop_token_ids and tok in sp.stop_token_ids and not early:
            req.stop_reason = tok
            return "stop"
        if sp.stop and self.tokenizer is not None and self._stop_string(req, early):
            return "stop"
        if n_out >= sp.max_tokens or len(req.prompt_token_ids) + n_out >= self.config.max_model_len:
            return "length"
        if self.simulated and req.expected_output_len is not None and n_out >= req.expected_output_len:
            return "stop"       # the simulator's stand-in for the model emitting EOS at the trace length
        return None

    def _stop_watch(self, req: Request) -> tuple:
        """When can ``check_stop`` fire for ``req``? ``(limit, watched)``: only once the output
        has ``limit`` tokens (the smallest length limit: ``max_tokens``, ``max_model_len``, the
        simulator's trace length) or on a token in ``watched`` (EOS unless ignored, the stop
        token ids); ``limit`` is 0 when stop strings are matched, which look at every token.
        Computed once per request from fields that never change, so that applying a step's
        results can skip ``check_stop`` for the tokens that cannot end the request."""
        sp = req.sampling_params
        limit = min(sp.max_tokens, self.config.max_model_len - len(req.prompt_token_ids))
        if self.simulated and req.expected_output_len is not None:
            limit = min(limit, req.expected_output_len)
        watched = set(sp.stop_token_ids)
        if req.eos_token_id is not None and not sp.ignore_eos:
            watched.add(req.eos_token_id)
        req.stop_watch = (0 if sp.stop and self.tokenizer is not None else limit, frozenset(watched))
        return req.stop_watch

    def _stop_string(self, req: Request, early: bool) -> bool:
        """Extend the output's text by its newest token; True if a stop string now appears in it
        (the text is then cut before it, or after it with ``include_stop_str_in_output``)."""
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        d = req.detokenizer
        new = d.update(req.output_token_ids)
        hit = find_stop(d.text, len(new), req.sampling_params.stop) if new and not early else None
        if hit is None:
            return False
        i, stop = hit
        req.stop_reason = stop
        req.stop_text = d.text[:i + len(stop)] if req.sampling_params.include_stop_str_in_output else d.text[:i]
        return True

    def update_from_output(self, out: SchedulerOutput, result, t: float) -> StepUpdate:
        """Apply what the executor returned (``result.sampled``, ``result.spec_accepted``) at
        clock time ``t``: each scheduled request advances, rejected guesses give back their
        KV, stops finish requests, and held requests are returned when their batch is done."""
        finished: list[Request] = []
        for req in out.released:                 # held back until this pass (static / every-N)
            self.finish_request(req, req.pending_finish_reason, self.now)
            finished.append(req)
        for req, w in zip(out.rejected_requests, out.rejected):
            self.finish_request(req, "rejected", self.now, detail=w.reason)
            finished.append(req)

        upd = StepUpdate(batch=[], finished=finished)
        sampled = result.sampled
        first_tokens = self.journal.save_progress(out.scheduled)
        # Guesses to settle, logprobs to keep, batch entries to record, groups to fork: one test per
        # request when the step has none of these (the simulator's usual step).
        extras = bool(self.config.speculative_model is not None or result.spec_accepted or result.logprobs
                      or result.prompt_logprobs or self.record_batch or self.has_groups)
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if extras:
                self._settle_guesses(s, result, upd)
            new = sampled.get(req.request_id, ())
            reason = None
            appended = 0
            if new:
                output_ids, m = req.output_token_ids, req.metrics
                if m.first_token_time is None:
                    m.first_token_time = t
                    first_tokens.append(req)
                limit, watched = req.stop_watch or self._stop_watch(req)
                for tok in new:
                    appended += 1
                    output_ids.append(tok)
                    m.token_times.append(t)
                    # check_stop(req, tok), skipped when it cannot fire (see _stop_watch): most tokens
                    if len(output_ids) >= limit or (watched and tok in watched):
                        reason = self.check_stop(req, tok)
                        if reason:
                            break
            if appended > 1 and reason:
                # Tokens accepted past a stop are dropped: keep KV consistent with the output.
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            if extras:
                self._after_tokens(s, result, appended, t, upd)
            if reason and self.finish(req, reason, t):
                finished.append(req)
        if self.config.batching == "static" and not self.running and self.held:
            finished += self._release_held(t)    # the whole static batch is done: return it now
        self.policy.on_step(out.scheduled, t)
        return upd

    def _release_held(self, t: float) -> list[Request]:
        """Finish every held request (finished earlier, kept back by static / every-N batching)."""
        released, self.held = self.held, []
        for req in released:
            self.finish_request(req, req.pending_finish_reason, t)
        return released

    def _settle_guesses(self, s: ScheduledRequest, result, upd: StepUpdate) -> None:
        """Speculative decoding: the KV of rejected guesses is rolled back (and blocks reserved for
        guesses this pass did not keep go back to the pool)."""
        req = s.request
        if not (s.spec_token_ids or req.spec_token_ids):
            return
        if s.spec_token_ids:
            accepted = result.spec_accepted.get(req.request_id, 0)
            req.num_computed_tokens -= len(s.spec_token_ids) - accepted
            self.kv.truncate(req, req.num_computed_tokens)
            upd.spec_proposed += len(s.spec_token_ids)
            upd.spec_accepted += accepted
            self.journal.save(req)
            req.metrics.num_spec_proposed += len(s.spec_token_ids)
            req.metrics.num_spec_accepted += accepted
        else:
            self.kv.truncate(req, req.num_computed_tokens)
        req.spec_token_ids = []

    def _after_tokens(self, s: ScheduledRequest, result, appended: int, t: float, upd: StepUpdate) -> None:
        """After a request's new tokens are appended: keep their logprobs, record the batch entry,
        fork a parallel-sampling group whose prompt is done."""
        req = s.request
        if result.logprobs or result.prompt_logprobs:
            self._keep_logprobs(req, appended, result.logprobs, result.prompt_logprobs)
        if self.record_batch:
            accepted = result.spec_accepted.get(req.request_id, 0) if result.spec_accepted else 0
            upd.batch.append(BatchEntry(req.request_id, s.phase, s.num_new_tokens, s.num_computed_before,
                                        req.num_computed_tokens, len(s.spec_token_ids), accepted, appended))
        if appended and req.parent is not None and not req.parent.forked:
            self._fork(req, result, t, upd)

    @staticmethod
    def _keep_logprobs(req: Request, appended: int, logprobs: dict, prompt_logprobs: dict) -> None:
        """The step's logprobs of the tokens kept (``SamplingParams.logprobs`` / ``prompt_logprobs``)."""
        if logprobs and req.output_logprobs is not None:
            req.output_logprobs += logprobs.get(req.request_id, ())[:appended]
        if prompt_logprobs and req.request_id in prompt_logprobs:
            for pos, lp in prompt_logprobs[req.request_id]:
                if req.prompt_logprobs[pos] is None:      # recomputed after a preemption: kept
                    req.prompt_logprobs[pos] = lp

    def _fork(self, first: Request, result, t: float, upd: StepUpdate) -> None:
        """Parallel sampling: the prompt is computed and its logits were sampled once per
        completion. Create the other n - 1 sequences, each sharing every block of ``first``
        (see ``minillm/core/parallel_sampling.py``), with its own first token."""
        parent = first.parent
        parent.forked = True
        self._forked.append(parent)
        shared: list[int] = []
        for i in range(1, parent.n):
            cid = completion_id(parent.request_id, i)
            seq = Request(cid, first.prompt_token_ids, parent.params[i], first.arrival_time, first.priority,
                          first.tenant, first.eos_token_id, first.expected_output_len, prompt=first.prompt)
            seq.parent, seq.index = parent, i
            seq.status = RequestStatus.RUNNING
            seq.num_computed_tokens = first.num_computed_tokens
            seq.num_cached_tokens = first.num_cached_tokens
            seq.admit_seq = first.admit_seq
            m, fm = seq.metrics, first.metrics
            m.first_scheduled_time, m.num_cached_tokens = fm.first_scheduled_time, fm.num_cached_tokens
            m.clock = fm.clock
            if first.prompt_logprobs is not None:
                seq.prompt_logprobs = first.prompt_logprobs
            shared = self.kv.fork(first, seq)
            parent.members.append(seq)
            self.running.append(seq)
            upd.forked.append(seq)
            # The runner sampled each completion's first token; the simulator, which samples
            # nothing, gives them all the first sequence's placeholder.
            tok = result.sampled.get(cid, first.output_token_ids[-1:])[0]
            seq.output_token_ids.append(tok)
            m.token_times.append(t)
            m.first_token_time = t
            if seq.output_logprobs is not None:
                seq.output_logprobs += result.logprobs.get(cid, ())
            reason = self.check_stop(seq, tok)
            if reason and self.finish(seq, reason, t):
                upd.finished.append(seq)
        upd.forks.append(ForkEvent(parent.request_id, [m.request_id for m in parent.members], shared))

    def _next_admit_seq(self) -> int:
        self._admit_counter += 1
        return self._admit_counter

    # --- preemption -----------------------------------------------------------------
    def _choose_mode(self, victim: Request) -> str:
        mode = self.config.preemption_mode
        if mode == "auto":
            # The preemption cost rule: swap when M_KV / B_PCIe < (n_input + n_generated) / S_prefill.
            cm = self.cost_model
            if cm is None or not getattr(cm, "kv_bytes_per_token", 0):
                return "recompute"
            mode = cm.preemption_mode(victim.num_computed_tokens)
        if mode == "swap" and not self.kv.can_swap_out(victim):
            return "recompute"            # swap pool full: fall back
        return mode

    def preempt(self, victim: Request, out: SchedulerOutput, reason: str) -> None:
        mode = self._choose_mode(victim)
        self.journal.save(victim)
        self.running.remove(victim)
        if mode == "swap":
            mapping = self.kv.swap_out(victim)
            out.swap_out.extend(mapping)
            self.counters["swapped_out_blocks"] += len(mapping)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            self.kv.free(victim)
            self.counters["recomputed_tokens"] += victim.num_computed_tokens
            victim.metrics.num_recomputed_tokens += victim.num_computed_tokens
            victim.num_computed_tokens = 0
            victim.num_cached_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self._writable_waiting().insert(0, victim)      # back to the front of the queue
        self.counters[f"preemptions_{mode}"] += 1
        victim.num_preemptions += 1
        victim.metrics.num_preemptions += 1
        out.preempted.append(PreemptionEvent(victim.request_id, mode, reason))

    # --- the pass ----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = self._schedule_pass(now)
        self._cap_queue(now, out)        # after admission: a free slot never turns a request away
        out.copies = [BlockCopy(*c) for c in self.kv.take_copies()]   # copy-on-write, before the forward
        return out

    def _schedule_pass(self, now: float) -> SchedulerOutput:
        cfg = self.config
        reform = self.num_passes % cfg.schedule_every == 0
        self.num_passes += 1
        self._release_arrivals(now)
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[], token_budget=budget, reformed=reform)

        # Requests finished earlier leave now (every N steps; a static batch leaves as a whole
        # in update_from_output).
        if self.held and cfg.batching != "static" and reform:
            out.released, self.held = self.held, []

        self._shed_load(now, out)

        static_blocked = cfg.batching == "static" and bool(self.running or self.held)
        prefill_first = cfg.interference == "prefill-priority"
        if prefill_first and reform and not static_blocked and self._admissible_head(now):
            budget = self._admit_waiting(now, out, budget, allow_chunk=False)
            if out.admitted:
                return out                 # a prefill step: running decodes stall this step

        budget = self._schedule_running(now, out, budget)     # 1. running requests
        if not reform:
            return out
        budget = self._schedule_swapped(out, budget)          # 2. swapped-out requests come back
        why = self._no_admission_reason(now, static_blocked)  # 3. waiting requests, unless ...
        if why is not None:
            out.waiting.extend(WaitingEntry(req.request_id, why) for req in self._arrived(now))
            return out
        self._admit_waiting(now, out, budget, allow_chunk=cfg.enable_chunked_prefill)
        return out

    def _schedule_running(self, now: float, out: SchedulerOutput, budget: int) -> int:
        """1. Running requests: one new token each (or the next chunk of their prompt), preempting
        (the policy's victim) when a block is needed and none is free. Returns the budget left."""
        guesses = self.config.speculative_model is not None and any(r.spec_token_ids for r in self.running)
        decodes_left = self._decodes_left() if guesses else 0
        kv = self.kv
        caching = getattr(kv, "enable_prefix_caching", True)   # else cache_full_blocks registers nothing
        # The decode fast path: one token into the block the request is part way through needs
        # nothing from the KV manager (kv.in_place_block_size; not with guesses or forks).
        rule = None if guesses or self.has_groups else getattr(kv, "in_place_block_size", None)
        bs = (rule() if rule is not None else None) or 0
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or budget <= 0:   # preempted above: O(1) test
                continue
            before = req.num_computed_tokens
            num_output = len(req.output_token_ids)
            num_tokens = len(req.prompt_token_ids) + num_output
            n = num_tokens - before                       # known tokens without KV yet
            if n == 1 and bs and before % bs:
                # grant(req, 1), with no allocate call
                if caching:
                    kv.cache_full_blocks(req, num_tokens, shareable=False)
                out.scheduled.append(ScheduledRequest(req, 1, before, num_output,
                                                      "decode" if num_output else "prefill", True))
                budget -= 1
                continue
            if n == 1 and decodes_left:
                decodes_left -= 1                         # this one's own next token
            # Speculative tokens count against the budget: keep as many as fit after the known
            # ones (and the later decodes'); if their KV does not fit, decode plainly rather
            # than preempt anyone.
            spec = req.spec_token_ids
            if spec:
                spec = spec[:max(0, budget - n - decodes_left)]
                if spec and not kv.allocate(req, n + len(spec)):
                    spec = []
                n += len(spec)
            if n > budget:
                n = budget
            while not kv.allocate(req, n):
                # The victim is chosen among all running requests; one already granted tokens
                # this pass gives them back.
                victim = self.policy.pick_victim(list(self.running), now)
                budget += self._preempt_group(victim, out,
                                              f"{req.request_id} needed a KV block and none was free")
                if req.status is not RequestStatus.RUNNING:     # the victim, or in its group
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            if caching:
                kv.cache_full_blocks(req, min(before + n, num_tokens), shareable=False)
            # grant(req, n, spec), written out: this line runs for every running request every step
            out.scheduled.append(ScheduledRequest(
                req, n, before, num_output, "decode" if num_output and before >= num_tokens - 1 else "prefill",
                before + n >= num_tokens + len(spec), list(spec) if spec else ()))
            budget -= n
        return budget

    def _decodes_left(self) -> int:
        """With speculative guesses this pass: the running requests with one known token to
        process (speculative tokens never crowd out another running request's next token).
        Only asked when a speculator proposed guesses: without one, no pass over the running set."""
        return sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """2. Swapped-out requests come back (KV copied in) before anybody new is admitted, oldest
        first while blocks and seats allow. Returns the budget left."""
        cfg = self.config
        while self.swapped and self._num_seqs() + self.swapped[0].num_seqs <= cfg.max_num_seqs and budget > 0:
            req = self.swapped[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            ok, need, free = self.kv.can_swap_in(req, n)
            if not ok:
                out.waiting.append(WaitingEntry(req.request_id, f"swapped out: needs {need} blocks "
                                                f"to come back, {free} free"))
                break
            self.swapped.pop(0)
            self.journal.save(req)
            copies = self.kv.swap_in(req)
            out.swap_in.extend(copies)
            self.counters["swapped_in_blocks"] += len(copies)
            self.kv.allocate(req, n)
            self.kv.cache_full_blocks(req, min(req.num_computed_tokens + n, req.num_tokens), shareable=False)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.swapped_in.append(req.request_id)
            out.scheduled.append(grant(req, n))
            budget -= n
        for req in self.swapped[1:]:
            out.waiting.append(WaitingEntry(req.request_id, "swapped out: queued behind "
                                            f"{self.swapped[0].request_id}"))
        return budget

    def _no_admission_reason(self, now: float, static_blocked: bool) -> Optional[str]:
        """3. Why no waiting request is admitted this pass, or None (admission goes ahead)."""
        if static_blocked:
            return "static batching: waits until the whole current batch has finished"
        if self.config.interference == "decode-priority" and any(not r.is_prefill for r in self.running):
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
                    break                               # long queue: record only the first entries
                out.waiting.append(WaitingEntry(req.request_id, f"queued behind {blocker}"))
                continue
            seats, extra_blocks = self._group_need(req)
            while self._num_seqs() + seats > cfg.max_num_seqs:
                victim = self.policy.preempt_for(req, self.running, now)
                if victim is None or self._just_placed(victim, out):
                    break
                budget += self._preempt_group(victim, out, f"{req.request_id} has higher priority")
            if self._num_seqs() + seats > cfg.max_num_seqs:
                out.waiting.append(WaitingEntry(
                    req.request_id, f"max_num_seqs={cfg.max_num_seqs} requests already running"
                    + (f" (it needs {seats} for its parallel samples)" if seats > 1 else "")))
                blocker = req.request_id
                continue
            cached = self.kv.find_cached_prefix(req) if req.prompt_logprobs is None else []
            computed = len(cached) * self.kv.block_size
            n = req.num_tokens - computed
            if n > budget:
                if not allow_chunk or budget <= 0:
                    out.waiting.append(WaitingEntry(
                        req.request_id, f"prefill of {n} tokens does not fit the {budget} tokens left "
                        f"in the budget of {cfg.max_num_batched_tokens}"
                        + ("" if allow_chunk else " (chunked prefill is off)")))
                    blocker = req.request_id
                    continue
                n = budget                              # chunked prefill: take what fits
            ok, need, free = self.kv.can_allocate(req, n, cached, extra_blocks)
            while not ok:                               # priority: push lower classes out until it fits
                victim = self.policy.preempt_for(req, self.running, now)
                if victim is None or self._just_placed(victim, out):
                    break
                budget += self._preempt_group(victim, out,
                                              f"{req.request_id} has higher priority and needs its memory")
                ok, need, free = self.kv.can_allocate(req, n, cached, extra_blocks)
            if not ok:
                reason = self.kv.explain_wait(req, n, cached, extra_blocks,
                                              requests={r.request_id: r for r in self.running})
                if extra_blocks:
                    reason += f" ({extra_blocks} more for its parallel samples)"
                out.waiting.append(WaitingEntry(req.request_id, reason))
                blocker = req.request_id
                continue
            self._admit(req, n, cached, now, out)
            budget -= n
        return budget

    def _admit(self, req: Request, n: int, cached: list, now: float, out: SchedulerOutput) -> None:
        """Admission passed: ``req`` gets its blocks (the ``cached`` prefix blocks shared), leaves the
        queue, runs, and is granted ``n`` tokens of its prompt after the cached prefix."""
        computed = len(cached) * self.kv.block_size
        self.journal.save(req)
        self.kv.allocate(req, n, cached)
        self.kv.record_lookup(req, cached)
        self._writable_waiting().remove(req)
        req.num_computed_tokens = computed
        self.kv.cache_full_blocks(req, min(computed + n, req.num_tokens))
        req.num_cached_tokens = computed
        req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, computed)
        req.status = RequestStatus.RUNNING
        req.admit_seq = self._next_admit_seq()
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = now
        self.running.append(req)
        out.admitted.append(req.request_id)
        out.scheduled.append(grant(req, n))

    def _num_seqs(self) -> int:
        """Sequences the running set counts against ``max_num_seqs``: one each, except a
        parallel-sampling group that has not forked yet, which counts all n."""
        if not self.has_groups:
            return len(self.running)
        return sum(r.num_seqs for r in self.running)

    def _group_need(self, req: Request) -> tuple[int, int]:
        """(seats, extra blocks) admitting ``req`` must find room for. A parallel-sampling group
        that has not forked needs n seats, and keeps one block per other sample free (each may
        need one at its first decode step). The first waiting member of a forked group that was
        preempted together claims the seats of all its waiting members; their memory is
        checked one by one (the whole group may never fit at once, each member does)."""
        p = req.parent
        if p is None:
            return 1, 0
        if not p.forked:
            return p.n, p.n - 1
        return sum(1 for m in p.members if m.status is RequestStatus.PREEMPTED), 0

    def _preempt_group(self, victim: Request, out: SchedulerOutput, reason: str) -> int:
        """Preempt ``victim``, and with it the other running sequences of its parallel-sampling
        group (a group is preempted together). Returns the budget tokens given back."""
        group = [victim]
        p = victim.parent
        if p is not None and p.forked:
            group += [m for m in p.members if m is not victim and m.status is RequestStatus.RUNNING
                      and m in self.running]
        budget = 0
        for m in group:
            budget += self._unschedule(m, out)
            self.preempt(m, out, reason if m is victim else
                         f"{reason}; preempted with {victim.request_id}, its parallel-sampling group")
        return budget

    @staticmethod
    def _just_placed(req: Request, out: SchedulerOutput) -> bool:
        """Admitted or swapped in by this very pass: not preempted by it (no ping-pong)."""
        return req.request_id in out.admitted or req.request_id in out.swapped_in

    def _unschedule(self, victim: Request, out: SchedulerOutput) -> int:
        """Take a running request back out of this step's batch (it is about to be preempted);
        returns the budget tokens it gave back (none if this pass has not granted it any yet).
        A search of the batch: preemptions are rare, grants happen for every request every step."""
        for i, s in enumerate(out.scheduled):
            if s.request is victim:
                del out.scheduled[i]
                return s.num_new_tokens
        return 0

    def _shed_load(self, now: float, out: SchedulerOutput) -> None:
        """Admission control: reject cleanly rather than let the queue grow without bound."""
        cfg = self.config
        if cfg.max_queue_delay is not None:
            for req in [r for r in self.waiting if r.status == RequestStatus.WAITING
                        and r.arrival_time <= now and now - r.arrival_time > cfg.max_queue_delay]:
                self._reject(req, out, f"waited {now - req.arrival_time:.3f}s > max_queue_delay="
                             f"{cfg.max_queue_delay}")

    def _cap_queue(self, now: float, out: SchedulerOutput) -> None:
        """Load shedding: new requests still waiting after a pass beyond ``max_queue_len`` are
        rejected, latest arrivals first."""
        cfg = self.config
        if cfg.max_queue_len is None or not out.reformed:
            return                       # between passes (schedule_every > 1) nobody could be admitted
        queued = [r for r in self.waiting if r.status == RequestStatus.WAITING and r.arrival_time <= now]
        if len(queued) <= cfg.max_queue_len:
            return
        for req in queued[cfg.max_queue_len:]:
            self._reject(req, out, f"queue full: {len(queued)} waiting > max_queue_len={cfg.max_queue_len}")
        gone = {w.request_id for w in out.rejected}
        out.waiting = [w for w in out.waiting if w.request_id not in gone]

    def _reject(self, req: Request, out: SchedulerOutput, reason: str) -> None:
        self.journal.save(req)
        self._writable_waiting().remove(req)
        req.finish_reason = "rejected"
        req.finish_detail = reason
        self.counters["rejected"] += 1
        out.rejected.append(WaitingEntry(req.request_id, reason))
        out.rejected_requests.append(req)
