"""A step in a few numbers: what a long simulation keeps per step instead of a full ``StepRecord``.

``simulate(records="summary")`` keeps one ``StepSummary`` per step; ``metrics.summarize`` and the what-if
widget's figures read them as they read records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class KVTotals(NamedTuple):
    used: int  # token positions holding KV
    total: int  # capacity in token positions
    free: int
    held: int = 0  # positions in the blocks handed out (used + the unfilled tails)


@dataclass(slots=True)
class StepSummary:
    """One step as a handful of numbers: what a 10,000-request simulation keeps per step.

    A full ``StepRecord`` holds an entry per request in the batch; at ~100 requests per step
    and tens of thousands of steps that is gigabytes. ``metrics.summarize`` accepts these
    too (it reads ``batch_size`` and ``kv.used / kv.total``).
    """

    step: int
    time: float
    duration: float
    batch_size: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_admitted: int
    num_finished: int
    num_preempted: int
    num_rejected: int
    kv: KVTotals
    schedule_time: float
    swap_time: float
    clock: str

    @classmethod
    def from_record(cls, rec, num_waiting: int) -> "StepSummary":
        return cls(
            rec.step,
            rec.time,
            rec.duration,
            rec.batch_size,
            rec.num_batched_tokens,
            rec.num_prefill_tokens,
            rec.num_decode_tokens,
            len(rec.running),
            num_waiting,
            len(rec.admitted),
            len(rec.finished),
            len(rec.preempted),
            len(rec.rejected),
            KVTotals(rec.kv.used, rec.kv.total, rec.kv.free, rec.kv.blocks_used * rec.kv.block_size),
            rec.schedule_time,
            rec.swap_time,
            rec.clock,
        )
