"""The undo logs of one step: what a failed step changed in its requests and in the KV manager's
block tables, and how to put both back.

A step is all or nothing. The scheduler's transitions (admit, preempt, swap in, reject, finish,
fork, apply the results) save a request here the first time the step changes it, every field of it
(``Request.snapshot``), and keep the step's grants, which say for each request the step ran where it
stood before the results were applied (positions, output length). If anything raises before the step
ends, ``restore()`` replays the log backwards and every request is as it was before the step.
(A policy's own bookkeeping, such as ``request.policy_state``, is the policy's business.)
``Scheduler.checkpoint`` / ``commit`` / ``rollback`` do the same for its queues and counters.

``KVStepJournal`` is the same for the paged KV manager: between its ``begin_step()`` and ``end_step()``
it keeps each block table the step changes (the first time), the blocks it hands out and the
prefixes it registers; ``undo()`` puts every table, reference count and free list back.
"""

from __future__ import annotations


class StepJournal:
    def __init__(self):
        self._saved: set[str] = set()
        self._log: list[tuple] = []

    def save(self, req) -> None:
        """Every field of ``req`` (``Request.snapshot``), the first time this step touches it."""
        if req.request_id in self._saved:
            return
        self._saved.add(req.request_id)
        self._log.append((True, req, req.snapshot()))

    def save_progress(self, scheduled) -> None:
        """Before applying a step's results to the requests it ran (``scheduled``, its
        ``ScheduledRequest``s). Nothing is copied per request: applying results only adds computed
        positions and appends output tokens with their times, so undoing it puts each request
        back to its grant's ``num_computed_before`` and ``num_output_before`` (``Request.rewind``).
        A full save made later in the step is replayed first, since the log is replayed backwards."""
        self._log.append((False, scheduled, None))

    def restore(self) -> None:
        for full, what, snapshot in reversed(self._log):
            if full:
                what.restore(snapshot)
            else:
                for s in reversed(what):
                    s.request.rewind(s.num_computed_before, s.num_output_before)
        self._log.clear()
        self._saved.clear()


class KVStepJournal:
    """What one step changed in a ``PagedKVCacheManager`` (``kv``), so that ``undo`` can put it back."""

    def __init__(self, kv):
        self.tables: dict[str, tuple] = {}  # request -> (block table, prefix hashes, host blocks) before the step
        self.fresh: set[int] = set()  # blocks handed out during the step
        self.hashed: dict[int, str] = {}  # block -> request: prefixes the step registered
        self.unshared: set[int] = set()  # of those, ones not offered to lookups this pass (preemptable owner)
        self.host_pending: list[int] = []  # host blocks freed in the step: reused after its copies have run
        self.computed = False  # has the forward written the step's KV?
        self.stats = (dict(kv.pool.stats), kv.prefill_tokens_saved)

    def forward_done(self) -> None:
        """The forward has written the step's KV: a block the step registered keeps its prefix even if
        its owner leaves now, and every one of them is offered to this pass's lookups."""
        self.computed = True
        self.unshared.clear()

    def save_table(self, kv, rid: str) -> None:
        """Before the step's first change to a request's tables, keep a copy."""
        if rid not in self.tables:  # (written out, no generator: a decode at a block boundary runs this)
            blocks, hashes, host = kv.req_blocks.get(rid), kv.req_hashes.get(rid), kv.swapped.get(rid)
            self.tables[rid] = (
                None if blocks is None else list(blocks),
                None if hashes is None else list(hashes),
                None if host is None else list(host),
            )

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
        depth: dict[int, int] = {}  # a block's position in a table the step made
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
        kv.swap_free[:] = [h for h in range(kv.num_swap_blocks - 1, -1, -1) if h not in used]
        kv.restore_counters(*self.stats)
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
