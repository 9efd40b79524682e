"""The undo logs of one step: what a failed step changed in its requests and in the KV manager's
block tables, and how to put both back.

A step is all or nothing. The scheduler saves a request here the first time the step changes it
(admission, preemption, swap-in, rejection, finishing) and keeps the step's grants, which say for
each request the step ran where it stood before the results were applied (positions, output
length). If anything raises before the step
ends, ``restore()`` replays the log backwards and every request is as it was before the step.
(A policy's own bookkeeping, such as ``request.policy_state``, is the policy's business.)

``checkpoint_step`` / ``commit_step`` / ``rollback_step`` are the scheduler's side of it
(``Scheduler.checkpoint`` / ``commit`` / ``rollback``): its queues, counters and KV tables.

``KVStepJournal`` is the same for the paged KV manager: between its ``begin_step()`` and ``end_step()``
it keeps each block table the step changes (the first time), the blocks it hands out and the
prefixes it registers; ``undo()`` puts every table, reference count and free list back.
"""

from __future__ import annotations

import heapq
from operator import attrgetter

_REQUEST_FIELDS = ("status", "num_computed_tokens", "num_cached_tokens", "finish_reason", "finish_detail",
                   "pending_finish_reason", "admit_seq", "num_preemptions", "stop_reason", "stop_text")
_METRICS_FIELDS = ("first_scheduled_time", "first_token_time", "finish_time", "num_output_tokens",
                   "num_cached_tokens", "num_preemptions", "num_recomputed_tokens", "num_spec_proposed",
                   "num_spec_accepted", "finish_reason")
_request_fields, _metrics_fields = attrgetter(*_REQUEST_FIELDS), attrgetter(*_METRICS_FIELDS)   # each a tuple


class StepJournal:
    def __init__(self):
        self._saved: set[str] = set()
        self._log: list[tuple] = []

    def save(self, req) -> None:
        """Every mutable field of ``req``, the first time this step touches it."""
        if req.request_id in self._saved:
            return
        self._saved.add(req.request_id)
        m = req.metrics
        self._log.append((True, req, len(req.output_token_ids), len(m.token_times), _request_fields(req),
                          _metrics_fields(m)))

    def save_progress(self, scheduled) -> list:
        """Before applying a step's results to the requests it ran (``scheduled``, its
        ``ScheduledRequest``s). Nothing is copied per request: applying results only adds computed
        positions and appends output tokens with their times, so undoing it puts each request
        back to its grant's ``num_computed_before`` and ``num_output_before``. The one other field
        it sets, a request's first token time, is noted in the list returned (the caller appends
        each request whose first token comes in this step). A full save made later in the step is
        replayed first, since the log is replayed backwards."""
        first_tokens: list = []
        self._log.append((False, scheduled, first_tokens))
        return first_tokens

    def restore(self) -> None:
        for entry in reversed(self._log):
            if entry[0]:
                _, req, n_out, n_times, a, b = entry
                for f, v in zip(_REQUEST_FIELDS, a):
                    setattr(req, f, v)
                for f, v in zip(_METRICS_FIELDS, b):
                    setattr(req.metrics, f, v)
                cut_output(req, n_out)
                del req.metrics.token_times[n_times:]
            else:
                _, scheduled, first_tokens = entry
                for req in first_tokens:
                    req.metrics.first_token_time = None
                for s in reversed(scheduled):
                    req = s.request
                    req.num_computed_tokens = s.num_computed_before
                    appended = len(req.output_token_ids) - s.num_output_before
                    if appended > 0:        # each output token was appended with its time
                        cut_output(req, s.num_output_before)
                        del req.metrics.token_times[-appended:]
                        req.stop_reason = req.stop_text = None     # only a stop in those tokens sets them
        self._log.clear()
        self._saved.clear()


def cut_output(req, num_tokens: int) -> None:
    """Cut ``req``'s output back to its first ``num_tokens`` tokens: their logprobs, and the text its
    incremental detokenizer has decoded (so a stop string is matched on the text of those tokens only)."""
    del req.output_token_ids[num_tokens:]
    if req.output_logprobs is not None:
        del req.output_logprobs[num_tokens:]
    d = req.detokenizer
    if d is not None and d.num_tokens > num_tokens:
        d.rewind(req.output_token_ids)


# --- the scheduler's step: checkpoint before, commit after, rollback if it raised --------------------

def checkpoint_step(sched) -> tuple:
    """Before a step: what ``rollback_step`` needs to undo it (the queues are copied; requests and
    KV tables are saved as the step first touches them)."""
    sched.journal = StepJournal()
    sched._arrivals = []
    sched._forked = []
    sched.kv.begin_step()
    # The waiting queue is not copied (it may be long): the step copies it before its first
    # change other than arrivals appended at the end (``Scheduler._writable_waiting``).
    sched._shared_waiting = sched.waiting
    return ((sched.waiting, len(sched.waiting)), list(sched.running), list(sched.swapped), list(sched.held),
            dict(sched.counters), sched.num_passes, sched._admit_counter, sched.now)


