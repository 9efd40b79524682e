"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLM``.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (streaming as server-sent events),
``/v1/models``, ``/health``, ``/metrics``. Named after vLLM's ``entrypoints/openai/api_server.py``.

Every error a client can cause is answered with OpenAI's error body and a 4xx status: malformed
JSON or a bad field 400, a wrong API key 401, an unknown model or route 404; the engine's own
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
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_llm import AsyncLLM, EngineDeadError, StreamOutput
from ..sampling_params import SamplingParams
from . import chat
from .metrics import PrometheusStatLogger
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                       ChatTokenLogprob, CompletionLogprobs, TopLogprob,
                       ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionRequest,
                       CompletionResponse, DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                       UsageInfo)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _param_of(message: str) -> Optional[str]:
    """The request field an engine error names: ``SamplingParams.max_tokens=-1: ...`` -> max_tokens."""
    m = re.match(r"SamplingParams\.(\w+)=", message)
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
                resp = error_response(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                                      "authentication_error", code="invalid_api_key")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServing:
    """What the routes share: the engine, the model's names, turning requests into engine calls."""

    def __init__(self, llm: AsyncLLM, model_name: str, model_path: Optional[str] = None):
        self.llm = llm
        self.model_name = model_name
        self.model_path = model_path
        self.max_model_len = llm.engine.config.max_model_len
        # the longest a request may grow when it names no max_tokens: the context, or the whole KV cache
        self.default_len = min(self.max_model_len, llm.engine.num_kv_blocks * llm.engine.config.block_size)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.model_name, self.model_path):
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{self.model_name}' (GET /v1/models)", "not_found_error", "model",
                           "model_not_found")

    @staticmethod
    def unsupported(req: Any, fields: dict) -> None:
        """Fields accepted only at their neutral value: anything else is a clear 400."""
        for name, neutral in fields.items():
            v = getattr(req, name, neutral)
            if v not in neutral if isinstance(neutral, tuple) else v != neutral:
                raise APIError(400, f"{name}={v!r} is not supported by this server", param=name)

    @staticmethod
    def sampling_params(req: Any, max_tokens: int, stop: list[str],
                        logprobs: Optional[int] = None) -> SamplingParams:
        """The request's ``SamplingParams``; ``stop``: its stop strings (the engine ends the text there)."""
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                  max_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos,
                                  stop=stop, include_stop_str_in_output=req.include_stop_str_in_output,
                                  stop_token_ids=list(req.stop_token_ids), n=req.n,
                                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                                  logprobs=logprobs)
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
                content.append(ChatTokenLogprob(**entry(tok, pos[tok]),
                                                top_logprobs=[TopLogprob(**entry(t, v)) for t, v in best]))
        return ChatLogprobs(content=content)

    @staticmethod
    def stop_strings(req: Any) -> list[str]:
        stop = req.stop
        stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        if len(stop) > 4:
            raise APIError(400, f"stop: at most 4 sequences, got {len(stop)}", param="stop")
        return stop

    async def start(self, prompt: Union[str, list[int]], sp: SamplingParams,
                    priority: int) -> tuple[AsyncIterator[StreamOutput], StreamOutput]:
        """Add the request; wait for its first output (a token, or a rejection).
        Returns (the rest of the stream, the first output)."""
        gen = self.llm.generate(prompt, sp, priority=priority)
        try:
            first = await gen.__anext__()
        except (ValueError, TypeError, KeyError) as e:
            raise bad_request(e) from None
        except EngineDeadError as e:
            raise APIError(500, str(e), "server_error") from None
        if first.finish_reason == "rejected":
            await gen.aclose()
            raise APIError(503, f"Server overloaded, request rejected: {first.finish_detail}",
                           "server_overloaded", code="queue_full", headers={"Retry-After": "1"})
        return gen, first

    def max_tokens(self, requested: Optional[int], num_prompt_tokens: Optional[int]) -> int:
        if requested is not None:
            return requested
        # None: up to the context length, or what the KV cache holds (the engine says if even that cannot fit)
        return max(1, self.default_len - (num_prompt_tokens or 0))

    def count_tokens(self, prompt: Union[str, list[int]]) -> Optional[int]:
        if isinstance(prompt, list):
            return len(prompt)
        tok = self.llm.tokenizer
        return len(tok.encode(prompt, add_special_tokens=False)) if tok is not None else None


