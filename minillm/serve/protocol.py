"""The OpenAI-compatible API's request and response bodies, as pydantic models.

Field names and defaults follow OpenAI's API (and vLLM's extensions ``top_k``, ``ignore_eos``,
``include_stop_str_in_output``, ``return_token_ids``), so the official ``openai`` client and
vLLM's tooling work unchanged.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class OpenAIModel(BaseModel):
    # Unknown fields are refused (400, like OpenAI's "Unrecognized request argument").
    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIModel):
    include_usage: bool = False          # one last chunk with ``usage`` and no choices


class SamplingFields(OpenAIModel):
    """What both endpoints share. Values are checked by the engine's ``SamplingParams``."""
    model: Optional[str] = None          # None: the one model served
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # vLLM's extension: 0 = all tokens
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    include_stop_str_in_output: bool = False   # vLLM's extension: the matched stop string ends the text
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1                           # completions of the prompt (they share its KV blocks)
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0      # vLLM's extension
    min_tokens: int = 0                  # vLLM's extension: no stop before this many tokens
    logit_bias: Optional[dict[str, float]] = None   # accepted empty only
    ignore_eos: bool = False             # vLLM's extension: generate max_tokens tokens
    stop_token_ids: list[int] = Field(default_factory=list)   # vLLM's extension
    return_token_ids: bool = False       # vLLM's extension: choices carry ``token_ids``
    priority: int = 0                    # vLLM's extension: lower = more urgent (policy="priority")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False                   # accepted False only
    logprobs: Optional[int] = None       # top-k logprobs per output token (the legacy format)
    suffix: Optional[str] = None         # accepted None only
    best_of: Optional[int] = None        # accepted None or 1 only


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")   # tool calls and the like pass through unread
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None     # None: up to the context length
    max_completion_tokens: Optional[int] = None   # OpenAI's newer name for max_tokens
    logprobs: bool = False               # logprobs of each output token ...
    top_logprobs: Optional[int] = None   # ... and of the top-k alternatives
    add_generation_prompt: bool = True   # vLLM's extension: end the prompt with the assistant's turn


# --- responses -----------------------------------------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The completions endpoint's (legacy) logprobs: parallel lists, one entry per token."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None   # vLLM's: the stop string or token id that ended it
    token_ids: Optional[list[int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str = ""


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None   # vLLM's: the stop string or token id that ended it
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None   # vLLM's: the stop string or token id that ended it
    token_ids: Optional[list[int]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minillm"
    root: Optional[str] = None           # the checkpoint directory
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    error: ErrorInfo
