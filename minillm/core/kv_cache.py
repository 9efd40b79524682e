"""KV memory management: who holds which KV positions.

Two strategies behind one interface, switched by ``EngineConfig.kv_allocation``:

* ``"paged"`` (PagedAttention): blocks on demand. A request holds just enough
  blocks for the positions it has computed (plus this step's new ones); the only
  waste is the empty tail of its last block.
* ``"reserved"``: what engines did before paging (Figure 4 of notebook 02). At
  admission a request reserves one contiguous region for its *maximum* length,
  ``min(prompt + max_tokens, max_model_len)`` positions, first fit in an address
  space of ``num_kv_blocks * block_size`` positions. Reserved-but-unused
  positions belong to nobody else; gaps between regions are external
  fragmentation.

The scheduler asks ``can_allocate`` / ``allocate`` and the runner asks
``block_table``; the snapshot for ``StepRecord.kv`` is taken here.

A step is all or nothing. Between ``begin_step()`` and ``end_step()`` the manager
remembers each block table it changes (the first time it changes it), the blocks it
hands out and the prefixes it registers, so that ``rollback()`` can put every table
back if anything in the step raises. Host swap blocks freed during a step are only
reused after the step's copies have run (``end_step``).
"""

from __future__ import annotations

import math
from typing import Optional

from .block_pool import Block, BlockPool
from .request import Request
from ..step_record import BlockInfo, KVSnapshot, RequestKV


