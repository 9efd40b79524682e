"""Scheduling policies: who goes first, and who is preempted.

A policy plugs into the scheduler through three questions, asked every step:

* ``order_waiting(waiting, now)``: in what order should waiting requests be
  considered for admission? (FCFS: arrival order.)
* ``pick_victim(candidates, now)``: a running request cannot get its next KV
  block; which one gives up its memory? (Default: the most recently admitted.)
* ``preempt_for(request, running, now)``: may this waiting request push a
  running one out (priority)? Return the victim or None.

and may keep its own bookkeeping in ``on_step``. A class you write plugs in the
same way as a built-in name: ``LLM(policy=MyPolicy())`` or ``LLM(policy="fcfs")``.
"""

from __future__ import annotations

from typing import Optional

from .request import Request


class Policy:
    name = "base"

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        return waiting

    def pick_victim(self, candidates: list[Request], now: float) -> Request:
        return max(candidates, key=lambda r: r.admit_seq)      # the most recently admitted

    def preempt_for(self, request: Request, running: list[Request], now: float) -> Optional[Request]:
        return None

    def on_step(self, scheduled: list, now: float) -> None:
        """Called after each step with the list of ScheduledRequest that ran."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFS(Policy):
    """First come, first served: arrival order (preempted requests go back to the front)."""
    name = "fcfs"


POLICIES = {"fcfs": FCFS}


def make_policy(spec) -> Policy:
    if isinstance(spec, Policy) or (hasattr(spec, "order_waiting") and hasattr(spec, "pick_victim")):
        return spec
    if isinstance(spec, str) and spec in POLICIES:
        return POLICIES[spec]()
    raise ValueError(f"EngineConfig.policy={spec!r}: must be one of {sorted(POLICIES)} or a Policy object")
