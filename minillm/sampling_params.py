"""SamplingParams: how one request picks its next token and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy (argmax)
    top_k: int = 0                    # keep the k most likely tokens; 0 = all
    top_p: float = 1.0                # keep the smallest set with probability >= top_p
    max_tokens: int = 16              # most output tokens to generate
    seed: Optional[int] = None        # per-request generator seed (reproducible sampling)
    ignore_eos: bool = False          # keep generating past the end-of-sequence token
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end the request

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be an integer >= 0")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
