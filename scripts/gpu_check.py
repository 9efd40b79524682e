"""``make gpu-check``: everything a GPU can show that the CPU tests cannot, in one unattended run.

One command, one report file (``build/gpu_check_report.md`` unless ``--out`` says otherwise),
exit status 1 when any check fails. The checks, each a section of the report:

1. **kernels**: every Triton kernel against its torch reference on the GPU: paged attention
   (decode with split-K, prefill chunks, speculative verifies; head dims 128 and 80) in
   float16, bfloat16 and float32, on float, int8 and fp8 caches (fp8 where the GPU has it),
   and the KV store and block copy (which must match their references byte for byte);
2. **shipped model**: the engine's greedy tokens (Triton attention) against transformers'
   ``generate()`` on the shipped Shakespeare checkpoint, float32;
3. **qwen3-0.6b shape**: the same on a random-weight model of Qwen3-0.6B's shape;
4. **decode bandwidth**: decode attention's achieved bandwidth against the GPU's peak;
5. **vLLM**: generation throughput of the engine next to vLLM's on the qwen3-shaped model, when
   vLLM is installed (skipped otherwise).

``--dry-run`` runs the same code on the CPU through Triton's interpreter at small sizes, so the
GPU run is never the script's first run (the numbers it prints mean nothing about speed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Report:
    """The report file: sections of lines, and a verdict per check."""

    def __init__(self):
        self.lines: list[str] = []
        self.verdicts: list[tuple[str, str]] = []

    def section(self, title: str):
        self.lines += ["", f"## {title}", ""]

    def line(self, text: str = ""):
        print(text, flush=True)
        self.lines.append(text)

    def verdict(self, name: str, status: str, why: str = ""):
        self.verdicts.append((name, status))
        self.line(f"**{status}** {name}" + (f": {why}" if why else ""))

    def text(self, header: list[str]) -> str:
        summary = [f"- {status}: {name}" for name, status in self.verdicts]
        return "\n".join(header + ["", "## Summary", ""] + summary + self.lines) + "\n"


def run_check(report: Report, name: str, fn, *args):
    """One section: ``fn(report, *args)``; an exception is a FAIL with its traceback's tail."""
    report.section(name)
    t0 = time.time()
    try:
        fn(report, *args)
    except Exception as e:
        report.line("```")
        report.line("".join(traceback.format_exception(e))[-3000:])
        report.line("```")
        report.verdict(name, "FAIL", f"{type(e).__name__}: {e}")
    report.line(f"({time.time() - t0:.1f} s)")


# --- 1. the kernels against their references ----------------------------------------------------

TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}  # absolute and relative


def check_kernels(report: Report, dev, small: bool):
    import torch

    from minillm_kernels import ops
    from minillm_kernels.bench import Case
    from minillm_kernels.kv_formats import KV_FORMATS
    from minillm_kernels.kv_quant import format_available

    caches = ["auto"] + [k for k in KV_FORMATS if format_available(k, dev) is None]
    for k in KV_FORMATS:
        if format_available(k, dev):
            report.line(f"{k} caches skipped: {format_available(k, dev)}")
    # (name, batch, context, new tokens per request): decode (split-K on a GPU), a prefill chunk on a
    # cached prefix, speculative verification.
    steps = (
        [("decode", 3, 40, 1), ("prefill", 2, 24, 16), ("verify", 2, 30, 4)]
        if small
        else [("decode", 32, 2048, 1), ("prefill", 4, 768, 512), ("verify", 16, 1000, 4)]
    )
    shapes = [(4, 2, 16), (2, 2, 80)] if small else [(16, 8, 128), (32, 32, 80)]
    failed = 0
    for dtype_name, tol in TOLERANCE.items():
        dtype = getattr(torch, dtype_name)
        for kv in caches:
            for heads, kv_heads, head_dim in shapes:
                for step, batch, ctx, q_len in steps:
                    case = Case(batch, ctx, q_len, heads, kv_heads, head_dim, 16, dtype, dev, kv_cache_dtype=kv)
                    args = (
                        case.q,
                        case.k_cache,
                        case.v_cache,
                        case.block_tables,
                        case.cu_seqlens_q,
                        case.context_lens,
                        case.scale,
                    )
                    scales = dict(k_scale=case.k_scale, v_scale=case.v_scale)
                    out = ops.paged_attention(*args, max_q_len=q_len, backend="triton", **scales)
                    ref = ops.paged_attention(*args, backend="torch", **scales)
                    err = (out.float() - ref.float()).abs().max().item()
                    ok = torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol) and bool(out.isfinite().all())
                    failed += not ok
                    report.line(
                        f"- attention {dtype_name:8s} cache {kv:4s} heads {heads}/{kv_heads} "
                        f"head_dim {head_dim:3d} {step:7s} B={batch} ctx={ctx} q={q_len}: "
                        f"max |err| {err:.2e} (tolerance {tol:g}) {'ok' if ok else 'FAIL'}"
                    )
            failed += not _check_store_and_copy(report, dtype, kv, dev)
    report.verdict("kernels against their references", "FAIL" if failed else "PASS", f"{failed} failed")


