"""spec: speculative decoding on held-out text: acceptance, tokens per target step, modeled speed-up.

Prompts are windows of ``minillm/checkpoints/shakespeare/heldout_slice.txt`` (text the model
never trained on). Each configuration (the shipped draft, ``default-draft``, and the n-gram
proposer, for k = 1..5) runs the same requests on the shipped model twice, on the modeled
clock of an H100 roofline:

* at **batch 1** (one request at a time), where decode is memory bound and the k extra
  positions of a verification are nearly free;
* at a **large batch** (every request at once), where the step is closer to compute bound.

The modeled clock charges the draft's forwards (its own shape on the same roofline) plus the
target's verification step, so ``speed-up = plain time / speculative time`` says where
speculation pays. Acceptance and tokens per target step do not depend on the clock. Greedy
runs are checked token for token against the plain run. The last table feeds the measured
per-token acceptance into ``modeled_speedup`` for a 7B-shaped target with a 0.6B-shaped draft:
what this acceptance would buy at a realistic scale (shapes only, no such models are run).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Optional

from .common import SHIPPED_SHAPE, finish, goal, pct, pick, progress, set_threads, shipped_model_available, table

NAME = "spec"


def _sizes(size: str) -> dict:
    return pick(
        size,
        tiny=dict(n=4, prompt_len=32, output_len=16, ks=[3], batch=4),
        small=dict(n=16, prompt_len=64, output_len=32, ks=[1, 2, 3, 4, 5], batch=16),
        full=dict(n=32, prompt_len=64, output_len=64, ks=[1, 2, 3, 4, 5], batch=32),
    )


def draft_available() -> bool:
    from ..model.loader import DEFAULT_DRAFT_DIR

    return (DEFAULT_DRAFT_DIR / "config.json").exists() and any(DEFAULT_DRAFT_DIR.glob("*.safetensors"))


def snapshot(src, dst) -> str:
    """Copy a checkpoint directory: every run of the comparison then reads the same weights, even
    while training rewrites the shipped checkpoint."""
    from pathlib import Path

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix in (".json", ".safetensors", ".txt", ".model"):
            shutil.copy2(f, dst / f.name)
    return str(dst)


def heldout_prompts(tokenizer, n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``prompt_len`` tokens spread evenly over the held-out text (random tokens
    when the shipped model, hence its tokenizer, is missing)."""
    if tokenizer is None:
        import torch

        g = torch.Generator().manual_seed(seed)
        return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
    from ..model.loader import DEFAULT_MODEL_DIR

    text = (DEFAULT_MODEL_DIR / "heldout_slice.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # longer than the model: fine
    stride = max(1, (len(ids) - prompt_len) // n)
    return [ids[i * stride : i * stride + prompt_len] for i in range(n)]


def run_one(
    prompts,
    output_len: int,
    batch: int,
    temperature: float,
    device: str,
    proposer: Optional[str] = None,
    k: int = 0,
    model: Optional[str] = None,
    paths: Optional[dict] = None,
) -> dict:
    from .. import LLM
    from ..sampling_params import SamplingParams
    from ..spec.speculative import spec_stats

    cfg = dict(
        max_num_seqs=batch,
        max_model_len=len(prompts[0]) + output_len + 8,
        device=device,
        clock="modeled",
        cost_model="H100-SXM",
        seed=0,
        max_num_batched_tokens=max(2048, batch * (k + 1)),
        record="summary",
    )
    if proposer:
        cfg.update(speculative_model=(paths or {}).get(proposer, proposer), num_speculative_tokens=k)
    if model is not None:
        llm = LLM(model, **cfg)
    else:
        llm = LLM("random", random_model=dict(SHIPPED_SHAPE), **cfg)
    e = llm.engine
    sp = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=None)
    ids = [e.add_request(p, sp) for p in prompts]
    t0 = time.perf_counter()
    recs = e.run()
    st = spec_stats(recs)
    return dict(
        proposer=proposer or "none",
        k=k,
        batch=batch,
        temperature=temperature,
        outputs=[e.get_output(i).token_ids for i in ids],
        modeled_s=e.clock.now(),
        wall_s=time.perf_counter() - t0,
        target_steps=len(recs),
        **st,
    )


def run(args) -> dict:
    from ..sim.costmodel import MODELS, RooflineCostModel
    from ..spec.speculative import alpha_from_tokens_per_step, modeled_speedup

    P = _sizes(args.size)
    threads = set_threads(args)
    have_model, have_draft = shipped_model_available(), draft_available()
    tokenizer, model, paths = None, None, {}
    tmp = tempfile.mkdtemp(prefix="minillm-spec-")
    if have_model:
        from transformers import AutoTokenizer
        from ..model.loader import DEFAULT_DRAFT_DIR, DEFAULT_MODEL_DIR

        model = snapshot(DEFAULT_MODEL_DIR, os.path.join(tmp, "target"))
        tokenizer = AutoTokenizer.from_pretrained(model)
        if have_draft:
            paths["default-draft"] = snapshot(DEFAULT_DRAFT_DIR, os.path.join(tmp, "draft"))
    prompts = heldout_prompts(tokenizer, P["n"], P["prompt_len"], SHIPPED_SHAPE["vocab_size"], args.seed)
    proposers = (["default-draft"] if have_draft else []) + ["ngram"]
    batches = [1, P["batch"]]
    label = "shipped shakespeare" if have_model else "random Llama of the shipped shape (checkpoint missing)"

    plan = [(None, 0, b, 0.0) for b in batches]
    plan += [(p, k, b, 0.0) for p in proposers for k in P["ks"] for b in batches]
    k_main = P["ks"][-1] if 4 not in P["ks"] else 4
    plan += [(p, k_main, 1, 1.0) for p in [None] + proposers]  # sampling, temperature 1
    runs = {}
    bar = progress(len(plan), "spec runs", "run")
    for p, k, b, temp in plan:
        runs[(p, k, b, temp)] = run_one(prompts, P["output_len"], b, temp, args.device, p, k, model, paths)
        bar.update(1)
    bar.close()
    shutil.rmtree(tmp, ignore_errors=True)

    # --- acceptance: does not depend on the batch (greedy tokens are identical) -----------------
    acc_rows, acc = [], []
    for p in proposers:
        for k in P["ks"]:
            r = runs[(p, k, 1, 0.0)]
            same = all(runs[(p, k, b, 0.0)]["outputs"] == runs[(None, 0, b, 0.0)]["outputs"] for b in batches)
            alpha = alpha_from_tokens_per_step(min(r["tokens_per_target_step"], k + 1), k)
            acc.append(
                dict(
                    proposer=p,
                    k=k,
                    sampling="greedy",
                    acceptance_rate=r["acceptance_rate"],
                    tokens_per_target_step=r["tokens_per_target_step"],
                    alpha=alpha,
                    greedy_identical=same,
                )
            )
            acc_rows.append([p, k, "greedy", pct(r["acceptance_rate"]), r["tokens_per_target_step"], alpha, same])
        r = runs[(p, k_main, 1, 1.0)]
        alpha = alpha_from_tokens_per_step(min(r["tokens_per_target_step"], k_main + 1), k_main)
        acc.append(
            dict(
                proposer=p,
                k=k_main,
                sampling="T=1",
                acceptance_rate=r["acceptance_rate"],
                tokens_per_target_step=r["tokens_per_target_step"],
                alpha=alpha,
                greedy_identical=None,
            )
        )
        acc_rows.append([p, k_main, "T=1", pct(r["acceptance_rate"]), r["tokens_per_target_step"], alpha, None])
    t1 = table(
        [
            "proposer",
            "k",
            "sampling",
            "acceptance (accepted/proposed)",
            "tokens per target step",
            "per-token alpha",
            "greedy identical",
        ],
        acc_rows,
        title=f"{label}: {P['n']} held-out prompts of {P['prompt_len']} tokens, {P['output_len']} output tokens",
    )

    # --- modeled time: draft + verification vs plain, at batch 1 and at a large batch -------------
    sp_rows, speed = [], []
    for p in proposers:
        for k in P["ks"]:
            row = [p, k]
            for b in batches:
                base, r = runs[(None, 0, b, 0.0)]["modeled_s"], runs[(p, k, b, 0.0)]["modeled_s"]
                row += [r * 1e3, base / r]
                speed.append(dict(proposer=p, k=k, batch=b, plain_s=base, spec_s=r, speedup=base / r))
            sp_rows.append(row)
    base_ms = [runs[(None, 0, b, 0.0)]["modeled_s"] * 1e3 for b in batches]
    t2 = table(
        [
            "proposer",
            "k",
            f"batch 1: ms (plain {base_ms[0]:.1f})",
            "speed-up",
            f"batch {batches[1]}: ms (plain {base_ms[1]:.1f})",
            "speed-up",
        ],
        sp_rows,
        title="modeled H100 time of the whole run (draft forwards + target steps), greedy",
    )

    # --- the measured acceptance at a realistic scale (shapes only) -------------------------------
    target_cm = RooflineCostModel("H100-SXM", "llama-2-7b")
    draft_cm = RooflineCostModel("H100-SXM", MODELS["qwen3-0.6b"])
    scale_rows, scale = [], []
    for a in acc:
        if a["sampling"] != "greedy":
            continue
        dcm = draft_cm if a["proposer"] != "ngram" else None
        s1 = modeled_speedup(target_cm, dcm, 1, 512, a["k"], a["alpha"])
        s2 = modeled_speedup(target_cm, dcm, 256, 512, a["k"], a["alpha"])
        scale.append(dict(proposer=a["proposer"], k=a["k"], alpha=a["alpha"], batch1=s1, batch256=s2))
        scale_rows.append([a["proposer"], a["k"], a["alpha"], s1["speedup"], s2["speedup"]])
    t3 = table(
        ["proposer", "k", "per-token alpha (measured)", "speed-up, batch 1", "speed-up, batch 256"],
        scale_rows,
        title="the same acceptance for a llama-2-7b-shaped target (qwen3-0.6b-shaped draft), "
        "H100 roofline, context 512",
    )

    goals = [
        goal(
            "greedy output with speculation identical to without (every proposer, k, batch)",
            "all identical",
            all(a["greedy_identical"] for a in acc if a["greedy_identical"] is not None),
            all(a["greedy_identical"] for a in acc if a["greedy_identical"] is not None),
        )
    ]
    if have_draft:
        d = max(
            (a for a in acc if a["proposer"] == "default-draft" and a["sampling"] == "greedy"),
            key=lambda a: a["tokens_per_target_step"],
        )
        n = next(a for a in acc if a["proposer"] == "ngram" and a["k"] == d["k"] and a["sampling"] == "greedy")
        goals.append(
            goal(
                "shipped draft beats prompt lookup (tokens per target step, same k)",
                f"> {n['tokens_per_target_step']:.2f}",
                round(d["tokens_per_target_step"], 2),
                d["tokens_per_target_step"] > n["tokens_per_target_step"],
            )
        )
    b1 = [s for s in speed if s["batch"] == 1]
    bb = [s for s in speed if s["batch"] == batches[1]]
    goals.append(
        goal(
            "speculation pays less at a large batch (best modeled speed-up)",
            "batch-B best < batch-1 best",
            f"{max(s['speedup'] for s in b1):.2f} vs {max(s['speedup'] for s in bb):.2f}",
            max(s["speedup"] for s in bb) < max(s["speedup"] for s in b1),
        )
    )
    cfg = dict(
        model=label,
        draft="shipped shakespeare-draft" if have_draft else "missing (n-gram only)",
        device=args.device,
        clock="modeled",
        cost_model="H100-SXM roofline",
        torch_threads=threads,
        **P,
    )
    for r in runs.values():
        r.pop("outputs")
    results = dict(acceptance=acc, modeled=speed, at_scale=scale, runs=[dict(r) for r in runs.values()])
    return dict(config=cfg, results=results, goals=goals, _tables=[t1, t2, t3])


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
