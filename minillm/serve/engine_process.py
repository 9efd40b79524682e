"""The engine in a process of its own, behind the server: ``minillm serve``'s default.

``AsyncLLM`` steps the engine on a thread of the server's own interpreter, so the HTTP handling, the
server-sent events' JSON and the engine's Python share one GIL. vLLM V1 runs its ``EngineCore`` in a
process of its own and its API server talks to it over ZMQ (``AsyncMPClient``). ``EngineProcessLLM``
is that split: an ``AsyncLLM`` whose engine side (the ``LLMEngine`` and the record of what each
stream was handed) runs in a child process, while the event loop, the streams and the HTTP server
stay here. The text is decoded here too (``text_in_front_end``), as vLLM's front end detokenizes,
except where the engine needs it itself: a request with stop strings gets the engine's text. The
engine process's compute threads can be bound to cores of their own (``engine_cores``, vLLM's
``VLLM_CPU_OMP_THREADS_BIND``) and the front end runs on the others.

The engine process is ``python -m minillm.serve.engine_process FD``; the protocol is one socket pair
(a ``multiprocessing`` ``Connection`` at each end) carrying pickled tuples, after the job (model,
config fields, cores) that the front end sends first.

    front end -> engine process                     engine process -> front end
    ("add", id, prompt, params, rid, keys,          ("ready", EngineDescription), once (or ("error", exc))
            perf_counter, priority, tenant)         ("reply", id, result, error), one per command
    ("abort", id, sequence id)                      ("step", StepSummary | None, [deltas], IterationStats)
    ("call", id, shipped function)                  ("failed", message, [sequence ids it aborted])
    ("load", id)
    ("shutdown",)

The engine process applies the commands that arrived since the last step (a reader thread queues
them as they come, so the front end never waits on a step), then steps; everything one step hands
the streams (each stream's new tokens and text, the requests that ended) is **one** message.

Failures: a command that raises (a bad request) answers its caller with the error, and only its
caller; a step that raises ends every open stream with ``EngineDeadError`` and aborts their requests,
as ``AsyncLLM`` does, and serving goes on; an engine process that exits (killed, crashed) closes the
pipe, and every open stream and pending call ends with ``EngineDeadError`` at once (``/health``
answers 503). ``shutdown()`` asks the process to end, waits, then terminates it; the process also
ends when the pipe closes (the front end is gone), so none is left behind.

``engine_call(fn)`` runs ``fn(engine)`` in the engine process: ``fn`` travels as its code and the
values of its closure (a lambda that reads ``e.requests[rid]`` works as in ``AsyncLLM``); what it
returns comes back pickled, and what it changes stays in the engine process.
"""

from __future__ import annotations

import asyncio
import builtins
import importlib
import itertools
import logging
import marshal
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..async_llm import AsyncLLM, EngineDeadError, settle_future
from ..config import EngineConfig
from ..detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

__all__ = ["EngineProcessLLM", "EngineSide", "EngineDescription", "StepSummary", "parse_cores", "run_engine_core"]


@dataclass
class EngineDescription:
    """What the front end reads of the engine in the other process (``llm.engine`` there)."""

    config: EngineConfig
    model_path: str
    device: str
    vocab_size: int
    num_kv_blocks: int
    pid: int


@dataclass
class StepSummary:
    """A step as the stat loggers read it (the StepRecord stays in the engine process)."""

    step: int
    preempted: list = field(default_factory=list)
    running: list = field(default_factory=list)
    swapped: list = field(default_factory=list)


def parse_cores(spec: Optional[str]) -> Optional[set[int]]:
    """``"0-3"`` or ``"0,2"`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` form) -> {0, 1, 2, 3}; None/"" -> None."""
    if not spec:
        return None
    cores = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        try:
            cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"engine_cores={spec!r}: expected core numbers like '0-3' or '0,2'") from None
    return cores


def text_in_front_end(sp, tokenizer) -> bool:
    """Does the front end decode this sequence's text, as vLLM's front end detokenizes? Yes, unless
    the engine needs the text itself (stop strings, matched as it steps) or there is none to make."""
    return tokenizer is not None and sp.detokenize and not sp.stop


@dataclass
class _FrontText:
    """Front end: one sequence's text, decoded here from the tokens its stream was handed."""

    decoder: IncrementalDetokenizer
    token_ids: list = field(default_factory=list)
    num_chars: int = 0  # handed out so far


