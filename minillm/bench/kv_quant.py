"""kv-quant: what a quantized KV cache costs in quality, and what it buys in capacity.

The shipped model reads the held-out slice (``minillm/checkpoints/shakespeare/heldout_slice.txt``,
text it never trained on) with its KV cache stored as float32, float16, int8 and fp8 (e4m3), the
model itself in float32 throughout, so the KV storage is the only difference:

* **held-out nats/char**, teacher forced: windows of ``context + 1`` tokens every ``context``
  tokens (the model card's rule), all windows as one batch. Two ways of filling the cache:
  ``decode`` writes one token per step, so every block fills token by token (its scale grows and
  its earlier rows are re-quantized: the hard case); ``prefill`` writes each window in one step;
* **top-1 agreement**: how often the next-token argmax under teacher forcing equals float32's;
* **greedy agreement**: prompts from the held-out text, greedy continuations, compared token by
  token with float32's (positions equal, and the share of tokens before the first divergence);
* **capacity**: KV blocks (of 16 positions) that ``kv_cache_memory_gb`` buys for each dtype, as
  the engine sizes them (values and scales), and the ratio to float16;
* **modeled**: the roofline cost model's largest batch and decode throughput for Llama-2-7B on
  an H100 with bf16, int8 and fp8 KV (the batching-math consequence, shapes only).

The helpers (:func:`teacher_forced`, :func:`greedy`) drive the model over a paged cache directly
(no scheduler), so they are shared by ``tests/test_kv_quant.py``; :func:`quality` puts them
together per KV dtype for this benchmark and notebook 02.
"""

from __future__ import annotations

import math
import time
from typing import Optional

from minillm_kernels.kv_formats import KV_FORMATS

from .common import finish, goal, pct, pick, set_threads, table

NAME = "kv-quant"
KV_DTYPES = ("float32", "float16", *KV_FORMATS)


class FewLevels:
    """An int8 store that keeps only the integers ``-levels ... +levels`` (``levels=7``: the 15 of a
    4-bit format): the same per-(block, head) scale, ``amax / levels``, and rounding as the int8 store,
    with 18 times coarser steps. An exaggerated case that shows what quantization error does to a
    model once it is large enough to matter (``EngineConfig.kv_quantizer`` takes it too)."""

    def __init__(self, levels: int = 7):
        if not 1 <= levels <= 127:
            raise ValueError(f"FewLevels(levels={levels!r}): must be in 1..127 (an int8 holds it)")
        self.levels = float(levels)

    def new_scale(self, old, amax, kind):
        import torch

        return torch.maximum(old, amax / self.levels)

    def quantize(self, x, scale, kind):
        import torch

        s = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(x.to(torch.float32) / s).clamp(-self.levels, self.levels).to(torch.int8)

    def dequantize(self, q, scale):
        import torch

        return q.to(torch.float32) * scale

    def __repr__(self) -> str:
        return f"FewLevels({int(self.levels)})"


# KV kinds beyond the engine's dtypes: name -> (the cache's storage dtype, the store's arithmetic).
EXAGGERATED = {"int4-like": ("int8", FewLevels(7))}


def _storage(kind) -> tuple[str, Optional[object]]:
    """A KV kind's storage dtype and quantizer (None: the engine's own): a dtype name, a name in
    ``EXAGGERATED``, or the pair itself, ``(storage dtype, quantizer)``."""
    if isinstance(kind, tuple):
        return kind
    return EXAGGERATED.get(kind, (kind, None))


def _sizes(size: str) -> dict:
    return pick(
        size,
        tiny=dict(tokens=300, context=128, prompts=2, prompt_len=16, new=8),
        small=dict(tokens=2100, context=512, prompts=8, prompt_len=32, new=32),
        full=dict(tokens=None, context=1024, prompts=16, prompt_len=32, new=64),
    )


# --------------------------------------------------------------------------------------
# Driving the model over a paged cache of a given dtype
# --------------------------------------------------------------------------------------


