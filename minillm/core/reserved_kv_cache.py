"""Max-length reservation: the KV layout engines used before paging (notebook 02, Figure 4).

At admission a request reserves one contiguous region for its *maximum* length,
``min(prompt + max_tokens, max_model_len)`` positions, first fit in an address space of
``num_kv_blocks * block_size`` positions. Reserved-but-unused positions belong to nobody else;
gaps between regions are external fragmentation. It keeps the ``KVCacheManager`` protocol
(``kv_manager.py``) and declares none of its capabilities: a reservation is not made of shareable
blocks, so no prefix caching, forking or swapping.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .kv_snapshot import reserved_snapshot
from .request import Request
from ..step_record import KVSnapshot


class ReservedKVCacheManager:
    """Max-length reservation in one contiguous address space (first fit)."""

    mode = "reserved"
    supports_prefix_caching = False
    supports_swapping = False
    supports_forking = False
    allocates_on_demand = False  # the whole reservation at admission

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, watermark: float = 0.0):
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * num_blocks)  # headroom a new request must leave free
        self.block_size = block_size
        self.capacity = num_blocks * block_size
        self.attn_block_size = 1  # regions need not start on a block boundary
        self.max_model_len = max_model_len
        self.enable_prefix_caching = False
        self.regions: dict[str, tuple[int, int]] = {}  # request -> (start position, length)
        self.num_swap_blocks = 0
        self.swapped: dict[str, list[int]] = {}
        self._saved_regions: Optional[dict] = None  # the regions before the step in progress

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

    def largest_gap(self) -> int:
        """The longest reservation that fits now: the largest free gap, in positions (0 when full)."""
        return max((length for _, length in self._gaps()), default=0)

    def num_gap_blocks(self) -> int:
        """Whole blocks of free positions, gap by gap (a block's worth split between two gaps does not
        count): the snapshot's ``blocks_free``."""
        return sum(length // self.block_size for _, length in self._gaps())

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

    # --- the KVCacheManager protocol (kv_manager.py) ----------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, cached=(), reserve_blocks: int = 0):
        """(fits, positions needed, positions free): a running request grows inside its region; a new
        one's whole reservation must fit one gap beside the watermark's headroom and ``reserve_blocks``."""
        if req.request_id in self.regions:
            _, length = self.regions[req.request_id]
            return req.num_computed_tokens + num_new_tokens <= length, 0, self.num_free_positions
        need = self.reservation_len(req)
        largest = self.largest_gap()
        headroom = (reserve_blocks + self.watermark_blocks) * self.block_size
        return need <= largest - headroom, need, self.num_free_positions

    def allocate(self, req: Request, num_new_tokens: int, cached=()) -> bool:
        ok, _, _ = self.can_allocate(req, num_new_tokens)
        if not ok:
            return False
        if req.request_id not in self.regions:
            length = self.reservation_len(req)
            start = self._first_fit(length)
            assert start is not None, f"{req.request_id}: can_allocate found a gap of {length}, first fit none"
            self.regions[req.request_id] = (start, length)
        return True

    def free(self, req: Request) -> None:
        self.regions.pop(req.request_id, None)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """A region keeps its length: the positions of rejected guesses stay reserved for the request."""

    # --- one step, all or nothing (see PagedKVCacheManager.begin_step) -------------------------
    def begin_step(self) -> None:
        self._saved_regions = dict(self.regions)

    def end_step(self) -> None:
        self._saved_regions = None

    def rollback(self) -> dict[str, int]:
        saved = self._saved_regions
        if saved is None:
            return {}
        new = [r for rid, r in self.regions.items() if saved.get(rid) != r]
        self.regions, self._saved_regions = saved, None
        damaged: dict[str, int] = {}
        for rid, (start, length) in saved.items():
            for s, n in new:
                if s < start + length and start < s + n:  # handed to another request meanwhile
                    damaged[rid] = min(damaged.get(rid, length), max(0, s - start))
        return damaged

    def block_table(self, request_id: str) -> list[int]:
        """Position-granular 'blocks' (block size 1) covering the request's region."""
        start, length = self.regions[request_id]
        return list(range(start, start + length))

    def explain_wait(
        self, req: Request, num_new_tokens: int, cached=(), reserve_blocks: int = 0, requests: Optional[dict] = None
    ) -> str:
        need = self.reservation_len(req)
        free = self.num_free_positions
        largest = self.largest_gap()
        s = (
            f"needs {num_new_tokens} positions for its prefill, inside a {need}-position reservation "
            f"(prompt + max_tokens); {free} free"
        )
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
        """No prefix cache: every counter is zero."""
        return dict(lookups=0, queried_blocks=0, hit_blocks=0, evictions=0, hit_rate=0.0, prefill_tokens_saved=0)

    def snapshot(self, requests: dict[str, Request], detail: bool = True) -> KVSnapshot:
        return reserved_snapshot(self, requests, detail)

    def totals(self, requests: dict[str, Request]) -> KVSnapshot:
        """``record="totals"``: the snapshot without its per-request entries or block map."""
        return dataclasses.replace(self.snapshot(requests, detail=False), per_request={})
