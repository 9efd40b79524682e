"""The KV manager contract: what the scheduler, the runner and the engine ask of KV memory.

Two managers keep it, ``kv_cache.PagedKVCacheManager`` (PagedAttention: blocks on demand) and
``reserved_kv_cache.ReservedKVCacheManager`` (a max-length reservation per request), and so does any
manager a student builds for ``EngineConfig.kv_manager``. ``KVCacheManager`` is what every manager
answers; a manager that can do more *declares* it (``supports_prefix_caching``, ``supports_swapping``,
``supports_forking``, ``allocates_on_demand``) and then also keeps that capability's protocol below.
The scheduler asks a declaration, never whether an object happens to have a method. The engine checks
the manager it builds against these protocols (``check_kv_manager``): a missing method is named
before the first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

from ..checks import check_protocol

if TYPE_CHECKING:
    from .request import Request
    from ..step_record import KVSnapshot


@runtime_checkable
class KVCacheManager(Protocol):
    """Which KV positions each request holds.

    Admission asks ``can_allocate(req, n)`` (does the request fit, leaving ``watermark_blocks`` free for
    the requests already running?) and the pass then ``allocate``s; a finished or preempted request
    ``free``s; a rejected speculative guess is cut off with ``truncate``. The runner reads each request's
    ``block_table`` (block ids in units of ``attn_block_size`` positions). A step is all or nothing:
    ``begin_step()`` before the pass, ``end_step()`` after the forward, ``rollback()`` instead when the
    step failed. ``explain_wait`` says why a request waits ("needs 2 blocks, 1 free"); ``snapshot`` and
    ``totals`` are what a ``StepRecord`` carries; ``stats`` the prefix cache's counters (zero without one).
    """

    num_blocks: int  # capacity, in blocks of block_size positions
    block_size: int  # token positions per block
    attn_block_size: int  # the runner's view of a block (1: position-granular regions)
    watermark_blocks: int  # headroom a new request must leave free
    supports_prefix_caching: bool  # keeps PrefixCaching below
    supports_swapping: bool  # keeps Swapping below
    supports_forking: bool  # keeps Forking below
    allocates_on_demand: bool  # keeps OnDemandBlocks below

    def can_allocate(
        self, req: Request, num_new_tokens: int, cached: Sequence = (), reserve_blocks: int = 0
    ) -> tuple[bool, int, int]:
        """(fits, needed, free) for ``num_new_tokens`` more positions after the ``cached`` prefix; a new
        request must also leave the watermark's headroom and ``reserve_blocks`` free."""

    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence = ()) -> bool:
        """Give the request room for ``num_new_tokens`` more positions; False (nothing changed) if it does not fit."""

    def free(self, req: Request) -> None:
        """The request gives back everything it holds (idempotent)."""

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Keep only what ``num_tokens`` positions need (rejected speculative guesses give back their KV)."""

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order, as the runner addresses them."""

    def begin_step(self) -> None:
        """Start remembering what this step changes."""

    def end_step(self) -> None:
        """The step is done (its forward has run): forget what it changed."""

    def rollback(self) -> dict[str, int]:
        """Undo the step; per request whose KV may have been written over, the first untrusted position."""

    def explain_wait(
        self,
        req: Request,
        num_new_tokens: int,
        cached: Sequence = (),
        reserve_blocks: int = 0,
        requests: Optional[dict] = None,
    ) -> str:
        """Why ``can_allocate`` said no, in a sentence a person can read."""

    def snapshot(self, requests: dict[str, Request], detail: bool = True) -> KVSnapshot:
        """What ``StepRecord.kv`` carries: positions used, free, cached, reserved; with ``detail``, each
        block's owners."""

    def totals(self, requests: dict[str, Request]) -> KVSnapshot:
        """The snapshot's counts only."""

    def stats(self) -> dict:
        """Prefix-cache counters: lookups, queried_blocks, hit_blocks, evictions, hit_rate, prefill_tokens_saved."""