class PagedRun:
    """A batch of sequences on ``model``, each with its own blocks of a fresh cache whose values
    are stored as ``kv_cache_dtype`` ("float32" | "float16" | "bfloat16" | "int8" | "fp8", a name in
    ``EXAGGERATED``, or a pair (storage dtype, quantizer))."""

    def __init__(self, model, lengths: list[int], kv_cache_dtype: str, block_size: int = 16):
        import torch

        from ..worker.kv_tensors import allocate_kv_cache

        kv_cache_dtype, self.quantizer = _storage(kv_cache_dtype)
        self.model, self.block_size = model, block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        need = [math.ceil(n / block_size) for n in lengths]
        caches, scales = allocate_kv_cache(
            model.num_layers,
            sum(need),
            block_size,
            model.num_kv_heads,
            model.head_dim,
            dtype,
            kv_cache_dtype,
            device=self.device,
        )
        self.caches = [kv + s for kv, s in zip(caches, scales)] if scales else caches
        firsts = [sum(need[:i]) for i in range(len(need))]
        self.tables = [list(range(f, f + n)) for f, n in zip(firsts, need)]
        self.torch = torch

    def forward(self, rows: list[int], chunks: list[list[int]], starts: list[int]):
        """Sequences ``rows`` bring ``chunks`` (new token ids) at positions ``starts``: float32
        logits for every new token, as one tensor per sequence."""
        from ..worker.flat_batch import flat_batch

        ids = [t for c in chunks for t in c]
        q_lens = [len(c) for c in chunks]
        input_ids, positions, meta, _ = flat_batch(
            ids, q_lens, starts, [self.tables[r] for r in rows], self.block_size, self.device, "torch"
        )
        meta.kv_quantizer = self.quantizer
        logits = self.model(input_ids, positions, self.caches, meta)
        return list(logits.split(q_lens))


def windows(ids: list[int], context: int) -> list[list[int]]:
    """Windows of ``context + 1`` tokens every ``context`` tokens: every token but the first is
    predicted exactly once (the model card's rule)."""
    return [ids[s : s + context + 1] for s in range(0, len(ids) - 1, context)]


def teacher_forced(
    model, ids: list[int], kv_cache_dtype: str, context: int = 1024, fill: str = "decode", block_size: int = 16
) -> dict:
    """Summed next-token loss (nats), predicted tokens and the argmax at each, over ``ids``.

    ``fill="decode"``: one token per step, so every block fills token by token; ``"prefill"``:
    each window in one step."""
    import torch
    import torch.nn.functional as F

    wins = windows(ids, context)
    run = PagedRun(model, [len(w) - 1 for w in wins], kv_cache_dtype, block_size)
    nats, n, argmax = 0.0, 0, [[] for _ in wins]

    def score(rows, logits, starts, chunk_lens):
        nonlocal nats, n
        for r, lg, s, q in zip(rows, logits, starts, chunk_lens):
            target = torch.tensor(wins[r][s + 1 : s + 1 + q], device=lg.device)
            nats += float(F.cross_entropy(lg.double(), target, reduction="sum"))
            n += q
            argmax[r] += lg.argmax(-1).tolist()

    with torch.inference_mode():
        if fill == "prefill":
            rows = list(range(len(wins)))
            chunks = [w[:-1] for w in wins]
            score(rows, run.forward(rows, chunks, [0] * len(rows)), [0] * len(rows), [len(c) for c in chunks])
        elif fill == "decode":
            for t in range(max(len(w) for w in wins) - 1):
                rows = [r for r, w in enumerate(wins) if len(w) - 1 > t]
                score(
                    rows,
                    run.forward(rows, [[wins[r][t]] for r in rows], [t] * len(rows)),
                    [t] * len(rows),
                    [1] * len(rows),
                )
        else:
            raise ValueError(f"fill={fill!r}: expected 'decode' or 'prefill'")
    return dict(nats=nats, predicted=n, argmax=[a for row in argmax for a in row])


def greedy(model, prompts: list[list[int]], max_new: int, kv_cache_dtype: str, block_size: int = 16) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (batched: the prompts in one step, then one token
    per step), with the KV stored as ``kv_cache_dtype``."""
    import torch

    run = PagedRun(model, [len(p) + max_new for p in prompts], kv_cache_dtype, block_size)
    rows = list(range(len(prompts)))
    with torch.inference_mode():
        logits = run.forward(rows, prompts, [0] * len(rows))
        out = [[int(lg[-1].argmax())] for lg in logits]
        for _ in range(max_new - 1):
            starts = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]
            logits = run.forward(rows, [[o[-1]] for o in out], starts)
            for o, lg in zip(out, logits):
                o.append(int(lg[-1].argmax()))
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token-by-token agreement of two sets of continuations: the share of positions equal, and
    the share of tokens before each pair's first divergence."""
    total = sum(len(x) for x in a)
    same = sum(x == y for xa, xb in zip(a, b) for x, y in zip(xa, xb))
    prefix = 0
    for xa, xb in zip(a, b):
        k = 0
        while k < min(len(xa), len(xb)) and xa[k] == xb[k]:
            k += 1
        prefix += k
    return dict(positions_equal=same / total, before_first_divergence=prefix / total)


