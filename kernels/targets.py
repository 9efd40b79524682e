"""GPU targets: what a kernel launch asks of the GPU, and compiling for a GPU without one.

The concept: *a launch must fit the device*. A Triton kernel is compiled for one compute
capability, and the tile sizes its launcher picks decide how much shared memory each program
needs (the K/V tiles in flight, the query tile). A T4 (sm_75) gives a program at most 64 KiB,
an A10 or L4 99 KiB, an A100 163 KiB, an H100 227 KiB; a launch that asks for more fails with
``OutOfResources`` on its first call. So the launchers describe each launch as a
:class:`Launch` (kernel, argument types, compile-time constants, compile options), pick tiles
that fit the device's :class:`Target`, and the same description is what
``tests/test_kernels_targets.py`` compiles ahead of time for every target in :data:`TARGETS`.

Compiling ahead of time needs no GPU: ``triton.compile`` lowers the kernel to PTX and runs the
``ptxas`` that ships inside Triton, for whatever compute capability is asked. The compiled
kernel's ``metadata.shared`` is the shared memory one program uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

import torch

from .kv_formats import KV_FORMATS


@dataclass(frozen=True)
class Target:
    """One kind of GPU, as the compiler and the launcher see it."""

    capability: int  # compute capability as an integer, e.g. 86 for 8.6
    shared_memory: int  # bytes of shared memory one program may use (the opt-in maximum)
    name: str = ""  # a GPU of this kind, for reports

    @property
    def fp8(self) -> bool:
        """Triton's e4m3 conversions need compute capability 8.9 (Ada, Hopper and later)."""
        return self.capability >= 89


# CUDA's sharedMemPerBlockOptin for each compute capability (CUDA C Programming Guide,
# "Technical Specifications per Compute Capability"): what a program may use once the
# launcher opts in, which Triton does.
TARGETS = {
    75: Target(75, 65_536, "T4"),
    80: Target(80, 166_912, "A100"),
    86: Target(86, 101_376, "A10"),
    89: Target(89, 101_376, "L4"),
    90: Target(90, 232_448, "H100/H200"),
}


@lru_cache(maxsize=None)
def device_target(device_index: int = 0) -> Target:
    """The :class:`Target` of CUDA device ``device_index``: its compute capability, and its
    shared memory from the device's own properties (the table when torch does not report it)."""
    props = torch.cuda.get_device_properties(device_index)
    capability = props.major * 10 + props.minor
    shared = getattr(props, "shared_memory_per_block_optin", 0)
    if not shared:
        known = TARGETS.get(capability) or TARGETS[max(c for c in TARGETS if c <= capability)]
        shared = known.shared_memory
    return Target(capability, int(shared), props.name)


# Triton's names for the element types of pointer arguments.
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
}
TRITON_TYPES.update(
    {getattr(torch, f.torch_dtype): f.triton_type for f in KV_FORMATS.values() if hasattr(torch, f.torch_dtype)}
)  # the quantized KV formats' storage types


def pointer(dtype: torch.dtype) -> str:
    """The type of a pointer argument to ``dtype`` elements, as ``triton.compile`` spells it."""
    return "*" + TRITON_TYPES[dtype]


# Every launch sets fp fusion explicitly (Triton's default for it changes between releases):
# off, so each multiply and add rounds on its own, as the torch reference's operations do.
FP_FUSION = False


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it: which kernel, the types of its runtime
    arguments (pointers by element type; unnamed ones are int32), its compile-time constants,
    and the compile options. Two launches with equal fields run the same compiled kernel."""

    kernel: Any
    types: tuple  # ((argument name, type), ...) for the non-int32 runtime arguments
    constants: tuple  # ((name, value), ...) the kernel's tl.constexpr arguments
    num_warps: int = 4
    num_stages: int = 3
    options: tuple = field(default=(("enable_fp_fusion", FP_FUSION),))

    @staticmethod
    def of(kernel, types: dict, constants: dict, num_warps: int = 4, num_stages: int = 3) -> "Launch":
        return Launch(kernel, tuple(sorted(types.items())), tuple(sorted(constants.items())), num_warps, num_stages)

    def __call__(self, grid, *args):
        """Launch on the tensors ``args`` (positional, in the kernel's order, constants left out)."""
        return self.kernel[grid](
            *args, **dict(self.constants), num_warps=self.num_warps, num_stages=self.num_stages, **dict(self.options)
        )

    def describe(self) -> str:
        consts = " ".join(f"{k}={getattr(v, 'name', v)}" for k, v in self.constants)
        types = " ".join(f"{k}={v}" for k, v in self.types if k in ("q_ptr", "k_ptr", "k_cache_ptr"))
        return (
            f"{getattr(self.kernel, 'fn', self.kernel).__name__} {consts} {types} "
            f"warps={self.num_warps} stages={self.num_stages}"
        )


def compile_for(launch: Launch, target: Target):
    """``launch`` compiled for ``target`` (a cubin, by Triton's own compiler), without a GPU.

    The kernel must have been defined with the interpreter off (``TRITON_INTERPRET=0``).
    Pointers and strides are assumed 16-aligned, as the runtime sees them for torch's
    allocations; that is the case whose loads become pipelined async copies, the one that
    uses the most shared memory."""
    return _compile(launch, target.capability)


@lru_cache(maxsize=None)
def _compile(launch: Launch, capability: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.kernel
    consts = dict(launch.constants)
    types = dict(launch.types)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if n not in consts and (sig[n].startswith("*") or n.startswith("stride"))
    }
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages, **dict(launch.options))
    return triton.compile(
        ASTSource(fn, sig, consts, aligned), target=GPUTarget("cuda", capability, 32), options=options
    )


def shared_memory(launch: Launch, target: Target) -> int:
    """Bytes of shared memory one program of ``launch`` uses on ``target`` (compiles it)."""
    return int(compile_for(launch, target).metadata.shared)


def fits(launch: Launch, target: Optional[Target]) -> bool:
    """Whether ``launch`` fits ``target``'s shared memory; anything fits no target (the interpreter)."""
    return target is None or shared_memory(launch, target) <= target.shared_memory


def require(condition, message: str) -> None:
    """A launch's precondition on the data (a bool, or a bool tensor): on the CPU an AssertionError with
    ``message``; on a GPU a device-side assert, so checking costs no host sync (a failed one
    stops the CUDA context, which is what a race it prevents would deserve)."""
    if isinstance(condition, torch.Tensor) and condition.is_cuda:
        torch._assert_async(condition, message)
    elif not bool(condition):
        raise AssertionError(message)


def check_launches(launches, target: Target) -> tuple[list[str], list[str]]:
    """Compile every launch for ``target``: ``(report, problems)``, one report line per launch
    (its shared memory against the target's), and a problem for each that does not compile or
    needs more shared memory than the target has."""
    report, problems = [], []
    for launch in launches:
        try:
            used = shared_memory(launch, target)
        except Exception as e:  # the compiler's own error, whatever its type
            problems.append(
                f"sm_{target.capability}: {launch.describe()}: does not compile: {type(e).__name__}: {str(e)[:300]}"
            )
            continue
        report.append(f"sm_{target.capability}: {used:>7} / {target.shared_memory} B  {launch.describe()}")
        if used > target.shared_memory:
            problems.append(
                f"sm_{target.capability}: {launch.describe()}: needs {used} B of shared memory, "
                f"the {target.name} has {target.shared_memory} B"
            )
    return report, problems
