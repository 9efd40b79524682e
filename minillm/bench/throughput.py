"""throughput: continuous batching (minillm) vs static batches (transformers ``generate``).

The same model, the same weights, the same requests, the same dtype and torch threads,
measured one after the other in one process:

1. **minillm**: continuous batching over the paged KV cache (``max_num_seqs`` requests at most).
2. **transformers static**: ``model.generate`` on batches of ``max_num_seqs`` requests in
   arrival order, left-padded, each batch running until its *longest* request is done
   (greedy, EOS ignored). Tokens generated past a request's own length are wasted work;
   only each request's own ``output_len`` tokens count as output.
3. **transformers continuous batching**: ``model.init_continuous_batching()``'s manager
   with per-request ``max_new_tokens``. If it cannot run here, the table says why.

The trace has a long tail of output lengths (log-normal), all requests arriving at once:
the workload where a static batch idles behind its longest request and continuous
batching refills the freed slot at the next step.

Throughput is output tokens per wall second and, beside it, per CPU second of this
process (all its threads): on a shared machine the second is the steadier ratio. Every
side's greedy tokens are compared with minillm's, so a faster side cannot be a wrong one.
"""

from __future__ import annotations

import math
import time

import torch

from .common import finish, goal, make_llm, pick, progress, set_threads, table

NAME = "throughput"


def _sizes(size: str) -> dict:
    from ..analysis.workloads import LogNormal, Uniform

    return pick(
        size,
        tiny=dict(n=6, max_num_seqs=4, prompt_len=Uniform(4, 12), output_len=LogNormal(4, 0.8, lo=1, hi=16)),
        small=dict(n=128, max_num_seqs=32, prompt_len=Uniform(8, 64), output_len=LogNormal(16, 1.0, lo=2, hi=256)),
        full=dict(n=256, max_num_seqs=64, prompt_len=Uniform(16, 128), output_len=LogNormal(24, 1.0, lo=4, hi=384)),
    )


# --------------------------------------------------------------------------------------
# The three sides
# --------------------------------------------------------------------------------------


def run_minillm(engine, trace) -> dict:
    from ..sampling_params import SamplingParams
    from ..analysis.workloads import submit_trace

    # Warm up (first-call allocations), then forget those steps.
    engine.add_request([11, 12, 13, 14], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.run()
    ids = submit_trace(engine, trace)
    total = sum(r.output_len for r in trace)
    records = []
    bar = progress(total, "minillm", "tok")
    c0, t0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        rec = engine.step()
        records.append(rec)
        bar.update(sum(e.num_output_tokens for e in rec.batch))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    bar.close()
    outputs = {rid: list(engine.requests[rid].output_token_ids) for rid in ids}
    produced = sum(len(v) for v in outputs.values())
    return dict(
        wall_s=wall,
        cpu_s=cpu,
        output_tokens=produced,
        tok_per_s=produced / wall,
        tok_per_cpu_s=produced / cpu,
        steps=len(records),
        batch_mean=sum(len(r.batch) for r in records) / max(1, len(records)),
        step_ms_median=1e3 * sorted(r.duration for r in records)[len(records) // 2],
        outputs=outputs,
    )


def hf_model_from(engine):
    """The transformers model with exactly the engine's weights, in the engine's dtype."""
    from transformers import AutoModelForCausalLM

    if engine.model_path != "random":
        model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.dtype)
    else:
        model = AutoModelForCausalLM.from_config(engine.hf_config, dtype=engine.dtype)
        model.load_state_dict(engine.model.state_dict(), strict=True)
    model = model.to(engine.device).eval()
    import logging
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no "flags may be ignored" chatter between the tables
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "eos disabled": we mean it
    # Ignore EOS like the trace does: no id to stop on (generate fills None from here).
    model.generation_config.eos_token_id = None
    return model


def _pad_id(model) -> int:
    for v in (model.config.pad_token_id, model.config.eos_token_id, 0):
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None and v >= 0:
            return int(v)
    return 0


@torch.inference_mode()
def run_hf_static(model, trace, batch_size: int) -> dict:
    from transformers import GenerationConfig

    pad = _pad_id(model)
    dev = model.device

    def gen(prompts, max_new):
        L = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=dev)
        gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        return out[:, L:].tolist()

    gen([[11, 12, 13, 14]], 4)  # warm up
    outputs, computed = {}, 0
    total = sum(r.output_len for r in trace)
    bar = progress(total, "transformers static", "tok")
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(trace), batch_size):
        batch = trace[i : i + batch_size]
        longest = max(r.output_len for r in batch)
        rows = gen([list(r.prompt_token_ids) for r in batch], longest)
        for r, row in zip(batch, rows):
            outputs[r.request_id] = row[: r.output_len]  # the rest of the row is padding work
        computed += len(batch) * longest
        bar.update(sum(r.output_len for r in batch))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    bar.close()
    produced = sum(len(v) for v in outputs.values())
    return dict(
        wall_s=wall,
        cpu_s=cpu,
        output_tokens=produced,
        tok_per_s=produced / wall,
        tok_per_cpu_s=produced / cpu,
        generated_incl_padding=computed,
        wasted_fraction=1 - produced / computed,
        batches=math.ceil(len(trace) / batch_size),
        outputs=outputs,
    )