class EngineSide(AsyncLLM):
    """``AsyncLLM``'s engine side, in the engine process: it records what each stream was handed and
    makes each step's message; the text of a sequence ``text_in_front_end`` is left to the front end
    (None)."""

    def _new_text(self, engine, rid: str, num_sent: int, done: bool) -> Optional[str]:
        if text_in_front_end(engine.requests[rid].sampling_params, engine.tokenizer):
            return None
        return super()._new_text(engine, rid, num_sent, done)

    def idle(self) -> bool:
        """Nothing to step and nothing to hand out: the loop waits for a command."""
        return not self.engine.has_unfinished_requests() and not self._ended and not self._done

    def apply(self, cmd: tuple) -> tuple:
        """One command on the engine, between two steps: its reply."""
        kind, call_id, *args = cmd
        engine = self.engine
        try:
            if kind == "add":
                prompt, sp, rid, keys, sent_at, priority, tenant = args
                # Arrival on the engine's clock: now, less the time the command spent in the pipe.
                arrival = engine.clock.now() - (time.perf_counter() - sent_at) if engine.clock.name == "wall" else None
                result = self._add_on_engine(engine, prompt, sp, rid, keys, arrival, priority, tenant)
            elif kind == "abort":
                result = self._abort_on_engine(engine, args[0])
            elif kind == "call":
                result = unship(args[0])(engine)
            elif kind == "load":
                result = self._load_on_engine(engine)
            else:
                raise ValueError(f"engine process: unknown command {kind!r}")
            return ("reply", call_id, result, None)
        except Exception as e:  # the caller's error, and only the caller's
            return ("reply", call_id, None, _picklable(e))

    def step_message(self) -> Optional[tuple]:
        """One step (if there is work) and the message that carries all it hands the streams;
        a step that raises ends every stream in flight ("failed")."""
        try:
            result = self._iteration()
        except Exception as e:  # the engine rolled the step back: end what was in flight
            aborted = list(self._sent)
            for seq in aborted:
                self._abort_on_engine(self.engine, seq)
            return ("failed", repr(e), aborted)
        if result is None:
            return None
        record, deltas, stats = result
        summary = None
        if record is not None:
            self.last_record = record
            summary = StepSummary(record.step, list(record.preempted), list(record.running), list(record.swapped))
        return ("step", summary, deltas, stats)


# --- functions sent to the engine process ---------------------------------------------------------


def ship(fn: Callable) -> tuple:
    """``fn`` as bytes: pickled when it can be (a module's function), else its code and closure."""
    try:
        return ("pickle", pickle.dumps(fn))
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"engine_call: {fn!r} cannot be sent to the engine process (not picklable, not a function)")
    cells = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            cells.append(pickle.dumps(cell.cell_contents))
        except Exception as e:
            raise TypeError(
                f"engine_call: {fn.__qualname__} runs in the engine process, sent as its code and closure; "
                f"its closure variable {name!r} ({type(cell.cell_contents).__name__}) cannot be pickled: {e}"
            ) from None
    return ("code", marshal.dumps(fn.__code__), fn.__module__, pickle.dumps(fn.__defaults__), cells)


def unship(shipped: tuple) -> Callable:
    """The function ``ship`` sent, rebuilt in this process (its module's globals when it imports)."""
    if shipped[0] == "pickle":
        return pickle.loads(shipped[1])
    _, code, module, defaults, cells = shipped
    try:
        namespace = vars(importlib.import_module(module))
    except ImportError:
        namespace = {"__builtins__": builtins}
    closure = tuple(types.CellType(pickle.loads(c)) for c in cells)
    return types.FunctionType(marshal.loads(code), namespace, None, pickle.loads(defaults), closure or None)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


# --- the engine process ---------------------------------------------------------------------------


def _spawn(model, config_fields: dict, cores) -> tuple[Connection, subprocess.Popen]:
    """Start ``python -m minillm.serve.engine_process FD``: a fresh interpreter (nothing of this
    process's threads or locks copied, no ``__main__`` guard needed), one end of a socket pair as
    its pipe. Its first message is the job: model, config fields, cores, this process's sys.path."""
    ours, theirs = socket.socketpair()
    here = str(Path(__file__).resolve().parents[2])  # the minillm this process runs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.Popen(
        [sys.executable, "-m", "minillm.serve.engine_process", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        env=env,
    )
    theirs.close()
    conn = Connection(ours.detach())
    conn.send(dict(model=model, config_fields=config_fields, cores=cores, sys_path=list(sys.path)))
    return conn, proc


