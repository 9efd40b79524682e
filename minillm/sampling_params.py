"""SamplingParams: how one request picks its next token and when it stops."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from .checks import as_bool, as_int, as_real, as_seed


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
        # Checked here, so a bad value fails where it is written, naming the field; integer-like
        # values (numpy, torch) become plain ints. LLMEngine.add_request checks a copy again.
        own = "SamplingParams"
        self.temperature = as_real(own, "temperature", self.temperature, 0.0)
        self.top_k = as_int(own, "top_k", self.top_k, 0)
        self.top_p = as_real(own, "top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.max_tokens = as_int(own, "max_tokens", self.max_tokens, 1)
        self.seed = as_seed(own, "seed", self.seed, optional=True)
        self.ignore_eos = as_bool(own, "ignore_eos", self.ignore_eos)
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes, bytearray)) or not isinstance(stop, Iterable):
            raise TypeError(f"SamplingParams.stop_token_ids={stop!r}: must be a list of token ids "
                            "(integers), e.g. [13]")
        self.stop_token_ids = [as_int(own, f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(stop)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
