"""RequestOutput: what ``LLM.generate`` returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .request import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    token_ids: list[int]              # generated tokens
    text: Optional[str]               # decoded generated text (None without a tokenizer)
    finish_reason: Optional[str]      # "stop" | "length" | "abort" | "rejected"
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    finish_detail: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
