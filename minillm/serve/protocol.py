"""The OpenAI-compatible API's request and response bodies, as pydantic models.

Field names and defaults follow OpenAI's API (and vLLM's extensions ``top_k``, ``ignore_eos``,
``include_stop_str_in_output``, ``return_token_ids``), so the official ``openai`` client and
vLLM's tooling work unchanged.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..sampling_params import LOGIT_BIAS_RANGE, REPETITION_PENALTY_RANGE


# OpenAI's bounds where the engine has the same ones (so the schema says what a request may hold).
MAX_LOGPROBS = 20  # top_logprobs / logprobs: OpenAI's and vLLM's default cap
MAX_STOP = 4  # stop sequences per request (OpenAI's)


def _json_integer(value: Any) -> Any:
    """JSON Schema's integer: ``3.0`` is one (it becomes 3), ``true`` is not."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not an integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def integer(**bounds) -> Any:
    """An int field's type: JSON Schema's integer within ``bounds`` (``ge``, ``le``, ...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_json_integer)]


def limit(name: str) -> dict:
    """A bound the served model sets (its vocabulary, context, max_num_seqs): the server writes it
    into its OpenAPI schema as ``maximum`` (``api_server.document_limits``)."""
    return {"x-limit": name}


def documented(schema: dict):
    """The schema documents only ``schema`` (the values served) while the model lets the others
    through to the server, which refuses them with a 400 that says why."""

    def replace(s: dict) -> None:
        s.clear()
        s.update(schema)

    return replace


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


class OpenAIModel(BaseModel):
    """A request body. Strict types (``true`` is not a token id or a count, ``"1"`` not a number);
    fields this server does not know are kept in ``model_extra``, and the server logs that it
    ignored them (as vLLM does)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False  # one last chunk with ``usage`` and no choices
    continuous_usage_stats: bool = False  # vLLM's: accepted; usage comes in the last chunk only


TokenId = integer(ge=0, json_schema_extra=limit("token_id"))
OutputLength = integer(ge=1, json_schema_extra=limit("max_output_tokens"))
TopK = integer(ge=-1)  # vLLM's: 0 or -1 = all tokens (so is k >= the vocabulary)
Seed = integer(ge=0, lt=2**64)
NumCompletions = integer(ge=1, json_schema_extra=limit("max_num_seqs"))
MinTokens = integer(ge=0, json_schema_extra=limit("max_output_tokens"))
Priority = integer()
NumLogprobs = integer(ge=0, le=MAX_LOGPROBS)
BestOf = integer(ge=1, le=1)  # server-side best-of-n is not served (use n)


class SamplingFields(OpenAIModel):
    """What both endpoints share. Values are checked again by the engine's ``SamplingParams``."""

    model: Optional[str] = None  # None: the one model served
    temperature: Optional[float] = Field(None, ge=0.0)  # None: 1.0
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)  # None: 1.0
    top_k: Optional[TopK] = None  # vLLM's extension: 0 or -1 = all tokens
    seed: Optional[Seed] = None
    stop: Optional[Union[str, Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]]] = None
    include_stop_str_in_output: bool = False  # vLLM's extension: the matched stop string ends the text
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[NumCompletions] = 1  # completions of each prompt (they share its KV blocks)
    user: Optional[str] = None  # an end user's id: accepted, not used
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])  # vLLM's
    min_tokens: MinTokens = 0  # vLLM's extension: no stop before this many tokens
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)  # vLLM's extension: None = 0 (no filter)
    skip_special_tokens: bool = True  # vLLM's extension: leave special tokens out of the text
    logit_bias: Optional[
        dict[
            Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,11})$")],  # a token id, as text
            Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])],
        ]
    ] = Field(
        None,
        json_schema_extra=documented(
            _nullable(
                {
                    "type": "object",
                    "propertyNames": limit("token_id_key"),
                    "additionalProperties": {
                        "type": "number",
                        "minimum": LOGIT_BIAS_RANGE[0],
                        "maximum": LOGIT_BIAS_RANGE[1],
                    },
                }
            )
        ),
    )
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens
    stop_token_ids: Optional[list[TokenId]] = None  # vLLM's extension
    return_token_ids: bool = False  # vLLM's extension: choices carry ``token_ids``
    priority: Priority = 0  # vLLM's extension: lower = more urgent (policy="priority")


TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=limit("prompt_tokens"))]
# A text the server reads: longer than the server's max_prompt_chars it cannot fit the context
PromptText = Annotated[str, Field(min_length=1, json_schema_extra=limit("prompt_chars"))]
Text = Annotated[str, Field(json_schema_extra=limit("prompt_chars"))]


