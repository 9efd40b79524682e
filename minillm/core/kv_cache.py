"""Paged KV memory (PagedAttention): which blocks hold each request's KV positions.

A request holds just enough blocks for the positions it has computed (plus this step's new ones);
the only waste is the empty tail of its last block. The scheduler asks ``can_allocate`` /
``allocate`` (admission keeps the watermark's headroom free), the runner asks ``block_table``.
Blocks come from the ``BlockPool``; prefix caching, copy-on-write after a fork and swapping to host
memory are here too. The other strategy, max-length reservation, is ``reserved_kv_cache.py``;
``EngineConfig.kv_allocation`` picks one (``make_kv_manager``).

A step is all or nothing: between ``begin_step()`` and ``end_step()`` a ``KVStepJournal``
(``step_journal.py``) keeps what the step changes, so that ``rollback()`` can put it back.
Host swap blocks freed during a step are only reused after the step's copies have run.
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Callable, Optional, Sequence

from .block_pool import Block, BlockPool
from .kv_snapshot import paged_snapshot, paged_totals, paged_wait_reason, prefix_cache_stats
from .request import Request
from .reserved_kv_cache import ReservedKVCacheManager
from .step_journal import KVStepJournal
from ..step_record import KVSnapshot


class PagedKVCacheManager:
    """Block tables on demand from a ``BlockPool``; admission leaves ``watermark_blocks`` free (kv_manager.py)."""

    mode = "paged"
    supports_prefix_caching = True  # (on when enable_prefix_caching)
    supports_swapping = True
    supports_forking = True
    allocates_on_demand = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        num_swap_blocks: int = 0,
        watermark: float = 0.0,
        block_pool: Optional[Callable] = None,
    ):
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)  # headroom a new request must leave free
        self.block_size = block_size
        self.attn_block_size = block_size  # the runner's view of the cache
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = (block_pool or BlockPool)(num_blocks, enable_prefix_caching)  # EngineConfig.block_pool
        self.req_blocks: dict[str, list[Block]] = {}  # block table of each request
        self.req_hashes: dict[str, list[int]] = {}  # prefix hashes of its full blocks
        self.num_swap_blocks = num_swap_blocks
        self.swap_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.swapped: dict[str, list[int]] = {}  # request -> host-pool block ids
        self.prefill_tokens_saved = 0
        self.copies: list[tuple[str, int, int]] = []  # copy-on-write this pass: (request, src, dst)
        self._journal: Optional[KVStepJournal] = None  # the step in progress (see begin_step)

    # --- sizes ---------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    # --- prefix cache -------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[Block]:
        """The longest run of full blocks of this request's tokens already in the cache.
        Capped so the last token is always computed (its logits pick the next token)."""
        if not self.enable_prefix_caching:
            return []
        tokens = req.all_token_ids
        bs = self.block_size
        hits: list[Block] = []
        parent = None
        unsafe = self._journal.unshared if self._journal is not None else ()
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block = self.pool.get_cached_block(self.pool.hash_block(parent, chunk))
            if block is None or block.token_ids != chunk or block.parent_hash != parent or block.block_id in unsafe:
                break  # a miss (or a hash collision)
            hits.append(block)
            parent = block.block_hash
        return hits

    def record_lookup(self, req: Request, hits: list[Block]) -> None:
        if not self.enable_prefix_caching:
            return
        st = self.pool.stats
        st["lookups"] += 1
        st["queried_blocks"] += (req.num_tokens - 1) // self.block_size
        st["hit_blocks"] += len(hits)
        self.prefill_tokens_saved += len(hits) * self.block_size

    def restore_counters(self, pool_stats: dict, prefill_tokens_saved: int) -> None:
        """Put the prefix cache's counters back (the pool's lookups, hits and evictions, and the
        prefill tokens saved) to values read before a step: a rolled-back step counted nothing."""
        self.pool.stats.clear()
        self.pool.stats.update(pool_stats)
        self.prefill_tokens_saved = prefill_tokens_saved

    def cache_full_blocks(self, req: Request, num_tokens: int, shareable: bool = True) -> None:
        """Register in the prefix cache every block of this request that is full once its first
        ``num_tokens`` positions hold KV. The scheduler calls it when it grants a step, so a
        request admitted later in the same pass already finds the prefix (its KV is written
        by this step's forward, before anyone attends over it). ``shareable=False`` (a running
        request, which this pass may still preempt) keeps the blocks out of this pass's
        lookups."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.get(req.request_id)
        num_full = num_tokens // self.block_size
        if hashes is not None and len(hashes) >= num_full:
            return
        rid = req.request_id
        self._save_table(rid)
        new = self.pool.cache_full_blocks(
            self.req_blocks[rid], self.req_hashes.setdefault(rid, []), req.all_token_ids, num_full, self.block_size
        )
        j = self._journal
        if j is not None:
            for block in new:
                j.hashed[block.block_id] = rid
                if not shareable:
                    j.unshared.add(block.block_id)

    # --- allocation ------------------------------------------------------------------------
    def num_blocks_needed(self, req: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> int:
        """New blocks for ``num_new_tokens`` more positions: the ones past the table's end, plus
        one when the next position falls in a block shared with another sequence (copy-on-write)."""
        held = self.num_held_blocks(req.request_id) + len(cached)
        computed = req.num_computed_tokens + len(cached) * self.block_size
        copy = not cached and self._writes_shared_block(req, self.req_blocks.get(req.request_id))
        return max(0, self.blocks_for(computed + num_new_tokens) - held) + copy

    def _writes_shared_block(self, req: Request, held: Optional[list[Block]]) -> bool:
        """Would the request's next KV go into a block another sequence also holds? (After a
        fork, the partly filled last block of the prompt: see ``minillm/core/parallel_sampling.py``.)"""
        if not held:
            return False
        i = req.num_computed_tokens // self.block_size
        return i < len(held) and held[i].ref_count > 1

    def fork(self, parent: Request, child: Request) -> list[int]:
        """Parallel sampling: ``child`` shares every block of ``parent`` (reference counts + 1,
        nothing copied). Returns the shared block ids."""
        self._save_table(child.request_id)
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        hashes = self.req_hashes.get(parent.request_id)
        if hashes is not None:
            self.req_hashes[child.request_id] = list(hashes)
        return [b.block_id for b in blocks]

    def _copy_on_write(self, req: Request, blocks: list[Block]) -> None:
        """Give the request its own copy of the shared block its next position falls in: a fresh
        block replaces it in the table, the shared one loses a reference, and the copy (made
        by the runner before the forward) is queued in ``copies``."""
        i = req.num_computed_tokens // self.block_size
        shared = blocks[i]
        fresh = self._new_block()
        blocks[i] = fresh
        self.pool.free_blocks([shared])  # one reference less; others still hold it
        self.copies.append((req.request_id, shared.block_id, fresh.block_id))

    def take_copies(self) -> list[tuple[str, int, int]]:
        """This pass's copy-on-write copies ``(request id, src block, dst block)``."""
        copies, self.copies = self.copies, []
        return copies

    def _drop_copies(self, rid: str) -> dict[int, int]:
        """A request preempted in this pass needs none of its copies: they go, returned as {dst: src}."""
        mine = {dst: src for r, src, dst in self.copies if r == rid}
        self.copies = [c for c in self.copies if c[0] != rid] if mine else self.copies
        return mine

    def _free_for(self, cached: Sequence[Block]) -> int:
        # Cached hits sitting in the free list stop being free once taken.
        if not cached:
            return self.pool.num_free
        return self.pool.num_free - sum(1 for b in cached if b.ref_count == 0)

    def headroom(self, req: Request, reserve_blocks: int = 0) -> int:
        """Blocks that must stay free beside the request's: for a new one (holding no blocks) the
        watermark's headroom plus ``reserve_blocks`` (a parallel-sampling group's other samples)."""
        return reserve_blocks + (self.watermark_blocks if req.request_id not in self.req_blocks else 0)

    def can_allocate(
        self, req: Request, num_new_tokens: int, cached: Sequence[Block] = (), reserve_blocks: int = 0
    ) -> tuple[bool, int, int]:
        """(fits, blocks needed, blocks free) for ``num_new_tokens`` more positions after the
        ``cached`` prefix; a new request must also leave the headroom (``headroom``) free."""
        need = self.num_blocks_needed(req, num_new_tokens, cached)
        free = self._free_for(cached)
        return need <= free - self.headroom(req, reserve_blocks), need, free

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> bool:
        """Give the request blocks for ``num_new_tokens`` more positions (after its cached prefix)."""
        if not cached and self.num_blocks_needed(req, num_new_tokens) == 0:
            return True  # the positions fit in blocks it holds, its own: nothing changes
        ok, need, _ = self.can_allocate(req, num_new_tokens, cached)
        if not ok:
            return False
        copy = not cached and self._writes_shared_block(req, self.req_blocks.get(req.request_id))
        self._save_table(req.request_id)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if copy:
            self._copy_on_write(req, blocks)
            need -= 1
        if cached:
            self.pool.touch(cached)
            blocks.extend(cached)
            hashes: list[int] = []
            for b in cached:  # prefix-cache hits: each carries its prefix's hash
                assert b.block_hash is not None, f"cached prefix block {b.block_id} has no hash"
                hashes.append(b.block_hash)
            self.req_hashes[req.request_id] = hashes
        blocks += self._new_blocks(need)  # (one pool call for a whole prefill's blocks)
        return True

    def _new_block(self) -> Block:
        return self._new_blocks(1)[0]

    def _new_blocks(self, n: int) -> list[Block]:
        new = self.pool.get_new_blocks(n)
        if self._journal is not None:
            self._journal.fresh.update(map(attrgetter("block_id"), new))
        return new

    def free(self, req: Request) -> None:
        rid = req.request_id
        if rid not in self.req_blocks and rid not in self.swapped and rid not in self.req_hashes:
            return
        self._save_table(rid)
        self._drop_copies(rid)
        blocks = self.req_blocks.pop(rid, [])
        self.pool.free_blocks(blocks)
        self._forget_uncomputed(blocks)
        self.req_hashes.pop(rid, None)
        host = self.swapped.pop(rid, None)
        if host:
            self._free_host(host)

    def _forget_uncomputed(self, blocks: list[Block]) -> None:
        """Blocks registered in this step whose owner leaves before the forward computes them
        (preempted) would offer a prefix nobody wrote: forget their hashes."""
        j = self._journal
        if j is None or not j.hashed or j.computed:
            return
        for b in blocks:
            if b.block_id in j.hashed and b.ref_count == 0:
                self.pool.forget_hash(b)
                del j.hashed[b.block_id]

    def _free_host(self, host: list[int]) -> None:  # inside a step: reused after the step's copies
        (self._journal.host_pending if self._journal is not None else self.swap_free).extend(reversed(host))

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks that ``num_tokens`` positions need (speculative rollback)."""
        rid = req.request_id
        blocks = self.req_blocks.get(rid, [])
        keep = self.blocks_for(num_tokens)
        hashes = self.req_hashes.get(rid, [])
        cut_hashes = len(hashes) > num_tokens // self.block_size
        if len(blocks) <= keep and not cut_hashes:
            return
        self._save_table(rid)
        if len(blocks) > keep:
            self.pool.free_blocks(blocks[keep:])
            del blocks[keep:]
        if cut_hashes:
            del hashes[num_tokens // self.block_size :]

    # --- one step, all or nothing (the journal: step_journal.KVStepJournal) ---------------------------
    def begin_step(self) -> None:
        """Start remembering what this step changes (so ``rollback`` can undo it)."""
        self._journal = KVStepJournal(self)

    def _save_table(self, rid: str) -> None:
        """Before the step's first change to a request's tables, the journal keeps a copy."""
        if self._journal is not None:
            self._journal.save_table(self, rid)

    def forward_done(self) -> None:
        """The forward has written this step's KV: the blocks it registered hold their prefixes."""
        if self._journal is not None:
            self._journal.forward_done()

    def end_step(self) -> None:
        """The step's copies have run: host blocks it freed can be handed out again."""
        j, self._journal = self._journal, None
        if j is not None and j.host_pending:
            self.swap_free.extend(j.host_pending)

    def rollback(self) -> dict[str, int]:
        """Undo the step (``KVStepJournal.undo``): every table it changed goes back to how it was.
        Returns, per request whose KV may have been written over, the first untrusted position."""
        j, self._journal = self._journal, None
        self.copies = []
        return {} if j is None else j.undo(self)

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # --- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, req: Request) -> bool:
        return self.num_held_blocks(req.request_id) <= len(self.swap_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool: returns (device block, host block) copies.
        The device blocks are free at once: the runner copies every swap-out before anything
        is written into them (copy-on-write copies, swap-ins, then the forward). A block this
        pass gave the request for a copy-on-write is still empty: its source goes to the host."""
        self._save_table(req.request_id)
        unfilled = self._drop_copies(req.request_id)
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_hashes.pop(req.request_id, None)
        host = [self.swap_free.pop() for _ in blocks]
        self.swapped[req.request_id] = host
        mapping = [(unfilled.get(b.block_id, b.block_id), h) for b, h in zip(blocks, host)]
        self.pool.free_blocks(blocks)
        self._forget_uncomputed(blocks)
        return mapping

    def can_swap_in(self, req: Request, num_new_tokens: int) -> tuple[bool, int, int]:
        """(fits, blocks needed, blocks free) for bringing a swapped-out request back and growing it by
        ``num_new_tokens`` positions, the watermark's headroom left free."""
        held, free = len(self.swapped.get(req.request_id, ())), self.pool.num_free
        need = max(held, self.blocks_for(req.num_computed_tokens + num_new_tokens))
        return need <= free - self.watermark_blocks, need, free

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Bring swapped blocks back: returns (host block, device block) copies."""
        self._save_table(req.request_id)
        host = self.swapped.pop(req.request_id)
        blocks = [self._new_block() for _ in host]
        self.req_blocks[req.request_id] = blocks
        self._free_host(host)  # not reused before this step's copies have run
        return [(h, b.block_id) for h, b in zip(host, blocks)]

    @property
    def swap_used(self) -> int:
        return self.num_swap_blocks - len(self.swap_free)

    # --- explaining ----------------------------------------------------------------------------
    def explain_wait(
        self,
        req: Request,
        num_new_tokens: int,
        cached: Sequence[Block] = (),
        reserve_blocks: int = 0,
        requests: Optional[dict] = None,
    ) -> str:
        return paged_wait_reason(self, req, num_new_tokens, cached, reserve_blocks)

    def stats(self) -> dict:
        return prefix_cache_stats(self)

    # --- the snapshot StepRecord.kv carries ----------------------------------------------------
    def snapshot(self, requests: dict[str, Request], detail: bool = True) -> KVSnapshot:
        return paged_snapshot(self, requests, detail)

    def totals(self, requests: dict[str, Request]) -> KVSnapshot:
        """The snapshot's counts only (``record="totals"``, what a long simulation keeps per step)."""
        return paged_totals(self, requests)


def make_kv_manager(config, num_blocks: int):
    """The built-in KV manager of an ``EngineConfig`` (the default of ``EngineConfig.kv_manager``)."""
    if config.kv_allocation == "reserved":
        return ReservedKVCacheManager(num_blocks, config.block_size, config.max_model_len, config.watermark)
    return PagedKVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        config.num_swap_blocks,
        config.watermark,
        config.block_pool,
    )