def shipped_heldout(tokens: Optional[int] = None):
    """(model in float32, tokenizer, held-out text, its token ids): the first ``tokens`` ids
    (all when None), the text cut to what they cover."""
    from transformers import AutoTokenizer

    from ..model.loader import DEFAULT_MODEL_DIR
    from ..model.loader import load_model

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    text = (DEFAULT_MODEL_DIR / "heldout_slice.txt").read_text(encoding="utf-8")
    ids = tok.encode(text, add_special_tokens=False, verbose=False)
    if tokens is not None and tokens < len(ids):
        ids = ids[:tokens]
        text = tok.decode(ids)
    model, _ = load_model(str(DEFAULT_MODEL_DIR), "float32", "cpu", 0, {})
    return model, tok, text, ids


def available_kv_dtypes(device=None) -> list[str]:
    """``KV_DTYPES`` less the quantized formats that cannot run here (this torch, or the GPU ``device``:
    see ``minillm_kernels.kv_quant.format_available``)."""
    from minillm_kernels.kv_quant import format_available

    return [d for d in KV_DTYPES if d not in KV_FORMATS or format_available(d, device) is None]


def heldout_prompts(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, spread evenly over ``ids``."""
    stride = max(1, (len(ids) - length) // count)
    return [ids[i * stride : i * stride + length] for i in range(count)]


def quality(
    model,
    text: str,
    ids: list[int],
    prompts: list[list[int]],
    new: int,
    context: int,
    kv_dtypes: Optional[list[str]] = None,
    fills: tuple[str, ...] = ("decode", "prefill"),
) -> dict:
    """What storing the KV as each of ``kv_dtypes`` (float32 first: the baseline) does to
    ``model`` reading ``text`` (token ids ``ids``), per dtype:

    * ``nats_per_char_<fill>`` and ``rel_change_<fill>`` (against float32) for each fill of
      :func:`teacher_forced` (``fills``; "decode": one token per step, the hard case);
    * ``top1_agreement``: the share of next-token argmaxes equal to float32's (first fill);
    * ``greedy``: :func:`agreement` of ``new``-token greedy continuations of ``prompts`` with float32's.
    """
    kv_dtypes = list(kv_dtypes or available_kv_dtypes())
    if kv_dtypes[0] != "float32":
        raise ValueError(f"kv_dtypes={kv_dtypes}: the first must be 'float32', the baseline")
    raw = {}
    for name in kv_dtypes:
        t0 = time.perf_counter()
        r = {fill: teacher_forced(model, ids, name, context, fill) for fill in fills}
        r["greedy"] = greedy(model, prompts, new, name)
        r["wall_s"] = time.perf_counter() - t0
        raw[name] = r
    base, first = raw["float32"], fills[0]
    summary = {}
    for name in kv_dtypes:
        r = raw[name]
        s = {}
        for fill in fills:
            s[f"nats_per_char_{fill}"] = r[fill]["nats"] / len(text)
            s[f"rel_change_{fill}"] = r[fill]["nats"] / base[fill]["nats"] - 1
        argmax = r[first]["argmax"]
        s.update(
            top1_agreement=sum(a == b for a, b in zip(argmax, base[first]["argmax"])) / len(argmax),
            greedy=agreement(r["greedy"], base["greedy"]),
            predicted_tokens=r[first]["predicted"],
            wall_s=r["wall_s"],
        )
        summary[name] = s
    return summary


def capacity(memory_gb: float = 0.25, block_size: int = 16) -> dict:
    """KV blocks the engine sizes for ``memory_gb`` with the shipped model's shape, per KV dtype."""
    from ..sim.costmodel import kv_block_bytes
    from .common import SHIPPED_SHAPE as S

    elt = {"float32": 4, "float16": 2, **{k: f.bytes_per_value for k, f in KV_FORMATS.items()}}
    out = {}
    for name in KV_DTYPES:
        per_block = kv_block_bytes(
            S["num_hidden_layers"],
            block_size,
            S["num_key_value_heads"],
            S["head_dim"],
            elt[name],
            name if name in KV_FORMATS else "auto",
        )
        out[name] = dict(bytes_per_block=per_block, blocks=int(memory_gb * 2**30) // per_block)
    for name in KV_DTYPES:
        out[name]["vs_float16"] = out[name]["blocks"] / out["float16"]["blocks"]
    return out


def modeled(hardware: str = "H100-SXM", model: str = "llama-2-7b", context: int = 4096) -> dict:
    """What the KV dtype does to the batching math of a real-sized model (cost model only): the
    largest batch of ``context``-token requests that fits beside the weights, and a decode step
    at that batch."""
    from ..sim.costmodel import RooflineCostModel, max_batch_size

    out = {}
    for name, kv in (("bfloat16", None), *((k, k) for k in KV_FORMATS)):
        cm = RooflineCostModel(hardware, model, kv_cache_dtype=kv)
        b = max_batch_size(hardware, cm.model, context)
        t = cm.step_time([1] * b, [context] * b) if b else float("nan")
        out[name] = dict(
            kv_bytes_per_token=cm.kv_bytes_per_token,
            max_batch=b,
            step_ms=round(1e3 * t, 2),
            tokens_per_s=b / t if b else 0.0,
        )
    return out


# --------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------


def run(args) -> dict:
    from minillm_kernels.kv_quant import fp8_available
    from .common import shipped_model_available

    if not shipped_model_available():
        raise RuntimeError("kv-quant measures the shipped model's quality: minillm/checkpoints/shakespeare is missing")
    P = _sizes(args.size)
    threads = set_threads(args)
    model, tok, text, ids = shipped_heldout(P["tokens"])
    dtypes = available_kv_dtypes()
    prompts = heldout_prompts(ids, P["prompts"], P["prompt_len"])
    summary = quality(model, text, ids, prompts, P["new"], P["context"], dtypes)
    rows = []
    for name in dtypes:
        s, ag = summary[name], summary[name]["greedy"]
        rows.append(
            [
                name,
                f"{s['nats_per_char_decode']:.4f}",
                f"{100 * s['rel_change_decode']:+.3f}%",
                f"{s['nats_per_char_prefill']:.4f}",
                f"{100 * s['rel_change_prefill']:+.3f}%",
                pct(s["top1_agreement"]),
                pct(ag["positions_equal"]),
                pct(ag["before_first_divergence"]),
            ]
        )
    cap = capacity()
    mod = modeled()
    chars = len(text)
    t1 = table(
        [
            "KV dtype",
            "nats/char (decode)",
            "vs fp32",
            "nats/char (prefill)",
            "vs fp32",
            "top-1 = fp32's",
            "greedy tokens = fp32's",
            "before 1st divergence",
        ],
        rows,
        title=f"shipped model (float32) on the held-out slice, {len(ids)} tokens / {chars} chars, "
        f"windows of {P['context']}; greedy: {len(prompts)} prompts x {P['new']} new tokens",
    )
    t2 = table(
        ["KV dtype", "bytes per block (16 positions, 4 layers)", "blocks in 0.25 GiB", "vs float16"],
        [[n, cap[n]["bytes_per_block"], cap[n]["blocks"], f"{cap[n]['vs_float16']:.3f}x"] for n in KV_DTYPES],
        title="capacity: what kv_cache_memory_gb buys (values and scales)",
    )
    t3 = table(
        ["KV dtype", "KV bytes per token", "largest batch at 4096 tokens", "decode step (ms)", "decode tokens/s"],
        [[n, m["kv_bytes_per_token"], m["max_batch"], m["step_ms"], round(m["tokens_per_s"])] for n, m in mod.items()],
        title="modeled: Llama-2-7B (bf16 weights) on one H100-SXM, every request 4096 tokens long, "
        "the largest batch that fits (roofline cost model)",
    )
    goals = [
        goal(
            "int8 KV: held-out nats/char within 1% of float32 KV (decode fill)",
            "<= 1%",
            f"{100 * summary['int8']['rel_change_decode']:+.3f}%",
            abs(summary["int8"]["rel_change_decode"]) <= 0.01,
        ),
        goal(
            "int8 KV blocks at a fixed memory budget vs float16",
            ">= 1.9x",
            f"{cap['int8']['vs_float16']:.3f}x",
            cap["int8"]["vs_float16"] >= 1.9,
        ),
    ]
    cfg = dict(
        model="shipped shakespeare",
        model_dtype="float32",
        device="cpu",
        block_size=16,
        context=P["context"],
        tokens=len(ids),
        chars=chars,
        prompts=len(prompts),
        prompt_len=P["prompt_len"],
        new_tokens=P["new"],
        kv_dtypes=dtypes,
        fp8_skipped=fp8_available(),
        torch_threads=threads,
    )
    return dict(config=cfg, results=dict(quality=summary, capacity=cap, modeled=mod), goals=goals, _tables=[t1, t2, t3])


def main(args) -> dict:
    t0 = time.perf_counter()
    r = run(args)
    return finish(NAME, args, r, r.pop("_tables"), t0)
