"""The simulated executor: runs no model. Each scheduled request that would sample gets a placeholder
token; the engine's scheduler, KV manager and (modeled) clock do everything else, exactly as with a model.

A request ends at its trace output length (``expected_output_len``) or ``max_tokens``; ``minillm.sim.simulated``
builds whole simulations on it (``simulate()``).
"""

from __future__ import annotations

from ..worker.model_runner import ExecutionResult
from ..core.scheduler_output import SchedulerOutput

PLACEHOLDER_TOKEN = 0
_ONE_TOKEN = (PLACEHOLDER_TOKEN,)


class SimulatedExecutor:
    """Stands in for ``ModelRunner``: the same ``execute(SchedulerOutput) -> ExecutionResult``, no forward."""

    def __init__(self, config, kv_manager, bytes_per_block: int = 0):
        self.config = config
        self.kv = kv_manager
        self.bytes_per_block = bytes_per_block

    def execute(self, out: SchedulerOutput) -> ExecutionResult:
        res = ExecutionResult()
        res.swap_bytes = (len(out.swap_out) + len(out.swap_in)) * self.bytes_per_block
        # A request that reached the end of its known tokens samples one new token. (One tuple
        # shared by all: the scheduler only reads the tokens it is given.)
        res.sampled = [_ONE_TOKEN if s.samples else () for s in out.scheduled]
        return res

    def forget(self, request_id: str) -> None:
        pass

    def checkpoint(self) -> None:
        pass                               # nothing of a step's is kept here

    def rollback(self, checkpoint) -> None:
        pass
