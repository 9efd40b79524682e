"""The engine's clock: measured wall time, the process's own CPU time, or modeled time advanced by a cost model.

With ``clock="modeled"`` a step takes as long as the cost model says (a roofline
of the GPU you name), so a laptop can tell you what an H100 would do; the run is
deterministic. With ``clock="wall"`` the step takes as long as it really took.
With ``clock="cpu"`` it takes the CPU time this process spent on it: the real engine
on a CPU, timed as if it had the core to itself (what other programs take of the
core is not counted; an idle wait for the next arrival is skipped, as on the
modeled clock).
"""

from __future__ import annotations

import contextlib
import time


class WallClock:
    name = "wall"

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def advance(self, seconds: float) -> None:
        pass  # real time advances by itself

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(min(delay, 1.0))

    def reset(self, t: float) -> None:
        pass  # a failed step cannot take back real time


class ModeledClock:
    name = "modeled"

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)  # an idle modeled clock jumps to the next arrival

    def reset(self, t: float) -> None:
        self.t = t  # a failed step takes no modeled time


class ProcessClock:
    """The CPU time this process has used (``time.process_time``), plus every idle wait skipped.

    For the real engine on a machine shared with other work: a step's time is the CPU time its
    forward and bookkeeping used, so another program taking the core for a while does not make the
    step look slower (it still shares the caches). Nothing runs while the engine waits for an arrival,
    so ``wait_until`` moves the clock to that time at once, as the modeled clock does. On a GPU the
    device's time is not the process's: use the wall clock there."""

    name = "cpu"

    def __init__(self):
        self.t0 = time.process_time()
        self.skipped = 0.0  # idle waits jumped over

    def now(self) -> float:
        return time.process_time() - self.t0 + self.skipped

    def advance(self, seconds: float) -> None:
        pass  # CPU time advances as the process works

    def wait_until(self, t: float) -> None:
        self.skipped += max(0.0, t - self.now())

    def reset(self, t: float) -> None:
        pass  # a failed step cannot take back the CPU time it used


def make_clock(name: str):
    return {"modeled": ModeledClock, "cpu": ProcessClock}.get(name, WallClock)()


class PhaseTimes:
    """Host time of each phase of one step (schedule, prepare, forward, sample, update, record), read
    off ``EngineConfig.phase_clock`` (``time.perf_counter``, or ``time.process_time`` so that a busy
    machine cannot inflate a phase). Without a clock nothing is timed and ``times`` stays empty::

        with phases.timing("schedule"):
            out = scheduler.schedule(now)
    """

    __slots__ = ("clock", "times")

    def __init__(self, clock=None):
        self.clock = clock
        self.times: dict[str, float] = {}

    def mark(self) -> float:
        return self.clock() if self.clock is not None else 0.0

    def add(self, phase: str, since: float) -> None:
        if self.clock is not None:
            self.times[phase] = self.times.get(phase, 0.0) + self.clock() - since

    def timing(self, phase: str):
        """Time the ``with`` block as ``phase`` (added to its earlier time in this step); without a clock,
        a ``with`` that times nothing."""
        return self._timed(phase) if self.clock is not None else _UNTIMED

    @contextlib.contextmanager
    def _timed(self, phase: str):
        since = self.mark()
        yield
        self.add(phase, since)


_UNTIMED = contextlib.nullcontext()  # (reusable: it holds nothing)
