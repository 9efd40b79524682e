"""Admission control: reject cleanly rather than let the waiting queue grow without bound.

Load shedding by age (``EngineConfig.max_queue_delay``) before a pass and by length (``max_queue_len``) after it;
a rejected request (``Scheduler.reject``) finishes with ``finish_reason="rejected"`` and a sentence saying why.
"""

from __future__ import annotations

from .request import RequestStatus


def shed_load(sched, now: float, out) -> None:
    """Requests that waited longer than ``max_queue_delay`` are rejected (before the pass)."""
    cfg = sched.config
    if cfg.max_queue_delay is not None:
        for req in [
            r
            for r in sched.waiting
            if r.status == RequestStatus.WAITING
            and r.arrival_time <= now
            and now - r.arrival_time > cfg.max_queue_delay
        ]:
            sched.reject(req, out, f"waited {now - req.arrival_time:.3f}s > max_queue_delay={cfg.max_queue_delay}")


def cap_queue(sched, now: float, out) -> None:
    """Load shedding: new requests still waiting after a pass beyond ``max_queue_len`` are
    rejected, latest arrivals first."""
    cfg = sched.config
    if cfg.max_queue_len is None or not out.reformed:
        return  # between passes (schedule_every > 1) nobody could be admitted
    queued = [r for r in sched.waiting if r.status == RequestStatus.WAITING and r.arrival_time <= now]
    if len(queued) <= cfg.max_queue_len:
        return
    for req in queued[cfg.max_queue_len :]:
        sched.reject(req, out, f"queue full: {len(queued)} waiting > max_queue_len={cfg.max_queue_len}")
    gone = {w.request_id for w in out.rejected}
    out.waiting[:] = [w for w in out.waiting if w.request_id not in gone]
