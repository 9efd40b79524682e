"""AsyncLLM: the engine behind an asyncio front end, streaming each request's tokens as produced.

One background task runs the step loop; ``engine.step()`` runs on one worker thread, so the event
loop (an HTTP server, a notebook) stays responsive. Named after vLLM's ``AsyncLLM``.

The engine is not thread-safe, so every call into it goes through one queue of commands that the
engine thread applies between two steps: add a request, abort one, or any ``engine_call(fn)``.
After each step the loop hands each request's new tokens and text to that request's
``asyncio.Queue``; ``generate()`` reads them. The text is the engine's (``LLMEngine.output_text``,
decoded by minillm/detokenizer.py), and so are stop strings (``SamplingParams.stop``): the engine
ends the request where one matches, exactly as ``LLM.generate`` does. A consumer that goes away (a
client that disconnects) aborts its request, which frees its KV blocks.

    llm = AsyncLLM.from_config(block_size=16, num_kv_blocks=256)
    async with llm:
        async for out in llm.generate("ROMEO:", SamplingParams(max_tokens=20, temperature=0)):
            print(out.text, end="")
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from .config import EngineConfig
from .detokenizer import next_output_text, stop_buffer_length
from .engine import LLMEngine
from .core.parallel_sampling import completion_id
from .core.request import RequestMetrics
from .sampling_params import SamplingParams, checked_copy
from .step_record import StepRecord

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "StreamOutput", "EngineDeadError", "IterationStats", "FinishedRequestStats"]


class EngineDeadError(RuntimeError):
    """The step loop failed; the requests that were in flight end with this error."""


@dataclass
class StreamOutput:
    """What ``generate()`` yields: the tokens and text new since the previous output."""

    request_id: str
    token_ids: list[int]  # new token ids
    text: str  # new text ("" without a tokenizer)
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "rejected"
    finish_detail: Optional[str] = None  # why, in words (a rejection's reason)
    stop_reason: Optional[object] = None  # the stop string or stop token id that ended it (None for EOS)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens so far
    metrics: Optional[RequestMetrics] = None  # the engine's timestamps, on the last output
    index: int = 0  # which completion (SamplingParams.n > 1: one stream each)
    logprobs: Optional[list] = None  # SamplingParams.logprobs: one {token id: Logprob} per new token


@dataclass
class FinishedRequestStats:
    """One request at the moment it ended (all its ``n`` completions; an abort too), for the stat
    loggers. Named after vLLM's ``FinishedRequestStats``."""

    request_id: str
    finish_reason: str  # "abort" if any completion was aborted, else completion 0's
    num_prompt_tokens: int
    num_generation_tokens: int  # over all its completions (= the response's usage.completion_tokens)
    ttft: Optional[float] = None  # its first token (any completion)
    tpot: Optional[float] = None  # completion 0's
    e2e_latency: Optional[float] = None  # to its last completion's end
    queue_wait: Optional[float] = None


@dataclass
class IterationStats:
    """What one pass of the step loop did for the stat loggers: the tokens it handed to the streams
    and the requests that ended. vLLM's ``IterationStats``."""

    num_generation_tokens: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class _Group:
    """One request's completions still streaming, and what the ended ones add up to (engine thread)."""

    left: int
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    reasons: list = field(default_factory=list)
    metrics: list = field(default_factory=list)

    def stats(self, request_id: str) -> FinishedRequestStats:
        ms = [m for m in self.metrics if m is not None]

        def pick(name, fn):
            values = [getattr(m, name) for m in ms if getattr(m, name) is not None]
            return fn(values) if values else None

        reason = "abort" if "abort" in self.reasons else str(self.reasons[0])
        return FinishedRequestStats(
            request_id,
            reason,
            self.num_prompt_tokens,
            self.num_generation_tokens,
            ttft=pick("ttft", min),
            tpot=ms[0].tpot if ms else None,
            e2e_latency=pick("e2e_latency", max),
            queue_wait=pick("queue_wait", min),
        )


