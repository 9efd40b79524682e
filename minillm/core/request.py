"""A request and its life cycle: WAITING -> RUNNING -> FINISHED, with detours
through PREEMPTED (recompute) and SWAPPED (KV copied to host memory).

There is no "prefill phase" in the data: each request has ``num_computed_tokens``
(positions whose KV is in the cache) and every step grants it some new tokens.
A decode is the case of one new token, a prefill the case of many.

A request's state changes only through its transition methods below (``admit``, ``preempt``,
``resume``, ``reject``, ``hold``, ``finish``, and applying a step's results: ``advance``,
``append_token`` (``append_tokens`` for several), ``settle_guesses``, ``stopped_by``); each refuses a
request in a state it does not start from. The scheduler calls each one after saving the request in the
step's undo log (``Scheduler``'s transitions), and the undo log saves every field in ``__slots__``: a new
field is rolled back with the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..detokenizer import IncrementalDetokenizer
from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the queue, no KV yet
    RUNNING = "running"  # admitted: holds KV blocks, scheduled each step
    PREEMPTED = "preempted"  # KV dropped (recompute): back in the queue
    SWAPPED = "swapped"  # KV copied to host memory: waiting to be swapped in
    FINISHED = "finished"


# The states each transition starts from.
_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_RUNNING = (RequestStatus.RUNNING,)
_SWAPPED = (RequestStatus.SWAPPED,)
_UNFINISHED = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds, on the engine's clock) and counters of one request."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
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
    """One generation request, as the scheduler sees it."""

    __slots__ = (
        "request_id",
        "prompt",
        "prompt_token_ids",
        "sampling_params",
        "priority",
        "tenant",
        "eos_token_id",
        "expected_output_len",
        "output_token_ids",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "finish_reason",
        "finish_detail",
        "stop_reason",
        "stop_text",
        "detokenizer",
        "output_logprobs",
        "prompt_logprobs",
        "parent",
        "index",
        "pending_finish_reason",
        "metrics",
        "admit_seq",
        "num_preemptions",
        "spec_token_ids",
        "policy_state",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        tenant: Optional[str] = None,
        eos_token_id: Optional[int] = None,
        expected_output_len: Optional[int] = None,
        prompt: Optional[str] = None,
        parent=None,
        index: int = 0,
        clock: str = "wall",
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.tenant = tenant
        self.eos_token_id = eos_token_id
        self.expected_output_len = expected_output_len  # the trace's true length (oracle / simulator)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # positions whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.finish_reason: Optional[str] = None
        self.finish_detail: Optional[str] = None
        self.stop_reason: Union[str, int, None] = None  # the stop string or stop token id that ended it (None: EOS)
        self.stop_text: Optional[str] = None  # the output text, cut where a stop string matched
        self.detokenizer: Any = None  # incremental text of the output (stop strings, streamed text)
        # Log-probabilities (SamplingParams.logprobs / prompt_logprobs): one dict per output token,
        # and one per prompt token (None for the first, which nothing predicts).
        self.output_logprobs: Optional[list] = [] if sampling_params.logprobs is not None else None
        self.prompt_logprobs: Optional[list] = (
            [None] * len(self.prompt_token_ids) if sampling_params.prompt_logprobs is not None else None
        )
        # Parallel sampling (SamplingParams.n > 1): the group this sequence belongs to, and which
        # completion it is. The first sequence runs the prompt alone and forks the others.
        self.parent = parent  # minillm.core.parallel_sampling.ParentRequest, or None
        self.index = index
        self.pending_finish_reason: Optional[str] = None  # done, but returned later (static / every-N)
        self.metrics = RequestMetrics(
            arrival_time=arrival_time,
            num_prompt_tokens=len(prompt_token_ids),
            priority=priority,
            tenant=tenant,
            clock=clock,
        )
        self.admit_seq = -1  # order of (last) admission: recency for victim choice
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # this step's draft (speculative decoding; a draft model's: slots)
        self.policy_state: dict = {}  # scratch space a scheduling policy may use

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
    def max_tokens(self) -> int:
        """The most output tokens: ``SamplingParams.max_tokens``, which the engine resolves when the
        request is added (vLLM's None, "until the context ends", becomes the positions left)."""
        max_tokens = self.sampling_params.max_tokens
        assert max_tokens is not None, (
            f"Request {self.request_id!r}: sampling_params.max_tokens is None (LLMEngine.add_request resolves it)"
        )
        return max_tokens

    @property
    def max_len(self) -> int:
        """The most positions this request may ever occupy (prompt + max_tokens)."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences this request stands for against ``max_num_seqs``: all ``n`` of its group
        until it forks them, then 1 (each forked sequence counts itself)."""
        p = self.parent
        return p.n if p is not None and not p.forked else 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """The one prefill/decode rule: a request *decodes* when it has output and KV for every known
        token but the newest (its next grant is that one token); otherwise it is still processing tokens
        it already knows (its prompt, or prompt + output after a recompute): a *prefill*."""
        return self.num_output_tokens > 0 and self.num_computed_tokens >= self.num_tokens - 1

    def text_decoder(self, tokenizer) -> IncrementalDetokenizer:
        """The incremental text of the output (stop strings, streamed text), made on first use."""
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.sampling_params.skip_special_tokens)
        return self.detokenizer

    # --- transitions (the scheduler saves the request in the step's undo log first) ----------------
    # Each refuses a request in a state it does not start from (a bug in the caller), naming both.
    def _require(self, transition: str, allowed: tuple[RequestStatus, ...]) -> None:
        if self.status not in allowed:
            raise RuntimeError(
                f"Request {self.request_id!r}: {transition} from {self.status.value}; only from "
                + " or ".join(s.value for s in allowed)
            )

    def admit(self, num_cached_tokens: int, admit_seq: int, now: float) -> None:
        """WAITING or PREEMPTED -> RUNNING, holding KV for its first ``num_cached_tokens`` positions
        (a prefix-cache hit); ``admit_seq`` orders admissions (recency, for victim choice)."""
        self._require("admit", _QUEUED)
        self.status = RequestStatus.RUNNING
        self.num_computed_tokens = self.num_cached_tokens = num_cached_tokens
        self.metrics.num_cached_tokens = max(self.metrics.num_cached_tokens, num_cached_tokens)
        self.admit_seq = admit_seq
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def preempt(self, status: RequestStatus, keeps_kv: bool) -> None:
        """RUNNING -> ``status`` (PREEMPTED: back in the queue; SWAPPED: its KV in host memory).
        Without its KV (``keeps_kv=False``) every computed position is computed again later."""
        self._require("preempt", _RUNNING)
        if status not in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED):
            raise ValueError(f"Request {self.request_id!r}: preempt to {status.value}; only to preempted or swapped")
        if not keeps_kv:
            self.metrics.num_recomputed_tokens += self.num_computed_tokens
            self.num_computed_tokens = self.num_cached_tokens = 0
        self.status = status
        self.num_preemptions += 1
        self.metrics.num_preemptions += 1

    def resume(self) -> None:
        """SWAPPED -> RUNNING: its KV is copied back."""
        self._require("resume", _SWAPPED)
        self.status = RequestStatus.RUNNING

    def reject(self, reason: str) -> None:
        """Turned away from the queue (load shedding): it finishes as "rejected" when the step's results apply."""
        self._require("reject", _QUEUED)
        self.finish_reason = "rejected"
        self.finish_detail = reason

    def hold(self, reason: str, detail: Optional[str] = None) -> None:
        """Done generating, returned later (static / every-N batching) with ``reason``."""
        self._require("hold", _RUNNING)
        self.pending_finish_reason = reason
        self.finish_detail = detail or self.finish_detail

    def finish(self, reason: str, t: float, detail: Optional[str] = None) -> None:
        """-> FINISHED at clock time ``t``: its reason and last metrics (from any state but FINISHED)."""
        self._require("finish", _UNFINISHED)
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        if detail is not None:
            self.finish_detail = detail
        self.metrics.finish_reason = reason
        self.metrics.finish_time = t
        self.metrics.num_output_tokens = self.num_output_tokens

    # --- applying a step's results (undone from the step's grants: ``StepJournal.save_progress``) ----
    def advance(self, num_new_tokens: int) -> None:
        """The step computed the KV of ``num_new_tokens`` more positions."""
        self.num_computed_tokens += num_new_tokens

    def append_token(self, token: int, t: float) -> None:
        """One output token, sampled at clock time ``t``."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = t
        self.output_token_ids.append(token)
        self.metrics.token_times.append(t)

    def append_tokens(self, tokens: list[int], times: list[float]) -> None:
        """Several output tokens, ``tokens[i]`` sampled at clock time ``times[i]`` (what ``append_token``
        does for each; the simulator's fast path applies the decode steps it takes in one go)."""
        if tokens and self.metrics.first_token_time is None:
            self.metrics.first_token_time = times[0]
        self.output_token_ids.extend(tokens)
        self.metrics.token_times.extend(times)

    def settle_guesses(self, num_proposed: int, num_accepted: int) -> None:
        """Speculative decoding: of ``num_proposed`` guesses computed, ``num_accepted`` were kept."""
        self.num_computed_tokens -= num_proposed - num_accepted
        self.metrics.num_spec_proposed += num_proposed
        self.metrics.num_spec_accepted += num_accepted
        self.spec_token_ids = []

    def drop_past_stop(self) -> None:
        """Tokens accepted past a stop are dropped: KV only up to the newest output token kept."""
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    def stopped_by(self, stop, text: Optional[str] = None) -> None:
        """The stop token id or stop string that ended it, and the output text cut there."""
        self.stop_reason = stop
        self.stop_text = text

    # --- undoing (the step journal) -------------------------------------------------------------
    def snapshot(self) -> tuple:
        """Every field in ``__slots__`` and every field of its metrics, and the lengths of the lists a
        step appends to: what ``restore`` puts back (the step journal saves this)."""
        m = self.metrics
        return (
            tuple(getattr(self, f) for f in Request.__slots__),
            tuple(getattr(m, f) for f in RequestMetrics.__slots__),
            len(self.output_token_ids),
            len(m.token_times),
        )

    def restore(self, snapshot: tuple) -> None:
        """Back to a ``snapshot()``: every field, and the output (its times, logprobs and decoded text)
        cut back to the length it had."""
        fields, metrics_fields, num_output, num_times = snapshot
        for f, v in zip(Request.__slots__, fields):
            setattr(self, f, v)
        for f, v in zip(RequestMetrics.__slots__, metrics_fields):
            setattr(self.metrics, f, v)
        del self.output_token_ids[num_output:]
        del self.metrics.token_times[num_times:]
        if self.output_logprobs is not None:
            del self.output_logprobs[num_output:]
        if self.detokenizer is not None and self.detokenizer.num_tokens > num_output:
            self.detokenizer.rewind(self.output_token_ids)

    def rewind(self, num_computed_tokens: int, num_output_tokens: int) -> None:
        """Back to ``num_computed_tokens`` positions and the first ``num_output_tokens`` output tokens
        (their times and logprobs, and the text decoded so far: a stop string is matched on those only)."""
        self.num_computed_tokens = num_computed_tokens
        appended = len(self.output_token_ids) - num_output_tokens
        if appended <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.metrics.token_times[-appended:]
        if self.output_logprobs is not None:
            del self.output_logprobs[num_output_tokens:]
        if self.detokenizer is not None and self.detokenizer.num_tokens > num_output_tokens:
            self.detokenizer.rewind(self.output_token_ids)
        self.stop_reason = self.stop_text = None  # only a stop in those tokens sets them
        if num_output_tokens == 0:
            self.metrics.first_token_time = None

    def lose_kv_from(self, position: int) -> None:
        """Its KV from ``position`` on can no longer be trusted: it computes those positions again."""
        if self.num_computed_tokens > position:
            self.num_computed_tokens = position
            self.num_cached_tokens = min(self.num_cached_tokens, position)

    def fork(self, request_id: str, params: SamplingParams, index: int) -> "Request":
        """Parallel sampling: sample ``index`` of this request's group, sharing everything computed
        so far (the caller shares its KV blocks); RUNNING from the start."""
        seq = Request(
            request_id,
            self.prompt_token_ids,
            params,
            self.arrival_time,
            self.priority,
            self.tenant,
            self.eos_token_id,
            self.expected_output_len,
            prompt=self.prompt,
            parent=self.parent,
            index=index,
            clock=self.metrics.clock,
        )
        seq.status = RequestStatus.RUNNING
        seq.num_computed_tokens, seq.num_cached_tokens = self.num_computed_tokens, self.num_cached_tokens
        seq.admit_seq = self.admit_seq
        seq.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        seq.metrics.num_cached_tokens = self.metrics.num_cached_tokens
        if self.prompt_logprobs is not None:
            seq.prompt_logprobs = self.prompt_logprobs
        return seq

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
