"""Where the kernels run, and a check that the Triton attention kernel computes what its torch reference does.

Every notebook starts with :func:`pick_device`: ``"cuda"`` when there is a GPU (the Triton kernels
are compiled for it), otherwise ``"cpu"``, where Triton's *interpreter* runs the same kernels one
program instance at a time in Python: far too slow to serve with, but the same kernel code, so it can
be checked. The switch to the interpreter must happen before anything imports Triton
(``kernels/_triton_setup.py`` explains why), which is why this is the first call of a notebook.

:func:`check_paged_attention` holds the paged attention kernel (``kernels/attention.py``) against its
plain-torch reference on the KV cache an engine has actually filled: the requests running at the
engine's last step, each read through its own block table, one query each (the shape of a decode
step). Both must agree to within rounding; a disagreement raises ``AssertionError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm_kernels import ops


def pick_device() -> str:
    """``"cuda"`` with a GPU, else ``"cpu"`` with Triton switched to its interpreter; prints which."""
    interpreted = ops.use_interpreter_if_no_cuda()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    how = (
        "run by Triton's interpreter on the CPU (slow, the same kernels)"
        if interpreted
        else "compiled for the GPU"
        if device == "cuda"
        else "compiled"
    )
    print(f"device: {device}; Triton kernels {how}")
    return device


@dataclass(frozen=True)
class AttentionCheck:
    """What :func:`check_paged_attention` compared: which requests, their KV lengths, the largest
    elementwise difference between the Triton kernel's output and the torch reference's, and the
    tolerance it had to stay under (tighter for float32 than for 16-bit caches)."""

    request_ids: tuple
    kv_lengths: tuple
    max_abs_diff: float
    tolerance: float

    def __str__(self) -> str:
        return (
            f"requests {list(self.request_ids)}, KV lengths {list(self.kv_lengths)}: "
            f"max |triton - torch| = {self.max_abs_diff:.1e} (tolerance {self.tolerance:.0e})"
        )


def check_paged_attention(engine, seed: int = 0) -> AttentionCheck:
    """Run the Triton paged attention kernel and its torch reference on ``engine``'s layer-0 KV cache,
    for the requests running at its last step, with one random query per request (``seed`` seeds
    the queries); return what was compared, or raise ``AssertionError`` when they disagree."""
    import torch

    if not engine.step_records:
        raise ValueError("check_paged_attention: the engine has not run a step yet, so its cache holds nothing")
    rec = engine.step_records[-1]
    if rec.kv is None:
        raise ValueError("check_paged_attention: the engine records no KV snapshots (EngineConfig.record='none')")
    rids = list(rec.running)  # requests holding KV right now
    if not rids:
        raise ValueError(f"check_paged_attention: no request is running after step {rec.step}")
    k_cache, v_cache = engine.executor.model.caches_for_attention()[0]  # layer 0's cache (its LocalModel)
    dev = k_cache.device
    tables = [engine.kv.block_table(r) for r in rids]  # where each request's positions live
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
    context_lens = torch.tensor([rec.kv.per_request[r].used for r in rids], dtype=torch.int32, device=dev)
    cu_seqlens_q = torch.arange(len(rids) + 1, dtype=torch.int32, device=dev)  # one query each, like a decode
    heads, head_dim = engine.hf_config.num_attention_heads, k_cache.shape[-1]
    q = torch.randn(
        len(rids),
        heads,
        head_dim,
        dtype=k_cache.dtype,
        device=dev,
        generator=torch.Generator(device=dev).manual_seed(seed),
    )
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, head_dim**-0.5)
    out_triton = ops.paged_attention(*args, backend="triton")
    out_torch = ops.paged_attention(*args, backend="torch")
    err = (out_triton.float() - out_torch.float()).abs().max().item()
    check = AttentionCheck(
        tuple(rids), tuple(context_lens.tolist()), err, 1e-4 if k_cache.dtype == torch.float32 else 3e-2
    )
    assert err < check.tolerance, f"the Triton kernel disagrees with the torch reference: {check}"
    return check
