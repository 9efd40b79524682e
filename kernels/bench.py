"""``python -m minillm_kernels.bench``: how fast is our paged attention, next to the alternatives?

Decode reads every retained K/V byte once per step and does little arithmetic per
byte: it is *memory-bound*, so we report the achieved HBM bandwidth (GB/s and % of the
GPU's peak). Prefill does ``O(q_len)`` work per byte: it is *compute-bound*, so we report
TFLOP/s. Every row is measured side by side in one run:

* ``ours``      the Triton kernel reading K/V through the block table;
* ``sdpa``      torch ``scaled_dot_product_attention`` on the same data, first gathered
                out of the paged cache into contiguous tensors (the gather is timed too:
                it is what a serving engine without a paged kernel has to do);
* ``flash-attn`` / ``flashinfer``, when installed (paged APIs where they have one).

Goal on H100/H200: decode >= 70% of peak HBM bandwidth for batch >= 32, context >= 1k.
Without CUDA there is nothing to measure: the script says so and exits 0.

``--kv-cache-dtype int8`` (or ``fp8``) runs the same cases on a quantized cache (one byte per
value, a float32 scale per block and KV head): ``ours`` dequantizes on load, ``sdpa+gather``
gathers and dequantizes first. The bytes counted are the bytes read, so at the same % of peak
a quantized decode step takes about half the time of a 16-bit one.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from .kv_formats import KV_FORMATS

# Datasheet HBM bandwidth, GB/s. More specific names first ("H200" before "H20").
_PEAK_GBPS = [
    ("GH200", 4000),
    ("H200", 4800),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("H800", 3350),
    ("H20", 4000),
    ("B200", 8000),
    ("B100", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),
    ("A800", 2039),
    ("L40S", 864),
    ("L40", 864),
    ("L4", 300),
    ("A10G", 600),
    ("A10", 600),
    ("RTX 6000 Ada", 960),
    ("A6000", 768),
    ("RTX 4090", 1008),
    ("RTX 3090", 936),
    ("V100", 900),
    ("T4", 320),
]


def peak_bandwidth_gbps(props) -> tuple[float | None, str]:
    for name, gbps in _PEAK_GBPS:
        if name.lower() in props.name.lower():
            return float(gbps), "datasheet"
    clock_khz = getattr(props, "memory_clock_rate", 0)  # newer torch exposes these
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "clock x bus width"
    return None, "unknown"


def _time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_bandwidth_gbps(dev) -> float:
    """Achievable bandwidth: a 1 GiB device-to-device copy (reads + writes)."""
    a = torch.empty(1 << 29, dtype=torch.float16, device=dev)
    b = torch.empty_like(a)
    ms = _time_ms(lambda: b.copy_(a))
    return 2 * a.numel() * a.element_size() / ms / 1e6


class Case:
    """One batch: ``batch`` requests of ``ctx`` tokens of KV, ``q_len`` of them new."""

    def __init__(
        self, batch, ctx, q_len, heads, kv_heads, head_dim, block_size, dtype, dev, seed=0, kv_cache_dtype="auto"
    ):
        g = torch.Generator(device=dev).manual_seed(seed)
        self.batch, self.ctx, self.q_len = batch, ctx, q_len
        self.heads, self.kv_heads, self.head_dim, self.block_size = heads, kv_heads, head_dim, block_size
        blocks_per_req = math.ceil(ctx / block_size)
        num_blocks = batch * blocks_per_req
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.quantized = kv_cache_dtype != "auto"
        self.k_scale = self.v_scale = None
        if not self.quantized:
            self.k_cache = torch.randn(shape, generator=g, device=dev, dtype=dtype)
            self.v_cache = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        else:  # stored values and scales drawn directly (no full-precision copy of a large cache)
            self.k_cache, self.v_cache = (self._random_quantized(shape, kv_cache_dtype, g, dev) for _ in "kv")
            self.k_scale, self.v_scale = (torch.rand(shape[::2], generator=g, device=dev) * 0.02 + 0.005 for _ in "kv")
        # Blocks scattered over the pool, as after a while of serving.
        perm = torch.randperm(num_blocks, generator=g, device=dev)
        self.block_tables = perm.view(batch, blocks_per_req).to(torch.int32)
        self.cu_seqlens_q = torch.arange(0, (batch + 1) * q_len, q_len, device=dev, dtype=torch.int32)
        self.context_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        self.q = torch.randn(batch * q_len, heads, head_dim, generator=g, device=dev, dtype=dtype)
        self.scale = head_dim**-0.5

    @staticmethod
    def _random_quantized(shape, kind, g, dev):
        from .kv_quant import QMAX, quantize

        x = torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * (QMAX[kind] / 4)
        return quantize(x, torch.ones((), device=dev), kind)  # values spread over the format's range

    # --- the work, in bytes and FLOPs ---
    def kv_bytes(self) -> int:
        values = 2 * self.batch * self.ctx * self.kv_heads * self.head_dim * self.k_cache.element_size()
        if self.quantized:  # each request's blocks' scales, K and V
            values += 2 * self.block_tables.numel() * self.kv_heads * self.k_scale.element_size()
        return values

    def io_bytes(self) -> int:  # K/V read once, q read, out written
        return self.kv_bytes() + 2 * self.q.numel() * self.q.element_size()

    def flops(self) -> float:  # QK^T and PV over the causally visible keys
        prefix = self.ctx - self.q_len
        visible = self.q_len * prefix + self.q_len * (self.q_len + 1) / 2
        return 4.0 * self.batch * self.heads * self.head_dim * visible

    # --- implementations ---
    def ours(self):
        from .attention import paged_attention_triton

        return paged_attention_triton(
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.cu_seqlens_q,
            self.context_lens,
            self.scale,
            max_q_len=self.q_len,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def gather(self):
        """The paged cache gathered into contiguous [batch, kv_heads, ctx, head_dim] (dequantized
        to the query's dtype when the cache is quantized)."""
        idx = self.block_tables.long()
        k, v = self.k_cache[idx], self.v_cache[idx]  # [batch, blocks, block_size, kv_heads, head_dim]
        if self.quantized:
            k = (k.float() * self.k_scale[idx][:, :, None, :, None]).to(self.q.dtype)
            v = (v.float() * self.v_scale[idx][:, :, None, :, None]).to(self.q.dtype)
        k = k.flatten(1, 2)[:, : self.ctx].transpose(1, 2)
        v = v.flatten(1, 2)[:, : self.ctx].transpose(1, 2)
        return k, v

    def sdpa(self):
        import torch.nn.functional as F

        k, v = self.gather()
        q = self.q.view(self.batch, self.q_len, self.heads, self.head_dim).transpose(1, 2)
        mask = None
        if self.q_len > 1:
            pos = self.ctx - self.q_len + torch.arange(self.q_len, device=q.device)
            mask = torch.arange(self.ctx, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(1, 2).reshape_as(self.q)


def _flash_attn(case: Case):
    """flash-attn's paged decode/prefill: it wants blocks of 256 tokens, so it gets its
    own copy of the same KV laid out that way (not timed)."""
    from flash_attn import flash_attn_with_kvcache

    page = 256
    k, v = case.gather()  # [B, Hkv, ctx, D]
    pad = (-case.ctx) % page

    def paged(x):
        x = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, pad))  # [B, ctx+pad, Hkv, D]
        return x.reshape(-1, page, case.kv_heads, case.head_dim).contiguous()

    kc, vc = paged(k), paged(v)
    per_req = (case.ctx + pad) // page
    bt = torch.arange(case.batch * per_req, device=kc.device, dtype=torch.int32).view(case.batch, per_req)
    q = case.q.view(case.batch, case.q_len, case.heads, case.head_dim)
    del k, v

    def run():
        return flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=case.context_lens, block_table=bt, softmax_scale=case.scale, causal=True
        ).reshape_as(case.q)

    return run


