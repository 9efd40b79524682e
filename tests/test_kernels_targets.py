"""Every kernel launch the engine can make compiles for every GPU we target, and fits its shared memory.

No GPU needed: Triton compiles for a compute capability ahead of time (``kernels/targets.py``).
The launches come from the engine's own launchers (``minillm_kernels.ops.launches``: the same
functions that compute the launch arguments when a kernel runs), for each model shape, dtype and
cache kind below and every step shape (decode, split-K decode, prefill chunks of every tile
size), so a new kernel or a new launch is covered without editing this file.

Two tiers. ``make test`` compiles a representative slice for every target: every kernel (attention
for decode, split-K and prefill chunks, the KV stores, the block copy) at least once, on the largest
head dim with 4-byte activations on an int8 cache, the launch that presses shared memory hardest
(a few minutes on a cold cache). ``make gpu-targets`` runs the full sweep (every model, dtype and cache kind below;
about 10 minutes on 2 cores with an empty Triton cache): run it before a change to ``kernels/``
lands.

The sweep runs in a subprocess (Triton's interpreter must be off before Triton is imported), two
compiles at a time. Triton caches every compiled kernel on disk, so a run after the first only
compiles what changed. Its time limit only catches a hang: it is hours, and a slow or busy machine
never reaches it.
"""

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # compiles every kernel launch for five GPU targets

REPO = Path(__file__).resolve().parents[1]

# The model shapes checked: (query heads, KV heads, head dim).
MODELS = {
    "shakespeare": (4, 2, 64),  # the shipped checkpoint
    "qwen3-0.6b": (16, 8, 128),  # the gpu-check's random-weight model
    "head-dim-80": (32, 32, 80),  # a head dim that is not a power of two (phi-2 style)
}
BLOCK_SIZE = 16  # EngineConfig.block_size's default
TARGET_CAPS = (75, 80, 86, 89, 90)
FULL_SWEEP = os.environ.get("MINILLM_TARGET_SWEEP") == "full"  # set by make gpu-targets
HANG_LIMIT_S = 4 * 3600  # far past any machine's compile time: reaching it means a hang


def _items(capabilities):
    import torch

    from minillm_kernels.targets import TARGETS

    items = []
    for cap in capabilities:
        for model in MODELS:
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                caches = [dtype, torch.int8] + ([torch.float8_e4m3fn] if TARGETS[cap].fp8 else [])
                items += [(cap, model, dtype, kv) for kv in caches]
    return items


def _check(item):
    """Compile the launches of one (target, model, dtype, cache): (capability, report, problems)."""
    from minillm_kernels import ops
    from minillm_kernels.targets import TARGETS, check_launches

    cap, model, dtype, kv = item
    heads, kv_heads, head_dim = MODELS[model]
    target = TARGETS[cap]
    try:
        launches = ops.launches(dtype, kv, heads, kv_heads, head_dim, BLOCK_SIZE, target)
    except Exception as e:  # the launcher found no tiles that fit, or a probe did not compile
        return cap, [], [f"sm_{cap}: {model} {dtype} cache {kv}: no launch: {type(e).__name__}: {e}"]
    return (cap, *check_launches(launches, target))


def sweep(capabilities, workers: int = 2, keep=lambda item: True) -> int:
    """Compile everything for ``capabilities`` (the items ``keep`` keeps); print the counts per
    target and the problems; return the number of problems."""
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = pool.map(_check, [i for i in _items(capabilities) if keep(i)], chunksize=1)
    problems = []
    for cap in capabilities:
        lines = sorted({line for c, report, _ in results if c == cap for line in report})
        largest = max((int(line.split()[1]) for line in lines), default=0)
        print(f"sm_{cap}: {len(lines)} distinct launches compiled, largest shared memory {largest} B")
        if os.environ.get("VERBOSE"):
            print("\n".join(lines))
    for _, _, p in results:
        problems += p
    print("\n".join(problems) if problems else "no problems", f"({time.time() - t0:.0f} s)")
    return len(problems)


