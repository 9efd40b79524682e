"""What the scheduler hands on: one step's grants (``SchedulerOutput``) and what applying its results did.

The plain data between the scheduler and the runner (vLLM's ``v1/core/sched/output.py``): who runs, how many
tokens each processes, which blocks move; then ``StepUpdate``, what ``update_from_output`` applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Sequence

from .request import Request
from ..step_record import BatchEntry, BlockCopy, ForkEvent, PreemptionEvent, WaitingEntry


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens processed this step (counted against the budget)
    num_computed_before: int
    num_output_before: int  # output tokens before the step (the undo log reads both)
    phase: str  # "prefill" | "decode" (a label: one rule covers both)
    samples: bool  # does the step reach the end of the known tokens (a token is sampled)?
    spec_token_ids: Sequence[int] = ()  # draft tokens to verify (a list when there are some)


def grant(req: Request, num_new_tokens: int, spec_token_ids: Sequence[int] = ()) -> ScheduledRequest:
    """This step's grant to ``req``: ``num_new_tokens`` positions from ``num_computed_tokens`` on
    (with ``spec_token_ids`` guesses to verify at the end). A *decode* is the grant of the newest
    token of a request that has output; anything else is a *prefill* (the label only)."""
    before = req.num_computed_tokens
    return ScheduledRequest(
        req,
        num_new_tokens,
        before,
        req.num_output_tokens,
        "decode" if req.is_decoding else "prefill",
        before + num_new_tokens >= req.num_tokens + len(spec_token_ids),
        list(spec_token_ids) if spec_token_ids else (),
    )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    token_budget: int
    admitted: list[str] = field(default_factory=list)
    preempted: list[PreemptionEvent] = field(default_factory=list)
    waiting: list[WaitingEntry] = field(default_factory=list)
    # Running requests given no tokens this step, each with the scheduler's reason (StepRecord.not_scheduled)
    not_scheduled: list[WaitingEntry] = field(default_factory=list)
    rejected: list[WaitingEntry] = field(default_factory=list)
    rejected_requests: list[Request] = field(default_factory=list)  # the same, as requests
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    swapped_in: list[str] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write: src -> dst, before the forward
    released: list[Request] = field(default_factory=list)  # finished earlier, returned now (static / every-N)
    reformed: bool = True  # did this pass re-form the batch?

    @property
    def num_batched_tokens(self) -> int:
        return sum(map(attrgetter("num_new_tokens"), self.scheduled))

    @property
    def num_decode_tokens(self) -> int:
        """Of ``num_batched_tokens``, those of decode grants (the rest are prefill)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.phase == "decode")


@dataclass
class StepUpdate:
    """What applying one step's results did (``Scheduler.update_from_output``)."""

    batch: list[BatchEntry]
    finished: list[Request]  # finished (or returned from the held set) this step
    forked: list[Request] = field(default_factory=list)  # sequences forked this step (parallel sampling)
    forks: list[ForkEvent] = field(default_factory=list)
    spec_proposed: int = 0
    spec_accepted: int = 0

    def count_guesses(self, proposed: int, accepted: int) -> None:
        """Speculative decoding: ``proposed`` guesses verified for one request, ``accepted`` of them kept."""
        self.spec_proposed += proposed
        self.spec_accepted += accepted
