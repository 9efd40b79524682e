"""Fast-forward: a run of decode-only steps advanced at once, for long simulations.

Between two events (an arrival, a finish, a chunk's end, a preemption) every step of a simulated
engine whose running requests all decode has a known outcome: each request gets one token under
the budget, the scheduler admits nobody (the queue is empty), the clock advances by what the cost
model charges a batch of that size and total context, and a request whose next position starts a
new block gets one from the pool. ``decode_run`` works out how many such steps come next and
applies them in one go: the clock steps by the same durations, the token counts and times grow by
the same amounts, and the same KV manager hands out the same blocks in the same order (a call of
``kv.allocate(req, 1)`` per new block, step by step, in the running order). Where any decision
could differ it takes no step and the engine steps normally:

* something is queued (an arrival within the run, a waiting, swapped or held request);
* a request is not a plain decode (a prompt chunk, speculative guesses) or may stop within the
  run (``StopChecker.num_tokens_before_stop``);
* the free blocks do not cover every new block the run needs (a preemption could come);
* the policy may change state or order between steps: only ``FCFS`` and ``Priority``, whose
  ``on_step`` does nothing and whose order depends on fixed fields, are fast-forwarded;
* the engine keeps more than counts per step (``record`` other than "none"), times its phases,
  caches prefixes, forks samples, speculates, or batches other than continuously every step.

``simulate(records=False)`` calls it before every step (``fast_forward=True``); each step it
takes yields the ``StepRecord`` that ``engine.step()`` would have returned with ``record="none"``.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Optional

from ..core.kv_cache import PagedKVCacheManager
from ..core.policies import FCFS, Priority
from ..core.request import RequestStatus
from ..step_record import StepRecord
from .costmodel import RooflineCostModel
from .sim_executor import PLACEHOLDER_TOKEN

__all__ = ["decode_run"]

_computed = attrgetter("num_computed_tokens")


def _can_fast_forward(engine) -> bool:
    """The engine-wide conditions: nothing queued, nothing recorded per request, no feature whose
    state changes between steps, a step priced by the roofline from its totals."""
    cfg, s = engine.config, engine.scheduler
    return (engine.record_mode == "none" and engine.clock.name == "modeled" and engine.speculator is None
            and bool(s.running) and not (s.waiting or s.swapped or s.held or s.has_groups)
            and cfg.batching == "continuous" and cfg.schedule_every == 1 and cfg.phase_clock is None
            and not cfg.enable_prefix_caching and type(engine.policy) in (FCFS, Priority)
            and type(engine.kv) is PagedKVCacheManager and isinstance(engine.cost_model, RooflineCostModel)
            and len(s.running) <= cfg.max_num_batched_tokens)


def decode_run(engine, max_steps: Optional[int] = None) -> list[StepRecord]:
    """Take the decode-only steps that come next (at least two, at most ``max_steps``) in one go;
    returns their records, or ``[]`` when fewer than two can be taken that way (``engine.step()``
    then takes the next step)."""
    if not _can_fast_forward(engine):
        return []
    s, kv, cm, clock = engine.scheduler, engine.kv, engine.cost_model, engine.clock
    running = s.running
    n = len(running)
    now, arrival = clock.now(), s.next_arrival()
    befores = list(map(_computed, running))
    total = sum(befores)                          # KV positions before the run
    # Step j of the run (from 1) holds total + j n positions after it: modeled_step_time's price of a
    # step of decodes alone (cm.decode_step_time), plus the pass (cm.schedule_time), no swap, no draft.
    sched_time = cm.schedule_time(n, 0)
    first = cm.decode_step_time(n, total + n)
    if first is None or (arrival is not None and (arrival <= now or now + (first + sched_time) >= arrival)):
        return []                                  # the next arrival comes before a second step
    # Every running request: a plain decode of one token, and how many steps it can take
    # without stopping (the run ends before the first step that could finish one).
    limit = max_steps if max_steps is not None else 1 << 30
    stops, bs = s.stops, kv.block_size
    new_block_at: dict[int, list] = {}             # step j -> (request, its computed positions before j)
    for req, before in zip(running, befores):
        if req.status is not RequestStatus.RUNNING or req.spec_token_ids or not req.is_decoding \
                or req.num_tokens - before != 1:
            return []
        limit = min(limit, stops.num_tokens_before_stop(req, PLACEHOLDER_TOKEN))
        if limit < 2:
            return []
        room = kv.num_held_blocks(req.request_id) * bs
        for j in range(room - before + 1, limit + 1, bs):   # the steps whose position starts a new block
            new_block_at.setdefault(j, []).append((req, before + j - 1))
    # The run's steps: each starts before the next arrival, finds its new blocks free, has a price.
    free, needed, t, steps = kv.num_free_blocks, 0, now, []
    for j in range(1, limit + 1):
        if arrival is not None and t >= arrival:
            break
        needed += len(new_block_at.get(j, ()))
        step = first if j == 1 else cm.decode_step_time(n, total + j * n)
        if needed > free or step is None:
            break
        duration = step + sched_time
        steps.append((t, duration))
        t += duration
    k = len(steps)
    if k < 2:
        return []
    # Apply: the new blocks in the order the steps take them, then the clock, the tokens and their times.
    for j in range(1, k + 1):
        for req, position in new_block_at.get(j, ()):
            req.num_computed_tokens = position
            if not kv.allocate(req, 1):
                raise RuntimeError(f"fast-forward: no KV block for request {req.request_id!r} in step {j} of {k}")
    times, records = [], []
    budget, first_step = engine.config.max_num_batched_tokens, engine.step_count
    for j, (_, duration) in enumerate(steps):
        clock.advance(duration)
        times.append(clock.now())
        records.append(StepRecord(step=first_step + j, time=times[-1], duration=duration, batch=[],
                                  num_batched_tokens=n, token_budget=budget, admitted=[], finished=[], preempted=[],
                                  waiting=[], kv=None, clock=clock.name, schedule_time=sched_time, batch_size=n,
                                  num_prefill_tokens=0, num_decode_tokens=0))
    tokens = [PLACEHOLDER_TOKEN] * k
    for req, before in zip(running, befores):
        req.output_token_ids.extend(tokens)
        req.metrics.token_times.extend(times)
        req.num_computed_tokens = before + k
    s.num_passes += k                              # (the passes the run stands for)
    s.now = max(s.now, steps[-1][0])               # the clock at the last one
    engine.step_count += k
    return records
