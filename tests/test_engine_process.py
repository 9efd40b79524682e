"""The engine in a process of its own (minillm/serve/engine_process.py, what ``minillm serve`` runs).

Its streams are the engine thread's (``AsyncLLM``), token for token; an abort frees the request's KV
blocks in the engine process; a bad request fails alone; an engine process that dies ends every
open stream with ``EngineDeadError`` (not a hang) and ``/health`` says 503; shutting down, or the
front end dying, leaves no engine process behind. tests/test_serve.py runs the whole server in both
modes.
"""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minillm import SamplingParams
from minillm.async_llm import AsyncLLM, EngineDeadError
from minillm.serve import BackgroundServer
from minillm.serve.engine_process import EngineProcessLLM, parse_cores

CONFIG = dict(block_size=16, num_kv_blocks=64, max_model_len=256, max_num_seqs=16)
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed", "To be, or not", "JULIET:\nO"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: starts engine processes


def _gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie (exited, not yet reaped by whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return state.split()[1] in ("Z", "X")


def _wait_until(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


async def _streams(llm, params: SamplingParams) -> list:
    """Every prompt at once; per prompt and completion: its token ids, its text, its finish reason
    (joined from the pieces streamed; how they are split depends on when each step ran)."""

    async def one(prompt):
        got = {}
        async for o in llm.generate(prompt, params):
            ids, text, _ = got.get(o.index, ([], "", None))
            got[o.index] = (ids + o.token_ids, text + o.text, o.finish_reason)
        return [got[i] for i in sorted(got)]

    async with llm:
        return await asyncio.gather(*(one(p) for p in PROMPTS))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2, stop=["\n"]),
    ],
    ids=["greedy", "n2-seeded-stop"],
)
def test_the_streams_equal_the_engine_threads(params):
    """The same requests at once through both: the same outputs, split into the same pieces."""
    thread = asyncio.run(_streams(AsyncLLM.from_config(**CONFIG), params))
    process = asyncio.run(_streams(EngineProcessLLM(**CONFIG), params))
    assert process == thread
    assert [len(out) for out in process] == [params.n] * len(PROMPTS)
    assert all(reason in ("length", "stop") for out in process for _, _, reason in out)
    if params.temperature == 0:  # every token handed out, 24 of them, text and all
        assert [[len(ids) for ids, _, _ in out] for out in process] == [[24]] * len(PROMPTS)
        assert all(text for out in process for _, text, _ in out)


def test_an_abort_frees_the_blocks_and_a_bad_request_fails_alone():
    async def main():
        async with EngineProcessLLM(**CONFIG) as llm:
            free = await llm.engine_call(lambda e: e.kv.num_free_blocks)
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            gen = llm.generate(PROMPTS[1], long, request_id="a")
            await gen.__anext__()
            other = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            with pytest.raises(ValueError, match="max_model_len|prompt"):  # too long for the context
                await llm.generate([1] * 300, long).__anext__()
            held = await llm.engine_call(lambda e: e.kv.num_held_blocks("a"))
            await gen.aclose()  # the consumer goes away: the request is aborted
            rest = [o async for o in other]
            reason = await llm.engine_call(lambda e: e.requests["a"].finish_reason)
            return free, held, reason, rest, await llm.engine_call(lambda e: e.kv.num_free_blocks), llm.num_in_flight()

    free, held, reason, rest, free_after, in_flight = asyncio.run(asyncio.wait_for(main(), 120))
    assert held > 0 and reason == "abort"
    assert free_after == free and in_flight == 0
    assert sum(len(o.token_ids) for o in rest) == 16 and rest[-1].finish_reason == "length"


def test_a_dead_engine_process_ends_every_stream_with_an_error():
    async def main():
        async with EngineProcessLLM(**CONFIG) as llm:
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            gens = [llm.generate(p, long) for p in PROMPTS]
            for g in gens:
                await g.__anext__()
            os.kill(llm.engine.pid, signal.SIGKILL)
            errors = []
            for g in gens:
                try:
                    async for _ in g:
                        pass
                except EngineDeadError as e:
                    errors.append(str(e))
            with pytest.raises(EngineDeadError, match="gone"):
                await llm.engine_call(lambda e: e.step_count)
            return errors, llm.dead

    errors, dead = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(errors) == len(PROMPTS) and all("exited" in e for e in errors)
    assert isinstance(dead, EngineDeadError)