class CompletionRequest(SamplingFields):
    # echo with logprobs would need the prompt's logprobs: documented as not served
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"required": ["echo"], "properties": {"echo": {"const": True}}},
                    "then": {"properties": {"logprobs": {"type": "null"}}},
                }
            ]
        }
    )
    # one prompt (text or token ids) or a list of them: choices are numbered across prompts
    prompt: Union[
        PromptText,
        Annotated[list[PromptText], Field(min_length=1)],
        TokenIds,
        Annotated[list[TokenIds], Field(min_length=1)],
    ]
    max_tokens: Optional[OutputLength] = 16  # None: up to the context
    echo: Optional[bool] = False  # the prompt's text starts each choice's text
    logprobs: Optional[NumLogprobs] = None  # top-k logprobs per token (legacy)
    suffix: Optional[Literal[""]] = None  # inserting between a prompt and a suffix is not served
    best_of: Optional[BestOf] = None  # server-side best-of-n is not served (use n)


class TextPart(OpenAIModel):
    """A part of a message's content: text is the one kind served (no images, audio or files)."""

    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIModel):
    """One message. ``name`` follows OpenAI's rule (letters, digits, ``_``, ``-``; up to 64), so it
    cannot carry a line break into the prompt and forge a turn."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[Text, list[TextPart]]] = None
    name: Optional[Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier tool calls (kept as history)
    tool_call_id: Optional[str] = None  # a tool message's answer to that call


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


def _needs_none(tools: str, choice: str) -> dict:
    """JSON Schema: with a non-empty ``tools`` list, ``choice`` must be "none" (the tools are ignored)."""
    return {
        "if": {"required": [tools], "properties": {tools: {"type": "array", "minItems": 1}}},
        "then": {"required": [choice], "properties": {choice: {"const": "none"}}},
    }


class ChatCompletionRequest(SamplingFields):
    # Tool calling is not served: tools are accepted only with tool_choice "none" (then ignored).
    # top_logprobs needs logprobs=true (as OpenAI's API says)
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _needs_none("tools", "tool_choice"),
                _needs_none("functions", "function_call"),
                {
                    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                },
            ]
        }
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[OutputLength] = None  # None: up to the context
    max_completion_tokens: Optional[OutputLength] = None  # OpenAI's newer name for max_tokens
    logprobs: Optional[bool] = False  # logprobs of each output token ...
    top_logprobs: Optional[NumLogprobs] = None  # ... and of the top-k alternatives
    add_generation_prompt: bool = True  # vLLM's extension: end the prompt with the assistant's turn
    # OpenAI fields clients send by default: the schema documents the values served (the neutral
    # ones); any other value gets a 400 that says why (``OpenAIServing.check_honoured``)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = Field(
        None, json_schema_extra=documented(_nullable({"enum": ["none", "auto"]}))
    )
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None  # the older form of tools
    function_call: Optional[Union[Literal["none", "auto"], dict[str, Any]]] = Field(
        None, json_schema_extra=documented(_nullable({"enum": ["none", "auto"]}))
    )
    response_format: Optional[ResponseFormat] = Field(
        None,
        json_schema_extra=documented(
            _nullable({"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]})
        ),
    )
    metadata: Optional[dict[str, str]] = None  # kept by nobody: accepted
    store: Optional[bool] = Field(None, json_schema_extra=documented(_nullable({"const": False})))
    modalities: Optional[list[Literal["text", "audio"]]] = Field(
        None, json_schema_extra=documented(_nullable({"type": "array", "items": {"const": "text"}}))
    )
    audio: Optional[dict[str, Any]] = Field(None, json_schema_extra=documented({"type": "null"}))
    prediction: Optional[dict[str, Any]] = Field(None, json_schema_extra=documented({"type": "null"}))
    reasoning_effort: Optional[str] = Field(None, json_schema_extra=documented({"type": "null"}))
    service_tier: Optional[str] = Field(None, json_schema_extra=documented(_nullable({"enum": ["auto", "default"]})))
    web_search_options: Optional[dict[str, Any]] = Field(None, json_schema_extra=documented({"type": "null"}))


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
    stop_reason: Optional[Union[int, str]] = None  # vLLM's: the stop string or token id that ended it
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
    stop_reason: Optional[Union[int, str]] = None  # vLLM's: the stop string or token id that ended it
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
    stop_reason: Optional[Union[int, str]] = None  # vLLM's: the stop string or token id that ended it
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
    root: Optional[str] = None  # the checkpoint directory
    max_model_len: Optional[int] = None


class TokenizeCompletionRequest(OpenAIModel):
    """vLLM's ``/tokenize`` of a prompt (encoded as the engine encodes prompts: no special tokens)."""

    model: Optional[str] = None
    prompt: Text
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    """vLLM's ``/tokenize`` of chat messages, rendered by the chat template."""

    model: Optional[str] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


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
