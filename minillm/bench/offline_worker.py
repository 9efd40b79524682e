"""One side of ``python -m minillm.bench vs-vllm``: one engine, one process, one timed offline run.

Run as a file (``python offline_worker.py JOB.json``) by the interpreter of the engine it runs:
minillm's, or the vLLM virtual environment's, which has no minillm installed; so this file
imports nothing of minillm at the top and reads everything it needs from the job file:
``{"engine": "minillm" | "vllm", "model": dir, "prompts": [[token ids]], "max_tokens": n,
"threads": n, "config": {engine options}, "out": path}``. It loads the engine, warms it up on
two prompts, then times ``generate`` over all prompts (greedy, EOS ignored) and writes
``{"tokens": [[ids]], "seconds": wall, "cpu_seconds": this process's CPU time}`` to ``out``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def bind_cores(threads: int) -> None:
    """Run on cores 0 .. threads-1, as vLLM's CPU backend binds its threads (VLLM_CPU_OMP_THREADS_BIND):
    on a shared machine an unbound process loses a share of its core to migrations that a bound
    one does not, so both engines are bound alike."""
    if hasattr(os, "sched_setaffinity"):
        cores = set(range(min(threads, os.cpu_count() or 1)))
        try:
            os.sched_setaffinity(0, cores)
        except OSError:
            pass  # a container that forbids it: run unbound


def run_minillm(job: dict):
    bind_cores(job["threads"])
    import torch

    torch.set_num_threads(job["threads"])
    from minillm import LLM, SamplingParams

    llm = LLM(job["model"], dtype="float32", **job.get("config", {}))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)

    def generate(prompts, p=params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, p)]

    return generate


def run_vllm(job: dict):
    # vLLM's CPU backend takes its threads from this binding (cores 0 .. threads-1).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    # The engine core in this process (not a child), so the CPU time measured is all of vLLM's.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.set_num_threads(job["threads"])
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", skip_tokenizer_init=True, seed=0, **job.get("config", {}))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)

    def generate(prompts, p=params):
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], p, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    generate = {"minillm": run_minillm, "vllm": run_vllm}[job["engine"]](job)
    generate(job["prompts"][:2])  # warm-up: first-call allocations, compiles
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = generate(job["prompts"])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    with open(job["out"], "w") as f:
        json.dump({"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu}, f)


if __name__ == "__main__":
    main(sys.argv[1])
