"""The runner: turn a SchedulerOutput into tensors, run the model, sample.

``LocalModel``: the model on this process, its KV cache tensors (``kv_tensors.py``; scales when quantized)
and the host swap pool; it copies blocks (swap out, swap in, copy-on-write) and runs the forward.
``ModelRunner`` (an ``Executor``, ``minillm/executor.py``) prepares the batch, asks its model for the
logits and samples; tensor parallelism gives it the ranks in place of a ``LocalModel`` (same verbs,
``swap`` and ``forward``: ``tp_executor.py``). Batch preparation is one Python loop over *requests*
collecting token ids and block tables; positions, slots and context lengths are arrays (``flat_batch.py``).
"""

from __future__ import annotations

import itertools
import sys
from typing import Optional

import torch

from ..spec import acceptance
from ..sim.clock import PhaseTimes
from .flat_batch import flat_batch, token_slice
from .kv_tensors import allocate_kv_cache
from .sampler import Sampler, sample_plain, token_logprobs
from ..core.scheduler_output import SchedulerOutput
from ..executor import ExecutionResult


def resolve_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto"
) -> str:
    """EngineConfig.attention_backend for this device: "auto" is Triton on CUDA and on the CPU the
    CPU fast path ("cpu") when its kernel compiles (else the torch reference, with a one-line note).
    "cpu" (the C kernel that reads the paged cache in place, ``kernels/cpu_attention.py``)
    computes in float32 on a float32 cache: on any other model or cache the torch reference
    serves instead."""
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        name = "cpu" if cpu_kernel_compiles() else "torch"
    if name == "cpu" and (device.type != "cpu" or dtype != torch.float32 or kv_cache_dtype != "auto"):
        return "torch"
    return name


def cpu_kernel_compiles() -> bool:
    """Whether the CPU attention kernel is built (compiled now if need be); if not, says why in one line."""
    from minillm_kernels import cpu_attention

    try:
        cpu_attention._library()
        return True
    except (RuntimeError, OSError) as e:
        print(f"minillm: attention_backend='auto' uses the torch reference: {str(e).splitlines()[0]}", file=sys.stderr)
        return False


class LocalModel:
    """The model on this process and its KV cache: block copies (``swap``) and the forward. ``attn_block_size``:
    the KV manager's view of a block (1 for a position-granular reservation)."""

    def __init__(self, config, model, num_blocks: int, device: torch.device, dtype: torch.dtype, attn_block_size: int):
        self.model = model
        self.device = device
        self.block_size, self.attn_block_size = config.block_size, attn_block_size
        self.num_heads, self.num_kv_heads = model.num_heads, model.num_kv_heads
        self.backend = resolve_backend(config.attention_backend, device, dtype, config.kv_cache_dtype)
        self.matmul_layout = None  # the CPU fast path's weight layout (cpu_linear.LAYOUTS)
        if self.backend == "cpu":
            # The CPU fast path: attention reads the paged KV in place (kernels/cpu_attention.py),
            # each decoder layer runs fused projections (model/cpu_fused.py) and every matrix
            # multiply runs on weights laid out once, in the layout timed fastest here (model/cpu_linear.py).
            from ..model import cpu_fused, cpu_linear

            hint = min(config.max_num_seqs, 32)  # the rows of a decode batch the layout is timed and tuned for
            layout = cpu_linear.choose_layout(cpu_fused.step_shapes(model), rows=hint)
            cpu_fused.fuse_layers(model, layout, hint)
            cpu_linear.pack_linears(model, layout, hint)
            self.matmul_layout = layout
        if self.backend == "triton":
            from minillm_kernels import ops

            ops.use_interpreter_if_no_cuda()  # on CPU: the same kernels through Triton's interpreter
        kv_dtype = config.kv_cache_dtype
        if kv_dtype != "auto" and self.backend == "triton" and device.type == "cuda":
            from minillm_kernels.kv_quant import check_available

            check_available(kv_dtype, device)  # say so now, not at the first store (fp8 needs sm 8.9)
        layout = (config.block_size, model.num_kv_heads, model.head_dim, dtype, kv_dtype)
        # kv_scales[layer] = (k_scale, v_scale) of a quantized cache; [] for a float one.
        self.kv_caches, self.kv_scales = allocate_kv_cache(model.num_layers, num_blocks, *layout, device=device)
        self.swap_caches, self.swap_scales = [], []
        if config.num_swap_blocks:
            self.swap_caches, self.swap_scales = allocate_kv_cache(
                model.num_layers, config.num_swap_blocks, *layout, pin_memory=device.type == "cuda"
            )
        k0 = self.kv_caches[0][0]
        self.bytes_per_block = (
            sum(t[0].nbytes + t[1].nbytes for t in (self.kv_caches + self.kv_scales)) // k0.shape[0]
        )  # K, V and their scales, every layer

    def swap(self, out) -> int:
        """Copy swapped blocks: every swap-out before any swap-in, so a device block freed by a
        swap-out and handed to a swap-in in the same pass is read before it is written (a host
        block freed by a swap-in is not reused until the step is over). The step's
        copy-on-write copies run between the two, for the same reason. Returns the bytes moved."""
        from minillm_kernels import ops

        moved = 0
        for pairs, to_host in ((out.swap_out, True), (out.swap_in, False)):
            if not to_host and out.copies:
                self.copy_on_write(out)  # after the swap-outs read their blocks
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
            for layer, ((dk, dv), (hk, hv)) in enumerate(zip(self.kv_caches, self.swap_caches)):
                dev_s = self.kv_scales[layer] if self.kv_scales else None
                host_s = self.swap_scales[layer] if self.kv_scales else None
                if to_host:
                    ops.swap_blocks(dk, dv, hk, hv, src, dst, src_scales=dev_s, dst_scales=host_s)
                else:
                    ops.swap_blocks(hk, hv, dk, dv, src, dst, src_scales=host_s, dst_scales=dev_s)
            moved += len(pairs) * self.bytes_per_block
        return moved

    def copy_on_write(self, out) -> None:
        """Copy each shared block a sequence is about to write into to its fresh block, every
        layer (``minillm_kernels.ops.copy_blocks``: Triton on a GPU, the torch reference on the CPU)."""
        from minillm_kernels import ops

        src = torch.tensor([c.src_block for c in out.copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c.dst_block for c in out.copies], dtype=torch.long, device=self.device)
        backend = "triton" if self.backend == "triton" else "auto"
        for layer, (k, v) in enumerate(self.kv_caches):
            scales = self.kv_scales[layer] if self.kv_scales else (None, None)
            ops.copy_blocks(k, v, src, dst, k_scale=scales[0], v_scale=scales[1], backend=backend)

    def caches_for_attention(self):
        """One entry per layer for the model: ``(k, v)``, or ``(k, v, k_scale, v_scale)`` when quantized."""
        if self.kv_scales:  # quantized caches are paged (EngineConfig rejects a reservation)
            return [kv + s for kv, s in zip(self.kv_caches, self.kv_scales)]
        if self.attn_block_size == self.block_size:
            return self.kv_caches
        # Reservation: regions are position-granular, so view the cache as blocks of 1.
        return [(k.view(-1, 1, *k.shape[2:]), v.view(-1, 1, *v.shape[2:])) for k, v in self.kv_caches]

    def forward(self, input_ids, positions, meta, logits_rows: torch.Tensor) -> torch.Tensor:
        """The logits of ``logits_rows`` after one forward over the flat batch (writing its KV)."""
        return self.model(input_ids, positions, self.caches_for_attention(), meta, logits_rows.to(self.device))


