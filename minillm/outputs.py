"""RequestOutput: what ``LLM.generate`` returns for each prompt.

As in vLLM, one prompt has ``n`` completions (``SamplingParams.n``), each a
``CompletionOutput`` in ``RequestOutput.outputs``. ``RequestOutput.token_ids``, ``.text``,
``.finish_reason`` and ``.finish_detail`` are the *first* completion's (``outputs[0]``), so
code written for one completion per prompt reads them directly. ``request_output`` assembles one
from a request's sequences; ``output_text`` is a sequence's text so far, for streaming.
``RequestTable`` is the engine's table of requests: an unknown id raises ``UnknownRequestError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .core.request import Request, RequestMetrics


class UnknownRequestError(KeyError):
    """An id the engine never had: a ``KeyError`` (what a missing id always raised) whose message
    names the id, shown as written (a bare KeyError shows only the key)."""

    def __str__(self) -> str:
        return f"unknown request_id={self.args[0]!r}: no request (or sequence '<id>#<index>') has this id"


class RequestTable(dict):
    """``LLMEngine.requests``: request id -> Request; an id never added raises UnknownRequestError."""

    def __missing__(self, request_id):
        raise UnknownRequestError(request_id)


@dataclass
class Logprob:
    """One token's log-probability under the model (log-softmax of its logits, before any
    temperature, top-k/top-p or penalty), its rank (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: Optional[str] = None


# Per position: token id -> Logprob, the top-k tokens plus the one actually there.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's ``CompletionOutput``)."""

    index: int  # which of the n completions
    text: Optional[str]  # decoded text (None without a tokenizer), cut at a stop string
    token_ids: list[int]  # generated tokens
    cumulative_logprob: Optional[float]  # sum of the sampled tokens' logprobs (when logprobs is set)
    logprobs: Optional[list[PositionLogprobs]]  # one entry per generated token (when logprobs is set)
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "rejected"
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it (None for EOS)
    finish_detail: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]  # the first completion's generated tokens
    text: Optional[str]  # the first completion's text (None without a tokenizer)
    finish_reason: Optional[str]  # the first completion's: "stop" | "length" | "abort" | "rejected"
    metrics: RequestMetrics  # the first completion's
    num_cached_tokens: int = 0
    finish_detail: Optional[str] = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # all n completions, by index
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None  # None for the first token

    @property
    def finished(self) -> bool:
        """Every completion is done."""
        if self.outputs:
            return all(o.finished for o in self.outputs)
        return self.finish_reason is not None


# --- assembling outputs from the engine's requests ------------------------------------------------


def final_text(r: Request, tokenizer) -> str:
    """A sequence's whole output text: cut where a stop string matched, else its tokens decoded
    ("" with ``SamplingParams.detokenize=False``, as vLLM)."""
    sp = r.sampling_params
    if not sp.detokenize:
        return ""
    if r.stop_text is not None:
        return r.stop_text
    return tokenizer.decode(r.output_token_ids, skip_special_tokens=sp.skip_special_tokens)


def output_text(r: Request, tokenizer) -> str:
    """A sequence's output text so far: while it runs, what its incremental detokenizer
    (minillm/detokenizer.py) has decoded; once finished, its ``final_text``. "" without a tokenizer."""
    if tokenizer is None or not r.sampling_params.detokenize:
        return ""
    if r.is_finished:
        return final_text(r, tokenizer)
    d = r.text_decoder(tokenizer)
    d.update(r.output_token_ids)
    return d.text


def with_token_text(positions, tokenizer):
    """Logprob dicts with each token's text filled in (when there is a tokenizer)."""
    if positions is None or tokenizer is None:
        return None if positions is None else list(positions)
    for lp in positions:
        for tok, l in (lp or {}).items():
            if l.decoded_token is None:
                l.decoded_token = tokenizer.decode([tok])
    return list(positions)


def completion_output(r: Request, index: int, tokenizer, with_text: bool) -> CompletionOutput:
    """Completion ``index`` of a request: sequence ``r``'s tokens, text (when ``with_text`` and there
    is a tokenizer), logprobs and finish reason."""
    text = final_text(r, tokenizer) if tokenizer is not None and with_text else None
    logprobs = with_token_text(r.output_logprobs, tokenizer if r.sampling_params.detokenize else None)
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=list(r.output_token_ids),
        cumulative_logprob=None
        if logprobs is None
        else sum(lp[t].logprob for lp, t in zip(logprobs, r.output_token_ids)),
        logprobs=logprobs,
        finish_reason=r.finish_reason,
        stop_reason=r.stop_reason,
        finish_detail=r.finish_detail,
    )


def request_output(request_id: str, members: list, tokenizer, with_text: bool) -> RequestOutput:
    """The output of a request whose sequences are ``members`` (one, or its n parallel samples by
    index): every completion, and the first one's tokens, text and finish reason at the top level."""
    outputs = [completion_output(m, i, tokenizer, with_text) for i, m in enumerate(members)]
    r, first = members[0], outputs[0]
    return RequestOutput(
        request_id=request_id,
        prompt=r.prompt,
        prompt_token_ids=r.prompt_token_ids,
        token_ids=first.token_ids,
        text=first.text,
        finish_reason=first.finish_reason,
        metrics=r.metrics,
        num_cached_tokens=r.metrics.num_cached_tokens,
        finish_detail=first.finish_detail,
        outputs=outputs,
        prompt_logprobs=with_token_text(r.prompt_logprobs, tokenizer if r.sampling_params.detokenize else None),
    )