def _flashinfer(case: Case):
    """flashinfer's paged wrappers, on our cache as is (same NHD layout)."""
    import flashinfer

    dev = case.q.device
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    per_req = case.block_tables.shape[1]
    kv_indptr = torch.arange(0, (case.batch + 1) * per_req, per_req, device=dev, dtype=torch.int32)
    kv_indices = case.block_tables.flatten().contiguous()
    last = torch.full((case.batch,), (case.ctx - 1) % case.block_size + 1, device=dev, dtype=torch.int32)
    common = (case.heads, case.kv_heads, case.head_dim, case.block_size)
    if case.q_len == 1:
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(
            kv_indptr,
            kv_indices,
            last,
            *common,
            q_data_type=case.q.dtype,
            kv_data_type=case.q.dtype,
            sm_scale=case.scale,
        )
    else:
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(
            case.cu_seqlens_q,
            kv_indptr,
            kv_indices,
            last,
            *common,
            causal=True,
            q_data_type=case.q.dtype,
            kv_data_type=case.q.dtype,
            sm_scale=case.scale,
        )
    return lambda: w.run(case.q, (case.k_cache, case.v_cache))


def _candidates(case: Case):
    """(name, callable or the reason it is missing)."""
    yield "ours", case.ours
    yield "sdpa+gather", case.sdpa
    if case.quantized:
        return  # the others are set up for a 16-bit cache here
    for name, make in (("flash-attn", _flash_attn), ("flashinfer", _flashinfer)):
        try:
            yield name, make(case)
        except ImportError:
            continue  # not installed: no column
        except Exception as e:  # an API that moved: say so, keep benchmarking
            yield name, f"{type(e).__name__}: {e}"[:60]