@runtime_checkable
class PrefixCaching(Protocol):
    """``supports_prefix_caching``: full blocks are registered by the hash of their prefix and shared by
    later requests with the same prefix (notebook 04). Whether it is on is ``enable_prefix_caching``."""

    enable_prefix_caching: bool

    def find_cached_prefix(self, req: Request) -> list:
        """The longest run of the request's full blocks already cached (never its last token)."""

    def record_lookup(self, req: Request, hits: list) -> None:
        """Count one lookup and its hits (``stats``)."""

    def cache_full_blocks(self, req: Request, num_tokens: int, shareable: bool = True) -> None:
        """Register every block that is full once ``num_tokens`` positions hold KV."""

    def forward_done(self) -> None:
        """The forward has written the step's KV: the blocks it registered hold their prefixes."""


@runtime_checkable
class Swapping(Protocol):
    """``supports_swapping``: a preempted request's blocks go to a host pool and come back (notebook 05)."""

    def can_swap_out(self, req: Request) -> bool:
        """Does the host pool hold the request's blocks?"""

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool: (device block, host block) copies."""

    def can_swap_in(self, req: Request, num_new_tokens: int) -> tuple[bool, int, int]:
        """(fits, needed, free) for bringing the request back and growing it by ``num_new_tokens``."""

    def swap_in(self, req: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back: (host block, device block) copies."""


@runtime_checkable
class Forking(Protocol):
    """``supports_forking``: parallel sampling shares a parent's blocks with its children and copies a
    shared block before one of them writes into it (copy-on-write, notebook 04)."""

    def fork(self, parent: Request, child: Request) -> list[int]:
        """``child`` shares every block of ``parent``; returns the shared block ids."""

    def take_copies(self) -> list[tuple[str, int, int]]:
        """This pass's copy-on-write copies, (request id, src block, dst block), for the runner."""


@runtime_checkable
class OnDemandBlocks(Protocol):
    """``allocates_on_demand``: blocks come as positions need them, so the scheduler can count the blocks a
    grant takes (speculative tokens get only the blocks no running request needs)."""

    num_free_blocks: int

    def num_blocks_needed(self, req: Request, num_new_tokens: int, cached: Sequence = ()) -> int:
        """New blocks for ``num_new_tokens`` more positions."""


# Each declared capability and the protocol it promises.
CAPABILITIES = {
    "supports_prefix_caching": PrefixCaching,
    "supports_swapping": Swapping,
    "supports_forking": Forking,
    "allocates_on_demand": OnDemandBlocks,
}


def check_kv_manager(kv, cfg, num_blocks: int):
    """A KV manager (``EngineConfig.kv_manager``'s, or the built-in one) keeps the ``KVCacheManager``
    protocol and the protocol of each capability it declares (``minillm/core/kv_manager.py``), holds the
    engine's blocks, of its size, and keeps the config's watermark (the manager keeps the headroom)."""
    who = f"EngineConfig.kv_manager={cfg.kv_manager!r}"
    check_protocol(kv, KVCacheManager, who)
    for flag, protocol in CAPABILITIES.items():
        declared = getattr(kv, flag)  # (check_protocol found every flag)
        if not isinstance(declared, bool):
            raise TypeError(f"{who}: {type(kv).__name__}.{flag}={declared!r}: must be True or False")
        if declared:
            check_protocol(kv, protocol, f"{who} (it declares {flag})")
    if kv.num_blocks != num_blocks or kv.block_size != cfg.block_size:
        raise ValueError(
            f"{who}: built a manager of "
            f"{kv.num_blocks} blocks of {kv.block_size} tokens; the engine has "
            f"{num_blocks} blocks of {cfg.block_size}"
        )
    if kv.watermark_blocks != int(cfg.watermark * num_blocks):
        raise ValueError(
            f"{who}: built a manager without the watermark={cfg.watermark} (pass the config's watermark to it)"
        )
    return kv
