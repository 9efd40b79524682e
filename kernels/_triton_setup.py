"""Getting Triton ready: a GPU if there is one, Triton's interpreter if there is not.

Why this module exists
----------------------
Triton compiles a kernel for a GPU. On a machine without CUDA it can still *run* the
kernel through its interpreter: every program instance executes in Python/numpy, one
after another. That is far too slow to serve, but exact enough to hold a kernel against
its torch reference on a laptop or in CI, which is what the tests do.

The interpreter is chosen by the environment variable ``TRITON_INTERPRET=1``, and the
choice is made when a kernel is *defined*: ``@triton.jit`` returns an interpreted
function or a compiled one, depending on what the flag says at that moment (Triton 3.x
reads ``triton.knobs.runtime.interpret``, which falls back to the variable; older
releases read the variable directly, some at import). Two rules follow:

1. Set the variable before Triton is first imported: that is early enough for every
   Triton version.
2. Kernel modules must be imported *after* the decision. So ``minillm_kernels.ops`` imports
   no Triton at all; each kernel module calls :func:`use_interpreter_if_no_cuda` on its
   first line, then imports Triton.

If someone imported Triton before us without the flag, we set it anyway and then check
that it took effect, by defining a throw-away kernel and looking at what ``@triton.jit``
returned. If it did not take effect (an old Triton that read the flag once at import, or
a flag explicitly pinned off in ``triton.knobs``), we raise an error that says what to do.

Torch-only users (no Triton installed) can still import the kernel modules: the
decorators then come from stand-ins below, and calling a Triton kernel raises an
ImportError, while the torch references beside the kernels work.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_ENV = "TRITON_INTERPRET"
_VERIFIED = False  # set once a late switch to the interpreter has been checked to work


def cuda_available() -> bool:
    """True when torch sees a CUDA device (no CUDA context is created)."""
    import torch

    return torch.cuda.is_available()


def no_gpu_driver() -> bool:
    """True when this machine shows no GPU driver at all (no NVIDIA, ROCm or WSL device files), so
    CUDA cannot be available. Answered without importing torch."""
    paths = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
    return not any(os.path.exists(p) for p in paths)


def use_interpreter_early() -> None:
    """At ``import minillm``: on a machine with no GPU driver, choose the interpreter before anything
    (transformers, a notebook) imports Triton, without importing torch. Elsewhere the decision waits
    for :func:`use_interpreter_if_no_cuda`, which asks torch."""
    if "triton" not in sys.modules and _ENV not in os.environ and no_gpu_driver():
        os.environ[_ENV] = "1"


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (it is not imported here)."""
    if "triton" in sys.modules:
        return sys.modules["triton"] is not None  # None: imports of triton are blocked
    return importlib.util.find_spec("triton") is not None


def interpreter_active() -> bool:
    """True when Triton kernels defined from now on run in the interpreter."""
    if "triton" in sys.modules:
        knobs = getattr(sys.modules["triton"], "knobs", None)
        if knobs is not None:
            return bool(knobs.runtime.interpret)
    return os.environ.get(_ENV, "0") == "1"


def use_interpreter_if_no_cuda() -> bool:
    """On a machine without CUDA, switch Triton to its interpreter. Returns whether the
    interpreter is in use.

    Call this before the first ``import triton`` (see the module docstring for why).
    With CUDA present it changes nothing (a ``TRITON_INTERPRET=1`` you set yourself is
    respected). An explicit ``TRITON_INTERPRET=0`` is respected too: it asks for compiled
    kernels even without a GPU (to compile ahead of time for one, as
    ``tests/test_kernels_compile.py`` does). Otherwise, without CUDA, it sets
    ``TRITON_INTERPRET=1``; if Triton was already
    imported it verifies that kernels defined from now on are interpreted, and raises
    ``RuntimeError`` with instructions if they are not.
    """
    if cuda_available() or os.environ.get(_ENV) == "0":
        return interpreter_active()
    if "triton" not in sys.modules:
        os.environ[_ENV] = "1"  # the normal case: Triton not imported yet
        return True
    # Triton is already imported. Flip the flag where this Triton reads it, then check.
    global _VERIFIED
    if _VERIFIED:
        return True
    os.environ[_ENV] = "1"
    triton = sys.modules["triton"]
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and not knobs.runtime.interpret:
        knobs.runtime.interpret = True  # an explicit `False` pinned in the knobs wins over the env
    _VERIFIED = _jit_is_interpreted()
    if not _VERIFIED:
        raise RuntimeError(
            "Triton was imported before TRITON_INTERPRET=1 was set, and this Triton "
            f"({getattr(triton, '__version__', '?')}) does not pick the flag up afterwards. "
            "There is no CUDA device, so Triton kernels can only run in the interpreter. "
            "Set TRITON_INTERPRET=1 in the environment before starting Python, or call "
            "minillm_kernels.ops.use_interpreter_if_no_cuda() before anything imports triton."
        )
    return True


def _jit_is_interpreted() -> bool:
    import triton

    def _probe():  # never launched; we only look at what the decorator returns
        pass

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old Triton
        return False
    if not isinstance(triton.jit(_probe), InterpretedFunction):
        return False
    # Triton's own library functions (tl.zeros, tl.maximum, ...) were defined when Triton was
    # imported; if that was before the flag, they are compiled-mode and fail inside an
    # interpreted kernel. Launch a tiny kernel that uses one to find out.
    import torch
    import triton.language as tl

    @triton.jit
    def _probe_kernel(out_ptr):
        tl.store(out_ptr + tl.arange(0, 2), tl.zeros([2], tl.float32) + 1.0)

    out = torch.zeros(2)
    try:
        _probe_kernel[(1,)](out)
    except Exception:
        return False
    return bool((out == 1.0).all())


def triton_available() -> bool:
    """Can Triton kernels run on this machine: on a GPU, or through the interpreter?

    Side effect, on a machine without CUDA: opts this process into the interpreter
    (see :func:`use_interpreter_if_no_cuda`)."""
    if not triton_installed():
        return False
    try:
        interpreted = use_interpreter_if_no_cuda()
    except RuntimeError:
        return False
    return interpreted or cuda_available()


def import_triton():
    """``(triton, triton.language)`` ready for this machine, or stand-ins without Triton.

    The stand-ins let a kernel module be imported (its ``@triton.jit`` functions and
    ``tl.constexpr`` annotations still evaluate) so that the torch references beside
    the kernels stay usable; launching a kernel then raises ImportError."""
    if not triton_installed():
        return _MissingTriton(), _MissingLanguage()
    try:
        use_interpreter_if_no_cuda()
    except RuntimeError:
        pass  # the torch references stay usable; asking for backend="triton" raises the error
    import triton
    import triton.language as tl

    return triton, tl


class _UnavailableKernel:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise ImportError(f"Triton is not installed: cannot launch {self.fn.__name__}; use backend='torch'")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"Triton is not installed: cannot call {self.fn.__name__}; use backend='torch'")


class _MissingTriton:
    __version__ = None

    @staticmethod
    def jit(fn=None, **kwargs):
        if fn is None:
            return _UnavailableKernel
        return _UnavailableKernel(fn)

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n):
        return 1 << (int(n) - 1).bit_length()


class _MissingLanguage:
    def __getattr__(self, name):
        return object  # enough for `x: tl.constexpr` annotations