def main(fd: int) -> None:
    """The engine process's entry point (``python -m minillm.serve.engine_process FD``)."""
    conn = Connection(fd)
    try:
        job = conn.recv()
    except EOFError:
        return
    sys.path.extend(p for p in job["sys_path"] if p not in sys.path)  # to rebuild engine_call's functions
    run_engine_core(conn, job["model"], job["config_fields"], job["cores"])


def run_engine_core(conn, model: Optional[str], config_fields: dict, cores: Optional[set[int]]) -> None:
    """The engine process's main: build the engine, then apply commands and step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server, which shuts this down
    if cores:
        os.sched_setaffinity(0, cores)  # threads started from here on (torch's) inherit it
        import torch

        torch.set_num_threads(len(cores))
    try:
        from ..engine import LLMEngine

        engine = LLMEngine(model, EngineConfig(**config_fields))
        core = EngineSide(engine)  # what each stream was handed, the deltas of a step
    except Exception as e:
        conn.send(("error", _picklable(e)))
        return
    conn.send(("ready", _describe(engine)))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(conn, inbox), name="minillm-commands", daemon=True).start()
    while True:
        commands = [inbox.get()] if core.idle() else []  # nothing to step: wait for a command
        while True:
            try:
                commands.append(inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in commands:
            if cmd[0] == "shutdown":
                conn.close()
                return
            _send(conn, core.apply(cmd))
        message = core.step_message()
        if message is not None:
            _send(conn, message)


def _describe(engine) -> EngineDescription:
    return EngineDescription(
        engine.config, engine.model_path, str(engine.device), engine.vocab_size, engine.num_kv_blocks, os.getpid()
    )


def _read_commands(conn, inbox: queue.SimpleQueue) -> None:
    """Reader thread: queue each command as it arrives; a closed pipe (the front end is gone) stops."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("shutdown",))


def _send(conn, message: tuple) -> None:
    """Send ``message``; a reply whose result cannot be pickled becomes that error."""
    try:
        data = pickle.dumps(message)
    except Exception as e:
        data = pickle.dumps(("reply", message[1], None, TypeError(f"the result cannot be sent back: {e}")))
    conn.send_bytes(data)


# --- the front end --------------------------------------------------------------------------------


