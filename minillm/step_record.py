"""StepRecord: everything one scheduler iteration did, as plain data.

The engine emits one per ``engine.step()``. Widgets, notebooks and metrics read
only these records, never the engine's internals, so what a reader sees is
exactly what the engine decided. (A contract: field names are relied upon.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(slots=True)  # one per request per step: slots make it cheap to create
class BatchEntry:
    """One request's share of this step's batch."""

    request_id: str
    phase: str  # "prefill" (tokens it already knew) | "decode" (its newest token)
    num_new_tokens: int  # new tokens processed this step (counted against the budget)
    num_computed_before: int  # positions with KV before the step
    context_len: int  # positions with KV after the step
    num_spec_tokens: int = 0  # speculative tokens verified this step (inside num_new_tokens)
    num_spec_accepted: int = 0  # of those, how many were accepted
    num_output_tokens: int = 0  # tokens appended to the output this step


@dataclass(slots=True)  # one per request per step: slots make it cheap to create
class WaitingEntry:
    request_id: str
    reason: str  # a sentence a person can read: "needs 2 blocks, 1 free"


@dataclass
class PreemptionEvent:
    request_id: str
    mode: str  # "recompute" | "swap"
    reason: str


@dataclass
class ForkEvent:
    """Parallel sampling: a request's prompt is computed and its n sequences now share its blocks."""

    request_id: str  # the request (the group)
    sequences: list[str]  # its sequences, completion 0 first
    shared_blocks: list[int]  # the blocks all of them hold (reference count = len(sequences))


@dataclass
class BlockCopy:
    """Copy-on-write: a sequence about to write into a shared block got its own copy."""

    request_id: str  # the sequence that writes
    src_block: int  # the shared block (one reference fewer now)
    dst_block: int  # its fresh copy, now in the sequence's block table


@dataclass
class BlockInfo:
    """One KV block (or, under reservation, one block-sized slice of the address space)."""

    block_id: int
    owners: list[str]  # request ids holding a reference
    num_filled: int  # token positions holding KV
    ref_count: int
    cached: bool = False  # carries a prefix hash (reusable)
    reserved: int = 0  # positions reserved for an owner but not yet filled


@dataclass(slots=True)  # one per request per step: slots make it cheap to create
class RequestKV:
    used: int  # positions holding this request's KV
    reserved_unused: int = 0  # positions reserved for it but not yet filled
    num_blocks: int = 0
    cached_prefix: int = 0  # prompt positions reused from the prefix cache


@dataclass
class KVSnapshot:
    """The KV cache after the step, in token positions and in blocks."""

    total: int  # capacity in token positions
    used: int  # positions holding KV (shared blocks counted once)
    free: int  # positions another request could be given now
    blocks_total: int
    blocks_used: int
    blocks_free: int
    block_size: int
    reserved_unused: int = 0  # reserved for a request but empty (reservation mode)
    cached: int = 0  # free but still holding a cached prefix (reusable)
    partial_waste: int = 0  # empty positions in the last, partly filled block of each request
    fragmentation: int = 0  # free positions in gaps too small for the next reservation
    per_request: dict[str, RequestKV] = field(default_factory=dict)  # empty with record="totals"
    blocks: list[BlockInfo] = field(default_factory=list)  # only with record="full"
    swap_used_blocks: int = 0
    swap_total_blocks: int = 0


@dataclass
class StepRecord:
    step: int  # index, from 0
    time: float  # clock time at the end of the step (seconds)
    duration: float  # how long the step took on the clock
    batch: list[BatchEntry]
    num_batched_tokens: int
    token_budget: int
    admitted: list[str]
    finished: list[str]
    preempted: list[PreemptionEvent]
    waiting: list[WaitingEntry]
    kv: Optional[KVSnapshot]  # None with EngineConfig.record="none"
    # Running requests given no tokens this step, each with the scheduler's reason: "the token budget of
    # 8 was spent before its turn", "prefill-priority: this step runs a new prompt's prefill, ...", "forked
    # from g at the end of this step: ..." (empty with EngineConfig.record="totals" or "none")
    not_scheduled: list[WaitingEntry] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # the running set after the step (not with record="none")
    swapped: list[str] = field(default_factory=list)  # requests whose KV sits in host memory (the same)
    swapped_in: list[str] = field(default_factory=list)
    rejected: list[WaitingEntry] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # aborted since the previous record
    finish_reasons: dict[str, str] = field(default_factory=dict)
    reformed: bool = True  # False on steps that reused the last batch (schedule_every > 1)
    clock: str = "wall"
    schedule_time: float = 0.0  # the scheduling pass's share of duration
    swap_time: float = 0.0  # time spent copying blocks to/from host memory
    spec_proposed: int = 0
    spec_accepted: int = 0
    draft_time: float = 0.0  # the draft model's share of duration (speculative decoding)
    swap_bytes: int = 0  # KV bytes copied to or from host memory this step
    forks: list[ForkEvent] = field(default_factory=list)  # parallel sampling: groups forked this step
    copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write copies made before the forward
    # Host time per phase ("schedule", "execute" with its "prepare", "forward", "sample", then
    # "update", "record") on EngineConfig.phase_clock; empty when that is None.
    phase_times: dict[str, float] = field(default_factory=dict)
    # The batch in counts, kept when its entries are not (EngineConfig.record="totals"; "none" records
    # the size only: 0 prefill and 0 decode tokens). None: counted from ``batch``.
    batch_size: Optional[int] = None  # requests that ran
    num_prefill_tokens: Optional[int] = None  # of num_batched_tokens, those of prefill grants
    num_decode_tokens: Optional[int] = None  # and of decode grants

    def __post_init__(self) -> None:
        if self.batch_size is None:
            self.batch_size = len(self.batch)
        if self.num_prefill_tokens is None:
            self.num_prefill_tokens = sum(e.num_new_tokens for e in self.batch if e.phase == "prefill")
        if self.num_decode_tokens is None:
            self.num_decode_tokens = sum(e.num_new_tokens for e in self.batch if e.phase == "decode")

    def entry(self, request_id: str) -> Optional[BatchEntry]:
        for e in self.batch:
            if e.request_id == request_id:
                return e
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One paragraph a person can read."""
        parts = [f"step {self.step} (t={self.time:.4f}s): {self.num_batched_tokens}/{self.token_budget} tokens"]
        if self.batch:
            parts.append("batch " + ", ".join(f"{e.request_id}:{e.phase}+{e.num_new_tokens}" for e in self.batch))
        if self.admitted:
            parts.append("admitted " + ", ".join(self.admitted))
        for p in self.preempted:
            parts.append(f"preempted {p.request_id} ({p.mode}: {p.reason})")
        for f in self.forks:
            parts.append(
                f"forked {f.request_id} into {len(f.sequences)} sequences sharing {len(f.shared_blocks)} blocks"
            )
        for c in self.copies:
            parts.append(f"copy-on-write for {c.request_id}: block {c.src_block} -> {c.dst_block}")
        if self.finished:
            parts.append("finished " + ", ".join(self.finished))
        for w in self.waiting:
            parts.append(f"{w.request_id} waits: {w.reason}")
        if self.aborted:
            parts.append("aborted " + ", ".join(self.aborted))
        if self.kv is not None:
            parts.append(f"KV {self.kv.used}/{self.kv.total} positions used, {self.kv.free} free")
        return "; ".join(parts)
