"""The executor contract: who runs a step the scheduler decided, and what it hands back.

The scheduler decides (a ``SchedulerOutput``); an *executor* runs it and returns an ``ExecutionResult``;
the scheduler applies that result where the requests live. Three executors keep this contract:
``worker.model_runner.ModelRunner`` (the model on this process), ``worker.tp_executor.TPExecutor``
(the model split over N rank processes) and ``sim.sim_executor.SimulatedExecutor`` (no model: a
placeholder token per sampling request, for experiments at scale). This module imports no torch,
so the simulator never does either.

``EXECUTORS`` declares the kinds ``EngineConfig.executor`` names and what each can do; code that
must know asks ``EngineConfig.runs_model``, never the kind's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .core.scheduler_output import SchedulerOutput


@dataclass
class ExecutionResult:
    """What one step produced, in the order of ``SchedulerOutput.scheduled`` (vLLM's ``ModelRunnerOutput``)."""

    # New output tokens of each grant, in ``out.scheduled``'s order (empty: a prompt chunk short of the
    # prompt's end), walked beside the grants (vLLM's ModelRunnerOutput.sampled_token_ids).
    sampled: list[Sequence[int]] = field(default_factory=list)
    # Parallel sampling: the first token of each completion a fork adds, by its request id.
    fork_sampled: dict[str, list[int]] = field(default_factory=dict)
    spec_accepted: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per request
    swap_bytes: int = 0
    # SamplingParams.logprobs: per request, one {token id: Logprob} per sampled token.
    logprobs: dict[str, list[dict]] = field(default_factory=dict)
    # Requests whose sampling failed (a row of non-finite logits, a draw that raised), with why: they
    # got no token and end alone (sampler.sample_plain); the rest of the batch is untouched.
    failed: dict[str, str] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per request, (prompt position, {token id: Logprob}) pairs.
    prompt_logprobs: dict[str, list[tuple[int, dict]]] = field(default_factory=dict)
    # EngineConfig.phase_clock: host time of "prepare", "forward" and "sample" (empty when not timed).
    phase_times: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Executor(Protocol):
    """Runs the steps the scheduler decides.

    Each step the engine calls ``checkpoint()``, then ``execute(out)``; if anything in the step raises,
    ``rollback(checkpoint)`` puts back what the executor keeps between steps (the random streams), so
    the step can be taken again with the same draws. ``execute`` copies the step's blocks first
    (``out.swap_out``, ``out.copies``, ``out.swap_in``, in that order), then runs one forward over the
    grants and samples a token for every grant that reaches the end of its known tokens
    (``ScheduledRequest.samples``), verifying speculative tokens where a grant carries them.
    ``forget(request_id)`` drops what it keeps per request once the request has finished; ``close()``
    releases what it holds outside this process (idempotent).
    """

    def execute(self, out: SchedulerOutput) -> ExecutionResult:
        """Run one step: the block copies, the forward, the sampling. One token list per grant."""

    def checkpoint(self) -> Any:
        """Before a step: remember what a failed step must not change (returned, for ``rollback``)."""

    def rollback(self, checkpoint: Any) -> None:
        """The step failed: back to ``checkpoint``."""

    def forget(self, request_id: str) -> None:
        """The request has finished: drop its state (its random stream, its draft probabilities)."""

    def close(self) -> None:
        """Release processes and memory held outside the engine's process (idempotent)."""


@dataclass(frozen=True)
class ExecutorKind:
    """One value of ``EngineConfig.executor`` and what an engine of that kind can do."""

    name: str
    runs_model: bool  # loads weights and computes logits: text, logprobs, speculative decoding, and a
    # KV cache of the model's real element size (else: the model's shape only)
    what: str


EXECUTORS = {
    "model": ExecutorKind("model", True, "the real forward (ModelRunner, or TPExecutor over N ranks)"),
    "simulated": ExecutorKind(
        "simulated", False, "no model: the scheduler and KV manager on a modeled clock (SimulatedExecutor)"
    ),
}