def commit_step(sched) -> None:
    """The step is done (its copies and forward ran): forget the undo log."""
    sched.kv.end_step()
    sched.journal = StepJournal()
    sched._arrivals = []
    sched._forked = []
    sched._shared_waiting = None


def rollback_step(sched, checkpoint: tuple) -> None:
    """The step raised: put the queues, the requests and the KV tables back. A request whose
    KV blocks another request wrote into during the step recomputes from that position."""
    ((sched.waiting, num_waiting), sched.running, sched.swapped, sched.held, sched.counters, sched.num_passes,
     sched._admit_counter, sched.now) = checkpoint
    del sched.waiting[num_waiting:]       # arrivals appended to the checkpoint's own list
    sched._shared_waiting = None
    sched.journal.restore()
    for parent in sched._forked:          # the forked sequences never existed
        parent.forked = False
        del parent.members[1:]
    sched._forked = []
    for item in sched._arrivals:
        heapq.heappush(sched.incoming, item)
    sched._arrivals = []
    for rid, pos in sched.kv.rollback().items():
        req = next((r for r in sched.running if r.request_id == rid), None)
        if req is not None and req.num_computed_tokens > pos:
            req.num_computed_tokens = pos
            req.num_cached_tokens = min(req.num_cached_tokens, pos)


class KVStepJournal:
    """What one step changed in a ``PagedKVCacheManager`` (``kv``), so that ``undo`` can put it back."""

    def __init__(self, kv):
        self.tables: dict[str, tuple] = {}   # request -> (block table, prefix hashes, host blocks) before the step
        self.fresh: set[int] = set()         # blocks handed out during the step
        self.hashed: dict[int, str] = {}     # block -> request: prefixes the step registered
        self.unshared: set[int] = set()      # of those, ones not offered to lookups this pass (preemptable owner)
        self.host_pending: list[int] = []    # host blocks freed in the step: reused after its copies have run
        self.computed = False                # has the forward written the step's KV?
        self.stats = (dict(kv.pool.stats), kv.prefill_tokens_saved)

    def save_table(self, kv, rid: str) -> None:
        """Before the step's first change to a request's tables, keep a copy."""
        if rid not in self.tables:     # (written out, no generator: a decode at a block boundary runs this)
            blocks, hashes, host = kv.req_blocks.get(rid), kv.req_hashes.get(rid), kv.swapped.get(rid)
            self.tables[rid] = (None if blocks is None else list(blocks), None if hashes is None else list(hashes),
                                None if host is None else list(host))

    def undo(self, kv) -> dict[str, int]:
        """Every table the step changed goes back to how it was. Returns, for a request whose blocks
        were handed to another request during the step (and so may have been written over), the
        first position whose KV can no longer be trusted."""
        pool = kv.pool
        # Prefixes registered in the step are forgotten: the forward may not have run, and a
        # rolled-back request will not look for them (it registers its own blocks again).
        for bid in self.hashed:
            pool.forget_hash(pool.blocks[bid])
        affected: dict = {}
        depth: dict[int, int] = {}                     # a block's position in a table the step made
        for rid, (blocks, hashes, host) in self.tables.items():
            for i, b in enumerate(kv.req_blocks.get(rid, ())):
                affected[b.block_id] = b
                depth[b.block_id] = max(depth.get(b.block_id, -1), i)
            for table, saved in ((kv.req_blocks, blocks), (kv.req_hashes, hashes), (kv.swapped, host)):
                if saved is None:
                    table.pop(rid, None)
                else:
                    table[rid] = saved
            for b in blocks or ():
                affected[b.block_id] = b
        refs = dict.fromkeys(affected, 0)
        for blocks in kv.req_blocks.values():
            for b in blocks:
                if b.block_id in refs:
                    refs[b.block_id] += 1
        # Blocks nobody holds any more go back to the free list children first (deepest position
        # first), as free_blocks() returns them, so a parent is never evicted before its child.
        for b in sorted(affected.values(), key=lambda b: -depth.get(b.block_id, -1)):
            pool.set_ref_count(b, refs[b.block_id])
        used = {h for hs in kv.swapped.values() for h in hs}
        kv.swap_free = [h for h in range(kv.num_swap_blocks - 1, -1, -1) if h not in used]
        pool.stats, kv.prefill_tokens_saved = dict(self.stats[0]), self.stats[1]
        return self._damaged(kv)

    def _damaged(self, kv) -> dict[str, int]:
        """Per request the step touched: the position of its first block handed out during the step.
        The request gives that block and the ones after it back (it recomputes them into blocks of its
        own: the samples of a fork still share them) and drops its prefix hashes from there on."""
        damaged: dict[str, int] = {}
        for rid in self.tables:
            blocks = kv.req_blocks.get(rid, ())
            for i, b in enumerate(blocks):
                if b.block_id in self.fresh:
                    damaged[rid] = i * kv.block_size
                    kv.pool.free_blocks(blocks[i:])
                    del blocks[i:]
                    hashes = kv.req_hashes.get(rid)
                    if hashes and len(hashes) > i:
                        del hashes[i:]
                    break
        return damaged