def representative(item) -> bool:
    """The slice ``make test`` compiles: per target, the largest head dim (qwen3-0.6b's 128) with
    float32 activations on a float32 and on an int8 cache (4-byte activations beside 1-byte keys: the
    largest tiles the launcher fits, the full sweep's largest shared memory on every target), float16
    on its own cache, and bfloat16 on the fp8 cache where the target has fp8: every kernel (attention's
    decode, split-K and prefill launches, both KV stores, the block copy of data and of scales) at
    least once. ``test_the_slice_holds_the_largest_tile`` checks the claim against the full sweep."""
    import torch

    _, model, dtype, kv = item
    return model == "qwen3-0.6b" and (dtype, kv) in {
        (torch.float32, torch.float32),
        (torch.float32, torch.int8),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float8_e4m3fn),
    }


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="0")  # compiled kernels: no GPU needed to compile
    cmd = [sys.executable, __file__, *args]
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the compile sweep ran past {HANG_LIMIT_S} s: a hang, not a slow machine ({' '.join(cmd)})")


def _check_sweep(r) -> None:
    print(r.stdout)
    assert r.returncode == 0 and "no problems" in r.stdout, r.stdout + r.stderr[-3000:]
    for cap in TARGET_CAPS:
        assert f"sm_{cap}: " in r.stdout


def test_every_kernel_compiles_and_fits_every_target():
    """The representative slice, in make test."""
    pytest.importorskip("triton.backends.nvidia")
    _check_sweep(_run("--representative", *map(str, TARGET_CAPS)))


@pytest.mark.skipif(not FULL_SWEEP, reason="the full compile sweep: make gpu-targets runs it")
def test_every_launch_compiles_and_fits_every_target():
    """The full sweep, in make gpu-targets."""
    pytest.importorskip("triton.backends.nvidia")
    _check_sweep(_run(*map(str, TARGET_CAPS)))


@pytest.mark.skipif(not FULL_SWEEP, reason="beside the full compile sweep: make gpu-targets runs it")
def test_the_slice_holds_the_largest_tile():
    """The representative slice's largest shared memory per target is the full sweep's (warm: the sweep
    above compiled both)."""
    pytest.importorskip("triton.backends.nvidia")

    def largest(stdout: str) -> dict:  # {"sm_86": " 99328 B", ...} from the sweep's summary lines
        return {
            line.split(":")[0]: line.rsplit("largest shared memory", 1)[1]
            for line in stdout.splitlines()
            if "largest shared memory" in line
        }

    full = largest(_run(*map(str, TARGET_CAPS)).stdout)
    part = largest(_run("--representative", *map(str, TARGET_CAPS)).stdout)
    assert len(full) == len(TARGET_CAPS) and part == full, (full, part)


def test_an_oversized_tile_is_reported():
    """A launcher that ignored the device and asked for too big a tile would be caught."""
    pytest.importorskip("triton.backends.nvidia")
    r = _run("--oversized")
    assert r.returncode != 0, r.stdout + r.stderr[-3000:]
    assert "needs" in r.stdout and "shared memory, the T4 has 65536 B" in r.stdout, r.stdout + r.stderr[-3000:]


def _oversized():
    """The tile choice replaced by one too big for a T4, and the fit check by one that says yes."""
    from minillm_kernels import attention

    def too_big(head_dim, group, max_q_len, elem_size=2):
        yield dict(BLOCK_D=128, BLOCK_M=16, BLOCK_Q=16 // group, BLOCK_N=128, num_warps=4, num_stages=4)

    attention.tile_choices = too_big
    attention.fits = lambda launch, target: True
    MODELS.clear()
    MODELS["qwen3-0.6b"] = (16, 8, 128)


if __name__ == "__main__":
    import torch

    if sys.argv[1:] == ["--oversized"]:
        _oversized()
        sys.exit(1 if sweep([75], workers=1, keep=lambda i: i[2] == i[3] == torch.float16) else 0)
    args = sys.argv[1:]
    keep = representative if args[:1] == ["--representative"] else (lambda item: True)
    sys.exit(1 if sweep([int(c) for c in args if c.isdigit()], keep=keep) else 0)