class EngineProcessLLM(AsyncLLM):
    """``AsyncLLM``'s interface (``generate``, ``abort``, ``engine_call``, ``load``), its engine in a
    child process. ``engine`` here is an ``EngineDescription``; the tokenizer is loaded in both."""

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        engine_cores: Optional[set[int]] = None,
        stat_loggers: Sequence[Any] = (),
        start_timeout: float = 600.0,
        **config_fields,
    ):
        unknown = set(config_fields) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"EngineProcessLLM: unknown config field(s) {sorted(unknown)}")
        EngineConfig(**config_fields)  # a bad value raises here, naming its field
        self._init_front_end(stat_loggers)
        self._conn, self.process = _spawn(model, config_fields, engine_cores)
        if not self._conn.poll(start_timeout):
            self._stop_process(0)
            raise RuntimeError(f"EngineProcessLLM: the engine process did not start within {start_timeout:.0f} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.process.wait()
            raise RuntimeError(f"EngineProcessLLM: the engine process exited ({self.process.returncode})") from None
        if kind == "error":
            self.process.wait()
            raise payload
        self.engine: EngineDescription = payload
        from ..model.loader import load_tokenizer

        self.tokenizer = load_tokenizer(payload.model_path) if payload.model_path != "random" else None
        self._texts: dict[str, _FrontText] = {}  # sequence id -> its text, for those decoded here
        self._ids_of_calls = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed = False

    @classmethod
    def from_config(cls, model: Optional[str] = None, tokenizer=None, **config_fields) -> "EngineProcessLLM":
        if tokenizer is not None:
            raise TypeError("EngineProcessLLM: the engine process loads the model's own tokenizer; pass none")
        return cls(model, **config_fields)

    # --- life cycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Read the engine process's messages on the running event loop."""
        if self._loop is not None:
            return
        if self._closed:
            raise RuntimeError("EngineProcessLLM: shut down; build a new one to serve again")
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    async def shutdown(self) -> None:
        """Ask the engine process to end and wait for it; streams still open end with ``EngineDeadError``."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and self.dead is None:
            self._loop.remove_reader(self._conn.fileno())
        try:
            self._conn.send(("shutdown",))
        except OSError:
            pass
        await asyncio.get_running_loop().run_in_executor(None, self._stop_process, 10.0)
        self._end_everything(EngineDeadError("the engine was shut down"))

    def _stop_process(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._conn.close()

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._closed

    # --- commands --------------------------------------------------------------------------------
    def _call(self, kind: str, *args) -> asyncio.Future:
        if self._loop is None:
            raise RuntimeError("EngineProcessLLM: call start() first (or use `async with`)")
        if self.dead is not None:
            raise EngineDeadError(f"the engine process is gone: {self.dead}")
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        call_id = next(self._ids_of_calls)
        fut = self._loop.create_future()
        self._pending[call_id] = fut
        try:
            self._conn.send((kind, call_id, *args))
        except OSError as e:
            self._engine_died(f"the pipe to the engine process failed: {e!r}")
        return fut

    def _add(self, prompt, sp, rid, keys, priority, tenant) -> asyncio.Future:
        if text_in_front_end(sp, self.tokenizer):
            for k in keys:
                self._texts[k] = _FrontText(IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens))
        return self._call("add", prompt, sp, rid, keys, time.perf_counter(), priority, tenant)

    def _abort_soon(self, rid: str) -> asyncio.Future:
        return self._call("abort", rid)

    async def engine_call(self, fn: Callable) -> Any:
        """``fn(engine)`` in the engine process between two steps; its result, pickled back."""
        return await self._call("call", ship(fn))

    async def load(self) -> dict:
        return await self._call("load")

    # --- messages from the engine process ----------------------------------------------------------
    def _on_readable(self) -> None:
        """Event loop: every message the pipe holds (a reply, a step's outputs, a failed step)."""
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            try:
                code = self.process.wait(1)
            except subprocess.TimeoutExpired:
                code = None
            self._engine_died(f"the engine process exited (exit code {code})")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "reply":
            _, call_id, result, error = msg
            fut = self._pending.pop(call_id, None)
            if fut is not None:
                settle_future(fut, result, error)
        elif kind == "step":
            _, summary, deltas, stats = msg
            if summary is not None:
                self.last_record = summary
                self.num_steps += 1
            self._dispatch(deltas)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.record(summary, stats)
                except Exception:
                    logger.exception("stat logger failed")
        elif kind == "failed":
            _, message, aborted = msg
            open_streams = {seq for seq, st in self._streams.items() if not st.finished}
            self._fail_all(EngineDeadError(f"engine step failed: {message}"))
            for seq in open_streams - set(aborted):  # added after the engine aborted its streams
                self._call("abort", seq)

    def _dispatch(self, deltas: list) -> None:
        """Event loop: fill in the text left to the front end, then hand the outputs to the streams."""
        for d in deltas:
            if d.text is None:
                d.text = self._decode(d)
            elif d.finish_reason is not None:
                self._texts.pop(d.request_id, None)
        super()._dispatch(deltas)

    def _decode(self, d) -> str:
        """The new text of a sequence decoded here: what ``LLMEngine.output_text`` gives in the
        engine, the incremental decoding while it runs and the whole output decoded once it ends."""
        st = self._texts.get(d.request_id)
        if st is None:  # its stream already failed
            return ""
        st.token_ids += d.token_ids
        if d.finish_reason is not None:
            del self._texts[d.request_id]
            text = self.tokenizer.decode(st.token_ids, skip_special_tokens=st.decoder.skip_special_tokens)
        else:
            st.decoder.update(st.token_ids)
            text = st.decoder.text
        new = text[st.num_chars :]
        st.num_chars += len(new)
        return new

    def _engine_died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = EngineDeadError(why)
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._end_everything(self.dead)

    def _end_everything(self, error: EngineDeadError) -> None:
        self._fail_all(error)
        self._texts.clear()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            settle_future(fut, None, error)


if __name__ == "__main__":  # run by its package name, so what it pickles names this module, not __main__
    from minillm.serve.engine_process import main as engine_process_main

    engine_process_main(int(sys.argv[1]))
