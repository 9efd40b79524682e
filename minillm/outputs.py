"""RequestOutput: what ``LLM.generate`` returns for each prompt.

As in vLLM, one prompt has ``n`` completions (``SamplingParams.n``), each a
``CompletionOutput`` in ``RequestOutput.outputs``. ``RequestOutput.token_ids``, ``.text``,
``.finish_reason`` and ``.finish_detail`` are the *first* completion's (``outputs[0]``), so
code written for one completion per prompt reads them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .core.request import RequestMetrics


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
    index: int                        # which of the n completions
    text: Optional[str]               # decoded text (None without a tokenizer), cut at a stop string
    token_ids: list[int]              # generated tokens
    cumulative_logprob: Optional[float]   # sum of the sampled tokens' logprobs (when logprobs is set)
    logprobs: Optional[list[PositionLogprobs]]   # one entry per generated token (when logprobs is set)
    finish_reason: Optional[str] = None   # "stop" | "length" | "abort" | "rejected"
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
    token_ids: list[int]              # the first completion's generated tokens
    text: Optional[str]               # the first completion's text (None without a tokenizer)
    finish_reason: Optional[str]      # the first completion's: "stop" | "length" | "abort" | "rejected"
    metrics: RequestMetrics           # the first completion's
    num_cached_tokens: int = 0
    finish_detail: Optional[str] = None
    outputs: list[CompletionOutput] = field(default_factory=list)     # all n completions, by index
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None   # None for the first token

    @property
    def finished(self) -> bool:
        """Every completion is done."""
        if self.outputs:
            return all(o.finished for o in self.outputs)
        return self.finish_reason is not None
