"""The undo log of one step: what a failed step changed in its requests, and how to put it back.

A step is all or nothing. The scheduler saves a request here the first time the step changes it
(admission, preemption, swap-in, rejection, finishing) and notes, for each request the step ran,
how long its output was before the results were applied. If anything raises before the step
ends, ``restore()`` replays the log backwards and every request is as it was before the step.
(A policy's own bookkeeping, such as ``request.policy_state``, is the policy's business.)
"""

from __future__ import annotations

_REQUEST_FIELDS = ("status", "num_computed_tokens", "num_cached_tokens", "finish_reason", "finish_detail",
                   "pending_finish_reason", "admit_seq", "num_preemptions", "stop_reason", "stop_text")
_METRICS_FIELDS = ("first_scheduled_time", "first_token_time", "finish_time", "num_output_tokens",
                   "num_cached_tokens", "num_preemptions", "num_recomputed_tokens", "num_spec_proposed",
                   "num_spec_accepted", "finish_reason")


class StepJournal:
    def __init__(self):
        self._saved: set[str] = set()
        self._log: list[tuple] = []

    def save(self, req) -> None:
        """Every mutable field of ``req``, the first time this step touches it."""
        if req.request_id in self._saved:
            return
        self._saved.add(req.request_id)
        m = req.metrics
        self._log.append((True, req, len(req.output_token_ids), len(m.token_times),
                          tuple(getattr(req, f) for f in _REQUEST_FIELDS),
                          tuple(getattr(m, f) for f in _METRICS_FIELDS)))

    def save_progress(self, scheduled) -> None:
        """The cheap save before applying a step's results to the requests it ran (``scheduled``,
        its ``ScheduledRequest``s): each one's computed positions, output and token times (the
        only fields that change unless it finishes). One call for the whole batch, the loop
        written out: it runs for every running request every step. (After a full save it is
        redundant but harmless; a full save made later, while the results are applied, is
        replayed first, since the log is replayed backwards.)"""
        append = self._log.append
        for s in scheduled:
            req = s.request
            m = req.metrics
            append((False, req, len(req.output_token_ids), len(m.token_times), req.num_computed_tokens,
                    m.first_token_time))

    def restore(self) -> None:
        for full, req, n_out, n_times, a, b in reversed(self._log):
            if full:
                for f, v in zip(_REQUEST_FIELDS, a):
                    setattr(req, f, v)
                for f, v in zip(_METRICS_FIELDS, b):
                    setattr(req.metrics, f, v)
            else:
                req.num_computed_tokens, req.metrics.first_token_time = a, b
            del req.output_token_ids[n_out:]
            del req.metrics.token_times[n_times:]
            if req.output_logprobs is not None:
                del req.output_logprobs[n_out:]
        self._log.clear()
        self._saved.clear()
