"""A request and its life cycle: WAITING -> RUNNING -> FINISHED, with detours
through PREEMPTED (recompute) and SWAPPED (KV copied to host memory).

There is no "prefill phase" in the data: each request has ``num_computed_tokens``
(positions whose KV is in the cache) and every step grants it some new tokens.
A decode is the case of one new token, a prefill the case of many.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # in the queue, no KV yet
    RUNNING = "running"        # admitted: holds KV blocks, scheduled each step
    PREEMPTED = "preempted"    # KV dropped (recompute): back in the queue
    SWAPPED = "swapped"        # KV copied to host memory: waiting to be swapped in
    FINISHED = "finished"


_FINISHED = RequestStatus.FINISHED   # read once: an enum member read off its class costs ~0.3 us (Python 3.11)


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds, on the engine's clock) and counters of one request."""
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)   # one per output token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    priority: int = 0
    tenant: Optional[str] = None
    finish_reason: Optional[str] = None
    clock: str = "wall"

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival -> first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_wait(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first: (last - first) / (n - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Request:
    """One generation request, as the scheduler sees it (fields in ``__slots__``: running ones are read every step)."""
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "prompt_len", "sampling_params", "priority", "tenant",
                 "eos_token_id", "expected_output_len", "output_token_ids", "status", "num_computed_tokens",
                 "num_cached_tokens", "finish_reason", "finish_detail", "stop_reason", "stop_text", "detokenizer",
                 "output_logprobs", "prompt_logprobs", "parent", "index", "pending_finish_reason", "metrics",
                 "admit_seq", "num_preemptions", "spec_token_ids", "policy_state", "stop_watch")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float, priority: int = 0, tenant: Optional[str] = None,
                 eos_token_id: Optional[int] = None, expected_output_len: Optional[int] = None,
                 prompt: Optional[str] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(self.prompt_token_ids)   # (the prompt never changes: read per step, not len())
        self.sampling_params = sampling_params
        self.priority = priority
        self.tenant = tenant
        self.eos_token_id = eos_token_id
        self.expected_output_len = expected_output_len   # the trace's true length (oracle / simulator)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0      # positions whose KV is in the cache
        self.num_cached_tokens = 0        # of those, how many came from the prefix cache
        self.finish_reason: Optional[str] = None
        self.finish_detail: Optional[str] = None
        self.stop_reason: Union[str, int, None] = None   # the stop string or stop token id that ended it (None: EOS)
        self.stop_text: Optional[str] = None   # the output text, cut where a stop string matched
        self.detokenizer: Any = None      # incremental text of the output (stop strings, streamed text)
        # Log-probabilities (SamplingParams.logprobs / prompt_logprobs): one dict per output token,
        # and one per prompt token (None for the first, which nothing predicts).
        self.output_logprobs: Optional[list] = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: Optional[list] = ([None] * len(self.prompt_token_ids)
                                                if sampling_params.prompt_logprobs is not None else None)
        # Parallel sampling (SamplingParams.n > 1): the group this sequence belongs to, and which
        # completion it is. The first sequence runs the prompt alone and forks the others.
        self.parent: Any = None           # minillm.core.parallel_sampling.ParentRequest, or None
        self.index = 0
        self.pending_finish_reason: Optional[str] = None   # done, but returned later (static / every-N)
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids),
                                      priority=priority, tenant=tenant)
        self.admit_seq = -1               # order of (last) admission: recency for victim choice
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []   # this step's draft (speculative decoding; a draft model's: slots)
        self.policy_state: dict = {}      # scratch space a scheduling policy may use
        self.stop_watch: Optional[tuple] = None   # (length limit, watched tokens): StopChecker.watch's cache

    # --- sizes -----------------------------------------------------------------
    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens: the length whose KV the request needs next."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_len(self) -> int:
        """The most positions this request may ever occupy (prompt + max_tokens)."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences this request stands for against ``max_num_seqs``: all ``n`` of its group
        until it forks them, then 1 (each forked sequence counts itself)."""
        p = self.parent
        return p.n if p is not None and not p.forked else 1

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED      # (policies ask this per request per step: see _FINISHED)

    @property
    def is_decoding(self) -> bool:
        """The one prefill/decode rule: a request *decodes* when it has output and KV for every known
        token but the newest (its next grant is that one token); otherwise it is still processing tokens
        it already knows (its prompt, or prompt + output after a recompute): a *prefill*."""
        return self.num_output_tokens > 0 and self.num_computed_tokens >= self.num_tokens - 1

    @property
    def is_prefill(self) -> bool:
        return not self.is_decoding

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
