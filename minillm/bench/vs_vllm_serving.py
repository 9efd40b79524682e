"""vs-vllm's serving half: both OpenAI servers, one load generator, the same requests.

``minillm serve`` (``python -m minillm.serve``, the CPU fast path) and ``vllm serve`` (from the vLLM
virtual environment) each run as their own process on the same checkpoint, float32, with the same
thread count, both up for the whole run. Both run their engine in a process of its own (vLLM's
EngineCore, minillm's ``--engine-process``) with its compute threads bound to cores 0 .. threads-1,
and their HTTP server unbound. A round replays the same token-id requests against each
server in turn (the order rotating from round to round) with the project's load generator
(``bench/serve.py``: the ``openai`` client, streaming, ``ignore_eos``), twice:

* **saturation**: every request sent at once; requests/s and output tokens/s over the replay;
* **latency**: Poisson arrivals at a rate both engines keep up with; TTFT and TPOT medians.

Before the rounds each server gets one untimed saturation replay: the first replay after a start
pays for new batch shapes (oneDNN primitives) and for what the last server started still runs.

The table gives medians over rounds and minillm's ratio to vLLM (for TTFT and TPOT below 1 is
better; for throughput above 1).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from .common import median

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(side: str, python: str, model: str, port: int, max_model_len: int, threads: int = 1) -> list[str]:
    """The command line that serves ``model`` on ``port``: minillm's (the CPU fast path) or vLLM's.
    Each binds its engine's compute threads to cores 0 .. threads-1 and leaves its HTTP server
    unbound: vLLM through ``VLLM_CPU_OMP_THREADS_BIND`` (its EngineCore process's OpenMP threads),
    minillm through ``--engine-cores`` (its engine process)."""
    if side == "vllm":
        # `vllm serve`'s own module: the `vllm` script looks up the distribution "vllm", and
        # the CPU build is installed as "vllm-cpu".
        return [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
            "--served-model-name",
            "bench",
        ]
    return [
        python,
        "-m",
        "minillm.serve",
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--attention-backend",
        "cpu",
        "--max-model-len",
        str(max_model_len),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        "--engine-process",
        "--engine-cores",
        f"0-{threads - 1}",
    ]


def server_env(side: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if side == "vllm":
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    else:  # this checkout's minillm
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


class Server:
    """One OpenAI server process; ``url`` once :meth:`wait` returned."""

    def __init__(self, side: str, python: str, model: str, threads: int, log_dir: Path, max_model_len: int = 1024):
        self.side, self.port = side, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{side}-server.log"
        self.proc = subprocess.Popen(
            server_command(side, python, model, self.port, max_model_len, threads),
            env=server_env(side, threads),
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait(self, timeout: float = 600.0) -> "Server":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vs-vllm: the {self.side} server exited ({self.proc.returncode}):\n" + self.log.read_text()[-3000:]
                )
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return self
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"vs-vllm: the {self.side} server did not answer within {timeout:.0f} s:\n" + self.log.read_text()[-3000:]
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def replay_once(url: str, prompts, max_tokens: int, rate: Optional[float], seed: int) -> dict:
    """One replay of ``prompts`` (token ids) against ``url``: the load generator's summary."""
    from ..analysis.metrics import summarize
    from .serve import ReplayRequest, replay, schedule

    requests = [ReplayRequest(f"r{i}", 0.0, list(p), max_tokens) for i, p in enumerate(prompts)]
    times = schedule(requests, rate if rate is not None else float("inf"), seed)
    client = asyncio.run(replay(url, requests, times, model="bench", show_progress=False))
    s = summarize(client)
    errors = sorted({c.error for c in client if c.error})
    if errors or s["num_finished"] != len(requests):
        raise RuntimeError(f"vs-vllm: {url}: {s['num_finished']}/{len(requests)} requests finished; {errors[:3]}")
    return s


def measure(
    sides: dict,
    model: str,
    prompts,
    max_tokens: int,
    rate: float,
    rounds: int,
    threads: int,
    workdir: Path,
    seed: int = 0,
) -> dict:
    """Both servers up, ``rounds`` alternating rounds of a saturation and a latency replay each.
    ``sides``: {side: python}. Returns {side: {"saturation": [summaries], "latency": [summaries]}}."""
    servers = {}
    try:
        for side, python in sides.items():  # one at a time: the loads do not overlap
            servers[side] = Server(side, python, model, threads, workdir).wait()
            replay_once(servers[side].url, prompts[:2], 4, None, seed)  # warm-up
        for side in sides:  # a full replay each, untimed: every batch shape seen once, start-up work done
            replay_once(servers[side].url, prompts, max_tokens, None, seed)
        runs = {s: {"saturation": [], "latency": []} for s in sides}
        names = list(sides)
        for r in range(rounds):
            for side in names[r % len(names) :] + names[: r % len(names)]:
                sat = replay_once(servers[side].url, prompts, max_tokens, None, seed)
                lat = replay_once(servers[side].url, prompts, max_tokens, rate, seed)
                runs[side]["saturation"].append(sat)
                runs[side]["latency"].append(lat)
                print(
                    f"serving round {r + 1}/{rounds} {side}: {sat['request_throughput']:.2f} req/s at saturation, "
                    f"TTFT p50 {1e3 * lat['ttft_p50']:.0f} ms, TPOT p50 {1e3 * lat['tpot_p50']:.1f} ms "
                    f"at {rate} req/s",
                    file=sys.stderr,
                    flush=True,
                )
        return runs
    finally:
        for s in servers.values():
            s.stop()


def medians(runs: dict) -> dict:
    """{side: {req_per_s, out_tok_per_s, ttft_p50, tpot_p50}}: medians over rounds."""
    out = {}
    for side, r in runs.items():
        out[side] = dict(
            req_per_s=median(s["request_throughput"] for s in r["saturation"]),
            out_tok_per_s=median(s["output_throughput"] for s in r["saturation"]),
            ttft_p50=median(s["ttft_p50"] for s in r["latency"]),
            tpot_p50=median(s["tpot_p50"] for s in r["latency"]),
        )
    return out
