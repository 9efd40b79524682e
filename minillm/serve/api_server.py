"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM``.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (streaming as server-sent events),
``/v1/models``, ``/v1/models/{id}``, ``/health``, ``/metrics``, ``/version``, and vLLM's
``/tokenize`` and ``/detokenize``. Named after vLLM's ``entrypoints/openai/api_server.py``.

Every error a client can cause is answered with OpenAI's error body and a 4xx status: malformed
JSON or a bad field 400 (the OpenAPI schema says 400 too, not FastAPI's 422), a wrong API key
401, an unknown model or route 404, a body over ``max_request_bytes`` 413; the engine's own
checks (``SamplingParams``, ``add_request``) raise ValueError, passed through as 400 with their
message. A request the engine's admission control rejects (``max_queue_len``, ``max_queue_delay``)
gets 503 with the engine's reason. A streamed response is decided (200 or an error) when its
first token or its rejection comes back, so a rejection is never a broken stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..async_llm import AsyncLLM, EngineDeadError, StreamOutput
from ..sampling_params import SamplingParams
from . import chat
from .metrics import PrometheusStatLogger
from .protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    VersionResponse,
)

logger = logging.getLogger(__name__)

# The largest request body read (--max-request-bytes): a prompt of a 128k context's token ids in
# JSON is about 1 MB; a text that long is refused before tokenizing anyway (max_prompt_chars).
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: Optional[str] = None,
    code: Optional[Union[str, int]] = None,
    headers: Optional[dict] = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _param_of(message: str) -> Optional[str]:
    """The request field an engine error names: ``SamplingParams.max_tokens=-1: ...`` -> max_tokens."""
    m = re.match(r"SamplingParams\.(\w+)", message)
    if m:
        return m.group(1)
    if message.startswith("prompt"):
        return "prompt"
    if "max_tokens" in message:
        return "max_tokens"
    return None


