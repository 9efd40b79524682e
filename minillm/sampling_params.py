"""SamplingParams: how one request picks its next token and when it stops.

The fields and their meaning follow vLLM's ``SamplingParams``, so what a reader learns here
transfers: ``n`` completions per prompt (parallel sampling, sharing the prompt's KV blocks),
stop strings, ``min_tokens``, ``min_p`` (Nguyen et al. 2024), ``logprobs`` / ``prompt_logprobs`` and the three penalties
(``repetition_penalty`` as in Keskar et al. 2019, CTRL; ``presence_penalty`` and
``frequency_penalty`` as in the OpenAI API). Every field is checked where it is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from .checks import as_bool, as_int, as_real, as_seed

# repetition_penalty p divides (or multiplies) float32 logits. vLLM asks only p > 0, but p = 1e-39
# already turns a logit of 1 into inf (NaN probabilities), and the rows of the other requests of
# the batch share the step. 100 either way is far past any useful penalty (transformers' docs
# suggest about 1.2) and leaves logits of a few thousand finite even at temperature 1e-6.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# logit_bias values, as the OpenAI API bounds them: -100 bans a token, +100 all but forces it.
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 (vLLM's "all") = all
    top_p: float = 1.0  # keep the smallest set with probability >= top_p
    max_tokens: Optional[int] = 16  # most output tokens to generate; None = until the context ends
    # (max_model_len - the prompt's length, set when the request is added)
    seed: Optional[int] = None  # per-request generator seed (reproducible sampling)
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end the request
    n: int = 1  # completions of this prompt (parallel sampling)
    stop: list[str] = field(default_factory=list)  # strings that end a completion (matched on its text)
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    min_tokens: int = 0  # no EOS / stop token / stop string before this many tokens
    logprobs: Optional[int] = None  # top-k log-probabilities per output token (+ the sampled one)
    prompt_logprobs: Optional[int] = None  # the same for each prompt token (after the first)
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of seen tokens;
    # in [0.01, 100] (see REPETITION_PENALTY_RANGE)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (0 = none)
    # (after temperature, before top-k / top-p, as vLLM)
    skip_special_tokens: bool = True  # leave special tokens (EOS, <|im_end|>, ...) out of the text
    detokenize: bool = True  # False: no text at all (outputs' text is ""), tokens only
    logit_bias: Optional[dict[int, float]] = None  # token id -> added to its logit, in [-100, 100]
    # (the OpenAI API's); {} is None

    def __post_init__(self) -> None:
        # Checked here, so a bad value fails where it is written, naming the field; integer-like
        # values (numpy, torch) become plain ints. LLMEngine.add_request checks a copy again.
        own = "SamplingParams"
        self.temperature = as_real(own, "temperature", self.temperature, 0.0)
        self.top_k = as_int(own, "top_k", self.top_k, -1, rng=" >= 1, or 0 or -1 (all tokens)")
        self.top_p = as_real(own, "top_p", self.top_p, 0.0, 1.0, low_open=True)
        self.min_p = as_real(own, "min_p", self.min_p, 0.0, 1.0)
        self.max_tokens = as_int(own, "max_tokens", self.max_tokens, 1, optional=True)
        self.seed = as_seed(own, "seed", self.seed, optional=True)
        self.ignore_eos = as_bool(own, "ignore_eos", self.ignore_eos)
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes, bytearray)) or not isinstance(stop, Iterable):
            raise TypeError(
                f"SamplingParams.stop_token_ids={stop!r}: must be a list of token ids (integers), e.g. [13]"
            )
        self.stop_token_ids = [as_int(own, f"stop_token_ids[{i}]", t, 0) for i, t in enumerate(stop)]
        self.n = as_int(own, "n", self.n, 1)
        strings = [self.stop] if isinstance(self.stop, str) else self.stop
        if strings is None:
            strings = []
        if isinstance(strings, (bytes, bytearray)) or not isinstance(strings, Iterable):
            raise TypeError(f"SamplingParams.stop={self.stop!r}: must be a string or a list of strings")
        strings = list(strings)
        for i, t in enumerate(strings):
            if not isinstance(t, str):
                raise TypeError(f"SamplingParams.stop[{i}]={t!r}: must be a string")
            if not t:
                raise ValueError(f"SamplingParams.stop[{i}]={t!r}: an empty stop string would match everywhere")
        self.stop = strings
        self.include_stop_str_in_output = as_bool(own, "include_stop_str_in_output", self.include_stop_str_in_output)
        self.min_tokens = as_int(own, "min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens}: must be <= max_tokens={self.max_tokens}")
        self.logprobs = as_int(own, "logprobs", self.logprobs, 0, optional=True)
        self.prompt_logprobs = as_int(own, "prompt_logprobs", self.prompt_logprobs, 0, optional=True)
        self.presence_penalty = as_real(own, "presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = as_real(own, "frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = as_real(own, "repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        self.skip_special_tokens = as_bool(own, "skip_special_tokens", self.skip_special_tokens)
        self.detokenize = as_bool(own, "detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            raise ValueError(
                f"SamplingParams.stop={self.stop!r}: stop strings are matched on the text, "
                "and detokenize=False makes none; use stop_token_ids"
            )
        bias = self.logit_bias
        if bias is not None and not isinstance(bias, dict):
            raise TypeError(f"SamplingParams.logit_bias={bias!r}: must be a dict {{token id: bias}}")
        self.logit_bias = (
            {
                as_int(own, "logit_bias key", t, 0): as_real(own, f"logit_bias[{t!r}]", b, *LOGIT_BIAS_RANGE)
                for t, b in bias.items()
            }
            if bias
            else None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Do the logits need changing before sampling (logit_bias, penalties)?"""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.logit_bias is not None
        )


def checked_copy(sampling_params, who: str = "") -> SamplingParams:
    """The engine's own copy of a request's params, checked again (the caller may have edited
    the object since it was made; ``None`` gives the defaults). ``who`` names the request."""
    if sampling_params is None:
        return SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return dataclasses.replace(sampling_params)
    raise TypeError(f"sampling_params={sampling_params!r}{who}: must be a SamplingParams or None")