@torch.inference_mode()
def run_hf_continuous(model, trace, cfg, timeout_s: float) -> dict:
    """transformers' own continuous batching manager, per-request max_new_tokens."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pad = _pad_id(model)
    kv_tokens = cfg["kv_tokens"]
    cbc = ContinuousBatchingConfig(
        page_size=cfg["block_size"],
        num_blocks=math.ceil(kv_tokens / cfg["block_size"]),
        max_batch_tokens=cfg["max_num_batched_tokens"],
        max_requests_per_batch=cfg["max_num_seqs"],
        seed=0,
    )
    gc = GenerationConfig(
        do_sample=False, max_new_tokens=max(r.output_len for r in trace), eos_token_id=None, pad_token_id=pad
    )  # None -> -1: EOS disabled
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.warmup()
    mgr.start()
    try:

        def collect(ids, deadline, bar=None):
            res = {}
            while len(res) < len(ids):
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"{len(ids) - len(res)} of {len(ids)} requests unfinished after {timeout_s:.0f}s"
                    )
                r = mgr.get_result(timeout=1)
                if r is None:
                    if not mgr.is_running():
                        raise RuntimeError("transformers' generation thread stopped")
                    continue
                if r.is_finished():
                    if getattr(r, "error", None):
                        raise RuntimeError(f"request {r.request_id}: {r.error}")
                    res[r.request_id] = list(r.generated_tokens)
                    if bar is not None:
                        bar.update(len(r.generated_tokens))
            return res

        mgr.add_request([11, 12, 13, 14], request_id="warmup", max_new_tokens=4)  # warm up
        collect(["warmup"], time.perf_counter() + timeout_s)
        total = sum(r.output_len for r in trace)
        bar = progress(total, "transformers continuous", "tok")
        c0, t0 = time.process_time(), time.perf_counter()
        for r in trace:
            rid = mgr.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.output_len)
            if rid is None:
                raise RuntimeError(f"the manager refused request {r.request_id}")
        outputs = collect([r.request_id for r in trace], t0 + timeout_s, bar)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0  # CPU time of all threads
        bar.close()
    finally:
        mgr.stop(block=True, timeout=10)
        destroy = getattr(mgr, "destroy", None)
        if destroy:
            destroy()
    produced = sum(len(v) for v in outputs.values())
    return dict(
        wall_s=wall,
        cpu_s=cpu,
        output_tokens=produced,
        tok_per_s=produced / wall,
        tok_per_cpu_s=produced / cpu,
        outputs=outputs,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
    )


def _median_side(sides: list[dict]) -> dict:
    """One side over several rounds: the round with the median throughput (its outputs and
    counters), with every rate replaced by the median of that rate over the rounds."""
    ok = [s for s in sides if "error" not in s]
    if not ok:
        return sides[0]
    mid = dict(sorted(ok, key=lambda s: s["tok_per_s"])[len(ok) // 2])
    for key in ("wall_s", "cpu_s", "tok_per_s", "tok_per_cpu_s"):
        vals = sorted(s[key] for s in ok)
        mid[key] = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
    mid["rounds"] = len(ok)
    return mid


def agreement(a: dict, b: dict) -> float:
    """Fraction of requests whose greedy outputs are identical on both sides."""
    same = sum(1 for k in a if a[k] == b.get(k))
    return same / len(a) if a else float("nan")


# --------------------------------------------------------------------------------------

# Qwen3-0.6B's shape (the cost model's preset), for the GPU comparison on a real-sized model.
QWEN3_06B = dict(
    num_hidden_layers=28,
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    bos_token_id=151643,
    eos_token_id=151645,
)
MODELS = ("shipped", "qwen3-0.6b")


def qwen3_random_checkpoint(dtype: torch.dtype) -> str:
    """A seeded, randomly initialised checkpoint directory of Qwen3-0.6B's shape (transformers'
    own initialisation), written once under the temp dir: both engines load the same files."""
    import os
    import tempfile
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = os.path.join(tempfile.gettempdir(), "minillm-bench", f"qwen3-0.6b-random-{str(dtype).split('.')[-1]}")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B, dtype=dtype)).to(dtype)
        model.save_pretrained(path, safe_serialization=True)
    return path


def build_engine(args, max_num_seqs: int):
    """(engine, label): the shipped model in float32, or (``--model qwen3-0.6b``) a random
    Qwen3-0.6B-shaped checkpoint, in bfloat16 on a GPU and float32 on the CPU."""
    from .. import LLM

    name = getattr(args, "model", "shipped") or "shipped"
    if name not in MODELS:
        raise ValueError(f"--model={name!r}: choose one of {MODELS}")
    if name == "shipped":
        llm, label = make_llm(max_num_seqs=max_num_seqs, dtype="float32", device=args.device, record="summary")
    else:
        dtype = torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32
        llm = LLM(
            qwen3_random_checkpoint(dtype),
            max_num_seqs=max_num_seqs,
            dtype=str(dtype).split(".")[-1],
            device=args.device,
            record="summary",
        )
        label = f"random Qwen3-0.6B-shaped checkpoint ({str(dtype).split('.')[-1]})"
    return llm.engine, label


def run(args) -> dict:
    from ..analysis.workloads import synthetic_trace

    P = _sizes(args.size)
    repeat = int(getattr(args, "repeat", 1))
    if repeat < 1:
        raise ValueError(f"--repeat={repeat}: must be >= 1")
    threads = set_threads(args)
    engine, label = build_engine(args, P["max_num_seqs"])
    trace = synthetic_trace(
        P["n"],
        rate=None,
        prompt_len=P["prompt_len"],
        output_len=P["output_len"],
        vocab_size=engine.vocab_size,
        seed=args.seed,
    )
    cfg = dict(
        model=label,
        n=P["n"],
        max_num_seqs=P["max_num_seqs"],
        block_size=engine.config.block_size,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        kv_tokens=engine.num_kv_blocks * engine.config.block_size,
        dtype=str(engine.dtype),
        torch_threads=threads,
        prompt_len=repr(P["prompt_len"]),
        output_len=repr(P["output_len"]),
        output_tokens=sum(r.output_len for r in trace),
        max_output_len=max(r.output_len for r in trace),
        arrivals="all at once",
        ignore_eos=True,
        greedy=True,
    )

    model = hf_model_from(engine)
    assert next(model.parameters()).dtype == engine.dtype
    rounds = []
    for i in range(repeat):
        if i:  # a fresh engine: request ids are used once
            engine = build_engine(args, P["max_num_seqs"])[0]
        mini = run_minillm(engine, trace)
        static = run_hf_static(model, trace, P["max_num_seqs"])
        try:
            cont = run_hf_continuous(model, trace, cfg, timeout_s=max(120.0, 20 * mini["wall_s"]))
        except Exception as e:  # report, do not crash: the table says why
            cont = dict(error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        rounds.append((mini, static, cont))
    mini, static, cont = (_median_side([r[k] for r in rounds]) for k in range(3))

    res = {"minillm": mini, "hf_static": static, "hf_continuous": cont}
    if repeat > 1:
        res["rounds"] = [
            {
                "minillm_tok_per_s": m["tok_per_s"],
                "hf_static_tok_per_s": s_["tok_per_s"],
                "hf_continuous_tok_per_s": c.get("tok_per_s"),
                "ratio_vs_hf_static": m["tok_per_s"] / s_["tok_per_s"],
                "ratio_vs_hf_continuous": m["tok_per_s"] / c["tok_per_s"] if "tok_per_s" in c else None,
            }
            for m, s_, c in rounds
        ]
    ratio = lambda key, side: mini[key] / side[key] if key in side else None  # noqa: E731
    r_static, r_cont = ratio("tok_per_s", static), ratio("tok_per_s", cont)
    res.update(
        ratio_vs_hf_static=r_static,
        ratio_vs_hf_continuous=r_cont,
        cpu_ratio_vs_hf_static=ratio("tok_per_cpu_s", static),
        cpu_ratio_vs_hf_continuous=ratio("tok_per_cpu_s", cont),
        greedy_agreement_hf_static=agreement(mini["outputs"], static["outputs"]),
    )
    if "outputs" in cont:
        res["greedy_agreement_hf_continuous"] = agreement(mini["outputs"], cont["outputs"])
    for side in (mini, static, cont):
        side.pop("outputs", None)
    for side in (s for r in rounds for s in r):
        side.pop("outputs", None)

    def row(name, side, note):
        if "error" in side:
            return [name, "-", "-", "-", "-", "-", "-", f"did not run: {side['error']}"]
        return [
            name,
            side["output_tokens"],
            side["wall_s"],
            side["tok_per_s"],
            ratio("tok_per_s", side),
            side["tok_per_cpu_s"],
            ratio("tok_per_cpu_s", side),
            note,
        ]

    pct = lambda k: f"{100 * res[k]:.0f}%" if k in res else "-"  # noqa: E731
    rows = [
        row("minillm (continuous, paged)", mini, f"{mini['steps']} steps, mean batch {mini['batch_mean']:.1f}"),
        row(
            "transformers generate (static)",
            static,
            f"{static['batches']} batches; {100 * static['wasted_fraction']:.0f}% of generated tokens are "
            f"padding; same greedy tokens as minillm: {pct('greedy_agreement_hf_static')}",
        ),
        row(
            "transformers continuous batching",
            cont,
            f"attn {cont.get('attn_implementation')}; same greedy tokens as minillm: "
            f"{pct('greedy_agreement_hf_continuous')}",
        ),
    ]
    t = table(
        [
            "engine",
            "output tokens",
            "wall (s)",
            "output tok/s",
            "minillm / this",
            "tok per CPU-s",
            "minillm / this (CPU)",
            "notes",
        ],
        rows,
        title=f"{P['n']} requests, max batch {P['max_num_seqs']}, output lengths {P['output_len']!r} "
        f"(max {cfg['max_output_len']}), {label}",
    )
    tables = [t]
    if repeat > 1:
        tables.append(
            table(
                [
                    "round",
                    "minillm tok/s",
                    "static tok/s",
                    "continuous tok/s",
                    "minillm / static",
                    "minillm / continuous",
                ],
                [
                    [
                        i + 1,
                        r["minillm_tok_per_s"],
                        r["hf_static_tok_per_s"],
                        r["hf_continuous_tok_per_s"],
                        r["ratio_vs_hf_static"],
                        r["ratio_vs_hf_continuous"],
                    ]
                    for i, r in enumerate(res["rounds"])
                ],
                title=f"each of the {repeat} rounds (the table above: the median of each column)",
            )
        )
    goals = [
        goal("minillm / transformers static (tok/s)", ">= 3x", r_static, r_static >= 3),
        goal(
            "minillm / transformers continuous batching (tok/s)",
            ">= 3x",
            r_cont,
            None if r_cont is None else r_cont >= 3,
        ),
    ]
    return dict(config=cfg, results=res, goals=goals, _tables=tables)


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
