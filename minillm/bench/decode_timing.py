"""decode_timing: how long one decode step takes at each batch size, measured so that noise shows.

Notebook 01 measures throughput and step latency against the batch size on the machine it runs
on. A single short run is easily fooled: another process takes the CPU for a few milliseconds and
one batch size looks ten times slower than it is. Three habits make the measurement robust:

* **many steps**: each run decodes ``steps`` tokens per request, and a run's time is the *median*
  of its decode steps (the prefill step is left out);
* **repeats, interleaved**: every batch size is run ``repeats`` times, round-robin over the batch
  sizes, so a burst of background load hits one repeat of several sizes rather than every repeat
  of one size;
* **minimum of repeats**: the estimate is the fastest repeat's median. Noise only ever adds time,
  so the minimum is the closest to what the machine can do.

And it says when it cannot be trusted: the *spread* of a batch size is its slowest repeat's median
over its fastest. On a quiet machine it stays near 1; when it is large, background load moved the
numbers by that factor and the ratios between batch sizes mean little. :func:`measure` returns both
and :attr:`DecodeTimings.noisy` applies the threshold.

The clock: on the CPU, :func:`measure` runs torch with one intra-op thread for its duration (the
setting is restored after) and times with this process's CPU time, which a busy machine cannot
inflate by descheduling us; with one thread, CPU time is the time the step would take on a quiet
core. On a GPU it is wall time (a GPU step's tokens are copied to the host before it returns, so
the wall clock covers the kernels).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from statistics import median
from typing import Callable, Iterator, Sequence

import torch

from ..sampling_params import SamplingParams

NOISY_SPREAD = 1.5  # a batch size whose repeats differ by more than this factor is called noisy


def clock_for(device: str) -> tuple[Callable[[], float], str]:
    """The clock :func:`measure` times steps with on ``device``, and its name."""
    if device == "cpu" and torch.get_num_threads() == 1:
        return time.process_time, "CPU time"
    return time.perf_counter, "wall time"


@contextmanager
def one_torch_thread(device: str) -> Iterator[None]:
    """On the CPU, one intra-op torch thread inside the block (the previous count is restored after);
    elsewhere nothing changes."""
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def decode_steps(
    engine, batch: int, steps: int, prompt_len: int = 32, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Run ``batch`` requests of ``prompt_len`` tokens together for ``steps`` decode steps each;
    the time of every step in which all ``batch`` requests decode (none prefills)."""
    if batch < 1 or steps < 1:
        raise ValueError(f"batch and steps must be >= 1, got batch={batch}, steps={steps}")
    for _ in range(batch):
        engine.add_request(
            list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
        )
    times = []
    while engine.has_unfinished_requests():
        t0 = clock()
        rec = engine.step()
        dt = clock() - t0
        if rec.batch_size == batch and rec.num_prefill_tokens == 0:
            times.append(dt)
    return times


@dataclass
class DecodeTimings:
    """Per batch size, the median decode step of each repeat (seconds)."""

    batches: list[int]
    repeat_medians: dict[int, list[float]] = field(default_factory=dict)
    clock: str = "wall time"

    @property
    def step_time(self) -> list[float]:
        """The estimate per batch size: the fastest repeat's median step."""
        return [min(self.repeat_medians[b]) for b in self.batches]

    @property
    def spread(self) -> list[float]:
        """Per batch size: slowest repeat's median / fastest repeat's median (1.0 = no noise)."""
        return [max(self.repeat_medians[b]) / min(self.repeat_medians[b]) for b in self.batches]

    @property
    def noisy(self) -> bool:
        """True when some batch size's repeats differ by more than ``NOISY_SPREAD``."""
        return max(self.spread) > NOISY_SPREAD

    def ratio(self, small: int, large: int) -> tuple[float, float]:
        """(throughput gain, step-latency growth) from batch ``small`` to batch ``large``."""
        t = dict(zip(self.batches, self.step_time))
        return (large / t[large]) / (small / t[small]), t[large] / t[small]


def measure(
    engine, batches: Sequence[int], steps: int = 16, repeats: int = 3, prompt_len: int = 32, device: str = "cpu"
) -> DecodeTimings:
    """Time decode steps at each batch size in ``batches``: ``repeats`` interleaved rounds of
    ``steps`` decode steps each, after one warm-up run (on a GPU it compiles the kernels). On the
    CPU with one torch thread, timed in CPU time (see the module's docstring).

    ``engine`` must admit ``max(batches)`` requests at once (``max_num_seqs`` and KV room for
    ``prompt_len + steps + 1`` positions each) and be idle."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if engine.has_unfinished_requests():
        raise ValueError("measure needs an idle engine: it has unfinished requests")
    if max(batches) > engine.config.max_num_seqs:
        raise ValueError(f"batches go up to {max(batches)} but max_num_seqs is {engine.config.max_num_seqs}")
    with one_torch_thread(device):
        clock, name = clock_for(device)
        decode_steps(engine, min(4, max(batches)), 2, prompt_len, clock)  # warm-up
        out = DecodeTimings(list(batches), {b: [] for b in batches}, name)
        for _ in range(repeats):
            for b in batches:
                out.repeat_medians[b].append(median(decode_steps(engine, b, steps, prompt_len, clock)))
    return out