class PagedKVCacheManager:
    mode = "paged"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_swap_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.attn_block_size = block_size        # the runner's view of the cache
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[Block]] = {}    # block table of each request
        self.req_hashes: dict[str, list[int]] = {}      # prefix hashes of its full blocks
        self.num_swap_blocks = num_swap_blocks
        self.swap_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.swapped: dict[str, list[int]] = {}         # request -> host-pool block ids
        self.prefill_tokens_saved = 0
        self.copies: list[tuple[str, int, int]] = []    # copy-on-write this pass: (request, src, dst)
        self._journal: Optional[dict] = None            # the step in progress (see begin_step)

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
        unsafe = self._journal["unshared"] if self._journal is not None else ()
        for i in range((len(tokens) - 1) // bs):
            block = self.pool.lookup(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None or block.block_id in unsafe:
                break
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
        self._touch(rid)
        hashes = self.req_hashes.setdefault(rid, [])
        blocks = self.req_blocks[rid]
        tokens = req.all_token_ids
        bs = self.block_size
        j = self._journal
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            block = blocks[i]
            fresh = block.block_hash is None
            hashes.append(self.pool.cache(block, parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if j is not None and fresh and block.block_hash is not None:
                j["hashed"][block.block_id] = rid
                if not shareable:
                    j["unshared"].add(block.block_id)

    # --- allocation ------------------------------------------------------------------------
    def num_blocks_needed(self, req: Request, num_new_tokens: int, cached: list[Block] = ()) -> int:
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
        self._touch(child.request_id)
        blocks = self.req_blocks[parent.request_id]
        for b in blocks:
            self.pool.take(b)
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
        self.pool.free([shared])              # one reference less; others still hold it
        self.copies.append((req.request_id, shared.block_id, fresh.block_id))

    def take_copies(self) -> list[tuple[str, int, int]]:
        """This pass's copy-on-write copies ``(request id, src block, dst block)`` whose writer
        still holds the destination (a writer preempted later in the pass needs no copy)."""
        copies, self.copies = self.copies, []
        return [(rid, src, dst) for rid, src, dst in copies
                if any(b.block_id == dst for b in self.req_blocks.get(rid, ()))]

    def _free_for(self, cached: list[Block]) -> int:
        # Cached hits sitting in the free list stop being free once taken.
        return self.pool.num_free - sum(1 for b in cached if b.ref_count == 0)

    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[Block] = (),
                     reserve_blocks: int = 0) -> tuple[bool, int, int]:
        """(fits, blocks needed, blocks free). ``reserve_blocks`` is admission headroom."""
        need = self.num_blocks_needed(req, num_new_tokens, cached)
        free = self._free_for(cached)
        return need <= free - reserve_blocks, need, free

    def allocate(self, req: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        """Give the request blocks for ``num_new_tokens`` more positions (after its cached prefix)."""
        held = self.req_blocks.get(req.request_id)
        if held and not cached:
            computed, room = req.num_computed_tokens, len(held) * self.block_size
            if computed + num_new_tokens <= room and computed < room \
                    and held[computed // self.block_size].ref_count <= 1:
                return True              # fast path: its last block has room and is its own (most decodes)
        copy = not cached and self._writes_shared_block(req, held)
        ok, need, _ = self.can_allocate(req, num_new_tokens, cached)
        if not ok:
            return False
        self._touch(req.request_id)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if copy:
            self._copy_on_write(req, blocks)
            need -= 1
        if cached:
            for b in cached:
                self.pool.take(b)
            blocks.extend(cached)
            self.req_hashes[req.request_id] = [b.block_hash for b in cached]
        for _ in range(need):
            blocks.append(self._new_block())
        return True

    def in_place_block_size(self) -> Optional[int]:
        """The decode fast path's rule, for a scheduler to apply to a whole batch without a call per
        request: a request whose computed positions end part way through a block
        (``num_computed_tokens % block_size != 0``) holds that block (its table covers every computed
        position), so one more position fits, and ``allocate(req, 1)`` changes nothing unless the
        block is shared. Only a fork shares a partly filled block (a prefix-cache hit shares full
        ones), so the caller applies the rule only while no sequence was forked. Returns the block
        size, or None when a subclass overrides ``allocate`` (its own rule decides, request by request)."""
        return self.block_size if type(self).allocate is PagedKVCacheManager.allocate else None

    def _new_block(self) -> Block:
        block = self.pool.allocate()
        if self._journal is not None:
            self._journal["fresh"].add(block.block_id)
        return block

    def free(self, req: Request) -> None:
        rid = req.request_id
        if rid not in self.req_blocks and rid not in self.swapped and rid not in self.req_hashes:
            return
        self._touch(rid)
        blocks = self.req_blocks.pop(rid, [])
        self.pool.free(blocks)
        self._forget_uncomputed(blocks)
        self.req_hashes.pop(rid, None)
        host = self.swapped.pop(rid, None)
        if host:
            self._free_host(host)

    def _forget_uncomputed(self, blocks: list[Block]) -> None:
        """Blocks registered in this step whose owner leaves before the forward computes them
        (preempted) would offer a prefix nobody wrote: forget their hashes."""
        j = self._journal
        if j is None or not j["hashed"] or j["computed"]:
            return
        for b in blocks:
            if b.block_id in j["hashed"] and b.ref_count == 0:
                self.pool.uncache(b)
                del j["hashed"][b.block_id]

    def _free_host(self, host: list[int]) -> None:
        if self._journal is not None:
            self._journal["host_pending"].extend(reversed(host))   # reused after this step's copies
        else:
            self.swap_free.extend(reversed(host))

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks that ``num_tokens`` positions need (speculative rollback)."""
        rid = req.request_id
        blocks = self.req_blocks.get(rid, [])
        keep = self.blocks_for(num_tokens)
        hashes = self.req_hashes.get(rid)
        cut_hashes = bool(hashes) and len(hashes) > num_tokens // self.block_size
        if len(blocks) <= keep and not cut_hashes:
            return
        self._touch(rid)
        if len(blocks) > keep:
            self.pool.free(blocks[keep:])
            del blocks[keep:]
        if cut_hashes:
            del hashes[num_tokens // self.block_size:]

    # --- one step, all or nothing -----------------------------------------------------------
    def begin_step(self) -> None:
        """Start remembering what this step changes (so ``rollback`` can undo it)."""
        self._journal = dict(tables={}, fresh=set(), hashed={}, unshared=set(), host_pending=[], computed=False,
                             stats=(dict(self.pool.stats), self.prefill_tokens_saved))

    def _touch(self, rid: str) -> None:
        """Before the first change to a request's tables in this step, keep a copy."""
        j = self._journal
        if j is None or rid in j["tables"]:
            return
        blocks = self.req_blocks.get(rid)
        hashes = self.req_hashes.get(rid)
        host = self.swapped.get(rid)
        j["tables"][rid] = (None if blocks is None else list(blocks), None if hashes is None else list(hashes),
                            None if host is None else list(host))

    def forward_done(self) -> None:
        """The forward has written this step's KV: the blocks it registered hold their prefixes."""
        if self._journal is not None:
            self._journal["computed"] = True
            self._journal["unshared"].clear()

    def end_step(self) -> None:
        """The step's copies have run: host blocks it freed can be handed out again."""
        j, self._journal = self._journal, None
        if j is not None and j["host_pending"]:
            self.swap_free.extend(j["host_pending"])

    def rollback(self) -> dict[str, int]:
        """Undo the step: every table it changed goes back to how it was. Returns, for a request
        whose blocks were handed to another request during the step (and so may have been
        written over), the first position whose KV can no longer be trusted."""
        j, self._journal = self._journal, None
        self.copies = []
        if j is None:
            return {}
        pool = self.pool
        # Prefixes registered in the step are forgotten: the forward may not have run, and a
        # rolled-back request will not look for them (it registers its own blocks again).
        for bid in j["hashed"]:
            pool.uncache(pool.blocks[bid])
        affected: dict[int, Block] = {}
        depth: dict[int, int] = {}                     # a block's position in a table the step made
        for rid, (blocks, hashes, host) in j["tables"].items():
            for i, b in enumerate(self.req_blocks.get(rid, ())):
                affected[b.block_id] = b
                depth[b.block_id] = max(depth.get(b.block_id, -1), i)
            for table, saved in ((self.req_blocks, blocks), (self.req_hashes, hashes), (self.swapped, host)):
                if saved is None:
                    table.pop(rid, None)
                else:
                    table[rid] = saved
            for b in blocks or ():
                affected[b.block_id] = b
        refs = dict.fromkeys(affected, 0)
        for blocks in self.req_blocks.values():
            for b in blocks:
                if b.block_id in refs:
                    refs[b.block_id] += 1
        # Blocks nobody holds any more go back to the free list children first (deepest position
        # first), as free() returns them, so a parent is never evicted before its child.
        for b in sorted(affected.values(), key=lambda b: -depth.get(b.block_id, -1)):
            pool.set_ref_count(b, refs[b.block_id])
        used = {h for hs in self.swapped.values() for h in hs}
        self.swap_free = [h for h in range(self.num_swap_blocks - 1, -1, -1) if h not in used]
        pool.stats, self.prefill_tokens_saved = dict(j["stats"][0]), j["stats"][1]
        bs = self.block_size
        damaged: dict[str, int] = {}
        for rid in j["tables"]:
            for i, b in enumerate(self.req_blocks.get(rid, ())):
                if b.block_id in j["fresh"]:
                    damaged[rid] = i * bs
                    hashes = self.req_hashes.get(rid)
                    if hashes and len(hashes) > i:
                        del hashes[i:]
                    break
        return damaged

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # --- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, req: Request) -> bool:
        return self.num_held_blocks(req.request_id) <= len(self.swap_free)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool: returns (device block, host block) copies.
        The device blocks are free at once: the runner copies every swap-out before anything
        is written into them (swap-ins, then the forward)."""
        self._touch(req.request_id)
        blocks = self.req_blocks.pop(req.request_id, [])
        self.req_hashes.pop(req.request_id, None)
        host = [self.swap_free.pop() for _ in blocks]
        self.swapped[req.request_id] = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host)]
        self.pool.free(blocks)
        self._forget_uncomputed(blocks)
        return mapping

    def can_swap_in(self, req: Request, reserve_blocks: int = 0) -> tuple[bool, int, int]:
        need = len(self.swapped.get(req.request_id, ()))
        return need <= self.pool.num_free - reserve_blocks, need, self.pool.num_free

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Bring swapped blocks back: returns (host block, device block) copies."""
        self._touch(req.request_id)
        host = self.swapped.pop(req.request_id)
        blocks = [self._new_block() for _ in host]
        self.req_blocks[req.request_id] = blocks
        self._free_host(host)             # not reused before this step's copies have run
        return [(h, b.block_id) for h, b in zip(host, blocks)]

    @property
    def swap_used(self) -> int:
        return self.num_swap_blocks - len(self.swap_free)

    # --- explaining ----------------------------------------------------------------------------
    def explain_wait(self, req: Request, num_new_tokens: int, cached: list[Block] = (),
                     reserve_blocks: int = 0, requests: Optional[dict] = None) -> str:
        ok, need, free = self.can_allocate(req, num_new_tokens, cached)
        s = f"needs {need} block{'s' if need != 1 else ''}, {free} free"
        if reserve_blocks:
            s += f" ({reserve_blocks} kept as headroom)"
        return s

    def stats(self) -> dict:
        st = dict(self.pool.stats)
        q = st["queried_blocks"]
        st["hit_rate"] = st["hit_blocks"] / q if q else 0.0
        st["prefill_tokens_saved"] = self.prefill_tokens_saved
        return st

    # --- the snapshot StepRecord.kv carries ----------------------------------------------------
    def snapshot(self, requests: dict[str, Request], detail: bool = True) -> KVSnapshot:
        bs = self.block_size
        filled = [0] * self.num_blocks if detail else None
        owners: dict[int, list[str]] = {}
        per_request = {}
        used = partial = 0
        seen: set[int] = set()
        shared = self.enable_prefix_caching or detail     # else no block has two owners
        for rid, blocks in self.req_blocks.items():
            req = requests.get(rid)
            n = req.num_computed_tokens if req is not None else 0
            per_request[rid] = RequestKV(used=n, num_blocks=len(blocks),
                                         cached_prefix=req.num_cached_tokens if req else 0)
            partial += len(blocks) * bs - n
            if not shared:                   # fast path (long simulations): O(requests), not O(blocks)
                used += max(0, min(n, len(blocks) * bs))
                continue
            for i, b in enumerate(blocks):
                f = max(0, min(bs, n - i * bs))
                if b.block_id not in seen:
                    seen.add(b.block_id)
                    used += f
                elif detail:
                    used += max(0, f - filled[b.block_id])
                if detail:
                    filled[b.block_id] = max(filled[b.block_id], f)
                    owners.setdefault(b.block_id, []).append(rid)
        cached_free = self.pool.num_cached_free
        blocks_used = self.num_blocks - self.pool.num_free
        snap = KVSnapshot(total=self.num_blocks * bs, used=used, free=self.pool.num_free * bs,
                          blocks_total=self.num_blocks, blocks_used=blocks_used,
                          blocks_free=self.pool.num_free, block_size=bs, cached=cached_free * bs,
                          partial_waste=partial, per_request=per_request,
                          swap_used_blocks=self.swap_used, swap_total_blocks=self.num_swap_blocks)
        if detail:
            for b in self.pool.blocks:
                snap.blocks.append(BlockInfo(block_id=b.block_id, owners=owners.get(b.block_id, []),
                                             num_filled=filled[b.block_id] if b.ref_count else
                                             (bs if b.block_hash is not None else 0),
                                             ref_count=b.ref_count, cached=b.block_hash is not None))
        return snap


class ReservedKVCacheManager:
    """Max-length reservation in one contiguous address space (first fit)."""
    mode = "reserved"

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.capacity = num_blocks * block_size
        self.attn_block_size = 1                 # regions need not start on a block boundary
        self.max_model_len = max_model_len
        self.enable_prefix_caching = False
        self.regions: dict[str, tuple[int, int]] = {}    # request -> (start position, length)
        self.num_swap_blocks = 0
        self.swapped: dict[str, list[int]] = {}

    def reservation_len(self, req: Request) -> int:
        return min(req.max_len, self.max_model_len)

    def _gaps(self) -> list[tuple[int, int]]:
        """Free (start, length) gaps between regions, in address order."""
        gaps, pos = [], 0
        for start, length in sorted(self.regions.values()):
            if start > pos:
                gaps.append((pos, start - pos))
            pos = start + length
        if pos < self.capacity:
            gaps.append((pos, self.capacity - pos))
        return gaps

    def _first_fit(self, length: int) -> Optional[int]:
        for start, size in self._gaps():
            if size >= length:
                return start
        return None

    @property
    def num_free_positions(self) -> int:
        return self.capacity - sum(length for _, length in self.regions.values())

    @property
    def num_free_blocks(self) -> int:
        return self.num_free_positions // self.block_size

    # --- same interface as the paged manager --------------------------------------------
    def find_cached_prefix(self, req: Request) -> list:
        return []

    def record_lookup(self, req, hits) -> None:
        pass

    def cache_full_blocks(self, req: Request, num_tokens: int, shareable: bool = True) -> None:
        pass

    def can_allocate(self, req: Request, num_new_tokens: int, cached=(), reserve_blocks: int = 0):
        if req.request_id in self.regions:
            _, length = self.regions[req.request_id]
            return req.num_computed_tokens + num_new_tokens <= length, 0, self.num_free_positions
        need = self.reservation_len(req)
        largest = max((s for _, s in self._gaps()), default=0)
        return need <= largest - reserve_blocks * self.block_size, need, self.num_free_positions

    def allocate(self, req: Request, num_new_tokens: int, cached=()) -> bool:
        ok, _, _ = self.can_allocate(req, num_new_tokens)
        if not ok:
            return False
        if req.request_id not in self.regions:
            self.regions[req.request_id] = (self._first_fit(self.reservation_len(req)),
                                            self.reservation_len(req))
        return True

    def free(self, req: Request) -> None:
        self.regions.pop(req.request_id, None)

    def truncate(self, req: Request, num_tokens: int) -> None:
        pass

    # --- one step, all or nothing (see PagedKVCacheManager.begin_step) -------------------------
    def begin_step(self) -> None:
        self._saved_regions = dict(self.regions)

    def forward_done(self) -> None:
        pass

    def end_step(self) -> None:
        self._saved_regions = None

    def rollback(self) -> dict[str, int]:
        saved = getattr(self, "_saved_regions", None)
        if saved is None:
            return {}
        new = [r for rid, r in self.regions.items() if saved.get(rid) != r]
        self.regions, self._saved_regions = saved, None
        damaged = {}
        for rid, (start, length) in saved.items():
            for s, n in new:
                if s < start + length and start < s + n:     # handed to another request meanwhile
                    damaged[rid] = min(damaged.get(rid, length), max(0, s - start))
        return damaged

    def block_table(self, request_id: str) -> list[int]:
        """Position-granular 'blocks' (block size 1) covering the request's region."""
        start, length = self.regions[request_id]
        return list(range(start, start + length))

    def can_swap_out(self, req) -> bool:
        return False

    def take_copies(self) -> list:
        return []                        # a reservation is never shared: nothing to copy

    def explain_wait(self, req: Request, num_new_tokens: int, cached=(), reserve_blocks: int = 0,
                     requests: Optional[dict] = None) -> str:
        need = self.reservation_len(req)
        free = self.num_free_positions
        largest = max((s for _, s in self._gaps()), default=0)
        s = (f"needs {num_new_tokens} positions for its prefill, inside a {need}-position reservation "
             f"(prompt + max_tokens); {free} free")
        if largest < free:
            s += f" but the largest gap is {largest} (fragmentation)"
        unused = []
        for rid, (_, length) in self.regions.items():
            r = (requests or {}).get(rid)
            if r is not None and length - r.num_computed_tokens > 0:
                unused.append(f"{length - r.num_computed_tokens} reserved by {rid} but unused")
        if unused:
            s += "; " + ", ".join(unused)
        return s

    def stats(self) -> dict:
        return dict(lookups=0, queried_blocks=0, hit_blocks=0, evictions=0, hit_rate=0.0,
                    prefill_tokens_saved=0)

    def snapshot(self, requests: dict[str, Request], detail: bool = True) -> KVSnapshot:
        bs = self.block_size
        used = reserved_unused = 0
        per_request = {}
        for rid, (start, length) in self.regions.items():
            req = requests.get(rid)
            n = req.num_computed_tokens if req else 0
            used += n
            reserved_unused += length - n
            per_request[rid] = RequestKV(used=n, reserved_unused=length - n,
                                         num_blocks=math.ceil(length / bs))
        free = self.capacity - used - reserved_unused
        largest = max((s for _, s in self._gaps()), default=0)
        blocks_free = sum(s // bs for _, s in self._gaps())
        snap = KVSnapshot(total=self.capacity, used=used, free=free, blocks_total=self.num_blocks,
                          blocks_used=self.num_blocks - blocks_free, blocks_free=blocks_free,
                          block_size=bs, reserved_unused=reserved_unused,
                          fragmentation=free - largest, per_request=per_request)
        if detail:
            for blk in range(self.num_blocks):
                lo, hi = blk * bs, (blk + 1) * bs
                owners, filled, reserved = [], 0, 0
                for rid, (start, length) in self.regions.items():
                    a, b = max(lo, start), min(hi, start + length)
                    if a < b:
                        owners.append(rid)
                        req = requests.get(rid)
                        n = req.num_computed_tokens if req else 0
                        f = max(0, min(b, start + n) - a)
                        filled += f
                        reserved += (b - a) - f
                snap.blocks.append(BlockInfo(block_id=blk, owners=owners, num_filled=filled,
                                             ref_count=len(owners), reserved=reserved))
        return snap


def make_kv_manager(config, num_blocks: int):
    if config.kv_allocation == "reserved":
        return ReservedKVCacheManager(num_blocks, config.block_size, config.max_model_len)
    return PagedKVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                               config.num_swap_blocks)