def _one_prompt(prompt: Any) -> Union[str, list[int]]:
    """OpenAI's prompt forms: a string, token ids, or a list of one of them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: {len(prompt)} prompts in one request; this server takes one "
                           "per request (send them concurrently)", param="prompt")
        return prompt[0]
    return prompt


def _usage(lasts: list[StreamOutput]) -> UsageInfo:
    """Usage of one request: its prompt once, the output tokens of all its completions."""
    prompt = lasts[0].num_prompt_tokens
    completion = sum(out.num_output_tokens for out in lasts)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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
    async for out in gen:        # the generator ends when every completion has finished
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
        return Response(status_code=499)       # nobody is listening
    return work.result()


def build_app(llm: AsyncLLM, model_name: str, model_path: Optional[str] = None,
              api_key: Optional[str] = None) -> FastAPI:
    """The FastAPI application. Its lifespan starts and stops ``llm``'s step loop."""
    serving = OpenAIServing(llm, model_name, model_path)
    stats = PrometheusStatLogger(model_name)
    llm.stat_loggers.append(stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await llm.start()
        yield
        await llm.shutdown()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.llm, app.state.serving, app.state.stats = llm, serving, stats
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

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
            return error_response(400, f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                                  code="invalid_json")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"Unrecognized request argument supplied: {'.'.join(loc)}",
                                  param=".".join(loc) or None)
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{err.get('msg')}" for err in errors[:5])
        return error_response(400, msg, param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"Internal server error: {type(e).__name__}: {e}", "server_error")

    # --- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not llm.is_running or llm.dead is not None:
            return error_response(503, "the engine is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if llm.is_running:
            stats.set_load(await llm.load())
        return Response(stats.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name, root=model_path, max_model_len=serving.max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        serving.check_model(req.model)
        serving.unsupported(req, {"echo": False, "suffix": None, "best_of": (None, 1), "logit_bias": (None, {})})
        prompt = _one_prompt(req.prompt)
        max_tokens = serving.max_tokens(req.max_tokens, serving.count_tokens(prompt)
                                        if req.max_tokens is None else None)
        sp = serving.sampling_params(req, max_tokens, serving.stop_strings(req), logprobs=req.logprobs)
        return await _respond(
            serving, request, req, prompt, sp, "cmpl",
            chunk=lambda rid, out, ids: CompletionResponse(id=rid, model=model_name, choices=[
                CompletionChoice(index=out.index, text=out.text, finish_reason=out.finish_reason, token_ids=ids,
                                 stop_reason=out.stop_reason, logprobs=serving.completion_logprobs([out]))]),
            usage_chunk=lambda rid, usage: CompletionResponse(id=rid, model=model_name, choices=[], usage=usage),
            whole=lambda rid, done, keep_ids: CompletionResponse(id=rid, model=model_name, choices=[
                CompletionChoice(index=i, text=c.text, finish_reason=c.last.finish_reason,
                                 stop_reason=c.last.stop_reason, token_ids=c.ids if keep_ids else None,
                                 logprobs=serving.completion_logprobs(c.outs))
                for i, c in enumerate(done)], usage=_usage([c.last for c in done])))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        serving.check_model(req.model)
        serving.unsupported(req, {"logit_bias": (None, {})})
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, f"top_logprobs={req.top_logprobs} needs logprobs=true", param="top_logprobs")
        top = req.top_logprobs or 0
        try:
            prompt, default_stop = chat.render(llm.tokenizer, [m.model_dump(exclude_none=True)
                                                               for m in req.messages], req.add_generation_prompt)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages") from None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = serving.max_tokens(requested, serving.count_tokens(prompt) if requested is None else None)
        stop = serving.stop_strings(req) if req.stop is not None else (default_stop or [])
        sp = serving.sampling_params(req, max_tokens, stop, logprobs=top if req.logprobs else None)
        return await _respond(
            serving, request, req, prompt, sp, "chatcmpl",
            first_chunk=lambda rid: ChatCompletionChunk(id=rid, model=model_name, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(sp.n)]),
            chunk=lambda rid, out, ids: ChatCompletionChunk(id=rid, model=model_name, choices=[
                ChatStreamChoice(index=out.index, delta=DeltaMessage(content=out.text),
                                 finish_reason=out.finish_reason, stop_reason=out.stop_reason, token_ids=ids,
                                 logprobs=serving.chat_logprobs([out], top))]),
            usage_chunk=lambda rid, usage: ChatCompletionChunk(id=rid, model=model_name, choices=[], usage=usage),
            whole=lambda rid, done, keep_ids: ChatCompletionResponse(id=rid, model=model_name, choices=[
                ChatChoice(index=i, message=ChatResponseMessage(content=c.text), finish_reason=c.last.finish_reason,
                           stop_reason=c.last.stop_reason, token_ids=c.ids if keep_ids else None,
                           logprobs=serving.chat_logprobs(c.outs, top))
                for i, c in enumerate(done)], usage=_usage([c.last for c in done])))

    return app


async def _respond(serving: OpenAIServing, request: Request, req: Any, prompt, sp: SamplingParams,
                   id_prefix: str, *, chunk, usage_chunk, whole, first_chunk=None):
    """One request, streamed as server-sent events or answered whole. The builders make the
    endpoint's bodies: ``chunk(id, output, token_ids)``, ``usage_chunk(id, usage)``,
    ``whole(id, completions, keep_token_ids)``, ``first_chunk(id)`` (chat's role chunks). A request
    with ``n`` completions streams their chunks interleaved, each with its choice index."""
    keep_ids = bool(req.return_token_ids)
    if not req.stream:
        async def answer():
            gen, first = await serving.start(prompt, sp, req.priority)
            done = await _collect(first, gen)
            return whole(f"{id_prefix}-{first.request_id}", done, keep_ids)
        return await _until_disconnect(request, answer())

    gen, first = await serving.start(prompt, sp, req.priority)
    rid = f"{id_prefix}-{first.request_id}"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        if first_chunk is not None:
            yield _sse(first_chunk(rid))
        last: dict[int, StreamOutput] = {}
        async for out in _achain(first, gen):
            last[out.index] = out
            yield _sse(chunk(rid, out, out.token_ids if keep_ids else None))
        if include_usage and last:
            yield _sse(usage_chunk(rid, _usage([last[i] for i in sorted(last)])))
        yield "data: [DONE]\n\n"
    return StreamingResponse(sse_stream(events()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _achain(first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> AsyncIterator[StreamOutput]:
    """The first output, then the rest of the stream; closing this closes (aborts) the stream.
    If the engine fails mid-stream, the stream ends with an error event (the status is sent)."""
    try:
        yield first
        async for out in gen:        # ends when every completion has finished
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