def _measure(case: Case, metric):
    """{name: (value, note)} for every candidate; checks each against ours first."""
    results, expected = {}, None
    for name, fn in _candidates(case):
        if isinstance(fn, str):
            results[name] = (None, fn)
            continue
        try:
            out = fn()
            if expected is None:
                expected = out
            note = ""
            if not torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2):
                note = "MISMATCH"
            results[name] = (metric(_time_ms(fn)), note)
        except torch.cuda.OutOfMemoryError:
            results[name] = (None, "OOM")
        except Exception as e:
            results[name] = (None, f"{type(e).__name__}: {e}"[:60])
        torch.cuda.empty_cache()
    return results


def _fmt(results, unit, peak=None):
    cells = []
    for name, (value, note) in results.items():
        if value is None:
            cells.append(f"{name} -- ({note})")
            continue
        pct = f" {100 * value / peak:3.0f}%" if peak else ""
        cells.append(f"{name} {value:7.1f} {unit}{pct}{' ' + note if note else ''}")
    return " | ".join(cells)


def _fits(nbytes: int, dev) -> bool:
    free, _ = torch.cuda.mem_get_info(dev)
    return nbytes * 3 < free  # cache + a gathered copy + headroom


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="512,1024,2048,4096,8192")
    p.add_argument("--chunks", default="128,256,512,1024,2048,4096", help="prefill query tokens per request")
    p.add_argument("--prefix", type=int, default=0, help="KV tokens already cached before each prefill chunk")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="batch size x chunk, roughly")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *KV_FORMATS],
        help="auto: the cache in --dtype; int8 / fp8: quantized, one scale per (block, KV head)",
    )
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "minillm_kernels.bench measures GPU throughput and needs CUDA; torch sees no CUDA device here. "
            "Nothing to measure (the kernels' correctness tests run on CPU: pytest tests/test_kernels.py)."
        )
        return 0

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(dev)
    peak, source = peak_bandwidth_gbps(props)
    copy_bw = _copy_bandwidth_gbps(dev)
    if args.kv_cache_dtype != "auto":
        from .kv_quant import check_available

        check_available(args.kv_cache_dtype, dev)
    shape = dict(
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        block_size=args.block_size,
        dtype=dtype,
        dev=dev,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    kv_elt = dtype.itemsize if args.kv_cache_dtype == "auto" else 4  # quantized values are drawn via a float32 copy
    print(
        f"{props.name}: {props.multi_processor_count} SMs, peak HBM "
        f"{f'{peak:.0f} GB/s ({source})' if peak else 'unknown'}, measured copy {copy_bw:.0f} GB/s"
    )
    print(
        f"heads {args.heads}/{args.kv_heads} (GQA {args.heads // args.kv_heads}), head_dim {args.head_dim}, "
        f"block_size {args.block_size}, {args.dtype}, KV cache {args.kv_cache_dtype}; median of do_bench, L2 flushed"
    )
    peak = peak or copy_bw

    print("\n== decode: one new token per request; achieved bandwidth = K/V/q/out bytes / time ==")
    goal = []
    for ctx in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            case_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * kv_elt
            if not _fits(case_bytes, dev):
                print(f"B={batch:4d} ctx={ctx:5d} | skipped: does not fit")
                continue
            case = Case(batch, ctx, 1, **shape)
            res = _measure(case, lambda ms, c=case: c.io_bytes() / ms / 1e6)
            print(f"B={batch:4d} ctx={ctx:5d} | {_fmt(res, 'GB/s', peak)}")
            if batch >= 32 and ctx >= 1024 and res["ours"][0]:
                goal.append(res["ours"][0] / peak)
            del case
            torch.cuda.empty_cache()
    if goal:
        print(
            f"goal (batch >= 32, ctx >= 1k): worst {100 * min(goal):.0f}% / median "
            f"{100 * sorted(goal)[len(goal) // 2]:.0f}% of peak -> {'MET' if min(goal) >= 0.7 else 'NOT met'} (70%)"
        )

    print(f"\n== prefill: chunks of new tokens on top of {args.prefix} cached tokens; causal TFLOP/s ==")
    for chunk in map(int, args.chunks.split(",")):
        batch = max(1, args.prefill_tokens // chunk)
        case = Case(batch, args.prefix + chunk, chunk, **shape)
        res = _measure(case, lambda ms, c=case: c.flops() / ms / 1e9)
        print(f"chunk={chunk:5d} x{batch:3d} | {_fmt(res, 'TFLOP/s')}")
        del case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