def bad_request(e: Exception) -> APIError:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return APIError(400, msg, param=_param_of(msg))


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every ``/v1`` route (plain ASGI, so streams pass untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                resp = error_response(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """A request body over ``max_bytes`` is answered 413 before anything parses it: at once by its
    ``Content-Length``, or as soon as a chunked body grows past the limit (plain ASGI)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def refusal(self, size: str) -> JSONResponse:
        return error_response(
            413,
            f"Request body of {size} bytes is over this server's limit of {self.max_bytes} bytes (--max-request-bytes)",
            code="request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.refusal(declared.decode())(scope, receive, send)
            return
        seen, over = 0, False

        async def counted_receive():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request" and not over:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # the app gets an empty end of body; its answer is replaced
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message):
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await self.refusal(f"more than {self.max_bytes}")(scope, receive, send)

        await self.app(scope, counted_receive, guarded_send)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` decodes to."""
    vocab = len(tokenizer)
    return max(1, max(len(t) for t in tokenizer.batch_decode([[i] for i in range(vocab)])))


class OpenAIServing:
    """What the routes share: the engine, the model's names, turning requests into engine calls.

    Text is tokenized (and chat templates rendered) on a thread of its own, never on the event loop
    (which answers /health and feeds the streams) nor on the engine thread (which steps the batch).
    A text longer than ``max_prompt_chars`` is refused before it is tokenized: no token decodes to
    more than ``longest_token_chars`` characters, so such a text cannot fit the context."""

    def __init__(self, llm: AsyncLLM, model_name: str, model_path: Optional[str] = None):
        self.llm = llm
        self.model_name = model_name
        self.model_path = model_path
        self.max_model_len = llm.engine.config.max_model_len
        self.vocab_size = llm.engine.vocab_size
        # the longest a request may grow when it names no max_tokens: the context, or the whole KV cache
        self.default_len = min(self.max_model_len, llm.engine.num_kv_blocks * llm.engine.config.block_size)
        tok = llm.tokenizer
        self.longest_token_chars = longest_token_chars(tok) if tok is not None else 1
        # x2: room for a normaliser that joins characters (a letter and its combining accent)
        self.max_prompt_chars = 2 * self.longest_token_chars * (self.max_model_len - 1)
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenize")

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.model_name, self.model_path):
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}' (GET /v1/models)",
                "not_found_error",
                "model",
                "model_not_found",
            )

    @staticmethod
    def warn_ignored(req: Any) -> None:
        """Fields no OpenAI or vLLM request has are accepted and named in the log (as vLLM does)."""
        names = sorted(req.model_extra or {})
        for i, m in enumerate(getattr(req, "messages", None) or ()):
            names += [f"messages[{i}].{k}" for k in sorted(m.model_extra or {})]
        if names:
            logger.warning("The following fields were present in the request but ignored: %s", names)

    @staticmethod
    def check_honoured(req: ChatCompletionRequest) -> None:
        """OpenAI's chat fields at a value this server cannot honour: a 400 that says so.
        Neutral values (no tools or tool_choice "none", response_format text, store false, text
        modality) are what the server does anyway."""

        def refuse(param: str, why: str):
            value = getattr(req, param)
            shown = f" type {value.type!r}" if param == "response_format" else f"={value!r}"
            raise APIError(400, f"{param}{shown}: {why}", param=param)

        for tools_field, choice_field in (("tools", "tool_choice"), ("functions", "function_call")):
            choice = getattr(req, choice_field)
            if isinstance(choice, dict) or choice == "required":
                refuse(choice_field, "this server does not call tools (no tool-call parser); send 'none' or 'auto'")
            if getattr(req, tools_field) and choice != "none":
                refuse(
                    tools_field,
                    "this server does not call tools (no tool-call parser); with "
                    f"{choice_field}='none' the tools are ignored",
                )
        if req.response_format is not None and req.response_format.type != "text":
            refuse("response_format", "structured output (JSON) is not served; only {'type': 'text'}")
        if req.store:
            refuse("store", "this server stores no completions; send false or leave it out")
        if req.modalities is not None and set(req.modalities) - {"text"}:
            refuse("modalities", "this server answers in text only; send ['text']")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(req, name) is not None:
                refuse(name, "not supported by this server")
        if req.service_tier not in (None, "auto", "default"):
            refuse("service_tier", "this server has one tier; send 'auto' or 'default'")

    @staticmethod
    def sampling_params(req: Any, max_tokens: int, stop: list[str], logprobs: Optional[int] = None) -> SamplingParams:
        """The request's ``SamplingParams`` (OpenAI's null is the default; vLLM's top_k=-1 is all
        tokens); ``stop``: its stop strings (the engine ends the text there)."""

        def given(value, default):
            return default if value is None else value

        try:
            return SamplingParams(
                temperature=given(req.temperature, 1.0),
                top_k=max(0, given(req.top_k, 0)),
                top_p=given(req.top_p, 1.0),
                max_tokens=max_tokens,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
                stop=stop,
                include_stop_str_in_output=req.include_stop_str_in_output,
                stop_token_ids=list(req.stop_token_ids or ()),
                n=given(req.n, 1),
                presence_penalty=given(req.presence_penalty, 0.0),
                frequency_penalty=given(req.frequency_penalty, 0.0),
                repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens,
                min_p=given(req.min_p, 0.0),
                skip_special_tokens=req.skip_special_tokens,
                logprobs=logprobs,
                logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None,
            )
        except (ValueError, TypeError) as e:
            raise bad_request(e) from None

    def token_text(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def completion_logprobs(self, outs: list[StreamOutput], offset: int = 0) -> Optional[CompletionLogprobs]:
        """OpenAI's legacy logprobs of the tokens in ``outs`` (text offsets from ``offset``)."""
        if not outs or outs[0].logprobs is None:
            return None
        lp = CompletionLogprobs()
        for out in outs:
            for tok, pos in zip(out.token_ids, out.logprobs or ()):
                text = self.token_text(tok)
                lp.tokens.append(text)
                lp.token_logprobs.append(pos[tok].logprob)
                lp.top_logprobs.append({self.token_text(t): v.logprob for t, v in pos.items()})
                lp.text_offset.append(offset)
                offset += len(text)
        return lp

    def chat_logprobs(self, outs: list[StreamOutput], top: int) -> Optional[ChatLogprobs]:
        """OpenAI's chat logprobs: each token, its logprob and the ``top`` most likely alternatives."""
        if not outs or outs[0].logprobs is None:
            return None
        content = []
        for out in outs:
            for tok, pos in zip(out.token_ids, out.logprobs or ()):

                def entry(t, v):
                    text = self.token_text(t)
                    return dict(token=text, logprob=v.logprob, bytes=list(text.encode()))

                best = sorted(pos.items(), key=lambda kv: kv[1].rank)[:top]
                content.append(
                    ChatTokenLogprob(**entry(tok, pos[tok]), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in best])
                )
        return ChatLogprobs(content=content)

    @staticmethod
    def stop_strings(req: Any) -> list[str]:
        stop = req.stop
        return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)

    async def start(
        self, prompt: list[int], sp: SamplingParams, priority: int, request_id: str
    ) -> tuple[AsyncIterator[StreamOutput], StreamOutput]:
        """Add the request; wait for its first output (a token, or a rejection).
        Returns (the rest of the stream, the first output)."""
        gen = self.llm.generate(prompt, sp, request_id, priority=priority)
        try:
            first = await gen.__anext__()
        except (ValueError, TypeError, KeyError) as e:
            raise bad_request(e) from None
        except EngineDeadError as e:
            raise APIError(500, str(e), "server_error") from None
        if first.finish_reason == "rejected":
            await gen.aclose()
            raise APIError(
                503,
                f"Server overloaded, request rejected: {first.finish_detail}",
                "server_overloaded",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        return gen, first

    def max_tokens(self, requested: Optional[int], num_prompt_tokens: int, what: str) -> int:
        """The output tokens a request may have: ``requested``, if the prompt and it fit the context
        (else 400, in OpenAI's and vLLM's words); None: up to the context or what the KV cache holds."""
        limit = self.max_model_len
        param = "prompt" if what == "prompt" else "messages"
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens (max_model_len). "
                f"However, your {what} has {num_prompt_tokens} tokens, which leaves no room for "
                "an output token. Please reduce its length.",
                param=param,
            )
        if requested is None:  # the engine says if even the KV cache cannot hold it
            return max(1, self.default_len - num_prompt_tokens)
        if num_prompt_tokens + requested > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens (max_model_len). "
                f"However, you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} "
                f"in the {what}, {requested} in the completion). Please reduce the length of the "
                f"{what} or completion.",
                param="max_tokens",
            )
        return requested

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text too long to fit the context in any tokenization."""
        if num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param}: {num_chars} characters cannot fit this model's maximum context "
                f"length of {self.max_model_len} tokens (max_model_len): no token is longer than "
                f"{self.longest_token_chars} characters; at most {self.max_prompt_chars} characters "
                "are read",
                param=param,
                code="context_length_exceeded",
            )

    def tokenizer(self, param: str):
        if self.llm.tokenizer is None:
            raise APIError(400, f"{param}: text needs a tokenizer and this model has none; send token ids", param=param)
        return self.llm.tokenizer

    async def off_loop(self, fn, *args):
        """``fn(*args)`` on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        """Text to token ids as the engine encodes a prompt, on the tokenizer's thread."""
        tok = self.tokenizer(param)
        self.check_chars(len(text), param)
        return await self.off_loop(lambda: tok.encode(text, add_special_tokens=add_special_tokens))

    async def prompt_ids(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return await self.encode(prompt)
        for i, t in enumerate(prompt):
            if t >= self.vocab_size:
                raise APIError(
                    400, f"prompt[{i}]={t}: token id outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
        return prompt

    async def render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool
    ) -> tuple[list[int], Optional[list[str]]]:
        """The conversation's prompt as token ids and its default stop strings, on the tokenizer's thread."""
        tok = self.tokenizer("messages")
        dicts = [m.model_dump(exclude_none=True) for m in messages]
        self.check_chars(sum(len(str(m.get("content", ""))) for m in dicts), "messages")

        def render():
            text, stop = chat.render(tok, dicts, add_generation_prompt)
            self.check_chars(len(text), "messages")
            return tok.encode(text, add_special_tokens=False), stop

        try:
            return await self.off_loop(render)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages") from None

    def shutdown(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


def _prompts(prompt: Any) -> list[Union[str, list[int]]]:
    """OpenAI's prompt forms: a string, token ids, or a list of either (several prompts)."""
    if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def random_request_id() -> str:
    """A request id no restart repeats (vLLM's ``random_uuid``)."""
    return secrets.token_hex(16)


def _sse(obj: Any) -> str:
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


class _Completion:
    """One completion of a request answered whole: its text, token ids and outputs."""

    def __init__(self):
        self.text, self.ids, self.outs = "", [], []

    def add(self, out: StreamOutput) -> None:
        self.text += out.text
        self.ids += out.token_ids
        self.outs.append(out)

    @property
    def last(self) -> StreamOutput:
        return self.outs[-1]


async def _collect(first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> list[_Completion]:
    """Every output of the request, gathered per completion (``StreamOutput.index``), by index."""
    got: dict[int, _Completion] = {}
    got.setdefault(first.index, _Completion()).add(first)
    async for out in gen:  # the generator ends when every completion has finished
        got.setdefault(out.index, _Completion()).add(out)
    return [got[i] for i in sorted(got)]


async def _until_disconnect(request: Request, coro):
    """Run ``coro``; if the client goes away first, cancel it (its request is aborted)."""

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work not in done:
        work.cancel()
        return Response(status_code=499)  # nobody is listening
    return work.result()


# The error answers each route may give, for the OpenAPI schema (a bad body is 400, never 422).
def _errors(*statuses: int) -> dict:
    words = {
        400: "A bad request: malformed JSON, a wrong field, a value the engine refuses",
        401: "A wrong or missing API key (--api-key)",
        404: "An unknown model",
        413: "A body over --max-request-bytes",
        500: "The engine failed",
        503: "Overloaded: the engine's admission control rejected the request",
    }
    return {code: {"model": ErrorResponse, "description": words[code]} for code in statuses}


# stream=true: server-sent events, each 'data: {chunk as JSON}', the last 'data: [DONE]'
_SSE = {
    "text/event-stream": {
        "schema": {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    }
}


def build_app(
    llm: AsyncLLM,
    model_name: str,
    model_path: Optional[str] = None,
    api_key: Optional[str] = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI application. Its lifespan starts and stops ``llm``'s step loop."""
    serving = OpenAIServing(llm, model_name, model_path)
    stats = PrometheusStatLogger(model_name)
    llm.stat_loggers.append(stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        yield
        await llm.shutdown()
        serving.shutdown()

    app = FastAPI(title="minillm", version=__version__, lifespan=lifespan)
    app.state.llm, app.state.serving, app.state.stats = llm, serving, stats
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    v1 = _errors(400, 404, 413, 500, 503) | (_errors(401) if api_key else {})
    plain = _errors(400, 413)

    # --- errors: always OpenAI's body, never a bare 500 for a client's mistake -----------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(
                400, f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", code="invalid_json"
            )

        def one(err: dict) -> str:  # "field=value: why", the value when it is short
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            value = err.get("input")
            shown = (
                f"={value!r}"
                if isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= 40)
                else ""
            )
            return f"{where}{shown}: {err.get('msg')}"

        msg = "; ".join(one(err) for err in errors[:5])
        return error_response(400, msg, param=loc[0] if loc else None)  # the request's field

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}: {e}", "server_error")

    # --- routes --------------------------------------------------------------------------------
    @app.get("/health", responses=_errors(503))
    async def health():
        if not llm.is_running or llm.dead is not None:
            return error_response(503, "the engine is not running", "server_error")
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus' text format (version 0.0.4)",
            }
        },
    )
    async def metrics():
        if llm.is_running:
            stats.set_load(await llm.load())
        return Response(stats.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=__version__)

    def card() -> ModelCard:
        return ModelCard(id=model_name, root=model_path, max_model_len=serving.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=v1)
    async def models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=v1)
    async def model(model_id: str):
        serving.check_model(model_id)
        return card()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=plain | _errors(404))
    async def tokenize(req: Union[TokenizeCompletionRequest, TokenizeChatRequest]):
        """vLLM's ``/tokenize``: a prompt (encoded as the engine encodes prompts), or chat messages
        through the chat template."""
        serving.check_model(req.model)
        serving.warn_ignored(req)
        if isinstance(req, TokenizeChatRequest):
            ids, _ = await serving.render_chat(req.messages, req.add_generation_prompt)
        else:
            ids = await serving.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = llm.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=plain | _errors(404))
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        serving.warn_ignored(req)
        tok = serving.tokenizer("tokens")
        for i, t in enumerate(req.tokens):
            if t >= serving.vocab_size:
                raise APIError(
                    400, f"tokens[{i}]={t}: token id outside the vocabulary [0, {serving.vocab_size})", param="tokens"
                )
        return DetokenizeResponse(prompt=await serving.off_loop(tok.decode, req.tokens))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=v1 | {200: {"content": _SSE}})
    async def completions(req: CompletionRequest, request: Request):
        serving.check_model(req.model)
        serving.warn_ignored(req)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo=true with logprobs (the prompt's logprobs) is not served", param="echo")
        given = _prompts(req.prompt)
        prompts = [await serving.prompt_ids(p) for p in given]
        n = req.n or 1
        stop = serving.stop_strings(req)
        sps = [
            serving.sampling_params(
                req, serving.max_tokens(req.max_tokens, len(ids), "prompt"), stop, logprobs=req.logprobs
            )
            for ids in prompts
        ]
        # echo: the prompt's text starts each of its choices' text
        echoed = (
            [p if isinstance(p, str) else await serving.off_loop(serving.tokenizer("prompt").decode, p) for p in given]
            if req.echo
            else [""] * len(prompts)
        )

        def choice(index: int, text: str, out: StreamOutput, ids, logprobs) -> CompletionChoice:
            return CompletionChoice(
                index=index,
                text=text,
                finish_reason=out.finish_reason,
                token_ids=ids,
                stop_reason=out.stop_reason,
                logprobs=logprobs,
            )

        return await _respond(
            serving,
            request,
            req,
            prompts,
            sps,
            "cmpl",
            first_chunks=lambda rid: (
                [
                    CompletionResponse(
                        id=rid,
                        model=model_name,
                        choices=[
                            CompletionChoice(index=i * n + j, text=echoed[i])
                            for i in range(len(prompts))
                            for j in range(n)
                        ],
                    )
                ]
                if req.echo
                else []
            ),
            chunk=lambda rid, index, out, ids: CompletionResponse(
                id=rid,
                model=model_name,
                choices=[choice(index, out.text, out, ids, serving.completion_logprobs([out]))],
            ),
            usage_chunk=lambda rid, usage: CompletionResponse(id=rid, model=model_name, choices=[], usage=usage),
            whole=lambda rid, done, keep_ids, usage: CompletionResponse(
                id=rid,
                model=model_name,
                choices=[
                    choice(
                        i,
                        echoed[i // n] + c.text,
                        c.last,
                        c.ids if keep_ids else None,
                        serving.completion_logprobs(c.outs),
                    )
                    for i, c in enumerate(done)
                ],
                usage=usage,
            ),
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=v1 | {200: {"content": _SSE}})
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        serving.check_model(req.model)
        serving.warn_ignored(req)
        serving.check_honoured(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs} needs logprobs=true", param="top_logprobs")
        top = req.top_logprobs or 0
        ids, default_stop = await serving.render_chat(req.messages, req.add_generation_prompt)
        if req.max_completion_tokens is not None and req.max_tokens is not None:  # both must fit
            serving.max_tokens(req.max_tokens, len(ids), "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = serving.max_tokens(requested, len(ids), "messages")
        stop = serving.stop_strings(req) if req.stop is not None else (default_stop or [])
        sp = serving.sampling_params(req, max_tokens, stop, logprobs=top if req.logprobs else None)
        return await _respond(
            serving,
            request,
            req,
            [ids],
            [sp],
            "chatcmpl",
            first_chunks=lambda rid: [
                ChatCompletionChunk(
                    id=rid,
                    model=model_name,
                    choices=[
                        ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(sp.n)
                    ],
                )
            ],
            chunk=lambda rid, index, out, ids: ChatCompletionChunk(
                id=rid,
                model=model_name,
                choices=[
                    ChatStreamChoice(
                        index=index,
                        delta=DeltaMessage(content=out.text),
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        token_ids=ids,
                        logprobs=serving.chat_logprobs([out], top),
                    )
                ],
            ),
            usage_chunk=lambda rid, usage: ChatCompletionChunk(id=rid, model=model_name, choices=[], usage=usage),
            whole=lambda rid, done, keep_ids, usage: ChatCompletionResponse(
                id=rid,
                model=model_name,
                choices=[
                    ChatChoice(
                        index=i,
                        message=ChatResponseMessage(content=c.text),
                        finish_reason=c.last.finish_reason,
                        stop_reason=c.last.stop_reason,
                        token_ids=c.ids if keep_ids else None,
                        logprobs=serving.chat_logprobs(c.outs, top),
                    )
                    for i, c in enumerate(done)
                ],
                usage=usage,
            ),
        )

    def openapi() -> dict:
        """FastAPI's schema, less the 422 it documents for every body: this server answers 400."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            document_limits(schema, serving)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def integer_pattern(n: int) -> str:
    """A regular expression for the decimal integers 0..n (no leading zeros): 1023 ->
    ``^(?:0|[1-9][0-9]{0,2}|[1-9]...|1023)$``, digit by digit."""
    digits = str(n)
    alts = ["0"] + ([f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else [])
    for i, c in enumerate(digits):  # the same length as n: equal up to i, smaller at i
        low = 1 if i == 0 else 0
        if int(c) > low:
            alts.append(digits[:i] + f"[{low}-{int(c) - 1}]" + "[0-9]" * (len(digits) - i - 1))
    alts.append(digits)
    return "^(?:" + "|".join(alts) + ")$"


def document_limits(schema: Any, serving: OpenAIServing) -> None:
    """Write the served model's bounds into the schema where a field is marked ``protocol.limit``:
    a token id below the vocabulary size, n up to max_num_seqs, a prompt and an output shorter than
    the context, a text no longer than ``max_prompt_chars``. What JSON Schema cannot say (a
    prompt's token count plus max_tokens within the context, min_tokens <= max_tokens) is a 400."""
    bounds = {
        "token_id": ("maximum", serving.vocab_size - 1),
        "token_id_key": ("pattern", integer_pattern(serving.vocab_size - 1)),  # logit_bias's keys
        "max_num_seqs": ("maximum", serving.llm.engine.config.max_num_seqs),
        "max_output_tokens": ("maximum", serving.max_model_len - 1),
        "prompt_tokens": ("maxItems", serving.max_model_len - 1),
        "prompt_chars": ("maxLength", serving.max_prompt_chars),
    }
    if isinstance(schema, dict):
        name = schema.pop("x-limit", None)
        if name is not None:
            keyword, value = bounds[name]
            schema[keyword] = value
        for value in schema.values():
            document_limits(value, serving)
    elif isinstance(schema, list):
        for value in schema:
            document_limits(value, serving)


async def _start_all(
    serving: OpenAIServing, prompts: list[list[int]], sps: list[SamplingParams], priority: int, request_ids: list[str]
) -> list[tuple[AsyncIterator[StreamOutput], StreamOutput]]:
    """Start every prompt's request; if one is refused, the others are aborted and its error raised."""
    started = await asyncio.gather(
        *(serving.start(p, sp, priority, rid) for p, sp, rid in zip(prompts, sps, request_ids)), return_exceptions=True
    )
    errors = [r for r in started if isinstance(r, BaseException)]
    if errors:
        for r in started:
            if not isinstance(r, BaseException):
                await r[0].aclose()
        raise errors[0]
    return started


async def _merge(streams: list[AsyncIterator[StreamOutput]]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """The outputs of several streams as they come, each with its stream's position; closing
    this closes (aborts) every stream."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StreamOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _respond(
    serving: OpenAIServing,
    request: Request,
    req: Any,
    prompts: list[list[int]],
    sps: list[SamplingParams],
    id_prefix: str,
    *,
    chunk,
    usage_chunk,
    whole,
    first_chunks,
):
    """One request (one or more prompts, each with ``n`` completions), streamed as server-sent events
    or answered whole. The builders make the endpoint's bodies: ``chunk(id, choice index, output,
    token_ids)``, ``usage_chunk(id, usage)``, ``whole(id, completions, keep_token_ids, usage)``,
    ``first_chunks(id)`` (chat's role chunks, completions' echo). Choice ``j`` of prompt ``i`` is
    index ``i * n + j``; the chunks of all choices interleave, each with its index.
    The response id is random (``cmpl-<hex>``); the engine's request id is the hex part, or for
    several prompts ``<hex>-<i>``."""
    keep_ids = bool(req.return_token_ids)
    n = sps[0].n
    rid = random_request_id()
    request_ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    response_id = f"{id_prefix}-{rid}"

    def usage(completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prompts)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    if not req.stream:

        async def answer():
            started = await _start_all(serving, prompts, sps, req.priority, request_ids)
            results = await asyncio.gather(*(_collect(first, gen) for gen, first in started))
            done = [c for completions in results for c in completions]
            return whole(response_id, done, keep_ids, usage(sum(c.last.num_output_tokens for c in done)))

        return await _until_disconnect(request, answer())

    started = await _start_all(serving, prompts, sps, req.priority, request_ids)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        for c in first_chunks(response_id):
            yield _sse(c)
        last: dict[int, StreamOutput] = {}
        async for i, out in _merge([_achain(first, gen) for gen, first in started]):
            index = i * n + out.index
            last[index] = out
            yield _sse(chunk(response_id, index, out, out.token_ids if keep_ids else None))
        if include_usage and last:
            yield _sse(usage_chunk(response_id, usage(sum(out.num_output_tokens for out in last.values()))))
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        sse_stream(events()), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _achain(first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> AsyncIterator[StreamOutput]:
    """The first output, then the rest of the stream; closing this closes (aborts) the stream.
    If the engine fails mid-stream, the stream ends with an error event (the status is sent)."""
    try:
        yield first
        async for out in gen:  # ends when every completion has finished
            yield out
    except EngineDeadError as e:
        raise _StreamError(str(e)) from None
    finally:
        await gen.aclose()


class _StreamError(Exception):
    pass


async def sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events; an engine failure mid-stream becomes a last ``data: {"error": ...}``."""
    try:
        async for chunk in chunks:
            yield chunk
    except _StreamError as e:
        body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error"))
        yield f"data: {body.model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"