def test_health_says_503_once_the_engine_process_is_gone_and_stop_leaves_no_process():
    with BackgroundServer("random", engine_process=True, block_size=16, num_kv_blocks=16, max_model_len=64) as s:
        assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}
        pid = s.llm.engine.pid
        assert pid != os.getpid() and not _gone(pid)
        os.kill(pid, signal.SIGKILL)
        assert _wait_until(lambda: httpx.get(s.url + "/health", timeout=10).status_code == 503)
    with BackgroundServer("random", engine_process=True, block_size=16, num_kv_blocks=16, max_model_len=64) as s:
        pid = s.llm.engine.pid
        assert s.engine_call(lambda e: os.getpid()) == pid  # engine_call runs in the engine process
    assert s.llm.process.poll() is not None and _gone(pid)


def test_a_front_end_killed_outright_leaves_no_engine_process(tmp_path):
    """SIGKILL gives the front end no chance to shut down: the engine process sees its pipe close."""
    script = (
        "from minillm.serve.engine_process import EngineProcessLLM\n"
        "llm = EngineProcessLLM('random', block_size=16, num_kv_blocks=16, max_model_len=64)\n"
        "print(llm.engine.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root)
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid = int(front.stdout.readline())
        assert not _gone(pid)
    finally:
        front.kill()
        front.wait()
    assert _wait_until(lambda: _gone(pid), timeout=30)


def test_engine_call_names_a_closure_variable_it_cannot_send():
    async def main():
        async with EngineProcessLLM("random", block_size=16, num_kv_blocks=16, max_model_len=64) as llm:
            lock = threading.Lock()
            with pytest.raises(TypeError, match="'lock'"):
                await llm.engine_call(lambda e: lock.locked())
            with pytest.raises(KeyError):  # the engine's error, raised here
                await llm.engine_call(lambda e: e.requests["nope"])
            return await llm.engine_call(lambda e: e.num_kv_blocks)

    assert asyncio.run(asyncio.wait_for(main(), 60)) == 16


def test_bad_settings_are_refused_before_a_process_starts():
    with pytest.raises(TypeError, match="no_such_field"):
        EngineProcessLLM("random", no_such_field=1)
    with pytest.raises(ValueError, match="block_size"):
        EngineProcessLLM("random", block_size=0)
    assert parse_cores("0-2,5") == {0, 1, 2, 5} and parse_cores(None) is None
    with pytest.raises(ValueError, match="engine_cores='x'"):
        parse_cores("x")


def test_the_command_line_binds_cores_only_for_an_engine_process():
    from minillm.serve.__main__ import main

    with pytest.raises(SystemExit, match="--engine-cores binds the engine process"):
        main(["--model", "random", "--no-engine-process", "--engine-cores", "0"])


def test_plain_decode_equals_the_tokenizers_decode():
    """The streams' decoder calls a fast tokenizer's backend straight; it must say what
    ``tokenizer.decode`` says, special tokens skipped or not, for the shipped tokenizer and the
    26M model's, and a tokenizer it does not recognise goes through its own ``decode``."""
    import random

    from minillm.bench import vs_vllm
    from minillm.detokenizer import plain_decode
    from minillm.model.loader import load_tokenizer

    rng = random.Random(0)
    for path in ("minillm/checkpoints/shakespeare", vs_vllm.checkpoint_dir("llama-26m")):
        tok = load_tokenizer(str(Path(__file__).resolve().parents[1] / path) if "checkpoints" in path else path)
        fast = plain_decode(tok)
        assert fast.__code__ is not plain_decode(object()).__code__  # the backend's path is taken
        special = [tok.eos_token_id] if tok.eos_token_id is not None else []
        for _ in range(50):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] + special * rng.randrange(2)
            for skip in (True, False):
                assert fast(ids, skip) == tok.decode(ids, skip_special_tokens=skip)

    class Wrapped:  # a tokenizer of another kind: its own decode is called
        def decode(self, ids, skip_special_tokens):
            return f"{ids}/{skip_special_tokens}"

    assert plain_decode(Wrapped())([1, 2], False) == "[1, 2]/False"
