"""The Triton kernels compile for a real GPU (Hopper, sm_90), even on a machine without one.

The interpreter (tests/test_kernels.py) checks what the kernels compute, but it accepts
code that the GPU compiler rejects (types of loop-carried values, early returns,
constexpr specialisation). ``tests/test_kernels_targets.py`` compiles every launch for every
target; here a few attention launches for sm_90, as the launcher makes them, are checked for
what their PTX says: the K/V loads came out as 16-byte async copies (pipelined, vectorised),
which is what lets decode approach peak memory bandwidth. Slow (LLVM + ptxas): marked ``slow``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r"""
    import torch

    from minillm_kernels import attention
    from minillm_kernels.targets import TARGETS, compile_for

    H100 = TARGETS[90]
    cases = [  # (dtype, KV cache dtype, head_dim, group, max_q_len, split-K)
        (torch.bfloat16, torch.bfloat16, 128, 4, 1, False),     # decode, GQA 4
        (torch.bfloat16, torch.bfloat16, 128, 4, 1, True),      # decode, split-K
        (torch.bfloat16, torch.bfloat16, 128, 4, 512, False),   # prefill chunk
        (torch.float16, torch.float16, 80, 1, 3, False),        # speculative verify, head dim 80, MHA
        (torch.bfloat16, torch.int8, 128, 4, 1, True),          # int8 KV cache, decode, split-K
        (torch.float16, torch.float8_e4m3fn, 64, 2, 512, False),  # fp8 KV cache, prefill chunk
    ]
    for dtype, kv, head_dim, group, max_q_len, split in cases:
        launch = attention.attention_launch(dtype, kv, head_dim, group, 16, max_q_len, split, H100)
        ptx = compile_for(launch, H100).asm["ptx"]
        assert "cp.async.cg.shared.global" in ptx and "ld.global.b16" not in ptx, (launch.describe(), "K/V loads")
        print(launch.describe())
    print("compiled")
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0")  # compiled kernels, no GPU needed
    hang_limit_s = 3 * 3600  # far past any machine's compile time: reaching it means a hang
    try:
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=hang_limit_s
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling six launches for sm_90 ran past {hang_limit_s} s: a hang, not a slow machine")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout + r.stderr[-3000:]