def _check_store_and_copy(report: Report, dtype, kv: str, dev) -> bool:
    """store_kv and copy_blocks, Triton against the torch reference: the same bytes."""
    import torch

    from minillm_kernels import ops
    from minillm_kernels.kv_quant import storage_dtype

    g = torch.Generator(device=dev).manual_seed(1)
    num_blocks, page, kv_heads, head_dim = 8, 16, 2, 80
    shape = (num_blocks, page, kv_heads, head_dim)
    cache_dtype = dtype if kv == "auto" else storage_dtype(kv)
    pairs = []
    for _ in range(2):
        k, v = (torch.zeros(shape, device=dev).to(cache_dtype) for _ in "kv")
        scales = (
            {}
            if kv == "auto"
            else dict(k_scale=torch.zeros(shape[::2], device=dev), v_scale=torch.zeros(shape[::2], device=dev))
        )
        pairs.append((k, v, scales))
    slots = torch.tensor([16, 17, 18, -1, 40, 41, 5], device=dev)  # a chunk, padding, another run, one token
    x = torch.randn(len(slots), kv_heads, head_dim, generator=g, device=dev).to(dtype)
    src, dst = torch.tensor([1, 2], device=dev), torch.tensor([6, 7], device=dev)
    for (k, v, scales), backend in zip(pairs, ("triton", "torch")):
        ops.store_kv(x, -x, k, v, slots, backend=backend, **scales)
        ops.copy_blocks(k, v, src, dst, backend=backend, **scales)
    as_bytes = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    same = all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(pairs[0][:2], pairs[1][:2]))
    same &= all(torch.equal(pairs[0][2][n], pairs[1][2][n]) for n in pairs[0][2])
    report.line(
        f"- store_kv + copy_blocks {str(dtype).removeprefix('torch.'):8s} cache {kv:4s}: "
        f"{'same bytes as the reference' if same else 'FAIL: differs from the reference'}"
    )
    return same


# --- 2, 3. the engine's greedy tokens against transformers ------------------------------------------


