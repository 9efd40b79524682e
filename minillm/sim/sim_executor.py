"""The simulated executor: runs no model. Each scheduled request that would sample gets a placeholder
token; the engine's scheduler, KV manager and (modeled) clock do everything else, exactly as with a model.

A request ends at its trace output length (``expected_output_len``) or ``max_tokens``; ``minillm.sim.simulated``
builds whole simulations on it (``simulate()``).
"""

from __future__ import annotations

from ..core.scheduler_output import SchedulerOutput
from ..executor import ExecutionResult

PLACEHOLDER_TOKEN = 0
_ONE_TOKEN = (PLACEHOLDER_TOKEN,)


class SimulatedExecutor:
    """Stands in for ``ModelRunner``: the same contract (``minillm.executor.Executor``), no forward."""

    def __init__(self, config, kv_manager, bytes_per_block: int = 0):
        self.config = config
        self.kv = kv_manager
        self.bytes_per_block = bytes_per_block

    def execute(self, out: SchedulerOutput) -> ExecutionResult:
        # A request that reached the end of its known tokens samples one new token. (One tuple
        # shared by all: the scheduler only reads the tokens it is given.)
        return ExecutionResult(
            sampled=[_ONE_TOKEN if s.samples else () for s in out.scheduled],
            swap_bytes=(len(out.swap_out) + len(out.swap_in)) * self.bytes_per_block,
        )

    # Nothing is kept between steps or per request, and nothing lives outside this process.
    def forget(self, request_id: str) -> None:
        pass

    def checkpoint(self) -> None:
        pass

    def rollback(self, checkpoint) -> None:
        pass

    def close(self) -> None:
        pass
