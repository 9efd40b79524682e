"""EngineMonitor: the Stepper's view of an engine that something else drives.

A Stepper steps its engine itself. A served engine is stepped by the server's loop
(``minillm.async_llm.AsyncLLM``, behind ``minillm.serve``) as requests arrive over HTTP;
the monitor only watches: ``poll()`` takes the StepRecords the engine has written since
the last poll and draws the newest, the history slider looks back over all of them.
Everything it reads from the engine is read through ``read`` (for a server,
``BackgroundServer.engine_call``: on the engine's own thread, between two steps), so a
step is never seen half done::

    with BackgroundServer(num_kv_blocks=64) as server:
        monitor = EngineMonitor(server.llm.engine, read=server.engine_call)
        display(monitor)
        ...send requests...
        monitor.follow(until=burst.done)       # redraws while they run
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ..step_record import StepRecord
from .panels import RequestInfo
from .stepper import Stepper, as_engine

__all__ = ["EngineMonitor"]


class EngineMonitor(Stepper):
    """A Stepper without Step, Run or Reset: it follows ``engine`` (an ``LLMEngine`` or ``LLM``)
    while another thread steps it. ``read(fn)`` runs ``fn(engine)`` where reading is safe and
    returns its result (default: call it here, for an engine nothing else touches)."""

    def __init__(
        self, engine: Any, *, read: Optional[Callable[[Callable], Any]] = None, title: Optional[str] = None, **kw
    ):
        target = as_engine(engine)
        self._read = read if read is not None else (lambda fn: fn(target))
        super().__init__(lambda: target, controls=False, title=title, **kw)

    def layout_children(self) -> list:
        children = super().layout_children()
        at = 1 if self.title else 0
        return children[:at] + [self.history] + children[at:]  # no controls, but look back

    def _refresh_infos(self) -> None:
        known = set(self._infos)
        new = self._read(
            lambda e: [
                (rid, r.num_prompt_tokens, r.sampling_params.max_tokens, r.arrival_time, r.metrics)
                for rid, r in e.requests.items()
                if rid not in known
            ]
        )
        for rid, *info in new:
            self._infos[rid] = RequestInfo(rid, *info)
            self.colors[rid]

    @property
    def done(self) -> bool:
        return True  # nothing to step here: the engine belongs to whoever drives it

    def step(self):
        raise TypeError("EngineMonitor watches an engine another thread steps; call poll() or follow()")

    run = reset = step

    def poll(self) -> list[StepRecord]:
        """The StepRecords written since the last poll (also appended to ``records``); the newest is drawn."""
        last = self.records[-1].step if self.records else -1
        new = self._read(lambda e: [r for r in e.step_records if r.step > last])
        for rec in new:
            self.records.append(rec)
            self._latest.apply(rec)
        if new:
            self._sync_history(len(self.records) - 1)
            self._render(len(self.records) - 1)
        return new

    def follow(self, until: Callable[[], bool], interval: float = 0.2, timeout: float = 600.0) -> int:
        """``poll()`` every ``interval`` seconds until ``until()`` is true, then once more: the
        records taken. Raises TimeoutError after ``timeout`` seconds."""
        taken, deadline = 0, time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError(f"EngineMonitor.follow: still waiting after {timeout} s")
            taken += len(self.poll())
            time.sleep(interval)
        return taken + len(self.poll())
