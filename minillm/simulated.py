"""The simulated executor: the same scheduler and memory manager, no model.

``executor="simulated"`` skips the forward pass and emits a placeholder token
for every request that would sample one; each request ends at its
``max_tokens`` (a trace's output length). Paired with ``clock="modeled"`` it
replays thousands of requests of a 70B-shaped model on a modeled H100 in
seconds, which is how the notebooks explore load curves at realistic scale.
"""

from __future__ import annotations

from .model_runner import ExecutionResult
from .scheduler import SchedulerOutput

PLACEHOLDER_TOKEN = 0


class SimulatedExecutor:
    def __init__(self, config, kv_manager, bytes_per_block: int = 0):
        self.config = config
        self.kv = kv_manager
        self.bytes_per_block = bytes_per_block

    def execute(self, out: SchedulerOutput) -> ExecutionResult:
        res = ExecutionResult()
        res.swap_bytes = (len(out.swap_out) + len(out.swap_in)) * self.bytes_per_block
        for s in out.scheduled:
            if s.samples:
                res.sampled[s.request.request_id] = [PLACEHOLDER_TOKEN]
        return res

    def forget(self, request_id: str) -> None:
        pass