@dataclass
class _Delta:
    """One request's share of one step, as the engine thread reads it."""

    request_id: str
    token_ids: list[int]
    text: Optional[str]  # None: left to the front end to decode (serve/engine_process.py)
    finish_reason: Optional[str]
    finish_detail: Optional[str]
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: Optional[RequestMetrics]
    logprobs: Optional[list] = None
    stop_reason: Optional[object] = None


@dataclass
class _Sent:
    """What one sequence's stream has been handed so far (engine thread side)."""

    num_tokens: int = 0
    num_chars: int = 0


@dataclass
class _Command:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _Stream:
    """The event-loop side of one completion: its queue (shared by the n completions of one
    request) and its id for the caller (the request's, with its index)."""

    def __init__(self, queue: asyncio.Queue, request_id: str, index: int = 0):
        self.queue = queue
        self.finished = False
        self.request_id, self.index = request_id, index


class AsyncLLM:
    """An ``LLMEngine`` driven by one background task, with per-request async streams."""

    def __init__(self, engine: LLMEngine, *, stat_loggers: Sequence[Any] = ()):
        if engine.record_mode in ("none", "totals"):  # the streams follow each step's batch entries
            raise ValueError(
                f"EngineConfig.record={engine.config.record!r}: AsyncLLM streams the tokens each "
                "step's batch entries name, and this mode keeps none; use 'auto', 'summary' or 'full'"
            )
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._init_front_end(stat_loggers)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="minillm-engine")
        self._commands: collections.deque[_Command] = collections.deque()
        self._lock = threading.Lock()  # guards _commands between the loop and the engine thread
        self._sent: dict[str, _Sent] = {}  # sequence id -> what was handed out (engine thread side)
        self._ended: list[_Delta] = []  # final outputs of aborts, for the next dispatch (engine thread)
        self._groups: dict[str, _Group] = {}  # request id -> its completions still streaming (engine thread)
        self._group_of: dict[str, str] = {}  # sequence id -> request id (engine thread)
        self._done: list[FinishedRequestStats] = []  # requests ended since the last stats (engine thread)

    def _init_front_end(self, stat_loggers: Sequence[Any]) -> None:
        """The event loop's side: the streams, the stat loggers, what the last step was."""
        self.stat_loggers = list(stat_loggers)  # each gets .record(step record or None, IterationStats)
        self._streams: dict[str, _Stream] = {}  # sequence id -> stream (event loop side)
        self._ids = itertools.count()
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self.last_record: Optional[StepRecord] = None
        self.num_steps = 0
        self.dead: Optional[BaseException] = None

    @classmethod
    def from_config(cls, model: Optional[str] = None, tokenizer=None, **config_fields) -> "AsyncLLM":
        """Build the engine like ``LLM(model, **config_fields)`` does."""
        unknown = set(config_fields) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"AsyncLLM: unknown config field(s) {sorted(unknown)}")
        return cls(LLMEngine(model, EngineConfig(**config_fields), tokenizer=tokenizer))

    # --- life cycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="minillm-step-loop")

    async def shutdown(self) -> None:
        """Stop the step loop; streams still open end with ``EngineDeadError``."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        error = EngineDeadError("the engine was shut down")
        self._fail_all(error)
        with self._lock:
            pending, self._commands = list(self._commands), collections.deque()
        for cmd in pending:
            settle_future(cmd.future, None, error)
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> "AsyncLLM":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- commands: applied on the engine thread between two steps --------------------------------
    def _submit(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        if self._task is None:
            raise RuntimeError("AsyncLLM: call start() first (or use `async with`)")
        if self.dead is not None:
            raise EngineDeadError(f"the step loop failed: {self.dead!r}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._commands.append(_Command(fn, fut, loop))
        self._wake.set()
        return fut

    async def engine_call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; returns its result.
        The one safe way to read the engine (a KV snapshot, ``stats()``) while it serves."""
        return await self._submit(fn)

    async def abort(self, request_id: str) -> None:
        """Abort a request in the engine (its KV blocks are freed before the next step)."""
        await self._abort_soon(request_id)

    def _abort_on_engine(self, engine: LLMEngine, request_id: str) -> None:
        """Engine thread: abort the request (every sample for n > 1, or one sample by its id) and
        hand each of its sequences still streaming its final output (``finish_reason="abort"``,
        with any tokens not yet handed out); nothing of it is left in ``_sent``."""
        parent = engine.parents.get(request_id)
        group = engine.parents.get(engine.parent_id(request_id)) if request_id in engine.requests else None
        if parent is None and group is not None and not group.forked:
            parent = group  # before its fork, sample 0 is the whole group: every sample ends
        if request_id in engine.requests or request_id in engine.parents:
            engine.abort_request(request_id)
        seqs = [completion_id(parent.request_id, i) for i in range(parent.n)] if parent is not None else [request_id]
        for seq in seqs:
            req = engine.requests.get(seq)
            if seq not in self._sent or (req is not None and not req.is_finished):
                continue  # not streaming, or done but held back: it ends with its own reason
            self._ended.append(
                self._delta(engine, seq) if req is not None else _Delta(seq, [], "", "abort", None, 0, 0, None)
            )  # a sample never forked
            self._end(engine, seq, "abort")

    def _apply_commands(self) -> None:
        """Engine thread: run the queued commands, resolve their futures on the event loop."""
        while True:
            with self._lock:
                if not self._commands:
                    return
                cmd = self._commands.popleft()
            try:
                result, error = cmd.fn(self.engine), None
            except Exception as e:  # a bad request: its caller gets the error
                result, error = None, e
            cmd.loop.call_soon_threadsafe(settle_future, cmd.future, result, error)

    # --- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Union[str, list[int]],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        priority: int = 0,
        tenant: Optional[str] = None,
    ) -> AsyncIterator[StreamOutput]:
        """Add a request and yield its outputs as the engine produces them; the last one has
        ``finished=True``. Bad input raises the engine's ValueError before anything is yielded.
        Stop strings are ``SamplingParams.stop``: while a sequence runs, its text's last
        characters that could begin one are held back, so the text handed out never includes
        what the final text cuts off. Closing the generator early aborts the request. With
        ``SamplingParams(n=k)`` the k completions' outputs interleave, each with its ``index``;
        the generator ends when all k have finished."""
        # The params are checked (and copied) before anything is registered: a dict, or a field
        # edited into a bad value after construction, raises here naming it.
        sp = checked_copy(sampling_params, f" (request {str(request_id)!r})" if request_id is not None else "")
        rid = str(request_id) if request_id is not None else str(next(self._ids))
        # One stream per completion, keyed by the engine's sequence id; one queue for all.
        keys = [completion_id(rid, i) for i in range(sp.n)] if sp.n > 1 else [rid]
        if any(k in self._streams for k in keys + [rid]):
            raise ValueError(f"request_id={rid!r}: already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        streams = [_Stream(queue, rid, i) for i in range(len(keys))]
        self._streams.update(zip(keys, streams))

        def forget() -> None:
            for k in keys:
                self._streams.pop(k, None)

        try:
            await self._add(prompt, sp, rid, keys, priority, tenant)
        except BaseException as e:
            forget()
            if not isinstance(e, ValueError) and self.is_running:
                self._abort_soon(rid)  # cancelled while being added
            raise
        try:
            left = len(keys)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                left -= item.finished
                if not left:
                    return
        finally:
            forget()
            if not all(st.finished for st in streams) and self.is_running:
                try:
                    self._abort_soon(rid)
                except Exception:  # shutting down: nothing left to free
                    pass

    def _add(self, prompt, sp: SamplingParams, rid: str, keys: list[str], priority: int, tenant) -> asyncio.Future:
        """Queue the request for the engine thread; the future resolves once the engine has it."""
        # Arrival: when the front end received it (the command may wait for a step to end).
        arrival = self.engine.clock.now() if self.engine.clock.name == "wall" else None
        return self._submit(lambda e: self._add_on_engine(e, prompt, sp, rid, keys, arrival, priority, tenant))

    def _abort_soon(self, rid: str) -> asyncio.Future:
        """Queue an abort of ``rid`` for the engine thread (callers need not wait for it)."""
        return self._submit(lambda e: self._abort_on_engine(e, rid))

    def _add_on_engine(self, engine: LLMEngine, prompt, sp, rid, keys, arrival, priority, tenant) -> str:
        """Engine thread: add the request; its sequences ``keys`` start streaming from nothing sent."""
        out = engine.add_request(prompt, sp, request_id=rid, arrival_time=arrival, priority=priority, tenant=tenant)
        for k in keys:
            self._sent[k] = _Sent()
            self._group_of[k] = rid
        self._groups[rid] = _Group(left=len(keys))
        return out

    # --- the step loop -----------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            try:
                result = await loop.run_in_executor(self._executor, self._iteration)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed step: the engine rolled it back; end what was in flight
                logger.exception("engine step failed")
                self._recover(e)
                continue
            if result is None:
                await self._wake.wait()  # nothing to do until a command arrives
                continue
            record, deltas, stats = result
            if record is not None:  # None: no step, only the final outputs of aborted requests
                self.last_record = record
                self.num_steps += 1
            self._dispatch(deltas)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.record(record, stats)
                except Exception:
                    logger.exception("stat logger failed")
            if record is not None:
                await asyncio.sleep(0)  # let handlers run between steps

    def _iteration(self):
        """Engine thread: apply commands, then one step if there is work. Returns
        (record or None, deltas, IterationStats) or None when idle."""
        self._apply_commands()
        ended, self._ended = self._ended, []
        engine = self.engine
        if not engine.has_unfinished_requests():
            return (None, ended, self._iteration_stats(ended)) if ended or self._done else None
        record = engine.step()
        touched = {e.request_id for e in record.batch if e.num_output_tokens}
        touched.update(record.finished)
        touched.update(w.request_id for w in record.rejected)
        deltas = ended
        for rid in touched:
            if rid not in self._sent:  # not ours (added straight to the engine) or already aborted
                continue
            deltas.append(self._delta(engine, rid))
            req = engine.requests[rid]
            done = req.finish_reason is not None
            if done:
                self._end(engine, rid, req.finish_reason)
            parent = req.parent
            if done and parent is not None and not parent.forked:
                # Finished before its prompt was computed (rejected): no other sample will come.
                for i in range(1, parent.n):
                    seq = completion_id(parent.request_id, i)
                    if seq in self._sent:
                        self._end(engine, seq, req.finish_reason)
                        deltas.append(
                            _Delta(seq, [], "", req.finish_reason, req.finish_detail, req.num_prompt_tokens, 0, None)
                        )
        return record, deltas, self._iteration_stats(deltas)

    def _end(self, engine: LLMEngine, seq: str, reason: str) -> None:
        """Engine thread: sequence ``seq`` streams no more; when it is its request's last, the
        request's ``FinishedRequestStats`` are ready for the stat loggers (an abort as soon as it
        is applied, not at the next step)."""
        del self._sent[seq]
        rid = self._group_of.pop(seq)
        group = self._groups[rid]
        req = engine.requests.get(seq)  # None: a sample that never forked
        group.left -= 1
        group.reasons.append(reason)
        if req is not None:
            group.num_prompt_tokens = req.num_prompt_tokens
            group.num_generation_tokens += req.num_output_tokens
            group.metrics.append(req.metrics)
        if not group.left:
            del self._groups[rid]
            self._done.append(group.stats(rid))

    def _iteration_stats(self, deltas: list[_Delta]) -> IterationStats:
        """Engine thread: the tokens ``deltas`` hand out and the requests that ended since the last call."""
        done, self._done = self._done, []
        return IterationStats(sum(len(d.token_ids) for d in deltas), done)

    def _delta(self, engine: LLMEngine, rid: str) -> _Delta:
        """Engine thread: what sequence ``rid`` has that its stream was not handed yet; ``_sent`` moves on."""
        sent, req = self._sent[rid], engine.requests[rid]
        start = sent.num_tokens
        new = req.output_token_ids[start:]
        done = req.finish_reason is not None
        text = self._new_text(engine, rid, sent.num_chars, done)
        sent.num_tokens += len(new)
        sent.num_chars += len(text or "")
        lp = req.output_logprobs[start : start + len(new)] if req.output_logprobs is not None else None
        return _Delta(
            rid,
            list(new),
            text,
            req.finish_reason,
            req.finish_detail,
            req.num_prompt_tokens,
            req.num_output_tokens,
            req.metrics if done else None,
            lp,
            req.stop_reason,
        )

    def _new_text(self, engine: LLMEngine, rid: str, num_sent: int, done: bool) -> Optional[str]:
        """Engine thread: the text sequence ``rid``'s stream gets now (the engine's, stop strings applied)."""
        hold_back = stop_buffer_length(engine.requests[rid].sampling_params)
        return next_output_text(engine.output_text(rid), num_sent, done, hold_back)

    def _dispatch(self, deltas: list[_Delta]) -> None:
        """Event loop: turn each delta into a StreamOutput on its request's queue."""
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None or stream.finished:
                continue
            final = d.finish_reason is not None
            stream.finished = final
            stream.queue.put_nowait(
                StreamOutput(
                    request_id=stream.request_id,
                    token_ids=d.token_ids,
                    text=d.text,
                    finished=final,
                    finish_reason=d.finish_reason,
                    finish_detail=d.finish_detail,
                    stop_reason=d.stop_reason,
                    num_prompt_tokens=d.num_prompt_tokens,
                    num_output_tokens=d.num_output_tokens,
                    metrics=d.metrics,
                    index=stream.index,
                    logprobs=d.logprobs,
                )
            )

    def _recover(self, error: Exception) -> None:
        """After a failed step: every open stream gets the error; its request is aborted."""
        rids = list(self._streams)
        self._fail_all(EngineDeadError(f"engine step failed: {error!r}"))

        def abort_all(engine: LLMEngine) -> None:
            for rid in rids:
                self._abort_on_engine(engine, rid)

        try:
            self._executor.submit(abort_all, self.engine).result()
        except Exception as e:  # the engine cannot even abort: stop serving
            self.dead = e

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            if not stream.finished:
                stream.finished = True
                stream.queue.put_nowait(error)

    # --- what the front end shows --------------------------------------------------------------------
    def num_in_flight(self) -> int:
        return len({s.request_id for s in self._streams.values()})

    async def load(self) -> dict:
        """Queue length, running and swapped requests and KV use right now (what /metrics shows)."""

        return await self.engine_call(self._load_on_engine)

    def _load_on_engine(self, engine: LLMEngine) -> dict:
        """Engine thread: ``load()``'s numbers."""
        rec = self.last_record
        ours = set(self._sent)
        running = [r for r in (rec.running if rec else []) if r in ours]
        swapped = [r for r in (rec.swapped if rec else []) if r in ours]
        total = engine.num_kv_blocks
        free = engine.kv.num_free_blocks
        return {
            "running": len(running),
            "swapped": len(swapped),
            "waiting": len(ours) - len(running) - len(swapped),
            "kv_blocks_total": total,
            "kv_blocks_free": free,
            "kv_usage": (total - free) / total if total else 0.0,
            "steps": engine.step_count,
            "time": time.time(),
        }


def settle_future(fut: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    """Give ``fut`` its result or its error, unless its caller went away (it is done)."""
    if fut.done():  # its caller went away
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
