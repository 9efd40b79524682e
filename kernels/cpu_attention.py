"""Paged attention on the CPU without copies: a small C kernel beside the torch reference.

A reader can skip this module: it computes what :func:`minillm_kernels.attention.paged_attention_ref`
computes (the reference the notebooks explain, and the one the tests hold it against), only faster.

Why it exists. The torch reference gathers each request's blocks out of the paged cache into
padded dense tensors (``index_select``), then runs one ``scaled_dot_product_attention``: at
every layer of every step it copies the whole KV it is about to read, so decode moves the KV
bytes three times (read for the copy, write the copy, read the copy). PagedAttention's point is
that attention reads the blocks where they lie, through the block table; vLLM's CPU backend does
that in C++, and so does ``cpu_attention.c`` here: an online softmax (FlashAttention's) folded
over one block of the table at a time, every query head of a GQA group served by each key it
loads, requests and KV heads spread over torch's CPU threads (OpenMP).

How it runs. The C file is compiled on first use with the machine's C compiler (``$CC``, else
``cc``; ``-O3 -march=native -fopenmp``) into a cache folder (``$MINILLM_KERNEL_CACHE``, else
``~/.cache/minillm``), named by a hash of the source, the flags and the CPU, and called through
``ctypes`` (which releases the GIL). Float32 queries and caches only; :func:`supports` says
whether a call qualifies, and ``ops.paged_attention(backend="cpu")`` sends any other call (a
float16/bfloat16 model, an int8/fp8 cache, CUDA tensors) to the torch reference.

The same C file serves the fused decoder layers (``minillm/model/cpu_fused.py``) with the small
passes around attention: :func:`rope_and_cache` (RoPE and the cache write) and :func:`rms_norm`;
:class:`StepCalls` makes a step's RoPE and attention calls for every layer with what the layers
share checked and converted once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")  # gnu11: a*b+c may fuse


def _cpu_tag() -> str:
    """What -march=native compiled for: the CPU's flags (a cache shared between machines stays right)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def compiler() -> str | None:
    """The C compiler this module would use, or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise RuntimeError(
            f"attention_backend='cpu' compiles {SOURCE.name} on first use and needs a C compiler: "
            f"none found as CC={os.environ.get('CC', 'cc')!r} (install gcc, or use "
            "attention_backend='torch')"
        )
    code = SOURCE.read_bytes()
    tag = hashlib.sha256(code + " ".join(FLAGS).encode() + _cpu_tag().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MINILLM_KERNEL_CACHE") or Path.home() / ".cache" / "minillm")
    lib = cache / f"cpu_attention-{tag}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)  # then renamed: another process may race us
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling {SOURCE} with {cc} failed:\n{done.stderr}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dll = ctypes.CDLL(str(lib))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    dll.paged_attention_f32.restype = i32
    dll.paged_attention_f32.argtypes = [
        ptr,
        i64,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        ptr,
        ptr,
        i32,
        i32,
        i32,
        i32,
        i32,
        ctypes.c_float,
        i32,
    ]
    dll.rope_and_cache_f32.restype = None
    dll.rope_and_cache_f32.argtypes = [ptr, i64, i32, i32, i32, i32, ptr, ptr, i64, ptr, ptr, ptr]
    dll.rms_norm_f32.restype = None
    dll.rms_norm_f32.argtypes = [ptr, i64, i32, i32, ptr, ctypes.c_float, ptr]
    return dll


def supports(q: torch.Tensor, k_cache: torch.Tensor, k_scale=None) -> bool:
    """Whether :func:`paged_attention_cpu` takes this call: float32 on the CPU, a float cache."""
    return k_scale is None and q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32


def paged_attention_cpu(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    """:func:`minillm_kernels.attention.paged_attention_ref`'s contract, computed in place in the
    paged cache: q ``[total_q, H, D]``, k/v_cache ``[num_blocks, block_size, H_kv, D]``,
    block_tables int32 ``[batch, max_blocks]``, cu_seqlens_q int32 ``[batch + 1]``, context_lens
    int32 ``[batch]``. Returns ``[total_q, H, D]`` float32."""
    if not supports(q, k_cache):
        raise ValueError(
            f"paged_attention_cpu: float32 CPU tensors only, got q {q.dtype} on {q.device}, cache {k_cache.dtype}"
        )
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[1] % num_kv_heads or q.shape[2] != head_dim:
        raise ValueError(
            f"paged_attention_cpu: q {tuple(q.shape)} does not fit a cache of {num_kv_heads} KV heads of dim {head_dim}"
        )
    # Only the last dimension must be contiguous (the kernel takes every other stride).
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("paged_attention_cpu: the caches' last dimension must be contiguous")
    bt = block_tables.to(torch.int32).contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    if q.shape[0] == 0:
        return out
    rc = _library().paged_attention_f32(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        bt.data_ptr(),
        bt.stride(0),
        cu.data_ptr(),
        ctx.data_ptr(),
        ctx.shape[0],
        num_kv_heads,
        q.shape[1] // num_kv_heads,
        head_dim,
        k_cache.shape[1],
        float(scale),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged_attention_cpu: the kernel could not allocate its scratch memory")
    return out


def rope_and_cache(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping):
    """RoPE and the cache write of one layer's new tokens, in place: ``qkv`` float32 ``[T, (H + 2 Hkv) D]``
    (the fused q/k/v projection's output) has its queries rotated where they lie; the rotated keys and the
    values go to ``k_cache``/``v_cache`` (contiguous ``[num_blocks, block_size, Hkv, D]``) at
    ``slot_mapping`` (int64 ``[T]``, every slot >= 0). ``cos``/``sin``: ``[T, 1, D]`` (``LlamaModel.rope``).
    Bit for bit what ``q * cos + rotate_half(q) * sin`` (the same for k) and two ``index_copy_`` give."""
    T, head_dim = qkv.shape[0], k_cache.shape[-1]
    tensors = (qkv, cos, sin, k_cache, v_cache)
    if (
        any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors)
        or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim
        or qkv.stride(1) != 1
        or cos.stride(-1) != 1
        or sin.stride(-1) != 1
        or cos.stride(0) != sin.stride(0)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or head_dim % 2
        or head_dim > 512
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
        or len(slot_mapping) != T
    ):
        raise ValueError(
            "rope_and_cache: float32 CPU tensors, qkv [T, (H + 2 Hkv) D] with rows of stride 1, contiguous "
            f"caches, an even head_dim <= 512 and T int64 slots; got qkv {tuple(qkv.shape)} {qkv.dtype}, "
            f"cache {tuple(k_cache.shape)} {k_cache.dtype}, slots {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if T == 0:
        return
    _library().rope_and_cache_f32(
        qkv.data_ptr(),
        qkv.stride(0),
        T,
        num_heads,
        num_kv_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (n,), weight, eps)`` of a float32 CPU ``x`` ``[T, n]`` (rows of stride 1) in one C
    call: equal within float32 rounding (the mean of squares summed in another order)."""
    T, n = x.shape
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.stride(1) != 1
        or weight.shape != (n,)
        or not weight.is_contiguous()
    ):
        raise ValueError(
            f"rms_norm: float32 CPU tensors, x [T, n] with rows of stride 1 and a contiguous weight [n]; got x "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty((T, n), dtype=torch.float32)
    if T:
        _library().rms_norm_f32(x.data_ptr(), x.stride(0), T, n, weight.data_ptr(), eps, out.data_ptr())
    return out


class StepCalls:
    """One step's :func:`rope_and_cache` and :func:`paged_attention_cpu` for every layer of a model, with the
    inputs all layers share checked and converted once: the fused layers' way to call this module.

    Made at the step's first layer from that layer's tensors: the block tables, query offsets, context
    lengths and slots (``AttentionMetadata``), RoPE's ``cos``/``sin``, and the shapes and strides of the
    layer's fused projection output ``qkv`` and its caches, validated as the two functions validate them.
    Each layer then passes only its own ``qkv`` and caches, checked to have the first layer's shapes and
    strides; the same results as the two functions, with a fraction of their Python work per call."""

    def __init__(self, qkv, num_heads: int, num_kv_heads: int, cos, sin, k_cache, v_cache, meta, scale: float):
        T, head_dim = qkv.shape[0], k_cache.shape[-1]
        q = qkv[:, : num_heads * head_dim].view(T, num_heads, head_dim)
        slots = meta.slot_mapping
        rope_and_cache(qkv[:0], num_heads, num_kv_heads, cos[:0], sin[:0], k_cache, v_cache, slots[:0])  # checks
        if not supports(q, k_cache) or k_cache.shape[2] != num_kv_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"StepCalls: q {tuple(q.shape)} does not fit a cache {tuple(k_cache.shape)} {k_cache.dtype}"
            )
        if len(slots) != T or slots.dtype != torch.int64 or not slots.is_contiguous() or cos.shape[0] != T:
            raise ValueError(f"StepCalls: {T} tokens, {len(slots)} slots ({slots.dtype}), {cos.shape[0]} cos rows")
        self.qkv_layout = (qkv.shape, qkv.stride(), qkv.dtype)
        self.cache_layout = (k_cache.shape, k_cache.stride(), k_cache.dtype)
        self.shape, self.scale = q.shape, scale
        self.tables = tuple(
            t.to(torch.int32).contiguous() for t in (meta.block_tables, meta.cu_seqlens_q, meta.context_lens)
        )
        self.keep = (cos, sin, slots)  # the memory the pointers below point into
        bt, cu, ctx = self.tables
        kst = k_cache.stride()
        self.rope_args = (T, num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0))
        # paged_attention_f32's arguments after the layer's q pointer, its strides and its caches' pointers
        self.cache_strides = kst[:3] + kst[:3]  # the K and the V cache: the same layout
        self.rest = (bt.data_ptr(), bt.stride(0), cu.data_ptr(), ctx.data_ptr(), ctx.shape[0], num_kv_heads)
        self.rest += (num_heads // num_kv_heads, head_dim, k_cache.shape[1], float(scale), torch.get_num_threads())

    def fits(self, qkv, cos, k_cache, v_cache, scale: float) -> bool:
        """Whether a layer's tensors are what this step's calls were made for: the first layer's shapes,
        strides and dtypes, the same ``cos`` (one forward's) and the same scale."""
        return (
            cos is self.keep[0]
            and scale == self.scale
            and (qkv.shape, qkv.stride(), qkv.dtype) == self.qkv_layout
            and (k_cache.shape, k_cache.stride(), k_cache.dtype) == self.cache_layout
            and (v_cache.shape, v_cache.stride(), v_cache.dtype) == self.cache_layout
        )

    def __call__(self, qkv, cos, k_cache, v_cache, scale: float) -> torch.Tensor:
        """One layer: :func:`rope_and_cache` of its ``qkv`` into its caches, then :func:`paged_attention_cpu`
        of its rotated queries over them; returns the attention output ``[T, H, D]``."""
        if not self.fits(qkv, cos, k_cache, v_cache, scale):
            raise ValueError(
                f"StepCalls: this layer's qkv {tuple(qkv.shape)}, caches {tuple(k_cache.shape)}, cos or scale "
                f"{scale} differ from those the step's calls were made for ({tuple(self.qkv_layout[0])}, "
                f"{tuple(self.cache_layout[0])}, scale {self.scale})"
            )
        out = torch.empty(self.shape, dtype=torch.float32)
        if self.shape[0] == 0:
            return out
        lib = _library()
        k, v = k_cache.data_ptr(), v_cache.data_ptr()
        lib.rope_and_cache_f32(qkv.data_ptr(), qkv.stride(0), *self.rope_args, k, v, self.keep[2].data_ptr())
        q_strides = qkv.stride(0), self.shape[2]  # the queries: qkv's first H * D columns, rotated in place
        rc = lib.paged_attention_f32(
            qkv.data_ptr(),
            *q_strides,
            k,
            v,
            *self.cache_strides,
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            *self.rest,
        )
        if rc != 0:
            raise MemoryError("paged_attention_cpu: the kernel could not allocate its scratch memory")
        return out