def qwen3_shaped(path: Path, small: bool):
    """A random-weight checkpoint of Qwen3-0.6B's shape (a shrunken one for the dry run)."""
    import torch
    import transformers as tf

    shape = dict(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    if small:
        shape = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        **shape,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=1_000_000.0,
    )
    model = tf.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def check_greedy(report: Report, path: str, hf_model, dev, small: bool):
    """The engine (Triton attention, float32) and transformers, greedy, token for token."""
    import torch

    from minillm import LLM, SamplingParams

    n_new = 4 if small else 32
    vocab = hf_model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 9] if small else [7, 64, 300, 33, 129, 500, 16, 250]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    hf_model = hf_model.to(device=dev, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    want = []
    for p in prompts:
        out = hf_model.generate(torch.tensor([p], device=dev), max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    llm = LLM(
        path,
        dtype="float32",
        device=str(dev.type),
        attention_backend="triton",
        max_model_len=1024,
        block_size=16,
        max_num_batched_tokens=256,
    )  # chunked prefill: several steps per long prompt
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    got = [engine.get_output(i).token_ids for i in ids]
    same = sum(a == b for a, b in zip(got, want))
    for p, a, b in zip(prompts, got, want):
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            report.line(
                f"- prompt of {len(p)} tokens differs from token {first}: engine {a[first : first + 4]}, "
                f"transformers {b[first : first + 4]}"
            )
    report.verdict(
        f"greedy tokens equal transformers' ({Path(path).name})",
        "PASS" if same == len(prompts) else "FAIL",
        f"{same} of {len(prompts)} prompts identical over {n_new} new tokens",
    )


def check_shipped(report: Report, dev, small: bool):
    import transformers as tf

    from minillm.model.loader import DEFAULT_MODEL_DIR

    model = tf.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype="float32").eval()
    check_greedy(report, str(DEFAULT_MODEL_DIR), model, dev, small)


def check_qwen3(report: Report, dev, small: bool, workdir: Path):
    path = workdir / "qwen3-0.6b-shaped"
    check_greedy(report, str(path), qwen3_shaped(path, small), dev, small)


# --- 4. decode bandwidth ------------------------------------------------------------------------------


def check_bandwidth(report: Report, dev, small: bool):
    import torch

    from minillm_kernels.bench import Case, peak_bandwidth_gbps

    case = (
        Case(2, 48, 1, 4, 2, 16, 16, torch.bfloat16, dev)
        if small
        else Case(64, 4096, 1, 32, 8, 128, 16, torch.bfloat16, dev)
    )
    if dev.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(case.ours, warmup=25, rep=100, return_mode="median")
        peak, source = peak_bandwidth_gbps(torch.cuda.get_device_properties(dev))
    else:
        case.ours()
        t0 = time.perf_counter()
        case.ours()
        ms, peak, source = (time.perf_counter() - t0) * 1e3, None, "no GPU"
    gbps = case.io_bytes() / ms / 1e6
    report.line(
        f"decode, batch {case.batch}, context {case.ctx}, heads {case.heads}/{case.kv_heads}, head_dim "
        f"{case.head_dim}, bfloat16: {ms:.3f} ms, {gbps:.1f} GB/s"
    )
    if peak:
        report.verdict(
            "decode attention bandwidth",
            "INFO",
            f"{gbps:.0f} GB/s = {100 * gbps / peak:.0f}% of the peak {peak:.0f} GB/s ({source}); the goal is 70%",
        )
    else:
        report.verdict(
            "decode attention bandwidth",
            "INFO",
            f"{gbps:.3f} GB/s on the CPU interpreter (no peak to compare: the dry run only exercises the code)",
        )


# --- 5. vLLM ------------------------------------------------------------------------------------------


def check_vllm(report: Report, dev, small: bool, workdir: Path):
    if importlib.util.find_spec("vllm") is None or dev.type != "cuda":
        report.verdict(
            "throughput next to vLLM", "SKIP", "vLLM is not installed" if dev.type == "cuda" else "no GPU (dry run)"
        )
        return
    import torch
    import vllm

    from minillm import LLM, SamplingParams

    path = workdir / "qwen3-0.6b-shaped"
    if not path.exists():
        qwen3_shaped(path, small)
    n, n_new = 64, 128
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 151_936, (256,), generator=g).tolist() for _ in range(n)]
    ours = LLM(
        str(path),
        dtype="bfloat16",
        device="cuda",
        attention_backend="triton",
        max_model_len=1024,
        max_num_seqs=n,
        kv_cache_memory_gb=8,
    )
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    ours.generate(prompts[:2], params)  # compile the kernels first
    t0 = time.perf_counter()
    ours.generate(prompts, params)
    ours_tps = n * n_new / (time.perf_counter() - t0)
    del ours
    torch.cuda.empty_cache()
    theirs = vllm.LLM(
        model=str(path), dtype="bfloat16", skip_tokenizer_init=True, gpu_memory_utilization=0.5, max_model_len=1024
    )
    vparams = vllm.SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    theirs.generate(inputs[:2], vparams)
    t0 = time.perf_counter()
    theirs.generate(inputs, vparams)
    vllm_tps = n * n_new / (time.perf_counter() - t0)
    report.verdict(
        "throughput next to vLLM",
        "INFO",
        f"{n} requests x {n_new} tokens: minillm {ours_tps:.0f} "
        f"tokens/s, vLLM {vllm.__version__} {vllm_tps:.0f} tokens/s ({ours_tps / vllm_tps:.2f}x)",
    )


# ------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU, Triton's interpreter, small sizes")
    p.add_argument("--out", default=str(REPO / "build" / "gpu_check_report.md"))
    args = p.parse_args(argv)
    small = args.dry_run
    if small:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    import minillm_kernels
    import triton

    if not small and not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU, and torch sees none; make gpu-check DRY_RUN=1 runs it on the CPU")
        return 2
    dev = torch.device("cpu" if small else "cuda")
    t0 = time.time()
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        run_check(report, "kernels", check_kernels, dev, small)
        run_check(report, "shipped model", check_shipped, dev, small)
        run_check(report, "qwen3-0.6b shape", check_qwen3, dev, small, Path(tmp))
        run_check(report, "decode bandwidth", check_bandwidth, dev, small)
        run_check(report, "vLLM", check_vllm, dev, small, Path(tmp))
    if dev.type == "cuda":
        from minillm_kernels.targets import device_target

        target = device_target(dev.index or 0)
        where = f"{torch.cuda.get_device_name(dev)} (sm_{target.capability}, {target.shared_memory} B shared memory)"
    else:
        where = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter: a dry run"
    header = [
        "# minillm gpu-check",
        "",
        f"- device: {where}",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}",
        f"- kernels from {list(minillm_kernels.__path__)[0]}",
        f"- {'dry run, small sizes' if small else 'full sizes'}; {time.time() - t0:.0f} s in all",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.text(header))
    failed = [name for name, status in report.verdicts if status == "FAIL"]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "no failures"
    print(f"\nreport: {out} ({time.time() - t0:.0f} s); {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
