"""The Triton kernels compile for a real GPU (Hopper, sm_90), even on a machine without one.

The interpreter (tests/test_kernels.py) checks what the kernels compute, but it accepts
code that the GPU compiler rejects (types of loop-carried values, early returns,
constexpr specialisation). So we also compile every kernel, at the tile sizes the
launcher picks, down to a cubin with the ptxas that ships inside Triton -- and check
that the K/V loads came out as 16-byte async copies (pipelined, vectorised), which is
what lets decode approach peak memory bandwidth. Slow (LLVM + ptxas): marked ``slow``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r'''
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minillm_kernels import attention, block_copy, kv_store

    TARGET = GPUTarget("cuda", 90, 32)
    TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    def build(fn, types, consts, num_warps=4, num_stages=3):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        # What the launcher's specialisation sees at runtime: 16-aligned pointers and strides.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n == "block_numel")}
        return triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                              options=dict(num_warps=num_warps, num_stages=num_stages))

    cases = [  # (dtype, head_dim, group, max_q_len, num_splits, KV cache: None = dtype, or int8/fp8)
        (torch.bfloat16, 128, 4, 1, 1, None),     # decode, GQA 4
        (torch.bfloat16, 128, 4, 1, 4, None),     # decode, split-K
        (torch.bfloat16, 128, 4, 512, 1, None),   # prefill chunk
        (torch.float16, 80, 1, 3, 1, None),       # speculative verify, head dim 80, MHA
        (torch.bfloat16, 128, 4, 1, 4, "i8"),     # int8 KV cache, decode, split-K
        (torch.float16, 64, 2, 512, 1, "fp8e4nv"),  # fp8 KV cache, prefill chunk
    ]
    for dtype, head_dim, group, max_q_len, splits, kv in cases:
        t = attention.pick_tiles(head_dim, group, max_q_len, dtype.itemsize)
        dt = "*" + TL[dtype]
        kv_t = "*" + kv if kv else dt
        types = dict(q_ptr=dt, k_cache_ptr=kv_t, v_cache_ptr=kv_t, out_ptr=dt, block_tables_ptr="*i32",
                     cu_seqlens_q_ptr="*i32", context_lens_ptr="*i32", part_out_ptr="*fp32",
                     part_lse_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32", scale="fp32")
        consts = dict(HEAD_DIM=head_dim, BLOCK_D=t["BLOCK_D"], GROUP=group, BLOCK_Q=t["BLOCK_Q"],
                      BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], PAGE=16, NUM_SPLITS=splits,
                      DOT_DTYPE=attention._dot_dtype(dtype), DOT_PRECISION="tf32", QUANT=kv is not None)
        k = build(attention._paged_attention_kernel, types, consts, t["num_warps"], t["num_stages"])
        ptx = k.asm["ptx"]
        assert "cp.async.cg.shared.global" in ptx and "ld.global.b16" not in ptx, (dtype, head_dim, kv, "K/V loads")
        print("attention", dtype, head_dim, group, max_q_len, splits, kv, "smem", k.metadata.shared)
    build(attention._merge_splits_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16"),
          dict(NUM_SPLITS=3, BLOCK_S=4, HEAD_DIM=128, BLOCK_D=128))
    build(kv_store._store_kv_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*bf16",
          v_cache_ptr="*bf16", slot_ptr="*i64"), dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, PAGE=16))
    for kv, qmax in (("i8", 127.0), ("fp8e4nv", 448.0)):   # quantizing stores
        build(kv_store._store_kv_quant_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", k_cache_ptr="*" + kv,
              v_cache_ptr="*" + kv, k_scale_ptr="*fp32", v_scale_ptr="*fp32", slot_ptr="*i64"),
              dict(HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_P=16, QMAX=qmax, FP8=kv != "i8"))
    build(block_copy._copy_blocks_kernel, dict(k_cache_ptr="*bf16", v_cache_ptr="*bf16", src_ptr="*i64",
          dst_ptr="*i64"), dict(BLOCK=4096))
    print("compiled")
''')


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")  # compiled kernels, no GPU needed
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout + r.stderr[-3000:]