class ModelRunner:
    """The executor of a model: prepares each step's batch on ``device``, has ``model`` (a ``LocalModel``,
    or tensor parallelism's rank group) copy the blocks and run the forward, and samples the tokens."""

    def __init__(self, config, kv_manager, model, device: torch.device):
        self.config = config
        self.kv = kv_manager
        self.model = model  # swap(out) -> bytes, forward(ids, positions, meta, rows) -> logits
        self.device = device
        self.backend = model.backend
        self.bytes_per_block = model.bytes_per_block
        self.sampler = Sampler(config.seed)
        # How the batch's tensors are built and plain rows sampled: the references, or on the CPU fast
        # path the same results with less work per step (cpu_step.py: reused buffers, one argmax).
        self.flat_batch, self.sample_plain = flat_batch, sample_plain
        if self.backend == "cpu" and device.type == "cpu":
            from . import cpu_step

            self.flat_batch, self.sample_plain = cpu_step.InputBuffers().flat_batch, cpu_step.sample_plain
        self.proposer = None  # speculative decoding: the engine's set_proposer (draft probabilities q)
        # The acceptance rule applied to each verified request: EngineConfig.acceptance_rule, by
        # default minillm.spec.acceptance.verify (notebook 06's exercise plugs its own in there).
        self.verify = config.acceptance_rule or acceptance.verify

    @property
    def kv_caches(self) -> list:  # a LocalModel's: one (K, V) pair per layer
        return self.model.kv_caches

    @property
    def kv_scales(self) -> list:  # a quantized cache's (k_scale, v_scale) per layer; [] for a float one
        return self.model.kv_scales

    def set_proposer(self, proposer) -> None:
        """Speculative decoding: the proposer whose draft probabilities ``q`` the acceptance rule reads."""
        self.proposer = proposer

    # --- one step, all or nothing; a request's and the process's end ------------------------
    def checkpoint(self) -> None:
        """Before a step: remember the random streams (a failed step draws nothing)."""
        self.sampler.checkpoint()

    def rollback(self, checkpoint) -> None:
        self.sampler.rollback()

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)  # a finished request's random stream goes

    def close(self) -> None:
        """Nothing outside this process to release."""

    # --- one step ---------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput):
        """Flat input ids, positions and attention metadata for the scheduled batch."""
        reqs = out.scheduled
        ids: list[int] = []
        tables: list[list[int]] = []
        block_table = self.kv.block_table
        for s in reqs:
            r = s.request
            start, end = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            out_ids = r.output_token_ids
            known = len(r.prompt_token_ids) + len(out_ids)
            if end == known and start == known - 1 and out_ids:
                ids.append(out_ids[-1])  # a decode: its newest token (the common case)
            else:
                ids += token_slice(r, start, min(end, known))
                if end > known:  # speculative tokens to verify
                    ids += s.spec_token_ids[: end - known]
            tables.append(block_table(r.request_id))
        batch = self.flat_batch(
            ids,
            [s.num_new_tokens for s in reqs],
            [s.num_computed_before for s in reqs],
            tables,
            self.kv.attn_block_size,
            self.device,
            self.backend,
        )
        meta = batch[2]
        meta.kv_quantizer = self.config.kv_quantizer  # set only with a quantized cache
        if self.backend == "torch":
            # The torch attention's gather indices and masks are the same in every layer:
            # plan them once here, as part of preparing the batch.
            from minillm_kernels import ops

            meta.plan = ops.plan_attention_ref(
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.context_lens,
                self.kv.attn_block_size,
                self.model.num_heads // self.model.num_kv_heads,
            )
        return batch

    def forward(
        self, out: SchedulerOutput, logits_rows: torch.Tensor, phases: Optional[PhaseTimes] = None
    ) -> torch.Tensor:
        phases = phases or PhaseTimes()
        t = phases.mark()
        input_ids, positions, meta, _ = self.prepare(out)
        phases.add("prepare", t)
        t = phases.mark()
        logits = self.model.forward(input_ids, positions, meta, logits_rows)
        phases.add("forward", t)
        return logits

    def execute(self, out: SchedulerOutput) -> ExecutionResult:
        res = ExecutionResult(sampled=[()] * len(out.scheduled))
        res.swap_bytes = self.model.swap(out)
        if not out.scheduled:
            return res
        # Logits rows: the last row of each request that samples; for a request verifying k
        # speculative tokens, its last k + 1 rows (the target's distribution after its newest
        # token and after each draft token: k checks plus one bonus token).
        ends = [e - 1 for e in itertools.accumulate(s.num_new_tokens for s in out.scheduled)]
        rows: list[int] = []
        plain: list[tuple[int, int, object]] = []  # (logits row, grant index, ScheduledRequest)
        spec: list[tuple[int, int, object]] = []  # (first logits row, grant index, ScheduledRequest)
        for i, s in enumerate(out.scheduled):
            if not s.samples:
                continue  # a partial prefill chunk: fills the cache only
            k = len(s.spec_token_ids)
            (spec if k else plain).append((len(rows), i, s))
            rows += range(ends[i] - k, ends[i] + 1)
        # Prompt logprobs: the row of each prompt position whose next token is still in the prompt.
        prompt_rows: list[tuple[int, object, int]] = []  # (logits row, ScheduledRequest, position)
        for i, s in enumerate(out.scheduled):
            if s.request.prompt_logprobs is not None:
                first = ends[i] - s.num_new_tokens + 1
                last = min(s.num_computed_before + s.num_new_tokens, s.request.num_prompt_tokens - 1)
                prompt_rows += [(first + p - s.num_computed_before, s, p) for p in range(s.num_computed_before, last)]
        phases = PhaseTimes(self.config.phase_clock)
        logits = self.forward(out, torch.tensor(rows + [r for r, _, _ in prompt_rows], dtype=torch.long), phases)
        res.phase_times = phases.times
        t = phases.mark()
        if prompt_rows:  # the LM head ran on these rows only
            self._prompt_logprobs(logits[len(rows) :], prompt_rows, res)
            logits = logits[: len(rows)]
        if plain:
            self.sample_plain(self.sampler, logits, plain, res)
        if spec:
            # The target's distributions p (temperature, top-k/p) for every row of every sampled
            # (non-greedy) verifying request, in one batched call.
            rand = [(r, s) for r, _, s in spec if not s.request.sampling_params.greedy]
            probs = {}
            if rand:
                width = [len(s.spec_token_ids) + 1 for _, s in rand]
                p = self.sampler.probs(
                    logits[[r + j for (r, _), w in zip(rand, width) for j in range(w)]],
                    [s.request.sampling_params for (_, s), w in zip(rand, width) for _ in range(w)],
                ).cpu()
                probs = {s.request.request_id: ps for (_, s), ps in zip(rand, p.split(width))}
            for r, i, s in spec:
                rid, k = s.request.request_id, len(s.spec_token_ids)
                q = self.proposer.draft_probs(rid, k) if self.proposer is not None else None
                sp = s.request.sampling_params
                toks = self.verify(logits[r : r + k + 1], s.spec_token_ids, q, sp, self.sampler, rid, probs.get(rid))
                toks = acceptance.check_verified(self.verify, toks, s.spec_token_ids, logits.shape[-1], rid)
                res.sampled[i] = toks
                res.spec_accepted[rid] = len(toks) - 1
        phases.add("sample", t)
        return res

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, prompt_rows: list, res: ExecutionResult) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)
        for row, (_, s, p) in enumerate(prompt_rows):
            req = s.request
            res.prompt_logprobs.setdefault(req.request_id, []).append(
                (p + 1, token_logprobs(logp[row], req.prompt_token_ids[p + 1], req.sampling_params.prompt_logprobs))
            )
